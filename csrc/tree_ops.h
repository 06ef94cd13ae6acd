// Tree ops of taps_kernels on raw host pointers: pure C++17, no torch, no allocation on the hot path
// beyond what a caller-owned Workspace grows to once.
//
// Every function here works on ONE tree of the batched layout of docs/DESIGN.md ("Tree layout"):
//   tokens  [N] int64, parents [N] int32 (-1 for the root and padding), depth [N] int32,
//   num_nodes real rows (root included), node 0 the root, parents[i] < i for real i > 0.
// The torch bindings (bindings.cpp) loop over the batch; the ctest unit tests (csrc/tests) call these
// directly. Results match taps_kernels/reference/*.py exactly: the same float32 / double operations in
// the same order, the same tie-breaks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace taps {

// ---------------------------------------------------------------------------------------------------------
// Top-K of one row of log-probabilities.
// x [V] float32 -> vals [K], ids [K] sorted by value descending, equal values by smaller index
// (what a stable descending sort gives); NaN ranks above every number, as in torch.sort. K in [1, V].
struct TopKWorkspace {
  std::vector<std::pair<float, int64_t>> heap;
};
void topk_row(const float* x, int64_t V, int32_t K, float* vals, int64_t* ids, TopKWorkspace& ws);

// ---------------------------------------------------------------------------------------------------------
// Best-first pool (METHOD.md section 3) of one tree.
// topk_logp [D,K] float32, topk_ids [D,K] int64 (position d predicts depth d+1).
// Writes N = pool_size + 1 rows of tokens/parents/depth/logq/step_logq/rank, padding included
// (tokens 0, parents -1, depth 0, logq = step_logq = -inf, rank -1); returns num_nodes.
// Candidate (parent, rank) scores logq[parent] + topk_logp[depth(parent), rank] in float32; priority:
// larger score, then smaller parent index, then smaller rank.
// The heap holds one 64-bit key per candidate (score order in the high half, parent and rank packed in
// the low half) so that every comparison is one integer compare; when parent and rank do not fit in 32
// bits (pool_size << ceil(log2 K) >= 2^32) it holds (score, parent, rank) records instead. Both orders
// are the same total order, so the pool does not depend on the path (packed_keys=false forces the
// record heap, for tests).
struct PoolCandidate {
  float score;
  int32_t parent;
  int32_t rank;
};
struct PoolWorkspace {
  std::vector<uint64_t> keys;
  std::vector<PoolCandidate> records;
};
int32_t best_first_pool_one(const float* topk_logp, const int64_t* topk_ids, int64_t root_token, int32_t D,
                            int32_t K, int32_t pool_size, int64_t* tokens, int32_t* parents, int32_t* depth,
                            float* logq, float* step_logq, int32_t* rank, PoolWorkspace& ws, bool packed_keys = true);

// ---------------------------------------------------------------------------------------------------------
// log_reach [N] float32: 0 at node 0, -inf where i > 0 and parents[i] == -1, else
// log_reach[parents[i]] + edge_logq[i] (float32, nodes in index order).
void propagate_reach_one(const int32_t* parents, const float* edge_logq, int32_t N, float* log_reach);

// ---------------------------------------------------------------------------------------------------------
// Subtree selection of one tree. Writes pool_index [max_nodes + 1] (0, kept pool nodes ascending, -1 pad)
// and returns the number of kept non-root nodes.
enum class Rule { kReach = 0, kUtility = 1 };
struct SelectParams {
  int32_t max_nodes = 1;
  Rule rule = Rule::kReach;
  const double* latency = nullptr;  // [latency_len] seconds; nullptr: fixed size min(max_nodes, num_nodes - 1)
  int32_t latency_len = 0;
  double t0 = 0.0;
  double lambda_node = 1.0;
  double lambda_depth = 0.002;
  double min_utility = 0.0;
};
struct SelectWorkspace {
  std::vector<float> eff;          // effective reach
  std::vector<uint64_t> keys;      // (order key of -e, node index) packed for the reach rule
  std::vector<std::pair<double, int32_t>> util;  // utility heap
  std::vector<uint8_t> kept;
  std::vector<int32_t> missing;
};
int32_t select_subtree_one(const int32_t* parents, const int32_t* depth, int32_t num_nodes, const float* log_reach,
                           const SelectParams& params, int64_t* pool_index, SelectWorkspace& ws);

// Batch throughput rule (taps.decode.policies.gate.GatedPolicy; spec: reference/select.py::
// select_throughput_reference): tree sizes chosen jointly for B trees, so one call takes the whole batch.
//   log_reach [B,N] float32: ranking key, non-increasing along paths; the root column and nodes at index
//             >= num_nodes[b] are not read (they count as -inf).
//   reach     [B,N] double: exp(double(log_reach)) as torch computes it. The caller computes it because the
//             reference's sums read torch's vectorised exp, which differs from libm's in the last bit now and
//             then; entries the rule does not read may hold anything.
//   num_nodes [B] in [1, N].
// Writes pool_index [B, max_nodes+1] (0, kept nodes ascending, -1 pad), num_selected [B], expected [B].
// Row b's candidates: its first cap = min(max_nodes, N-1) nodes by (-log_reach, index). All candidates are
// merged by (-reach, b * cap + rank) (the row's own order when B == 1); the batch keeps the first k* of
// K = min(B * cap, table_len - 1) with k* the first maximum of S_k - (table[k] - table[0]) * (rows /
// plain_seconds), S_k the running double sum of merged reaches. Row b keeps its first n_b candidates (its
// entries among the first k*) except those of log reach -inf; expected[b] = float(1 + their reach summed in
// merged order).
struct ThroughputParams {
  int32_t max_nodes = 0;
  const double* table = nullptr;  // [table_len] seconds, table_len >= 1
  int32_t table_len = 0;
  double plain_seconds = 1.0;
  int64_t rows = 1;
};
struct ThroughputWorkspace {
  std::vector<uint64_t> keys;                        // one row: (order key of -log_reach, node index) packed
  std::vector<int32_t> node;                         // [B * cap] candidate nodes in row rank order
  std::vector<std::pair<double, int64_t>> cand;      // [B * cap] (reach, b * cap + rank) in row rank order
  std::vector<std::pair<double, int64_t>> heads;     // merge heap: each row's next candidate
  std::vector<std::pair<double, int64_t>> merged;    // [K] the first K candidates in merged order
  std::vector<int32_t> sizes;
  std::vector<double> mass;
};
void select_throughput_batch(const float* log_reach, const double* reach, const int32_t* num_nodes, int64_t B,
                             int32_t N, const ThroughputParams& params, int64_t* pool_index, int32_t* num_selected,
                             float* expected, ThroughputWorkspace& ws);

