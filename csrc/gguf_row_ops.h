// The per-row math of the GGUF forward (gguf_forward.h): RMSNorm, SwiGLU and the attention of one query row,
// one implementation per instruction set (gguf_row_ops_avx512.cpp, gguf_row_ops_avx2.cpp).
//
// Each is row-invariant on its own: a row's result depends on that row's inputs and, for attention, on the
// sequence of its visible keys only. The two sets reduce over different lane counts, so they may differ in
// the last bits from each other; a process always runs one of them (row_ops()), so a tree's rows still equal
// plain decoding's bit for bit.
#pragma once

#include <cstdint>

#include "gguf_forward.h"

namespace taps {
namespace gguf {

constexpr int kMaxGroup = 8;  // query heads per KV head handled together

// Attention of one query row for the G query heads of one KV head over the visible slots vis[0..nv):
// q [G, D], K / V the head's cache rows [slots, D] of the cache type, scores a workspace of G * nv floats,
// out [G, D].
using AttendFn = void (*)(const float* q, const void* K, const void* V, const int64_t* vis, int64_t nv,
                          float scale, float* scores, float* out);

struct RowOps {
  const char* isa;                                                            // "avx512" or "avx2"
  void (*rmsnorm_row)(const float* x, const float* w, float* y, int64_t H, float eps);  // y = w * x / rms(x)
  void (*swiglu)(float* g, const float* u, int64_t n);                        // g = silu(g) * u
  AttendFn (*attend_for)(int64_t G, int64_t D, CacheType t);                  // G in 1..8, D = 16 * (1..8)
  void (*to_half)(const float* x, uint16_t* y, int64_t n);                    // y = float16(x), nearest even
};

// float32 -> float16 bits, rounded to nearest even (F16C; both sets need it, so both write the cache with it).
// Built on x86-64 GCC/Clang only, where the sets are.
void to_half_f16c(const float* x, uint16_t* y, int64_t n);

// The set each instruction set gives; null where the build or this CPU lacks it.
const RowOps* row_ops_avx512();
const RowOps* row_ops_avx2();

// The set this process runs: AVX-512 where the CPU has it (unless TAPS_GGUF_KERNELS=avx2), else AVX2; null
// where neither runs.
const RowOps* row_ops();

}  // namespace gguf
}  // namespace taps
