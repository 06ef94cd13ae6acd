// TAPS edge scorer (op score_edges) of one pool tree on raw host pointers: pure C++17, no torch.
//
// The specification is the docstring of taps_kernels/reference/score.py (feature layout, the two
// LayerNorm -> Linear -> SiLU -> Linear heads, the "other" bucket, sibling normalisation, reach); the
// names below follow it. One call scores ONE tree of the batched layout (docs/DESIGN.md "Tree layout"):
//   tokens [N] int64 (all in [0, table rows), padding included, when a full scorer reads them),
//   parents [N] int32 (-1 for the root and padding, otherwise smaller than the child's index), depth [N] int32;
//   logq, step_logq [N] f32; entropy, margin, topk_mass [D] f32 (per draft position), D >= 1 with a scorer.
// The torch binding (bindings.cpp) checks all of that and loops over the batch; csrc/tests calls this
// directly.
//
// Outputs [N] f32: edge_logq, other_logq, log_reach, with the reference's conventions: root edge and
// reach 0, padding rows -inf in all three, a real node without children other_logq = 0 (exactly, with a
// scorer; log(1 - 0) in the marginal model).
//
// Precision: float32 throughout, but the projections, fc1 and the LayerNorm moments sum in a different
// order from torch's, and the AVX-512 SiLU uses its own exp, so the scorer outputs match the reference
// to float32 rounding, not bit for bit. The marginal model (no scorer) gives the reference's edge_logq
// and log_reach bit for bit.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace taps {

// One head: LayerNorm(F) -> Linear(F, M) -> SiLU -> Linear(M, 1); nn.Linear layout [out, in].
struct ScorerHead {
  const float* ln_weight = nullptr;   // [F]
  const float* ln_bias = nullptr;     // [F]
  const float* fc1_weight = nullptr;  // [M, F]
  const float* fc1_bias = nullptr;    // [M]
  const float* fc2_weight = nullptr;  // [M]  (the [1, M] tensor)
  const float* fc2_bias = nullptr;    // [1]
};

// Rows of the target's input embedding table read as float32. The table may hold float16 / bfloat16
// and is large (SmolLM2: 49152 x 576), so only the rows of the tokens in the pool are ever converted.
struct TokenTable {
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t width = 0;       // E
  int64_t row_stride = 0;  // in elements
  int64_t col_stride = 1;  // in elements
  // writes row `row` as `width` floats to out
  void (*load_row)(const TokenTable& table, int64_t row, float* out) = nullptr;
};

// A float32 scorer; full == false is the tiny variant (F = 7 scalars, no embedding parts).
struct ScorerNet {
  int32_t F = 7;
  int32_t M = 0;
  float ln_eps = 1e-5f;
  // AVX-512 for fc1 and SiLU where the CPU has it (false forces the plain loops: the unit test runs both)
  bool vectorized = true;
  ScorerHead edge, other;
  bool full = false;
  int32_t Pt = 0, Pd = 0, Ph = 0;         // full only: F == 2*Pt + Pd + Ph + 7
  int32_t H = 0;                          // drafter hidden width
  int32_t depth_rows = 0;                 // rows of depth_embedding (>= 1; indices are clamped into it)
  const float* token_proj_weight = nullptr;   // [Pt, E]
  const float* token_proj_bias = nullptr;     // [Pt]
  const float* depth_embedding = nullptr;     // [depth_rows, Pd]
  const float* hidden_proj_weight = nullptr;  // [Ph, H]
  const float* hidden_proj_bias = nullptr;    // [Ph]
};

struct ScoreTree {
  const int64_t* tokens = nullptr;
  const int32_t* parents = nullptr;
  const int32_t* depth = nullptr;
  int32_t N = 0;
  const float* logq = nullptr;
  const float* step_logq = nullptr;
  const float* entropy = nullptr;
  const float* margin = nullptr;
  const float* topk_mass = nullptr;
  int32_t D = 0;
};

// Scratch that grows to the largest tree seen and is reused across calls (one per thread).
struct ScoreWorkspace {
  std::vector<std::pair<int64_t, int32_t>> token_nodes;  // (token, node), sorted by token
  std::vector<int32_t> token_row;                        // node -> row of tok_proj
  std::vector<float> emb_rows, tok_proj, hid_proj;
  std::vector<float> feats, fc1_t, hidden, row_logit;    // one head's feature rows, fc1^T, fc1 activations, logits
  std::vector<int32_t> edge_nodes, other_nodes;          // node of each feature row
  std::vector<float> edge_logit, other_logit, seg_max, seg_sum;  // per node
};

// net == nullptr: the marginal (DDTree) model, edge_logq = step_logq. Otherwise table and
// drafter_hidden ([D, H] f32, row-major) are read only when net->full.
void score_edges_one(const ScoreTree& tree, const ScorerNet* net, const TokenTable* table, const float* drafter_hidden,
                     float* edge_logq, float* other_logq, float* log_reach, ScoreWorkspace& ws);

}  // namespace taps
