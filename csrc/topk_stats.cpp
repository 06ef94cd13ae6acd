// One pass per draft position: max, exp-sums, log-probs, top-K (see topk_stats.h).
#include "topk_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "gguf_linear.h"
#include "simd_math.h"

namespace taps {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// exp of anything below this is 0 in float32; (x - max) is clamped here before it multiplies its exp, so an
// impossible token (-inf) adds 0 * -110 = 0 to t instead of 0 * -inf = NaN.
constexpr float kExpFloor = -110.0f;

// Top-K order: larger log-prob, then smaller id (what a stable descending sort gives).
inline bool candidate_before(const TopKCandidate& a, const TopKCandidate& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// The threshold filters' buffer (log-probs lp and ids of n entries): sorts its best K (all of it when fewer) to its
// front, best first when all_sorted, and returns how many.
int64_t best_first(float* lp, int32_t* id, int64_t n, int32_t K, bool all_sorted, std::vector<TopKCandidate>& c) {
  c.resize(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) c[j] = {lp[j], id[j]};
  const auto kth = c.begin() + std::min<int64_t>(n, K);
  if (all_sorted) std::partial_sort(c.begin(), kth, c.end(), candidate_before);
  else std::nth_element(c.begin(), kth - 1, c.end(), candidate_before);
  n = kth - c.begin();
  for (int64_t j = 0; j < n; ++j) lp[j] = c[j].value, id[j] = c[j].id;
  return n;
}

// The top-K of the buffer into vals / ids (K of them: every row has at least K entries).
void take_best(float* lp, int32_t* id, int64_t n, int32_t K, float* vals, int64_t* ids,
               std::vector<TopKCandidate>& c) {
  best_first(lp, id, n, K, true, c);
  for (int32_t k = 0; k < K; ++k) {
    vals[k] = lp[k];
    ids[k] = id[k];
  }
}

// Writes logp and runs the top-K once s and t are known.
void finish_row(const float* x, int64_t V, int32_t K, float mx, double s, double t, float* vals, int64_t* ids,
                float* entropy, TopKStatsWorkspace& ws) {
  const double lse = mx + std::log(s);
  ws.logp.resize(static_cast<size_t>(V));
  float* logp = ws.logp.data();
  for (int64_t i = 0; i < V; ++i) logp[i] = static_cast<float>(x[i] - lse);
  topk_row(logp, V, K, vals, ids, ws.topk);
  *entropy = static_cast<float>(std::log(s) - t / s);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's avx512fintrin.h trips its own -Wuninitialized in the masked loads (a known false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define TAPS_TOPK_AVX512 __attribute__((target("avx512f")))

TAPS_TOPK_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// x - lse in float64, rounded once to float32 (so a log-prob is the float nearest its value for this lse)
TAPS_TOPK_AVX512 inline __m512 log_prob(__m512 x, __m512d lse) {
  const __m256 lo = _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), lse));
  const __m256 hi = _mm512_cvtpd_ps(_mm512_sub_pd(
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), lse));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

