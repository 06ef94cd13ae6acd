// The GGUF forward's per-row math on AVX2 + FMA + F16C (see gguf_row_ops.h), for CPUs without AVX-512.
//
// The AVX-512 set's operations on 8 lanes instead of 16: sums over 8 fixed lanes then a fixed lane reduction,
// the same exp polynomial (2^n applied as two exact power-of-two factors, so the one rounding is scalef's), the
// scores of 8 consecutive visible keys reduced by one transpose. Every reduction order depends only on the
// lengths and the sequence of visible keys, never on other rows or on the slots the keys sit in.
#include "gguf_row_ops.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TAPS_HAVE_AVX2_ROWS 1
#define TAPS_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace taps {
namespace gguf {

#ifdef TAPS_HAVE_AVX2_ROWS
namespace {

// Lanes [0, n) of an all-ones mask (n in 0..8), for maskload / maskstore.
TAPS_AVX2 inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

TAPS_AVX2 inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum of x[0..n) in a fixed order that depends on n only: 8 lanes over chunks, then the lane reduction.
TAPS_AVX2 float sum_fixed(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  if (i < n) acc = _mm256_add_ps(acc, _mm256_maskload_ps(x + i, first_lanes(n - i)));
  return hsum8(acc);
}

TAPS_AVX2 void rmsnorm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  if (i < H) {
    const __m256 v = _mm256_maskload_ps(x + i, first_lanes(H - i));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  const float inv = 1.0f / std::sqrt(hsum8(acc) / static_cast<float>(H) + eps);
  for (int64_t k = 0; k < H; ++k) y[k] = w[k] * (x[k] * inv);
}

// silu(g) * u in place into g; each element's result depends on that element alone (the tail under a mask).
TAPS_AVX2 void swiglu(float* g, const float* u, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = first_lanes(std::min<int64_t>(8, n - i));
    const __m256 v = _mm256_maskload_ps(g + i, m);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), v));
    _mm256_maskstore_ps(g + i, m, _mm256_div_ps(v, _mm256_add_ps(one, e)));
  }
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] * u[i];
}

// The 8 horizontal sums of v[0..8) as one vector (lane i = sum of v[i]); a fixed shuffle tree.
TAPS_AVX2 inline __m256 transpose_sum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Softmax of one head's scores s[0..nv) in place (max, exp, then the fixed-order sum); returns 1 / sum.
TAPS_AVX2 float softmax_scores(float* s, int64_t nv) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx = ninf;
  int64_t full = 0;
  for (; full + 8 <= nv; full += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + full));
  if (full < nv) {
    const __m256i k = first_lanes(nv - full);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + full, k), _mm256_castsi256_ps(k)));
  }
  const __m256 m = _mm256_set1_ps(hmax8(mx));
  int64_t t = 0;
  for (; t + 8 <= nv; t += 8) _mm256_storeu_ps(s + t, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), m)));
  if (t < nv) {
    const __m256i k = first_lanes(nv - t);
    _mm256_maskstore_ps(s + t, k, exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(s + t, k), m)));
  }
  return 1.0f / sum_fixed(s, nv);
}

