// The GGUF forward's per-row math on AVX-512 (see gguf_row_ops.h).
#include "gguf_row_ops.h"

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define TAPS_HAVE_AVX512_ROWS 1
#define TAPS_AVX512 __attribute__((target("avx512f,avx512dq,f16c")))
#endif

namespace taps {
namespace gguf {

#ifdef TAPS_HAVE_AVX512_ROWS
namespace {

// Sum of x[0..n) in a fixed order that depends on n only: 16 lanes over chunks, then the lane reduction.
TAPS_AVX512 float sum_fixed(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + i));
  if (i < n) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - i)) - 1u), x + i));
  return _mm512_reduce_add_ps(acc);
}

TAPS_AVX512 void rmsnorm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  if (i < H) {
    const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (H - i)) - 1u), x + i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps);
  for (int64_t k = 0; k < H; ++k) y[k] = w[k] * (x[k] * inv);
}

// silu(g) * u in place into g.
TAPS_AVX512 void swiglu(float* g, const float* u, int64_t n) {
  silu_avx512(g, n);
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] * u[i];
}

// The 16 horizontal sums of v[0..16) as one vector (lane i = sum of v[i]); a fixed shuffle tree.
TAPS_AVX512 inline __m512 transpose_sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k) {
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // chunk g of the result sums u[g]: lane 4 * g + c is vector 4 * g + c
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Softmax of one head's scores s[0..nv) in place (max, exp, then the fixed-order sum); returns 1 / sum.
TAPS_AVX512 float softmax_scores(float* s, int64_t nv) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < nv; t += 16) {
    const __mmask16 k = nv - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (nv - t)) - 1u);
    mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, s + t));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  for (int64_t t = 0; t < nv; t += 16) {
    const __mmask16 k = nv - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (nv - t)) - 1u);
    _mm512_mask_storeu_ps(s + t, k, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
  }
  return 1.0f / sum_fixed(s, nv);
}

// 16 cache values as float32 (float16 widened exactly).
TAPS_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TAPS_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Attention of one query row for the G query heads of one KV head over the visible slots vis[0..nv)
// (head_dim = 16 * DC; cache elements T: float, or uint16_t holding float16). q: G heads x D floats; out:
// G x D; scores: workspace of G * nv floats. Each key and value row is loaded once for the G heads; per head
// the operations (and so the bits) are those of one head alone: dots by FMA over the 16-lane chunks, 16 keys
// reduced by one transpose, the softmax in slot-sequence order, the value sum in that order.
template <int G, int DC, typename T>
TAPS_AVX512 void attend(const float* q, const void* Kv, const void* Vv, const int64_t* vis, int64_t nv, float scale,
                        float* scores, float* out) {
  constexpr int64_t D = 16 * DC;
  const T* K = static_cast<const T*>(Kv);
  const T* V = static_cast<const T*>(Vv);
  __m512 qv[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  for (int64_t t0 = 0; t0 < nv; t0 += 16) {
    const int64_t tn = std::min<int64_t>(16, nv - t0);
    alignas(64) __m512 part[G][16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t < tn) {
        const T* k = K + vis[t0 + t] * D;
        __m512 kv[DC];
        for (int c = 0; c < DC; ++c) kv[c] = load16(k + 16 * c);
        for (int g = 0; g < G; ++g) {
          __m512 acc = _mm512_setzero_ps();
          for (int c = 0; c < DC; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
          part[g][t] = acc;
        }
      } else {
        for (int g = 0; g < G; ++g) part[g][t] = _mm512_setzero_ps();
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sc = _mm512_mul_ps(transpose_sum16(part[g]), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + g * nv + t0, static_cast<__mmask16>((1u << tn) - 1u), sc);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_scores(scores + g * nv, nv);
  __m512 acc[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < nv; ++t) {
    const T* v = V + vis[t] * D;
    __m512 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = load16(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * nv + t]);
      for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(out + g * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

// The kernel for (G, head_dim, cache type): G in 1..8 (at most 8 query heads per KV head), head_dim 16 * (1..8).
template <typename T>
AttendFn attend_of(int64_t G, int64_t D) {
#define TAPS_ATTEND_ROW(g) {attend<g, 1, T>, attend<g, 2, T>, attend<g, 3, T>, attend<g, 4, T>, attend<g, 5, T>, \
                            attend<g, 6, T>, attend<g, 7, T>, attend<g, 8, T>}
  static const AttendFn table[8][8] = {TAPS_ATTEND_ROW(1), TAPS_ATTEND_ROW(2), TAPS_ATTEND_ROW(3), TAPS_ATTEND_ROW(4),
                                       TAPS_ATTEND_ROW(5), TAPS_ATTEND_ROW(6), TAPS_ATTEND_ROW(7), TAPS_ATTEND_ROW(8)};
#undef TAPS_ATTEND_ROW
  return table[G - 1][D / 16 - 1];
}

AttendFn attend_for(int64_t G, int64_t D, CacheType t) {
  return t == CacheType::F16 ? attend_of<uint16_t>(G, D) : attend_of<float>(G, D);
}

}  // namespace

const RowOps* row_ops_avx512() {
  static const RowOps ops{"avx512", rmsnorm_row, swiglu, attend_for, to_half_f16c};
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("f16c");
  return ok ? &ops : nullptr;
}
#else
const RowOps* row_ops_avx512() { return nullptr; }
#endif

}  // namespace gguf
}  // namespace taps