TAPS_TOPK_AVX512 bool row_avx512(const float* x, int64_t V, int32_t K, float* vals, int64_t* ids, float* entropy,
                                 TopKStatsWorkspace& ws) {
  const __m512 inf = _mm512_set1_ps(kInf);
  __m512 vmax = _mm512_set1_ps(-kInf);
  __mmask16 bad = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), m, x + i);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, inf, _CMP_EQ_OQ);
    vmax = _mm512_max_ps(vmax, v);
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  if (bad || mx == -kInf) return false;
  const __m512 vm = _mm512_set1_ps(mx), floor = _mm512_set1_ps(kExpFloor);
  __m512d vs = _mm512_setzero_pd(), vt = _mm512_setzero_pd();
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    const __m512 d = _mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), m, x + i), vm);
    const __m512 e = exp_avx512(d);  // exp(-inf) is 0: a masked-off lane adds nothing
    const __m512 ed = _mm512_mul_ps(e, _mm512_max_ps(d, floor));
    vs = _mm512_add_pd(_mm512_add_pd(vs, _mm512_cvtps_pd(_mm512_castps512_ps256(e))),
                       _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    vt = _mm512_add_pd(_mm512_add_pd(vt, _mm512_cvtps_pd(_mm512_castps512_ps256(ed))),
                       _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ed), 1))));
  }
  const double sum = _mm512_reduce_add_pd(vs);
  const double lse = mx + std::log(sum);
  *entropy = static_cast<float>(std::log(sum) - _mm512_reduce_add_pd(vt) / sum);
  // Top-K by a threshold filter: entries that can still enter are compressed into a small buffer, which is cut
  // back to its best K (value descending, then id) whenever it fills. After the first cut only entries strictly
  // better than the K-th kept one can enter (an equal one comes later, so its id is larger).
  const int64_t cap = std::max(4 * K, 256);
  ws.logp.resize(static_cast<size_t>(cap + 16));  // room for a full 16-lane store past the last entry
  ws.ids.resize(static_cast<size_t>(cap + 16));
  float* buf_lp = ws.logp.data();
  int32_t* buf_id = ws.ids.data();
  int64_t n = 0;
  const __m512d vl = _mm512_set1_pd(lse);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 bound = _mm512_setzero_ps();
  bool strict = false;  // before the first cut every entry may enter, -inf ones included
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    const __m512 lp = log_prob(_mm512_maskz_loadu_ps(m, x + i), vl);
    const __mmask16 keep = strict ? m & _mm512_cmp_ps_mask(lp, bound, _CMP_GT_OQ) : m;
    if (!keep) continue;
    // compress in registers, then full stores: the memory form of vcompressps is microcoded on some cores
    // (Zen 4), and reading single lanes back from a wide store stalls on forwarding
    _mm512_storeu_ps(buf_lp + n, _mm512_maskz_compress_ps(keep, lp));
    _mm512_storeu_si512(buf_id + n, _mm512_maskz_compress_epi32(
                                        keep, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i)))));
    n += __builtin_popcount(keep);
    if (n >= cap) {
      n = best_first(buf_lp, buf_id, n, K, false, ws.candidates);
      bound = _mm512_set1_ps(buf_lp[K - 1]);
      strict = true;
    }
  }
  take_best(buf_lp, buf_id, n, K, vals, ids, ws.candidates);
  return true;
}

TAPS_TOPK_AVX512 bool max_avx512(const float* x, int64_t V, float* out) {
  __m512 vmax = _mm512_set1_ps(-kInf);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), m, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  *out = _mm512_reduce_max_ps(vmax);
  return nan == 0;
}

TAPS_TOPK_AVX512 int64_t first_equal_avx512(const float* x, int64_t V, float value) {
  const __m512 target = _mm512_set1_ps(value);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 hit = tail_mask(V - i) & _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(tail_mask(V - i), x + i), target,
                                                                 _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;
}

bool avx512_available() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}

// The AVX-512 rows on 8 lanes, for CPUs without AVX-512, arranged to give their bits: the same per-element exp, the
// float64 sums in the AVX-512 path's lanes (its 8 float64 lanes as two registers of 4, each element added to the
// lane the 16-wide loop adds it to) and its final reduction order, the same log-probs, so the same top-K. On a
// Zen 3 core, one draft's 7 x 24,001 logits: 1.01 ms in the plain loops, 0.33 ms so; 16 rows' argmax of 49,152
// logits 0.77 -> 0.12 ms.
#define TAPS_TOPK_AVX2 __attribute__((target("avx2,fma")))

TAPS_TOPK_AVX2 inline __m256i first_lanes8(int64_t left) {
  const int n = left >= 8 ? 8 : static_cast<int>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// x[i .. i + 8) with lanes past V set to fill
TAPS_TOPK_AVX2 inline __m256 load_tail(const float* x, int64_t i, int64_t V, __m256 fill) {
  if (V - i >= 8) return _mm256_loadu_ps(x + i);
  const __m256i m = first_lanes8(V - i);
  return _mm256_blendv_ps(fill, _mm256_maskload_ps(x + i, m), _mm256_castsi256_ps(m));
}

TAPS_TOPK_AVX2 inline float hmax8_avx2(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// _mm512_reduce_add_pd of the 8 lanes (lo = lanes 0..3, hi = lanes 4..7), in its order
TAPS_TOPK_AVX2 inline double reduce_add_8pd(__m256d lo, __m256d hi) {
  const __m256d t = _mm256_add_pd(hi, lo);
  const __m128d u = _mm_add_pd(_mm256_extractf128_pd(t, 1), _mm256_castpd256_pd128(t));
  return _mm_cvtsd_f64(u) + _mm_cvtsd_f64(_mm_unpackhi_pd(u, u));
}

TAPS_TOPK_AVX2 inline __m256 log_prob8(__m256 x, __m256d lse) {
  const __m128 lo = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), lse));
  const __m128 hi = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), lse));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

