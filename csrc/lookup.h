// Prompt lookup on the host: the n-gram match of a row's last tokens against its history, and the graft of
// the matched continuation into a tree. Same results as taps_kernels/reference/lookup.py (the specification),
// without its per-n and per-chain-token tensor passes: one scan per row.
#pragma once

#include <cstdint>

namespace taps {

// tokens [B, C] (row b's history is tokens[b, :lengths[b]], lengths in [0, C]). For n = min(max_ngram, C - 1)
// down to 1 the first n that has an earlier occurrence of the row's last n tokens with at least one token
// after it wins; of its occurrences the latest. Writes chain [B, K] (0 past the end), chain_len [B], ngram [B]
// (0: no match) and sibling [B]: the token after the latest occurrence of the same n tokens whose next token
// differs from the chain's first (-1: none, or no match).
void lookup_chain(const int64_t* tokens, const int64_t* lengths, int64_t B, int64_t C, int64_t K, int64_t max_ngram,
                  int64_t* chain, int64_t* chain_len, int64_t* ngram, int64_t* sibling);

// Merges root -> chain[b, 0] -> chain[b, 1] -> ... (chain_len[b] tokens) into row b of a [B, N] tree whose first
// num_nodes[b] nodes are real; outputs are [B, N + K] (tree copied, then appended nodes, then padding: token 0,
// parent -1, depth 0, reach -inf). A chain node that exists (same parent, same token; first such node) is
// reused and its reach becomes the larger of the two (NaN if either is NaN). chain_nodes [B, K]: the node of
// each chain token, -1 past chain_len.
void graft_chain(const int64_t* tokens, const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                 const float* log_reach, int64_t B, int64_t N, const int64_t* chain, const int64_t* chain_len,
                 const float* chain_log_reach, int64_t K, int64_t* out_tokens, int32_t* out_parents,
                 int32_t* out_depth, int32_t* out_num_nodes, float* out_reach, int64_t* chain_nodes);

}  // namespace taps
