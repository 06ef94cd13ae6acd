// Few-row linear layer over GGUF blocks (see gguf_linear.h for the numerics and the packed layout).
#include "gguf_linear.h"
#include "gguf_linear_interleave.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define TAPS_HAVE_VNNI_PATH 1
#endif

namespace taps {
namespace gguf {

namespace {

constexpr int64_t kQ41Bytes = 20;   // fp16 d, fp16 m, 16 bytes of nibbles
constexpr int64_t kQ80Bytes = 34;   // fp16 d, 32 int8

}  // namespace

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3FFu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float half_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return half_to_float(v);
}

int64_t block_bytes(BlockType t) { return t == BlockType::Q4_1 ? kQ41Bytes : kQ80Bytes; }
int64_t record_bytes(BlockType t) { return t == BlockType::Q4_1 ? kQ41Record : kQ80Record; }

int64_t packed_bytes(BlockType t, int64_t N, int64_t K) {
  return (N + kGroupRows - 1) / kGroupRows * (K / kBlock) * record_bytes(t);
}

void pack_blocks(BlockType t, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
  const int64_t KB = K / kBlock, G = (N + kGroupRows - 1) / kGroupRows, rec = record_bytes(t);
  std::memset(dst, 0, static_cast<size_t>(packed_bytes(t, N, K)));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      uint8_t* out = dst + (g * KB + kb) * rec;
      for (int64_t r = 0; r < kGroupRows && g * kGroupRows + r < N; ++r) {
        const uint8_t* blk = src + ((g * kGroupRows + r) * KB + kb) * block_bytes(t);
        if (t == BlockType::Q4_1) {
          for (int j = 0; j < 4; ++j) std::memcpy(out + 64 * j + 4 * r, blk + 4 + 4 * j, 4);
          std::memcpy(out + 256 + 2 * r, blk, 2);      // d
          std::memcpy(out + 288 + 2 * r, blk + 2, 2);  // m
        } else {
          for (int q = 0; q < 8; ++q) {
            for (int b = 0; b < 4; ++b) {
              out[64 * q + 4 * r + b] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + 4 * q + b]) + 128);
            }
          }
          std::memcpy(out + 512 + 2 * r, blk, 2);  // d
        }
      }
    }
  }
}

void dequantize_blocks(BlockType t, const uint8_t* src, int64_t N, int64_t K, float* dst) {
  const int64_t KB = K / kBlock;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* blk = src + (n * KB + kb) * block_bytes(t);
      float* out = dst + n * K + kb * kBlock;
      const float d = half_at(blk);
      if (t == BlockType::Q4_1) {
        const float m = half_at(blk + 2);
        for (int e = 0; e < 16; ++e) {
          out[e] = static_cast<float>(blk[4 + e] & 0xF) * d + m;
          out[e + 16] = static_cast<float>(blk[4 + e] >> 4) * d + m;
        }
      } else {
        for (int e = 0; e < 32; ++e) out[e] = static_cast<float>(static_cast<int8_t>(blk[2 + e])) * d;
      }
    }
  }
}

void quantize_activations_scalar(const float* x, int64_t M, int64_t K, int8_t* a, float* scale, int32_t* asum) {
  const int64_t KB = K / kBlock;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      const float* xb = x + m * K + kb * kBlock;
      int8_t* ab = a + m * K + kb * kBlock;
      float amax = 0.0f;
      for (int e = 0; e < kBlock; ++e) amax = std::max(amax, std::fabs(xb[e]));
      int32_t sum = 0;
      if (!std::isfinite(amax)) {  // inf or NaN in the block (std::max drops NaN: check the inputs too)
        std::memset(ab, 0, kBlock);
        scale[m * KB + kb] = std::numeric_limits<float>::quiet_NaN();
      } else {
        bool nan = false;
        for (int e = 0; e < kBlock; ++e) nan = nan || std::isnan(xb[e]);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int e = 0; e < kBlock; ++e) {
          const float q = nan ? 0.0f : std::nearbyint(xb[e] * inv);
          ab[e] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)));
          sum += ab[e];
        }
        scale[m * KB + kb] = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      }
      asum[m * KB + kb] = sum;
    }
  }
}