TAPS_TOPK_AVX2 bool row_avx2(const float* x, int64_t V, int32_t K, float* vals, int64_t* ids, float* entropy,
                             TopKStatsWorkspace& ws) {
  const __m256 inf = _mm256_set1_ps(kInf), ninf = _mm256_set1_ps(-kInf);
  __m256 vmax = ninf, bad = _mm256_setzero_ps();
  for (int64_t i = 0; i < V; i += 8) {
    const __m256 v = load_tail(x, i, V, ninf);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(v, inf, _CMP_EQ_OQ)));
    vmax = _mm256_max_ps(vmax, v);
  }
  const float mx = hmax8_avx2(vmax);
  if (_mm256_movemask_ps(bad) || mx == -kInf) return false;
  const __m256 vm = _mm256_set1_ps(mx), floor = _mm256_set1_ps(kExpFloor);
  // lanes 0..3 and 4..7 of the AVX-512 path's float64 sums: elements 16j + 0..7 go to them, then 16j + 8..15
  // (where a row ends in the first half of 16, the 16-wide loop adds the second half's zeros: no sum changes)
  __m256d s_lo = _mm256_setzero_pd(), s_hi = _mm256_setzero_pd(), t_lo = _mm256_setzero_pd(),
          t_hi = _mm256_setzero_pd();
  for (int64_t i = 0; i < V; i += 8) {
    const __m256 d = _mm256_sub_ps(load_tail(x, i, V, ninf), vm);
    const __m256 e = exp_avx2(d);
    const __m256 ed = _mm256_mul_ps(e, _mm256_max_ps(d, floor));
    s_lo = _mm256_add_pd(s_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s_hi = _mm256_add_pd(s_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    t_lo = _mm256_add_pd(t_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(ed)));
    t_hi = _mm256_add_pd(t_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(ed, 1)));
  }
  const double sum = reduce_add_8pd(s_lo, s_hi);
  const double lse = mx + std::log(sum);
  *entropy = static_cast<float>(std::log(sum) - reduce_add_8pd(t_lo, t_hi) / sum);
  // the threshold filter of row_avx512, entries pushed one by one from a lane mask
  const int64_t cap = std::max(4 * K, 256);
  ws.logp.resize(static_cast<size_t>(cap + 8));
  ws.ids.resize(static_cast<size_t>(cap + 8));
  float* buf_lp = ws.logp.data();
  int32_t* buf_id = ws.ids.data();
  int64_t n = 0;
  const __m256d vl = _mm256_set1_pd(lse);
  __m256 bound = _mm256_setzero_ps();
  bool strict = false;
  alignas(32) float lanes[8];
  for (int64_t i = 0; i < V; i += 8) {
    const __m256 lp = log_prob8(load_tail(x, i, V, _mm256_setzero_ps()), vl);
    const int live = V - i >= 8 ? 0xFF : (1 << (V - i)) - 1;
    int keep = strict ? live & _mm256_movemask_ps(_mm256_cmp_ps(lp, bound, _CMP_GT_OQ)) : live;
    if (!keep) continue;
    _mm256_store_ps(lanes, lp);
    for (; keep; keep &= keep - 1) {
      const int l = __builtin_ctz(keep);
      buf_lp[n] = lanes[l];
      buf_id[n++] = static_cast<int32_t>(i + l);
    }
    if (n >= cap) {
      n = best_first(buf_lp, buf_id, n, K, false, ws.candidates);
      bound = _mm256_set1_ps(buf_lp[K - 1]);
      strict = true;
    }
  }
  take_best(buf_lp, buf_id, n, K, vals, ids, ws.candidates);
  return true;
}

