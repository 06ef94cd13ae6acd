// Per-position statistics of draft logits in one read of each row: log-softmax, entropy, top-K.
//
// Why it exists: the candidate pool reads every draft position's logits over the (draft) vocabulary
// (7 x 24K floats per round here); log_softmax, exp, the entropy product, its sum and the top-K as
// separate ATen passes cost ~0.5 ms a round, while one pass per row costs ~0.1 ms.
//
// Numerics: s = sum_i exp(x[i] - max) and t = sum_i exp(x[i] - max) * (x[i] - max), float32 terms summed in
// float64 (8 lanes on AVX-512, the same lanes and order on AVX2, in order in plain loops); lse = max + log(s) and
// logp[i] = x[i] - lse in float64, rounded once; entropy = log(s) - t / s. They match the PyTorch reference
// (taps_kernels/reference/pool.py) to float32 rounding, not bit for bit. The top-K (a threshold filter on AVX-512
// and AVX2, topk_row in plain loops) orders these log-probabilities exactly: larger first, equal values by smaller
// id.
#pragma once

#include <cstdint>
#include <vector>

#include "tree_ops.h"

namespace taps {

struct TopKCandidate {
  float value;
  int32_t id;
};

struct TopKStatsWorkspace {
  std::vector<float> logp;
  std::vector<int32_t> ids;
  std::vector<TopKCandidate> candidates;
  TopKWorkspace topk;
};

// The rows this process runs (topk_stats_row, argmax_row): AVX-512 where the CPU has it, else AVX2, else plain loops.
// TAPS_GGUF_KERNELS=avx2 or =scalar asks for a slower set, as it does for the GGUF kernels, so that one CPU can
// compare them (the AVX2 rows are built to give the AVX-512 rows' bits; tests/test_topk_rows.py).
enum class RowPath { Scalar, Avx2, Avx512 };
RowPath row_path();
const char* row_path_name();  // "avx512", "avx2", "scalar"

// x [V] float32 -> vals [K], ids [K] (top-K log-probs, descending), *entropy (nats), K in [1, V], V < 2^31.
// Returns false (outputs unspecified) when the row holds a NaN or +inf, or only -inf.
bool topk_stats_row(const float* x, int64_t V, int32_t K, float* vals, int64_t* ids, float* entropy,
                    TopKStatsWorkspace& ws);

// The plain-loop path on its own (what topk_stats_row runs without AVX-512 or AVX2); exposed for the unit test.
bool topk_stats_row_scalar(const float* x, int64_t V, int32_t K, float* vals, int64_t* ids, float* entropy,
                           TopKStatsWorkspace& ws);

// One draft position's statistics as the pool and the scorer read them: topk_stats_row over K2 columns (K2 =
// max(K, 2) capped at V: the margin needs a runner-up), margin = x[ids[0]] - x[ids[1]] (the logits' own difference;
// 0 when V = 1 or not finite), topk_mass = the float64 sum of exp of the first K log-probs, rounded once.
// Returns false as topk_stats_row.
bool position_stats(const float* x, int64_t V, int32_t K, int32_t K2, float* vals, int64_t* ids, float* entropy,
                    float* margin, float* topk_mass, TopKStatsWorkspace& ws);

// Index of the largest entry of x [V] (V >= 1), the first among equal ones; a NaN counts as larger than any number
// (the first NaN wins), as torch.argmax. The target's greedy token: ATen's last-dim argmax reads ~0.7 GB/s here,
// this ~10x that.
int64_t argmax_row(const float* x, int64_t V);

}  // namespace taps