namespace {

// The residual digits of rows already quantised to a (gguf_linear.h: two digits) into lo / lo_scale /
// lo_sum; the plain loop. Blocks holding inf or NaN get codes that quantize_activations_digits then clears.
void residual_digits_scalar(const float* x, int64_t M, int64_t K, const int8_t* a, int8_t* lo,
                            float* lo_scale, int32_t* lo_sum) {
  const int64_t KB = K / kBlock;
  for (int64_t i = 0; i < M * KB; ++i) {
    const float* xb = x + i * kBlock;
    int8_t* lb = lo + i * kBlock;
    float amax = 0.0f;
    for (int e = 0; e < kBlock; ++e) amax = std::max(amax, std::fabs(xb[e]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int e = 0; e < kBlock; ++e) {
      const float r = xb[e] * inv - static_cast<float>(a[i * kBlock + e]);  // exact (no contraction in this build)
      const float q = std::nearbyint(r * kResidualSteps);
      lb[e] = static_cast<int8_t>(q >= -127.0f && q <= 127.0f ? q : (q > 0.0f ? 127.0f : -127.0f));
      sum += lb[e];
    }
    lo_scale[i] = amax / kTwoDigitLevels;
    lo_sum[i] = sum;
  }
}

}  // namespace

void packed_linear_scalar(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                          const float* scale, const int32_t* asum, int64_t M, float* y, int64_t ldy, int64_t g0,
                          int64_t g1) {
  const int64_t KB = K / kBlock, rec = record_bytes(t);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t r = 0; r < kGroupRows && g * kGroupRows + r < N; ++r) {
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t kb = 0; kb < KB; ++kb) {
          const uint8_t* p = packed + (g * KB + kb) * rec;
          const int8_t* ab = a + m * K + kb * kBlock;
          int32_t isum = 0;
          float blk;
          if (t == BlockType::Q4_1) {
            for (int j = 0; j < 4; ++j) {
              for (int b = 0; b < 4; ++b) {
                const uint8_t byte = p[64 * j + 4 * r + b];
                isum += (byte & 0xF) * ab[4 * j + b] + (byte >> 4) * ab[16 + 4 * j + b];
              }
            }
            const float d = half_at(p + 256 + 2 * r), mw = half_at(p + 288 + 2 * r);
            blk = d * static_cast<float>(isum) + mw * static_cast<float>(asum[m * KB + kb]);
          } else {
            for (int q = 0; q < 8; ++q) {
              for (int b = 0; b < 4; ++b) isum += (static_cast<int32_t>(p[64 * q + 4 * r + b]) - 128) * ab[4 * q + b];
            }
            blk = half_at(p + 512 + 2 * r) * static_cast<float>(isum);
          }
          acc = acc + blk * scale[m * KB + kb];
        }
        y[m * ldy + g * kGroupRows + r] = acc;
      }
    }
  }
}

