// The GGUF block kernels on AVX2 (CPUs without AVX-512): the numerics of gguf_linear.h, bit for bit.
//
// AVX2 has no vpdpbusd. vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into int16
// with saturation, so each block's int32 sum is built where no int16 can saturate:
//   Q4_1: nibbles 0..15 times activations in [-127, 127]: a pair is at most 3,810 in magnitude, and the eight
//         pair sums of one 32-element block per lane at most 30,480, so they add in int16; one vpmaddwd by 1
//         then gives the block's int32 sum per output row.
//   Q8_0: q in [-128, 127] (stored q + 128): |q| times (a with q's sign) keeps a pair within 2 * 128 * 127 =
//         32,512; each vpmaddubsw goes to int32 at once.
// Both are exact integer sums, so the float step after them (the same multiplies and adds in the same order
// as the plain loop) gives the same bits as the plain loop and the VNNI path, whatever the row count.
//
// Lanes are output rows: one 256-bit register holds 8 of a packed group's 16 rows (one half of each 64-byte
// line), so a group's two halves are two registers. The rows of x come block-interleaved and in row and group
// blocks, with records prefetched ahead, as on the VNNI path (gguf_linear_interleave.h). From a few rows on a
// row costs ~8.7 cycles per 256 multiply-adds on Zen 3 (3 rows, everything in L1), against the 4.5 that its 9
// integer multiplies need on the core's two multiply pipes; the per-block float step (convert, 3 multiplies, 2
// adds: the numerics above) takes ~2.2 of them (timed by leaving it out). llvm-mca -mcpu=znver3 puts the bound
// on the broadcasts' pipes, yet activations stored pre-broadcast (plain loads) measured no faster. Also tried and
// not kept (SmolLM2's Q4_1 matrices, best of 7, builds alternated): a group's nibbles unpacked once per row block
// into an L1 scratch, so rows skip the and/shift and chunks carry 4-6 rows (64 rows 84.4 -> 84.5 ms, 5 rows 7.6 ->
// 10.8-11.4 ms); the int16 pairs widened by shifts instead of vpmaddwd (16 rows 21.4-22.2 -> 24.4-24.6 ms).
#include "gguf_linear.h"
#include "gguf_linear_interleave.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TAPS_HAVE_AVX2_PATH 1
#define TAPS_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace taps {
namespace gguf {

bool avx2_available() {
#ifdef TAPS_HAVE_AVX2_PATH
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

#ifdef TAPS_HAVE_AVX2_PATH
namespace {

typedef int32_t __attribute__((may_alias, aligned(1))) dword;  // 4 activation bytes, read as one

// Rows at a time: 2 * MC block sums, both halves' weights and the broadcasts fill the 16 registers at MC = 3 (the
// accumulators go to the stack once a block). Four rows spill more, yet a call of exactly 4 rows ran faster as one
// chunk than as 2 + 2 (7.8 vs 8.5 ms) and no slower than 3 + 1 (the Q4_1 matrices 6.4-6.5 vs 6.4-6.7 ms);
// from 5 rows on, chunks of at most 3 (16 rows: 29.0 vs 30.7 ms with chunks of 4).
constexpr int kMaxRowChunk = 4;
inline int64_t row_chunk(int64_t left) {
  if (left <= kMaxRowChunk) return left;
  const int64_t chunks = (left + 2) / 3;
  return (left + chunks - 1) / chunks;
}

TAPS_AVX2 inline __m256i broadcast_dword(const int8_t* p) {
  return _mm256_set1_epi32(*reinterpret_cast<const dword*>(p));
}

TAPS_AVX2 inline void store_live(float* y, __m256 v, int live) {
  if (live >= 8) {
    _mm256_storeu_ps(y, v);
  } else {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(live), lane), v);
  }
}

// Rows y[c * ldy ..] (c < MC) of a group: its first 8 outputs from acc[0][c], the rest of `live` from acc[1][c].
template <int MC>
TAPS_AVX2 inline void store_group(const __m256 (&acc)[2][MC], float* y, int64_t ldy, int live) {
  for (int c = 0; c < MC; ++c) {
    store_live(y + c * ldy, acc[0][c], live);
    if (live > 8) store_live(y + c * ldy + 8, acc[1][c], live - 8);
  }
}

// Keeps v in a register at this point of the program. Without it GCC hoists every vpmaddubsw of a block above
// the adds (integer adds reassociate) and spills their products and the accumulators to the stack: at 4 rows
// the loop then made ~100 stack accesses a block.
#define TAPS_KEEP(v) asm volatile("" : "+x"(v))

// Rows m0 .. m0 + MC of x (interleaved) over the 16 output rows of one packed group; `live` of them exist. The
// group's two halves of 8 rows (one register each) run in the same pass over its records, so each activation
// broadcast feeds both and the loop runs once per group rather than once per half: SmolLM2's 211 matrices
// (random blocks of their shapes, one thread, Zen 3, best of 7) at 1 / 3 / 5 / 16 rows 6.0-6.9 / 7.4-7.9 /
// 11.8 / 31.1-31.8 ms -> 4.6-4.8 / 5.9 / 9.6-9.9 / 29.0 ms. The steps over a block's dwords go across the rows
// first, so 2 * MC independent add chains overlap.
template <int MC>
TAPS_AVX2 void group_q4_1(const uint8_t* rec, int64_t KB, const Interleaved& x, int64_t m0, float* y, int64_t ldy,
                          int live) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[2][MC];
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < MC; ++c) acc[h][c] = _mm256_setzero_ps();
  const int8_t* act = x.act + m0 * kBlock;
  const float* meta = x.meta + m0 * 2;
  const int64_t astride = x.M * kBlock, mstride = x.M * 2;
  for (int64_t kb = 0; kb < KB; ++kb, rec += kQ41Record, act += astride, meta += mstride) {
    prefetch_record_ahead(rec, kQ41Record, x.M <= kMaxRowChunk);
    __m256i s16[2][MC];
    for (int j = 0; j < 4; ++j) {
      __m256i wl[2], wh[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * h));
        wl[h] = _mm256_and_si256(p, low);
        wh[h] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
      }
      for (int c = 0; c < MC; ++c) {
        __m256i alo = broadcast_dword(act + c * kBlock + 4 * j);
        __m256i ahi = broadcast_dword(act + c * kBlock + 16 + 4 * j);
        TAPS_KEEP(alo);
        TAPS_KEEP(ahi);
        for (int h = 0; h < 2; ++h) {
          const __m256i lo = _mm256_maddubs_epi16(wl[h], alo);
          const __m256i hi = _mm256_maddubs_epi16(wh[h], ahi);
          s16[h][c] = j == 0 ? _mm256_add_epi16(lo, hi) : _mm256_add_epi16(s16[h][c], _mm256_add_epi16(lo, hi));
          TAPS_KEEP(s16[h][c]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256 + 16 * h)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 288 + 16 * h)));
      for (int c = 0; c < MC; ++c) {
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[h][c], _mm256_set1_epi16(1)));
        const __m256 blk = _mm256_add_ps(_mm256_mul_ps(dv, isum), _mm256_mul_ps(mv, _mm256_set1_ps(meta[2 * c + 1])));
        acc[h][c] = _mm256_add_ps(acc[h][c], _mm256_mul_ps(blk, _mm256_set1_ps(meta[2 * c])));
      }
    }
  }
  store_group<MC>(acc, y, ldy, live);
}

