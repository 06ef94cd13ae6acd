// AVX-512 elementwise math shared by the C++ kernels (the edge scorer, the GGUF decoder forward).
//
// exp evaluates 2^n * P(r) with r = x - n*ln2 (|r| <= ln2/2, two-part ln2) and P the degree-7 Taylor
// polynomial (truncation < 1e-8 relative, below float32 rounding), scaled by vscalefps, which overflows to
// inf and underflows to 0 like expf. Each element's result depends on that element alone (tails run the
// same code under a mask), which the row-invariant forward relies on.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <cstdint>

namespace taps {

__attribute__((target("avx512f"))) inline __m512 exp_avx512(__m512 x) {
  // max/min return their second operand for a NaN, so a NaN input stays NaN
  x = _mm512_min_ps(_mm512_set1_ps(100.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);   // ln2 high part (exact n*hi)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);   // ln2 - high part
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
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
