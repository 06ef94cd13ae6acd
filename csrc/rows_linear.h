// Few-row linear layer on raw host pointers: y[M,N] = x[M,K] . w[N,K]^T (+ bias[N]), float32, row-major.
//
// Why it exists: a verify forward multiplies the target's weights by a handful of rows (an AR step: 1,
// a tree: 2..32). BLAS sgemm is tuned for large M and, on the CPUs measured here, costs about twice
// the single-row sgemv from M = 2 on, although both are bound by streaming the weights from memory.
// This kernel streams each weight row once for all M rows: weights are cut into tiles of kRowsLinearTile
// rows that stay in L2 while the rows of x pass over them in chunks of 4, with 4 weight rows x 4 x rows
// of 16-lane AVX-512 accumulators.
//
// Summation order differs from BLAS (16 lanes, then a lane reduction), so results match torch's
// linear to float32 rounding (~1e-6 relative), not bit for bit.
#pragma once

#include <cstdint>

namespace taps {

constexpr int64_t kRowsLinearTile = 64;

// A bfloat16 weight (the upper 16 bits of a float32). Weights stored so are widened exactly and multiplied in
// float32: the same products as their float32 copies, half the bytes to stream.
struct Bf16 {
  uint16_t bits;
};

// Whether this CPU runs the AVX-512 path; without it rows_linear_tiles runs an AVX2 twin where the CPU has AVX2
// (the GGUF drafter's fc projection), else plain loops (correct, slower than BLAS: callers should not pick it
// over torch's linear then; the AVX2 twin was not measured against BLAS).
bool rows_linear_vectorized();

// Computes the weight-row tiles [t0, t1) (tile t covers weight rows t*kRowsLinearTile ...) for all M rows.
// bias may be null. Tiles write disjoint columns of y, so callers may run tile ranges in parallel.
void rows_linear_tiles(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t t0, int64_t t1);
void rows_linear_tiles(const float* x, const Bf16* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t t0, int64_t t1);

// The plain-loop path on its own (what rows_linear_tiles runs without AVX-512 or AVX2); exposed for the unit test.
void rows_linear_tiles_scalar(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                              int64_t K, int64_t t0, int64_t t1);
void rows_linear_tiles_scalar(const float* x, const Bf16* w, const float* bias, float* y, int64_t M, int64_t N,
                              int64_t K, int64_t t0, int64_t t1);

}  // namespace taps