template <int MC>
TAPS_AVX2 void group_q8_0(const uint8_t* rec, int64_t KB, const Interleaved& x, int64_t m0, float* y, int64_t ldy,
                          int live) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[2][MC];
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < MC; ++c) acc[h][c] = _mm256_setzero_ps();
  const int8_t* act = x.act + m0 * kBlock;
  const float* meta = x.meta + m0 * 2;
  const int64_t astride = x.M * kBlock, mstride = x.M * 2;
  for (int64_t kb = 0; kb < KB; ++kb, rec += kQ80Record, act += astride, meta += mstride) {
    prefetch_record_ahead(rec, kQ80Record, x.M <= kMaxRowChunk);
    __m256i s32[2][MC];
    for (int t = 0; t < 8; ++t) {
      __m256i q[2], mag[2];
      for (int h = 0; h < 2; ++h) {
        q[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * t + 32 * h)), bias);
        mag[h] = _mm256_sign_epi8(q[h], q[h]);  // |q| as unsigned bytes (128 for -128)
      }
      for (int c = 0; c < MC; ++c) {
        __m256i a = broadcast_dword(act + c * kBlock + 4 * t);
        TAPS_KEEP(a);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(a, q[h])),
                                                  _mm256_set1_epi16(1));
          s32[h][c] = t == 0 ? pairs : _mm256_add_epi32(s32[h][c], pairs);
          TAPS_KEEP(s32[h][c]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 512 + 16 * h)));
      for (int c = 0; c < MC; ++c) {
        const __m256 blk = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(s32[h][c]));
        acc[h][c] = _mm256_add_ps(acc[h][c], _mm256_mul_ps(blk, _mm256_set1_ps(meta[2 * c])));
      }
    }
  }
  store_group<MC>(acc, y, ldy, live);
}

using GroupFn = void (*)(const uint8_t*, int64_t, const Interleaved&, int64_t, float*, int64_t, int);


}  // namespace