// Gathers the kept rows of a tree into a new one: pool_index [M] (kept pool nodes ascending, -1 padding)
// -> tokens/parents/depth [M] with parents renumbered to the new rows (-1 for the root, for padding and
// for a kept node whose parent was not kept); new_of_old [N] is scratch. pool_index entries must be -1
// or in [0, N).
void reindex_subtree_one(const int64_t* tokens, const int32_t* parents, const int32_t* depth, int32_t N,
                         const int64_t* pool_index, int32_t M, int64_t* out_tokens, int32_t* out_parents,
                         int32_t* out_depth, int32_t* new_of_old);

// ---------------------------------------------------------------------------------------------------------
// position_ids [N] = prefix_len + depth; ancestor_bits [N, W] (W = ceil(N/32)), bit j%32 of word j/32 of
// row i set iff j is an ancestor of i or i itself; padding rows (i >= num_nodes) carry only their own bit.
void tree_mask_one(const int32_t* parents, const int32_t* depth, int32_t num_nodes, int32_t N, int64_t prefix_len,
                   int64_t* position_ids, int32_t* ancestor_bits);

// ---------------------------------------------------------------------------------------------------------
// Greedy acceptance walk: from node 0, move to the smallest-index child whose token equals target[cur]
// while fewer than path_len nodes were visited. Writes path [path_len] (-1 padded), returns accept_len;
// *next_token = target[last visited node].
struct AcceptWorkspace {
  std::vector<int32_t> first_child;
  std::vector<int32_t> next_sibling;
};
int64_t accept_greedy_one(const int64_t* tokens, const int32_t* parents, int32_t num_nodes, const int64_t* target,
                          int32_t path_len, int64_t* path, int64_t* next_token, AcceptWorkspace& ws);

// One row of a decode round's acceptance (taps_kernels.accept_round): the walk above; an idle row (!active)
// accepts nothing (path [0, -1, ...]); committed [path_len] = the accepted tokens after the root, then
// *next_token, -1 after; when history is given, the n committed tokens are written at history[*history_len ..]
// (those at or past history_cap dropped) and *history_len += n. Returns n, the tokens committed.
int64_t accept_round_one(const int64_t* tokens, const int32_t* parents, int32_t num_nodes, const int64_t* target,
                         bool active, int32_t path_len, int64_t* path, int64_t* next_token, int64_t* committed,
                         int64_t* history, int64_t* history_len, int64_t history_cap, AcceptWorkspace& ws);

// ---------------------------------------------------------------------------------------------------------
// KV compaction on a raw strided buffer [B, H, L, Dh] of elem_size-byte elements (strides in elements).
struct KVView {
  char* data;
  int64_t elem_size;
  int64_t B, H, L, Dh;
  int64_t stride_b, stride_h, stride_l, stride_d;
};
// Path check done before any write: entries are node indices or trailing -1, strictly increasing, and
// path[b, j] <= L - 1 - prefix_lens[b] with 0 <= prefix_lens[b] <= L (compared without forming
// prefix + path, which can overflow int64). Returns -1 when valid, else the flat index b * P + j of the
// first bad entry (row-major).
int64_t check_compact_path(const int64_t* path, int64_t B, int64_t P, const int64_t* prefix_lens, int64_t L);
// Moves row prefix_len + path[j] to prefix_len + j for j < n, every head of batch row b. Requires a path
// that passed check_compact_path (then path[j] >= j, so ascending copies never read an overwritten row).
void compact_kv_row(const KVView& kv, int64_t b, int64_t prefix_len, const int64_t* path, int64_t n);

// ---------------------------------------------------------------------------------------------------------
// Structural tree check over a whole batch (tokens/parents/depth [B,N], num_nodes [B]); vocab_size < 0
// skips the token range check. Returns the first violation in the same phase order and row-major order
// as taps_kernels.layout.validate_tree, or kind == kOk.
enum class TreeFault : int32_t {
  kOk = 0,
  kNumNodes = 1,
  kParent = 2,
  kRootParent = 3,
  kPaddingParent = 4,
  kDepth = 5,
  kToken = 6,
};
struct TreeCheck {
  TreeFault kind = TreeFault::kOk;
  int64_t b = -1;
  int64_t i = -1;
};
TreeCheck validate_tree(const int64_t* tokens, const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                        int64_t B, int64_t N, int64_t vocab_size);

}  // namespace taps