// 8 cache values as float32 (float16 widened exactly).
TAPS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TAPS_AVX2 inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Attention of one query row for the G query heads of one KV head (head_dim = 8 * DC; cache elements T: float,
// or uint16_t holding float16); gguf_row_ops.h. Each head's dots by FMA over the 8-lane chunks in chunk order, 8
// keys reduced by one transpose, the softmax in slot-sequence order, the value sums in that order. Every key or
// value chunk is widened once for all G heads (per head, the vcvtph2ps were as many as the FMAs): the dots run
// KeyStep keys at a time with the G heads' sums of those keys in registers, the value sums SliceChunks chunks at
// a time for all heads. Only the loop nesting differs from a head-by-head loop, not any sum's order or bits.
template <int G, int DC, typename T>
TAPS_AVX2 void attend_row(const float* q, const void* Kv, const void* Vv, const int64_t* vis, int64_t nv,
                          float scale, float* scores, float* out) {
  constexpr int64_t D = 8 * DC;
  // 16 registers: G * KeyStep sums + KeyStep widened chunks; G * SliceChunks sums + G weights + 1 value chunk
  constexpr int KeyStep = G <= 3 ? 4 : (G <= 7 ? 2 : 1);
  constexpr int SliceChunks = std::max(1, std::min(DC, (15 - G) / G));
  const T* K = static_cast<const T*>(Kv);
  const T* V = static_cast<const T*>(Vv);
  for (int64_t t0 = 0; t0 < nv; t0 += 8) {
    const int64_t tn = std::min<int64_t>(8, nv - t0);
    __m256 part[G][8];
    for (int64_t s = 0; s < 8; s += KeyStep) {
      __m256 acc[G][KeyStep];
      const T* k[KeyStep];
      for (int t = 0; t < KeyStep; ++t) k[t] = s + t < tn ? K + vis[t0 + s + t] * D : nullptr;
      for (int g = 0; g < G; ++g) {
        for (int t = 0; t < KeyStep; ++t) acc[g][t] = _mm256_setzero_ps();
      }
      for (int c = 0; c < DC; ++c) {
        for (int t = 0; t < KeyStep; ++t) {
          if (k[t] == nullptr) continue;
          const __m256 kc = load8(k[t] + 8 * c);
          for (int g = 0; g < G; ++g) acc[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * c), kc, acc[g][t]);
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int t = 0; t < KeyStep; ++t) part[g][s + t] = acc[g][t];
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 st = _mm256_mul_ps(transpose_sum8(part[g]), _mm256_set1_ps(scale));
      if (tn == 8) {
        _mm256_storeu_ps(scores + g * nv + t0, st);
      } else {
        _mm256_maskstore_ps(scores + g * nv + t0, first_lanes(tn), st);
      }
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_scores(scores + g * nv, nv);
  for (int c0 = 0; c0 < DC; c0 += SliceChunks) {
    constexpr int CS = SliceChunks;
    const int cn = std::min(CS, DC - c0);
    __m256 acc[G][CS];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < CS; ++c) acc[g][c] = _mm256_setzero_ps();
    }
    for (int64_t t = 0; t < nv; ++t) {
      const T* v = V + vis[t] * D + 8 * c0;
      for (int c = 0; c < CS; ++c) {
        if (c >= cn) break;
        const __m256 vc = load8(v + 8 * c);
        for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(scores[g * nv + t]), vc, acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < cn; ++c) {
        _mm256_storeu_ps(out + g * D + 8 * (c0 + c), _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
      }
    }
  }
}

// The rows one after another (gguf_row_ops.h's AttendRows); the shared prefix comes from L2 for every row after
// the first.
template <int G, int DC, typename T>
TAPS_AVX2 void attend(const AttendRows& a, const void* K, const void* V) {
  for (int64_t r = 0; r < a.rows; ++r) {
    attend_row<G, DC, T>(a.q + r * a.q_stride, K, V, a.vis + a.vis_start[r], a.vis_start[r + 1] - a.vis_start[r],
                         a.scale, a.scores, a.out + r * a.out_stride);
  }
}

// The kernel for (G, head_dim, cache type): G in 1..8, head_dim 16 * (1..8).
template <typename T>
AttendFn attend_of(int64_t G, int64_t D) {
#define TAPS_ATTEND_ROW(g) {attend<g, 2, T>, attend<g, 4, T>, attend<g, 6, T>, attend<g, 8, T>, attend<g, 10, T>, \
                            attend<g, 12, T>, attend<g, 14, T>, attend<g, 16, T>}
  static const AttendFn table[8][8] = {TAPS_ATTEND_ROW(1), TAPS_ATTEND_ROW(2), TAPS_ATTEND_ROW(3), TAPS_ATTEND_ROW(4),
                                       TAPS_ATTEND_ROW(5), TAPS_ATTEND_ROW(6), TAPS_ATTEND_ROW(7), TAPS_ATTEND_ROW(8)};
#undef TAPS_ATTEND_ROW
  return table[G - 1][D / 16 - 1];
}

AttendFn attend_for(int64_t G, int64_t D, CacheType t) {
  return t == CacheType::F16 ? attend_of<uint16_t>(G, D) : attend_of<float>(G, D);
}

}  // namespace

__attribute__((target("f16c"))) void to_half_f16c(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

const RowOps* row_ops_avx2() {
  static const RowOps ops{"avx2", rmsnorm_row, swiglu, attend_for, to_half_f16c};
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok ? &ops : nullptr;
}
#else
const RowOps* row_ops_avx2() { return nullptr; }
#endif

}  // namespace gguf
}  // namespace taps
