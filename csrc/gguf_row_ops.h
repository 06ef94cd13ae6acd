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

// Attention of R query rows over one KV head's cache rows K / V ([slots, D] of the cache type), for the G query
// heads of that KV head. Row r's query heads are q + r * q_stride ([G, D]), its output out + r * out_stride
// ([G, D]), its visible slots vis[vis_start[r] .. vis_start[r + 1]) in cache order; every row's first `shared`
// visible slots are 0, 1, ..., shared - 1 (a batch row's committed prefix), which lets the kernel read those
// keys and values once for all rows. Workspaces: scores R * G * max_nv floats (max_nv: the most visible slots
// of any row), acc R * G * D floats. Each row's result is what it would be alone (R = 1, shared = 0).
struct AttendRows {
  int64_t rows = 0;
  const float* q = nullptr;
  int64_t q_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  const int64_t* vis = nullptr;
  const int64_t* vis_start = nullptr;
  int64_t shared = 0;
  int64_t max_nv = 0;
  float scale = 1.0f;
  float* scores = nullptr;
  float* acc = nullptr;
};
using AttendFn = void (*)(const AttendRows& a, const void* K, const void* V);

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