namespace {

#ifdef TAPS_HAVE_VNNI_PATH
#define TAPS_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

typedef int32_t __attribute__((may_alias, aligned(1))) dword;  // 4 activation bytes, read as one

// Rows are taken up to 12 at a time (12 block sums + 12 accumulators + the weights in the 32 registers),
// in equal chunks (16 rows: 8 + 8, not 12 + 4). The group's records stay in L1 across the chunks.
constexpr int kRowChunk = 12;

// Rows m0 .. m0 + MC of x over one group of 16 output rows; rows past N are masked out of the store. The steps
// over a block's 8 dwords go across the rows first, so MC independent vpdpbusd chains hide its latency.
template <int MC>
TAPS_VNNI_TARGET void group_q4_1(const uint8_t* rec, int64_t KB, const Interleaved& x, int64_t m0, float* y,
                                 int64_t ldy, __mmask16 store) {
  __m512 acc[MC];
  for (int c = 0; c < MC; ++c) acc[c] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* act = x.act + m0 * 32;
  const float* meta = x.meta + m0 * 2;
  const int64_t astride = x.M * 32, mstride = x.M * 2;
  for (int64_t kb = 0; kb < KB; ++kb, rec += kQ41Record, act += astride, meta += mstride) {
    prefetch_record_ahead(rec, kQ41Record, x.M <= kRowChunk);
    __m512i is[MC];
    for (int c = 0; c < MC; ++c) is[c] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i p = _mm512_loadu_si512(rec + 64 * j);
      const __m512i wl = _mm512_and_si512(p, low);
      const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
      for (int c = 0; c < MC; ++c) {
        is[c] = _mm512_dpbusd_epi32(is[c], wl, _mm512_set1_epi32(reinterpret_cast<const dword*>(act + c * 32)[j]));
      }
      for (int c = 0; c < MC; ++c) {
        is[c] = _mm512_dpbusd_epi32(is[c], wh, _mm512_set1_epi32(reinterpret_cast<const dword*>(act + c * 32)[j + 4]));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
    for (int c = 0; c < MC; ++c) {
      const __m512 blk = _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(is[c])),
                                       _mm512_mul_ps(mv, _mm512_set1_ps(meta[2 * c + 1])));
      acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(blk, _mm512_set1_ps(meta[2 * c])));
    }
  }
  for (int c = 0; c < MC; ++c) _mm512_mask_storeu_ps(y + c * ldy, store, acc[c]);
}

template <int MC>
TAPS_VNNI_TARGET void group_q8_0(const uint8_t* rec, int64_t KB, const Interleaved& x, int64_t m0, float* y,
                                 int64_t ldy, __mmask16 store) {
  __m512 acc[MC];
  for (int c = 0; c < MC; ++c) acc[c] = _mm512_setzero_ps();
  const int8_t* act = x.act + m0 * 32;
  const float* meta = x.meta + m0 * 2;
  const int32_t* a128 = x.asum128 + m0;
  const int64_t astride = x.M * 32, mstride = x.M * 2;
  for (int64_t kb = 0; kb < KB; ++kb, rec += kQ80Record, act += astride, meta += mstride, a128 += x.M) {
    prefetch_record_ahead(rec, kQ80Record, x.M <= kRowChunk);
    __m512i is[MC];
    for (int c = 0; c < MC; ++c) is[c] = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) {
      const __m512i w = _mm512_loadu_si512(rec + 64 * t);
      for (int c = 0; c < MC; ++c) {
        is[c] = _mm512_dpbusd_epi32(is[c], w, _mm512_set1_epi32(reinterpret_cast<const dword*>(act + c * 32)[t]));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 512)));
    for (int c = 0; c < MC; ++c) {
      // the weights are stored as q + 128 (vpdpbusd multiplies unsigned by signed bytes): take 128 * sum a back
      const __m512i exact = _mm512_sub_epi32(is[c], _mm512_set1_epi32(a128[c]));
      const __m512 blk = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(exact));
      acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(blk, _mm512_set1_ps(meta[2 * c])));
    }
  }
  for (int c = 0; c < MC; ++c) _mm512_mask_storeu_ps(y + c * ldy, store, acc[c]);
}