TAPS_TOPK_AVX2 bool max_avx2(const float* x, int64_t V, float* out) {
  const __m256 ninf = _mm256_set1_ps(-kInf);
  __m256 vmax = ninf, nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < V; i += 8) {
    const __m256 v = load_tail(x, i, V, ninf);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  *out = hmax8_avx2(vmax);
  return _mm256_movemask_ps(nan) == 0;
}

TAPS_TOPK_AVX2 int64_t first_equal_avx2(const float* x, int64_t V, float value) {
  const __m256 target = _mm256_set1_ps(value);
  for (int64_t i = 0; i < V; i += 8) {
    const int live = V - i >= 8 ? 0xFF : (1 << (V - i)) - 1;
    const int hit = live & _mm256_movemask_ps(_mm256_cmp_ps(load_tail(x, i, V, _mm256_setzero_ps()), target,
                                                            _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;
}

bool avx2_available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#else
bool avx512_available() { return false; }
bool avx2_available() { return false; }
#endif

}  // namespace

RowPath row_path() {
  static const RowPath p = [] {
    const std::string& want = gguf::kernels_requested();
    if (want == "scalar") return RowPath::Scalar;
    if (avx512_available() && want != "avx2") return RowPath::Avx512;
    return avx2_available() ? RowPath::Avx2 : RowPath::Scalar;
  }();
  return p;
}

const char* row_path_name() {
  switch (row_path()) {
    case RowPath::Avx512: return "avx512";
    case RowPath::Avx2: return "avx2";
    default: return "scalar";
  }
}

bool topk_stats_row_scalar(const float* x, int64_t V, int32_t K, float* vals, int64_t* ids, float* entropy,
                           TopKStatsWorkspace& ws) {
  float mx = -kInf;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i]) || x[i] == kInf) return false;
    mx = std::max(mx, x[i]);
  }
  if (mx == -kInf) return false;
  double s = 0.0, t = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    const float d = x[i] - mx, e = std::exp(d);
    s += e;
    t += e * std::max(d, kExpFloor);
  }
  finish_row(x, V, K, mx, s, t, vals, ids, entropy, ws);
  return true;
}

int64_t argmax_row(const float* x, int64_t V) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  float best;
  if (row_path() == RowPath::Avx512) {
    if (max_avx512(x, V, &best)) return first_equal_avx512(x, V, best);
  } else if (row_path() == RowPath::Avx2 && max_avx2(x, V, &best)) {
    return first_equal_avx2(x, V, best);
  }
#endif
  int64_t arg = 0;  // plain loop, and rows holding a NaN
  for (int64_t i = 1; i < V; ++i) {
    if (std::isnan(x[arg])) break;
    if (std::isnan(x[i]) || x[i] > x[arg]) arg = i;
  }
  return arg;
}

bool topk_stats_row(const float* x, int64_t V, int32_t K, float* vals, int64_t* ids, float* entropy,
                    TopKStatsWorkspace& ws) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (row_path() == RowPath::Avx512) return row_avx512(x, V, K, vals, ids, entropy, ws);
  if (row_path() == RowPath::Avx2) return row_avx2(x, V, K, vals, ids, entropy, ws);
#endif
  return topk_stats_row_scalar(x, V, K, vals, ids, entropy, ws);
}

bool position_stats(const float* x, int64_t V, int32_t K, int32_t K2, float* vals, int64_t* ids, float* entropy,
                    float* margin, float* topk_mass, TopKStatsWorkspace& ws) {
  if (!topk_stats_row(x, V, K2, vals, ids, entropy, ws)) return false;
  // the logits' own difference: the log-probs' shared lse cancels exactly
  *margin = V > 1 ? x[ids[0]] - x[ids[1]] : 0.0f;
  if (std::isinf(*margin)) *margin = 0.0f;  // no possible runner-up: 0, as for V = 1
  double mass = 0.0;
  for (int32_t k = 0; k < K; ++k) mass += std::exp(static_cast<double>(vals[k]));
  *topk_mass = static_cast<float>(mass);
  return true;
}

}  // namespace taps
