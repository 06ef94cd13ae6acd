// The GGUF forward's per-row math on AVX-512 (see gguf_row_ops.h).
#include "gguf_row_ops.h"

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

// v held in a register: a key or value chunk feeds G FMAs, which the compiler would otherwise each give a load
// of their own (from a float32 tile: 3x the loads, and the loads then bound the loop).
TAPS_AVX512 inline __m512 in_register(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}

// One row's scores for the G query heads q [G, D] against tn <= 16 keys key(0) .. key(tn - 1) (D = 16 * DC
// float32 or float16 elements each), into s[g * ld + t]: per head and key the dot by FMA over the 16-lane chunks, then
// the 16 keys reduced by one transpose and scaled. A key's score depends on q and that key only.
template <int G, int DC, typename KeyAt>
TAPS_AVX512 inline void score_tile(const float* q, KeyAt key, int64_t tn, float scale, float* s, int64_t ld) {
  constexpr int64_t D = 16 * DC;
  __m512 qv[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  alignas(64) __m512 part[G][16];
  for (int64_t t = 0; t < 16; ++t) {
    if (t < tn) {
      const auto* k = key(t);
      __m512 kv[DC];
      for (int c = 0; c < DC; ++c) kv[c] = in_register(load16(k + 16 * c));
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
    _mm512_mask_storeu_ps(s + g * ld, static_cast<__mmask16>((1u << tn) - 1u), sc);
  }
}

// acc[g] += p[g * ld + t] * value(t) for t = 0 .. tn - 1 in that order (acc [G, D] float32 in memory).
template <int G, int DC, typename ValueAt>
TAPS_AVX512 inline void value_tile(const float* p, int64_t ld, ValueAt value, int64_t tn, float* acc) {
  constexpr int64_t D = 16 * DC;
  __m512 a[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  for (int64_t t = 0; t < tn; ++t) {
    const auto* v = value(t);
    __m512 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = in_register(load16(v + 16 * c));
    for (int g = 0; g < G; ++g) {
      const __m512 pb = _mm512_set1_ps(p[g * ld + t]);
      for (int c = 0; c < DC; ++c) a[g][c] = _mm512_fmadd_ps(pb, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// 16 cache rows (slots t0 .. t0 + 15) widened to float32 into w [16, D]: exact, so a tile read from w gives
// the bits it gives read from the cache.
template <int DC, typename T>
TAPS_AVX512 inline void widen_tile(const T* src, float* w) {
  for (int64_t e = 0; e < 16 * 16 * DC; e += 16) _mm512_store_ps(w + e, load16(src + e));
}

// tile(r, at, tn) for every row r that has visible keys in the tile at t0: at(t) is the t-th of its tn keys
// there, read from the widened tile when the tile is shared, else from the cache row of the row's slot.
template <int64_t D, typename T, typename Tile>
TAPS_AVX512 inline void each_row_of_tile(const AttendRows& a, int64_t t0, const T* cache, const float* wide,
                                         bool shared, Tile&& tile) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t* vis = a.vis + a.vis_start[r];
    const int64_t nv = a.vis_start[r + 1] - a.vis_start[r];
    if (t0 >= nv) continue;
    if (shared) {
      tile(r, [&](int64_t t) { return wide + t * D; }, int64_t{16});
    } else {
      tile(r, [&](int64_t t) { return cache + vis[t0 + t] * D; }, std::min<int64_t>(16, nv - t0));
    }
  }
}

// Attention of a.rows query rows for the G query heads of one KV head (gguf_row_ops.h's AttendRows; head_dim
// = 16 * DC; cache elements T: float, or uint16_t holding float16). Tiles of 16 visible keys, each row's tile
// after the other's: per row and head the scores of score_tile, the softmax in slot-sequence order, the value
// sum in that order, so each row's bits are those of the row alone. A tile inside the shared prefix is widened
// once and read by every row from L1 instead of converted again per row (all layers' attention of 16 tree rows
// at a 500-token prefix, SmolLM2's heads, timed alone: 6.7-8.4 -> 6.0-7.3 ms, 1.1-1.15x, the same bits). The
// lambdas carry the target attribute so that the tile functions inline into them (without it: a call per tile
// and row).
template <int G, int DC, typename T>
TAPS_AVX512 void attend(const AttendRows& a, const void* Kv, const void* Vv) {
  constexpr int64_t D = 16 * DC;
  const T* K = static_cast<const T*>(Kv);
  const T* V = static_cast<const T*>(Vv);
  const int64_t R = a.rows, ld = a.max_nv;
  int64_t most = 0;
  for (int64_t r = 0; r < R; ++r) most = std::max(most, a.vis_start[r + 1] - a.vis_start[r]);
  alignas(64) float wide[16 * D];
  const auto is_shared = [&](int64_t t0) { return R > 1 && t0 + 16 <= a.shared; };
  for (int64_t t0 = 0; t0 < most; t0 += 16) {
    const bool shared = is_shared(t0);
    if (shared) widen_tile<DC>(K + t0 * D, wide);
    each_row_of_tile<D>(a, t0, K, wide, shared, [&](int64_t r, auto key, int64_t tn) TAPS_AVX512 {
      score_tile<G, DC>(a.q + r * a.q_stride, key, tn, a.scale, a.scores + r * G * ld + t0, ld);
    });
  }
  thread_local std::vector<float> inv;
  inv.resize(static_cast<size_t>(R * G));
  for (int64_t r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      inv[r * G + g] = softmax_scores(a.scores + (r * G + g) * ld, a.vis_start[r + 1] - a.vis_start[r]);
    }
  }
  std::fill(a.acc, a.acc + R * G * D, 0.0f);
  for (int64_t t0 = 0; t0 < most; t0 += 16) {
    const bool shared = is_shared(t0);
    if (shared) widen_tile<DC>(V + t0 * D, wide);
    each_row_of_tile<D>(a, t0, V, wide, shared, [&](int64_t r, auto value, int64_t tn) TAPS_AVX512 {
      value_tile<G, DC>(a.scores + r * G * ld + t0, ld, value, tn, a.acc + r * G * D);
    });
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      const __m512 iv = _mm512_set1_ps(inv[r * G + g]);
      const float* acc = a.acc + (r * G + g) * D;
      float* out = a.out + r * a.out_stride + g * D;
      for (int c = 0; c < DC; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), iv));
    }
  }
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