// quantize_activations on AVX-512: the same operations per element (max |x|, one IEEE multiply, round half
// to even, the same scale division), so the same bits as the plain loop.
TAPS_VNNI_TARGET void quantize_activations_avx512(const float* x, int64_t M, int64_t K, int8_t* a, float* scale,
                                                  int32_t* asum) {
  const int64_t KB = K / kBlock;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      const float* xb = x + m * K + kb * kBlock;
      int8_t* ab = a + m * K + kb * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
      // NaN compares unordered: a block with NaN or inf is flagged by "not <= FLT_MAX"
      const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
      const __mmask16 ok0 = _mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ), ok1 = _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ);
      if (ok0 != 0xFFFF || ok1 != 0xFFFF) {
        std::memset(ab, 0, kBlock);
        scale[m * KB + kb] = std::numeric_limits<float>::quiet_NaN();
        asum[m * KB + kb] = 0;
        continue;
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 iv = _mm512_set1_ps(inv);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, iv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, iv));
      const __m512i lim = _mm512_set1_epi32(127);
      const __m512i c0 = _mm512_max_epi32(_mm512_min_epi32(q0, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
      const __m512i c1 = _mm512_max_epi32(_mm512_min_epi32(q1, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ab), _mm512_cvtepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ab + 16), _mm512_cvtepi32_epi8(c1));
      asum[m * KB + kb] = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
      scale[m * KB + kb] = amax / 127.0f;
    }
  }
}

// residual_digits_scalar on AVX-512: the same operations per element, so the same bits.
TAPS_VNNI_TARGET void residual_digits_avx512(const float* x, int64_t M, int64_t K, const int8_t* a, int8_t* lo,
                                             float* lo_scale, int32_t* lo_sum) {
  const int64_t KB = K / kBlock;
  const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
  const __m512 steps = _mm512_set1_ps(kResidualSteps);
  for (int64_t i = 0; i < M * KB; ++i) {
    const float* xb = x + i * kBlock;
    int8_t* lb = lo + i * kBlock;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 iv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m128i a01 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i * kBlock));
    const __m128i a23 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i * kBlock + 16));
    const __m512 r0 = _mm512_sub_ps(_mm512_mul_ps(x0, iv), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a01)));
    const __m512 r1 = _mm512_sub_ps(_mm512_mul_ps(x1, iv), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a23)));
    const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(r0, steps)), lim), neg);
    const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(r1, steps)), lim), neg);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lb), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lb + 16), _mm512_cvtepi32_epi8(q1));
    lo_sum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    lo_scale[i] = amax / kTwoDigitLevels;
  }
}

using GroupFn = void (*)(const uint8_t*, int64_t, const Interleaved&, int64_t, float*, int64_t, __mmask16);

TAPS_VNNI_TARGET void packed_linear_vnni(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                                         const float* scale, const int32_t* asum, int64_t M, float* y, int64_t ldy,
                                         int64_t g0, int64_t g1) {
  static const GroupFn q41[kRowChunk + 1] = {nullptr,        group_q4_1<1>,  group_q4_1<2>,  group_q4_1<3>,
                                             group_q4_1<4>,  group_q4_1<5>,  group_q4_1<6>,  group_q4_1<7>,
                                             group_q4_1<8>,  group_q4_1<9>,  group_q4_1<10>, group_q4_1<11>,
                                             group_q4_1<12>};
  static const GroupFn q80[kRowChunk + 1] = {nullptr,        group_q8_0<1>,  group_q8_0<2>,  group_q8_0<3>,
                                             group_q8_0<4>,  group_q8_0<5>,  group_q8_0<6>,  group_q8_0<7>,
                                             group_q8_0<8>,  group_q8_0<9>,  group_q8_0<10>, group_q8_0<11>,
                                             group_q8_0<12>};
  const GroupFn* fns = t == BlockType::Q4_1 ? q41 : q80;
  const int64_t KB = K / kBlock, rec = record_bytes(t);
  const Interleaved x = interleave_activations(a, scale, asum, M, K);
  for_each_block(g0, g1, M, [&](int64_t g, int64_t m0, int64_t m1) {
    const int64_t live = std::min<int64_t>(kGroupRows, N - g * kGroupRows);
    const __mmask16 store = static_cast<__mmask16>((1u << live) - 1u);
    const uint8_t* grec = packed + g * KB * rec;
    for (int64_t m = m0, mc = 0; m < m1; m += mc) {
      const int64_t left = m1 - m, chunks = (left + kRowChunk - 1) / kRowChunk;
      mc = (left + chunks - 1) / chunks;
      fns[mc](grec, KB, x, m, y + m * ldy + g * kGroupRows, ldy, store);
    }
  });
}
#endif

}  // namespace

