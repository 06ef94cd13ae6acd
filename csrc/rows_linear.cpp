// Few-row linear layer (see rows_linear.h for why and the blocking).
#include "rows_linear.h"
#include "simd_math.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's avx512fintrin.h trips its own -Wuninitialized in the masked loads (a known false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define TAPS_HAVE_AVX512_PATH 1
#endif

namespace taps {

namespace {

inline float weight_value(float w) { return w; }
inline float weight_value(Bf16 w) {
  const uint32_t bits = static_cast<uint32_t>(w.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Plain loops: the fallback on CPUs without AVX-512 (and the shape of what the vector path computes).
template <typename W>
void tiles_scalar(const float* x, const W* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t t0,
                  int64_t t1) {
  const int64_t n0 = t0 * kRowsLinearTile, n1 = std::min(N, t1 * kRowsLinearTile);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * weight_value(w[n * K + k]);
      y[m * N + n] = acc + (bias ? bias[n] : 0.0f);
    }
  }
}

}  // namespace

void rows_linear_tiles_scalar(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                              int64_t K, int64_t t0, int64_t t1) {
  tiles_scalar(x, w, bias, y, M, N, K, t0, t1);
}

void rows_linear_tiles_scalar(const float* x, const Bf16* w, const float* bias, float* y, int64_t M, int64_t N,
                              int64_t K, int64_t t0, int64_t t1) {
  tiles_scalar(x, w, bias, y, M, N, K, t0, t1);
}

namespace {

#ifdef TAPS_HAVE_AVX512_PATH
// 16 weights as float32: bf16 widens exactly (its bits are a float32's upper half).
__attribute__((target("avx512f"))) inline __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load_w(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx512f"))) inline __m512 load_w_tail(const float* p, int64_t n, __mmask16 m) {
  (void)n;
  return _mm512_maskz_loadu_ps(m, p);
}
__attribute__((target("avx512f"))) inline __m512 load_w_tail(const Bf16* p, int64_t n, __mmask16 m) {
  alignas(64) float buf[16] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = weight_value(p[i]);
  return _mm512_maskz_load_ps(m, buf);
}

// y[c, r] = dot(x[c, :], w[r, :]) (+ bias[r]) for R weight rows and C x rows; ldy is y's row stride.
// Prefetch: also pull the weight rows two blocks ahead into L1 (the first pass over a tile streams them
// from memory; measured 12-16% faster at 5-16 rows, no change at 1-2).
template <int R, int C, bool Prefetch, typename W>
__attribute__((target("avx512f"))) inline void micro_avx512(const float* x, const W* w, const float* bias,
                                                             float* y, int64_t ldy, int64_t K) {
  const int64_t kmain = K & ~int64_t(15);
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - kmain)) - 1u);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kmain; k += 16) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(x + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load_w(w + r * K + k);
      if (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (r + 2 * R) * K + k), _MM_HINT_T0);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  if (tail) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_maskz_loadu_ps(tail, x + c * K + kmain);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load_w_tail(w + r * K + kmain, K - kmain, tail);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r] = _mm512_reduce_add_ps(acc[r][c]) + (bias ? bias[r] : 0.0f);
}

template <int C, bool Prefetch, typename W>
__attribute__((target("avx512f"))) void rows_avx512(const float* x, const W* w, const float* bias, float* y,
                                                     int64_t N, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* b = bias ? bias + n : nullptr;
    if (Prefetch && n + 12 <= n1) {
      micro_avx512<4, C, true, W>(x, w + n * K, b, y + n, N, K);
    } else {
      micro_avx512<4, C, false, W>(x, w + n * K, b, y + n, N, K);
    }
  }
  for (; n < n1; ++n) micro_avx512<1, C, false, W>(x, w + n * K, bias ? bias + n : nullptr, y + n, N, K);
}

// One chunk of up to 4 x rows over weight rows [n0, n1).
template <bool Prefetch, typename W>
__attribute__((target("avx512f"))) void chunk_avx512(int64_t rows, const float* x, const W* w, const float* bias,
                                                      float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  switch (rows) {
    case 4: rows_avx512<4, Prefetch, W>(x, w, bias, y, N, K, n0, n1); break;
    case 3: rows_avx512<3, Prefetch, W>(x, w, bias, y, N, K, n0, n1); break;
    case 2: rows_avx512<2, Prefetch, W>(x, w, bias, y, N, K, n0, n1); break;
    default: rows_avx512<1, Prefetch, W>(x, w, bias, y, N, K, n0, n1); break;
  }
}