TAPS_AVX2 void quantize_activations_avx2(const float* x, int64_t M, int64_t K, int8_t* a, float* scale,
                                         int32_t* asum) {
  const int64_t KB = K / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      const float* xb = x + m * K + kb * kBlock;
      int8_t* ab = a + m * K + kb * kBlock;
      __m256 v[4], mx = _mm256_setzero_ps();
      bool finite = true;
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        const __m256 av = _mm256_andnot_ps(sign, v[i]);
        // NaN compares unordered: a block with NaN or inf is flagged by "not <= FLT_MAX"
        finite = finite && _mm256_movemask_ps(_mm256_cmp_ps(av, big, _CMP_LE_OQ)) == 0xFF;
        mx = _mm256_max_ps(mx, av);
      }
      if (!finite) {
        std::memset(ab, 0, kBlock);
        scale[m * KB + kb] = std::numeric_limits<float>::quiet_NaN();
        asum[m * KB + kb] = 0;
        continue;
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
      __m256i total = _mm256_setzero_si256();
      alignas(32) int32_t q[32];
      for (int i = 0; i < 4; ++i) {
        // cvtps rounds to nearest even under the default rounding mode, as nearbyint does in the plain loop
        const __m256i qi = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lim), neg);
        total = _mm256_add_epi32(total, qi);
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i), qi);
      }
      for (int e = 0; e < 32; ++e) ab[e] = static_cast<int8_t>(q[e]);
      alignas(32) int32_t t[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(t), total);
      asum[m * KB + kb] = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
      scale[m * KB + kb] = amax / 127.0f;
    }
  }
}

// The plain loop's residual digits on AVX2: the same operations per element, so the same bits.
TAPS_AVX2 void residual_digits_avx2(const float* x, int64_t M, int64_t K, const int8_t* a, int8_t* lo,
                                    float* lo_scale, int32_t* lo_sum) {
  const int64_t KB = K / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f), steps = _mm256_set1_ps(kResidualSteps);
  const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
  for (int64_t i = 0; i < M * KB; ++i) {
    const float* xb = x + i * kBlock;
    int8_t* lb = lo + i * kBlock;
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i total = _mm256_setzero_si256();
    alignas(32) int32_t q[32];
    for (int j = 0; j < 4; ++j) {
      const __m256 hi = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a + i * kBlock + 8 * j))));
      const __m256 r = _mm256_sub_ps(_mm256_mul_ps(v[j], inv), hi);
      const __m256i qj = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(r, steps)), lim), neg);
      total = _mm256_add_epi32(total, qj);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * j), qj);
    }
    for (int e = 0; e < 32; ++e) lb[e] = static_cast<int8_t>(q[e]);
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), total);
    lo_sum[i] = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    lo_scale[i] = amax / kTwoDigitLevels;
  }
}

TAPS_AVX2 void packed_linear_avx2(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                                  const float* scale, const int32_t* asum, int64_t M, float* y, int64_t ldy,
                                  int64_t g0, int64_t g1) {
  static const GroupFn q41[kMaxRowChunk + 1] = {nullptr, group_q4_1<1>, group_q4_1<2>, group_q4_1<3>,
                                                 group_q4_1<4>};
  static const GroupFn q80[kMaxRowChunk + 1] = {nullptr, group_q8_0<1>, group_q8_0<2>, group_q8_0<3>,
                                                 group_q8_0<4>};
  const GroupFn* fns = t == BlockType::Q4_1 ? q41 : q80;
  const int64_t KB = K / kBlock, rec = record_bytes(t);
  const Interleaved x = interleave_activations(a, scale, asum, M, K);
  for_each_block(g0, g1, M, [&](int64_t g, int64_t m0, int64_t m1) {
    const int live = static_cast<int>(std::min<int64_t>(kGroupRows, N - g * kGroupRows));
    const uint8_t* grec = packed + g * KB * rec;
    for (int64_t m = m0, mc = 0; m < m1; m += mc) {
      mc = row_chunk(m1 - m);
      fns[mc](grec, KB, x, m, y + m * ldy + g * kGroupRows, ldy, live);
    }
  });
}
#else
void quantize_activations_avx2(const float*, int64_t, int64_t, int8_t*, float*, int32_t*) {
  throw std::logic_error("quantize_activations_avx2: not an x86-64 build");
}
void residual_digits_avx2(const float*, int64_t, int64_t, const int8_t*, int8_t*, float*, int32_t*) {
  throw std::logic_error("residual_digits_avx2: not an x86-64 build");
}
void packed_linear_avx2(BlockType, const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const int32_t*,
                        int64_t, float*, int64_t, int64_t, int64_t) {
  throw std::logic_error("packed_linear_avx2: not an x86-64 build");
}
#endif

}  // namespace gguf
}  // namespace taps