Interleaved interleave_activations(const int8_t* a, const float* scale, const int32_t* asum, int64_t M, int64_t K) {
  // per call: M * K bytes, a small fraction of the call's N * K * M multiply-adds
  const int64_t KB = K / kBlock;
  thread_local std::vector<int8_t> act;
  thread_local std::vector<float> meta;
  thread_local std::vector<int32_t> a128;
  act.resize(static_cast<size_t>(M * K + kActTailRows * kBlock));
  std::memset(act.data() + M * K, 0, kActTailRows * kBlock);
  meta.resize(static_cast<size_t>(M * KB * 2));
  a128.resize(static_cast<size_t>(M * KB));
  for (int64_t kb = 0; kb < KB; ++kb) {
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(act.data() + (kb * M + m) * kBlock, a + m * K + kb * kBlock, kBlock);
      meta[(kb * M + m) * 2] = scale[m * KB + kb];
      meta[(kb * M + m) * 2 + 1] = static_cast<float>(asum[m * KB + kb]);
      a128[kb * M + m] = asum[m * KB + kb] * 128;
    }
  }
  return {act.data(), meta.data(), a128.data(), M};
}

bool vnni_available() {
#ifdef TAPS_HAVE_VNNI_PATH
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

const std::string& kernels_requested() {
  static const std::string want = [] {
    const char* env = std::getenv("TAPS_GGUF_KERNELS");
    return std::string(env ? env : "");
  }();
  return want;
}

KernelPath kernel_path() {
  static const KernelPath p = [] {
    const KernelPath best = amx_available()    ? KernelPath::Amx
                            : vnni_available() ? KernelPath::Vnni
                            : avx2_available() ? KernelPath::Avx2
                                               : KernelPath::Scalar;
    // TAPS_GGUF_KERNELS names a slower path to run on a CPU that has a faster one (to test it there)
    const std::string& want = kernels_requested();
    if (want == "scalar") return KernelPath::Scalar;
    if (want == "avx2" && best >= KernelPath::Vnni) return KernelPath::Avx2;
    if (want == "vnni" && best >= KernelPath::Vnni) return KernelPath::Vnni;
    if (want == "amx-emulated" && best >= KernelPath::Vnni) return KernelPath::AmxEmulated;
    return best;
  }();
  return p;
}

const char* kernel_path_name(KernelPath p) {
  switch (p) {
    case KernelPath::Amx: return "amx";
    case KernelPath::AmxEmulated: return "amx-emulated";
    case KernelPath::Vnni: return "vnni";
    case KernelPath::Avx2: return "avx2";
    default: return "scalar";
  }
}

namespace {

// `path` where this CPU runs it, else the next slower path it runs (never kernel_path(): amx_available() calls
// this from its start-up check).
KernelPath runnable(KernelPath path) {
  if (path == KernelPath::Amx && !amx_available()) path = KernelPath::Vnni;
  if ((path == KernelPath::Vnni || path == KernelPath::AmxEmulated) && !vnni_available()) path = KernelPath::Avx2;
  if (path == KernelPath::Avx2 && !avx2_available()) path = KernelPath::Scalar;
  return path;
}

}  // namespace

void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* a, float* scale, int32_t* asum,
                          KernelPath path) {
  switch (runnable(path)) {
#ifdef TAPS_HAVE_VNNI_PATH
    case KernelPath::Amx:
    case KernelPath::AmxEmulated:
    case KernelPath::Vnni: quantize_activations_avx512(x, M, K, a, scale, asum); return;
#endif
    case KernelPath::Avx2: quantize_activations_avx2(x, M, K, a, scale, asum); return;
    default: quantize_activations_scalar(x, M, K, a, scale, asum);
  }
}