template <typename W>
__attribute__((target("avx512f"))) void tile_avx512(const float* x, const W* w, const float* bias, float* y,
                                                    int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  // the first chunk streams the tile from memory (prefetching ahead); the others find it in L2
  chunk_avx512<true, W>(std::min<int64_t>(4, M), x, w, bias, y, N, K, n0, n1);
  for (int64_t m = 4; m < M; m += 4) {
    chunk_avx512<false, W>(std::min<int64_t>(4, M - m), x + m * K, w, bias, y + m * N, N, K, n0, n1);
  }
}
#endif

#ifdef TAPS_HAVE_AVX512_PATH
#define TAPS_AVX2 __attribute__((target("avx2,fma")))
// The AVX2 twin for CPUs without AVX-512 (8 lanes, 2 weight rows x up to 4 x rows in the 16 registers): what
// rows_linear_tiles runs there instead of the plain loops. Sums in another order than the AVX-512 path.
TAPS_AVX2 inline __m256 load_w8(const float* p) { return _mm256_loadu_ps(p); }
TAPS_AVX2 inline __m256 load_w8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int R, int C, typename W>
TAPS_AVX2 void micro_avx2(const float* x, const W* w, const float* bias, float* y, int64_t ldy, int64_t K) {
  const int64_t kmain = K & ~int64_t(7);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kmain; k += 8) {
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load_w8(w + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = hsum8(acc[r][c]);
      for (int64_t k = kmain; k < K; ++k) s += x[c * K + k] * weight_value(w[r * K + k]);
      y[c * ldy + r] = s + (bias ? bias[r] : 0.0f);
    }
  }
}

template <int C, typename W>
TAPS_AVX2 void rows_avx2(const float* x, const W* w, const float* bias, float* y, int64_t N, int64_t K, int64_t n0,
                         int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) micro_avx2<2, C, W>(x, w + n * K, bias ? bias + n : nullptr, y + n, N, K);
  if (n < n1) micro_avx2<1, C, W>(x, w + n * K, bias ? bias + n : nullptr, y + n, N, K);
}

template <typename W>
TAPS_AVX2 void tile_avx2(const float* x, const W* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                         int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; m += 4) {
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (std::min<int64_t>(4, M - m)) {
      case 4: rows_avx2<4, W>(xm, w, bias, ym, N, K, n0, n1); break;
      case 3: rows_avx2<3, W>(xm, w, bias, ym, N, K, n0, n1); break;
      case 2: rows_avx2<2, W>(xm, w, bias, ym, N, K, n0, n1); break;
      default: rows_avx2<1, W>(xm, w, bias, ym, N, K, n0, n1); break;
    }
  }
}

bool avx2_available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#endif

}  // namespace

bool rows_linear_vectorized() {
#ifdef TAPS_HAVE_AVX512_PATH
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
#else
  return false;
#endif
}

namespace {

template <typename W>
void tiles(const float* x, const W* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t t0,
           int64_t t1) {
#ifdef TAPS_HAVE_AVX512_PATH
  if (rows_linear_vectorized()) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRowsLinearTile;
      tile_avx512(x, w, bias, y, M, N, K, n0, std::min(N, n0 + kRowsLinearTile));
    }
    return;
  }
  if (avx2_available()) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRowsLinearTile;
      tile_avx2(x, w, bias, y, M, N, K, n0, std::min(N, n0 + kRowsLinearTile));
    }
    return;
  }
#endif
  tiles_scalar(x, w, bias, y, M, N, K, t0, t1);
}

}  // namespace

void rows_linear_tiles(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t t0, int64_t t1) {
  tiles(x, w, bias, y, M, N, K, t0, t1);
}

void rows_linear_tiles(const float* x, const Bf16* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t t0, int64_t t1) {
  tiles(x, w, bias, y, M, N, K, t0, t1);
}

}  // namespace taps
