// Elementwise math shared by the C++ kernels (the edge scorer, the GGUF decoder forward, the row projections),
// for AVX-512 and for AVX2 + FMA.
//
// exp evaluates 2^n * P(r) with r = x - n*ln2 (|r| <= ln2/2, two-part ln2) and P the degree-7 Taylor
// polynomial (truncation < 1e-8 relative, below float32 rounding), scaled by 2^n, which overflows to inf and
// underflows to 0 like expf. Both widths run the same operations on each element (the AVX2 one applies 2^n as
// two exact power-of-two factors where AVX-512 has vscalefps: the one rounding is the same), and each element's
// result depends on that element alone (tails run the same code under a mask), which the row-invariant forward
// relies on.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <cstdint>

namespace taps {

// The clamp, the two-part ln2 and the polynomial's coefficients (highest degree first) of both widths.
namespace exp_poly {
constexpr float kMax = 100.0f, kMin = -110.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;         // n * kLn2Hi is exact
constexpr float kLn2Lo = 1.42860682030941723212e-6f;  // ln2 - kLn2Hi
constexpr float kCoef[8] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                            1.0f / 6.0f,    0.5f,           1.0f,           1.0f};
}  // namespace exp_poly

__attribute__((target("avx512f"))) inline __m512 exp_avx512(__m512 x) {
  using namespace exp_poly;
  // max/min return their second operand for a NaN, so a NaN input stays NaN
  x = _mm512_min_ps(_mm512_set1_ps(kMax), _mm512_max_ps(_mm512_set1_ps(kMin), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kCoef[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kCoef[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^n for integral n in [-126, 127] (exact).
__attribute__((target("avx2,fma"))) inline __m256 pow2_avx2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

// exp_avx512 on 8 lanes; p * 2^n as (p * 2^n1) * 2^n2 with both factors normal, of which only the second product
// rounds (to inf, to a subnormal or to 0 as scalef does).
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  using namespace exp_poly;
  x = _mm256_min_ps(_mm256_set1_ps(kMax), _mm256_max_ps(_mm256_set1_ps(kMin), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kCoef[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kCoef[i]));
  const __m256 n1 = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));  // n in [-159, 145]: n1, n2 in range
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_avx2(n1)), pow2_avx2(_mm256_sub_ps(n, n1)));
}

// Lane sum of 8 floats in a fixed order: halves, then pairs, then the last two.
__attribute__((target("avx2"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// SiLU in place, a / (1 + exp(-a)).
__attribute__((target("avx512f"))) inline void silu_avx512(float* a, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(m, a + i);
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_mask_storeu_ps(a + i, m, _mm512_div_ps(v, _mm512_add_ps(one, e)));
  }
}
}  // namespace taps

#endif