void quantize_activations_digits(const float* x, int64_t M, int64_t K, int8_t* a, float* scale, int32_t* asum,
                                 int64_t digits, int64_t lo_rows, KernelPath path) {
  quantize_activations(x, M, K, a, scale, asum, path);
  if (digits == 1) return;
  const int64_t KB = K / kBlock;
  int8_t* lo = a + lo_rows * K;
  float* lo_scale = scale + lo_rows * KB;
  int32_t* lo_sum = asum + lo_rows * KB;
  switch (runnable(path)) {
#ifdef TAPS_HAVE_VNNI_PATH
    case KernelPath::Amx:
    case KernelPath::AmxEmulated:
    case KernelPath::Vnni: residual_digits_avx512(x, M, K, a, lo, lo_scale, lo_sum); break;
#endif
    case KernelPath::Avx2: residual_digits_avx2(x, M, K, a, lo, lo_scale, lo_sum); break;
    default: residual_digits_scalar(x, M, K, a, lo, lo_scale, lo_sum);
  }
  for (int64_t i = 0; i < M * KB; ++i) {
    if (std::isnan(scale[i])) {  // the block held inf or NaN: its outputs are NaN through the leading digit already
      std::memset(lo + i * kBlock, 0, kBlock);
      lo_scale[i] = std::numeric_limits<float>::quiet_NaN();
      lo_sum[i] = 0;
    }
  }
}

void packed_linear_digits(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                          const float* scale, const int32_t* asum, int64_t M, int64_t digits, float* both, float* y,
                          int64_t ldy, int64_t g0, int64_t g1, KernelPath path) {
  if (digits == 1) {
    packed_linear(t, packed, N, K, a, scale, asum, M, y, ldy, g0, g1, path);
    return;
  }
  packed_linear(t, packed, N, K, a, scale, asum, 2 * M, both, N, g0, g1, path);
  const int64_t n0 = g0 * kGroupRows, n1 = std::min(N, g1 * kGroupRows);
  for (int64_t m = 0; m < M; ++m) {
    const float* hi = both + m * N;
    const float* lo = both + (M + m) * N;
    for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] = hi[n] + lo[n];
  }
}

void packed_linear(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a, const float* scale,
                   const int32_t* asum, int64_t M, float* y, int64_t ldy, int64_t g0, int64_t g1, KernelPath path) {
  path = runnable(path);
  switch (path) {
#ifdef TAPS_HAVE_VNNI_PATH
    case KernelPath::Amx:
    case KernelPath::AmxEmulated: {
      // every row's bits are the same on both paths, so the rows may be split between them freely
      const int64_t tiled = amx_tile_rows(M), KB = K / kBlock;
      if (tiled > 0) {
        packed_linear_amx(t, packed, N, K, a, scale, asum, tiled, y, ldy, g0, g1, path == KernelPath::AmxEmulated);
      }
      if (tiled < M) {
        packed_linear_vnni(t, packed, N, K, a + tiled * K, scale + tiled * KB, asum + tiled * KB, M - tiled,
                           y + tiled * ldy, ldy, g0, g1);
      }
      return;
    }
    case KernelPath::Vnni: packed_linear_vnni(t, packed, N, K, a, scale, asum, M, y, ldy, g0, g1); return;
#endif
    case KernelPath::Avx2: packed_linear_avx2(t, packed, N, K, a, scale, asum, M, y, ldy, g0, g1); return;
    default: packed_linear_scalar(t, packed, N, K, a, scale, asum, M, y, ldy, g0, g1);
  }
}

}  // namespace gguf
}  // namespace taps
