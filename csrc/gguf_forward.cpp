// Decoder forward over GGUF blocks (see gguf_forward.h for what is row-invariant and why).
#include "gguf_forward.h"

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define TAPS_HAVE_FORWARD 1
#define TAPS_AVX512 __attribute__((target("avx512f,avx512dq,f16c")))
#endif

namespace taps {
namespace gguf {

void dequantize_packed_rows(const PackedMatrix& m, const int64_t* ids, int64_t n, float* out) {
  const int64_t KB = m.cols / kBlock, rec = record_bytes(m.type);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = ids[i] / kGroupRows, r = ids[i] % kGroupRows;
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* p = m.data + (g * KB + kb) * rec;
      float* o = out + i * m.cols + kb * kBlock;
      if (m.type == BlockType::Q4_1) {
        const float d = half_at(p + 256 + 2 * r), mw = half_at(p + 288 + 2 * r);
        for (int j = 0; j < 4; ++j) {
          for (int b = 0; b < 4; ++b) {
            const uint8_t byte = p[64 * j + 4 * r + b];
            o[4 * j + b] = static_cast<float>(byte & 0xF) * d + mw;
            o[16 + 4 * j + b] = static_cast<float>(byte >> 4) * d + mw;
          }
        }
      } else {
        const float d = half_at(p + 512 + 2 * r);
        for (int t = 0; t < 8; ++t) {
          for (int b = 0; b < 4; ++b) o[4 * t + b] = static_cast<float>(static_cast<int>(p[64 * t + 4 * r + b]) - 128) * d;
        }
      }
    }
  }
}

#ifdef TAPS_HAVE_FORWARD
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

constexpr int kMaxGroup = 8;  // query heads per KV head handled together

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

// Attention of one query row for the G query heads of one KV head over the visible slots vis[0..nv)
// (head_dim = 16 * DC). q: G heads x D floats; out: G x D; scores: workspace of G * nv floats.
// Each key and value row is loaded once for the G heads; per head the operations (and so the bits) are
// those of one head alone: dots by FMA over the 16-lane chunks, 16 keys reduced by one transpose, the
// softmax in slot-sequence order, the value sum in that order.
template <int G, int DC>
TAPS_AVX512 void attend(const float* q, const float* K, const float* V, const int64_t* vis, int64_t nv, float scale,
                        float* scores, float* out) {
  constexpr int64_t D = 16 * DC;
  __m512 qv[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  for (int64_t t0 = 0; t0 < nv; t0 += 16) {
    const int64_t tn = std::min<int64_t>(16, nv - t0);
    alignas(64) __m512 part[G][16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t < tn) {
        const float* k = K + vis[t0 + t] * D;
        __m512 kv[DC];
        for (int c = 0; c < DC; ++c) kv[c] = _mm512_loadu_ps(k + 16 * c);
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
    const float* v = V + vis[t] * D;
    __m512 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * nv + t]);
      for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(out + g * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

using AttendFn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t, float, float*, float*);

// The kernel for (G, head_dim): G in 1..8 (at most 8 query heads per KV head), head_dim 16 * (1..8).
AttendFn attend_for(int64_t G, int64_t D) {
#define TAPS_ATTEND_ROW(g) {attend<g, 1>, attend<g, 2>, attend<g, 3>, attend<g, 4>, attend<g, 5>, attend<g, 6>, \
                            attend<g, 7>, attend<g, 8>}
  static const AttendFn table[8][8] = {TAPS_ATTEND_ROW(1), TAPS_ATTEND_ROW(2), TAPS_ATTEND_ROW(3), TAPS_ATTEND_ROW(4),
                                       TAPS_ATTEND_ROW(5), TAPS_ATTEND_ROW(6), TAPS_ATTEND_ROW(7), TAPS_ATTEND_ROW(8)};
#undef TAPS_ATTEND_ROW
  return table[G - 1][D / 16 - 1];
}

// rotate-half RoPE of one head vector at position pos (cos/sin from double precision, rounded once).
void rope_head(float* x, const float* cs, const float* sn, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) {
    const float a = x[d], b = x[d + h];
    x[d] = a * cs[d] - b * sn[d];
    x[d + h] = b * cs[d] + a * sn[d];
  }
}

// Per-head RMSNorm (Qwen3's q/k norms; none when norm is null) then RoPE, for the heads of one row.
void norm_rope_heads(float* x, int64_t heads, const float* norm, const float* cs, const float* sn, int64_t D,
                     float eps) {
  float tmp[128];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    if (norm) {
      rmsnorm_row(v, norm, tmp, D, eps);
      std::memcpy(v, tmp, D * sizeof(float));
    }
    rope_head(v, cs, sn, D);
  }
}

struct Quantized {
  std::vector<int8_t> a;
  std::vector<float> scale;
  std::vector<int32_t> asum;
  int64_t M = 0, K = 0;

  void set(const float* x, int64_t m, int64_t k, const ParallelFor& parallel) {
    M = m, K = k;
    a.resize(static_cast<size_t>(m * k));
    scale.resize(static_cast<size_t>(m * k / kBlock));
    asum.resize(scale.size());
    parallel(m, [&](int64_t r0, int64_t r1) {
      quantize_activations(x + r0 * k, r1 - r0, k, a.data() + r0 * k, scale.data() + r0 * (k / kBlock),
                           asum.data() + r0 * (k / kBlock));
    });
  }
};

void linear(const PackedMatrix& w, const Quantized& q, float* y, int64_t ldy, const ParallelFor& parallel) {
  const int64_t groups = (w.rows + kGroupRows - 1) / kGroupRows;
  parallel(groups, [&](int64_t g0, int64_t g1) {
    packed_linear(w.type, w.data, w.rows, w.cols, q.a.data(), q.scale.data(), q.asum.data(), q.M, y, ldy, g0, g1);
  });
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

void check_cache_slots(const ForwardBatch& f) {
  for (int64_t b = 0; b < f.B; ++b) {
    check(f.prefix_lens[b] >= 0 && f.prefix_lens[b] + f.N <= f.capacity, "prefix_lens + N exceed the cache capacity");
    check(f.cache_rows[b] >= 0 && f.cache_rows[b] < f.cache_batch, "cache_rows: out of range");
  }
}

// RoPE cos/sin of every row ([M, head_dim / 2] each), from double precision, rounded once.
void rope_tables(const ModelWeights& w, const int64_t* positions, int64_t M, std::vector<float>& cosv,
                 std::vector<float>& sinv) {
  const int64_t D = w.head_dim, half = D / 2;
  cosv.resize(static_cast<size_t>(M * half));
  sinv.resize(cosv.size());
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t d = 0; d < half; ++d) {
      const double inv_freq = 1.0 / std::pow(w.rope_base, static_cast<double>(2 * d) / static_cast<double>(D));
      const double ang = static_cast<double>(positions[i]) * inv_freq;
      cosv[i * half + d] = static_cast<float>(std::cos(ang));
      sinv[i * half + d] = static_cast<float>(std::sin(ang));
    }
  }
}

// Row i = (b, j) of k/v [M, Hkv * D] into layer l's cache at slot prefix_lens[b] + j of cache row cache_rows[b].
void write_cache(const ForwardBatch& f, int64_t l, const float* k, const float* v, int64_t Hkv, int64_t D) {
  for (int64_t i = 0; i < f.B * f.N; ++i) {
    const int64_t b = i / f.N, j = i % f.N, slot = f.prefix_lens[b] + j;
    for (int64_t hh = 0; hh < Hkv; ++hh) {
      const int64_t off = ((f.cache_rows[b] * Hkv + hh) * f.capacity + slot) * D;
      std::memcpy(f.keys[l] + off, k + (i * Hkv + hh) * D, D * sizeof(float));
      std::memcpy(f.values[l] + off, v + (i * Hkv + hh) * D, D * sizeof(float));
    }
  }
}

}  // namespace

bool forward_available() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

void forward(const ModelWeights& w, const ForwardBatch& f, const ParallelFor& parallel) {
  check(forward_available(), "the GGUF forward needs AVX-512F");
  const int64_t H = w.hidden, Hq = w.heads, Hkv = w.kv_heads, D = w.head_dim, F = w.ffn, V = w.vocab;
  check(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "heads: expected a multiple of kv_heads, at most 8x");
  check(D % 16 == 0 && D <= 128, "head_dim: expected a multiple of 16, at most 128");
  check(H % kBlock == 0 && F % kBlock == 0 && (Hq * D) % kBlock == 0, "hidden, ffn, heads*head_dim: multiples of 32");
  const int64_t M = f.B * f.N, G = Hq / Hkv, L = static_cast<int64_t>(w.layers.size());
  const AttendFn attend_kernel = attend_for(G, D);
  if (M == 0) return;
  check_cache_slots(f);
  for (int64_t i = 0; i < M; ++i) check(f.tokens[i] >= 0 && f.tokens[i] < V, "tokens: outside the vocabulary");
  for (int64_t i = 0; i < f.n_logit_rows; ++i) check(f.logit_rows[i] >= 0 && f.logit_rows[i] < M, "logit_rows: out of range");

  // visible slots of every query row, in cache order (prefix, then visible tree nodes by index)
  std::vector<int64_t> vis_start(M + 1, 0);
  for (int64_t i = 0; i < M; ++i) {
    const int64_t b = i / f.N;
    int64_t n = f.prefix_lens[b];
    for (int64_t j = 0; j < f.N; ++j) n += (f.bits[i * f.words + j / 32] >> (j % 32)) & 1;
    vis_start[i + 1] = vis_start[i] + n;
  }
  std::vector<int64_t> vis(static_cast<size_t>(vis_start[M]));
  int64_t max_vis = 0;
  for (int64_t i = 0; i < M; ++i) {
    const int64_t b = i / f.N;
    int64_t* out = vis.data() + vis_start[i];
    for (int64_t s = 0; s < f.prefix_lens[b]; ++s) *out++ = s;
    for (int64_t j = 0; j < f.N; ++j) {
      if ((f.bits[i * f.words + j / 32] >> (j % 32)) & 1) *out++ = f.prefix_lens[b] + j;
    }
    max_vis = std::max(max_vis, vis_start[i + 1] - vis_start[i]);
  }
  const int64_t half = D / 2;
  std::vector<float> cosv, sinv;
  rope_tables(w, f.positions, M, cosv, sinv);

  std::vector<float> x(M * H), h(M * H), q(M * Hq * D), k(M * Hkv * D), v(M * Hkv * D), att(M * Hq * D);
  std::vector<float> gate(M * F), up(M * F);
  Quantized qa;
  dequantize_packed_rows(w.embed, f.tokens, M, x.data());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  int64_t feat_stride = f.n_features * H;

  auto store_feature = [&](int64_t layer, const float* src) {
    for (int64_t s = 0; s < f.n_features; ++s) {
      if (f.feature_layers[s] != layer) continue;
      for (int64_t i = 0; i < M; ++i) std::memcpy(f.features + i * feat_stride + s * H, src + i * H, H * sizeof(float));
    }
  };

  for (int64_t l = 0; l < L; ++l) {
    const LayerWeights& lw = w.layers[l];
    for (int64_t i = 0; i < M; ++i) rmsnorm_row(x.data() + i * H, lw.attn_norm, h.data() + i * H, H, w.rms_eps);
    qa.set(h.data(), M, H, parallel);
    linear(lw.q, qa, q.data(), Hq * D, parallel);
    linear(lw.k, qa, k.data(), Hkv * D, parallel);
    linear(lw.v, qa, v.data(), Hkv * D, parallel);
    for (int64_t i = 0; i < M; ++i) {
      norm_rope_heads(q.data() + i * Hq * D, Hq, lw.q_norm, cosv.data() + i * half, sinv.data() + i * half, D, w.rms_eps);
      norm_rope_heads(k.data() + i * Hkv * D, Hkv, lw.k_norm, cosv.data() + i * half, sinv.data() + i * half, D,
                      w.rms_eps);
    }
    // the new rows' keys and values go into the cache before any row attends (a node sees its ancestors)
    write_cache(f, l, k.data(), v.data(), Hkv, D);
    const float* Kc = f.keys[l];
    const float* Vc = f.values[l];
    // KV head by KV head, every query row of it in turn: the rows of a tree share their prefix, whose keys and
    // values (prefix x head_dim floats, ~256 KB at 500 tokens) then come from L2 for every row after the first
    // instead of from memory (row by row, the other heads' prefixes evicted them). Each (row, head) is computed
    // as before, so no bit changes.
    parallel(M * Hkv, [&](int64_t t0, int64_t t1) {
      std::vector<float> scores(static_cast<size_t>(G * std::max<int64_t>(max_vis, 1)));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t hh = t / M, i = t % M, b = i / f.N;
        const int64_t base = (f.cache_rows[b] * Hkv + hh) * f.capacity * D;
        attend_kernel(q.data() + (i * Hq + hh * G) * D, Kc + base, Vc + base, vis.data() + vis_start[i],
                      vis_start[i + 1] - vis_start[i], scale, scores.data(), att.data() + (i * Hq + hh * G) * D);
      }
    });
    qa.set(att.data(), M, Hq * D, parallel);
    linear(lw.o, qa, h.data(), H, parallel);
    for (int64_t e = 0; e < M * H; ++e) x[e] = x[e] + h[e];
    for (int64_t i = 0; i < M; ++i) rmsnorm_row(x.data() + i * H, lw.ffn_norm, h.data() + i * H, H, w.rms_eps);
    qa.set(h.data(), M, H, parallel);
    linear(lw.gate, qa, gate.data(), F, parallel);
    linear(lw.up, qa, up.data(), F, parallel);
    parallel(M, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) swiglu(gate.data() + i * F, up.data() + i * F, F);
    });
    qa.set(gate.data(), M, F, parallel);
    linear(lw.down, qa, h.data(), H, parallel);
    for (int64_t e = 0; e < M * H; ++e) x[e] = x[e] + h[e];
    if (l + 1 < L) store_feature(l, x.data());
  }
  // final norm: over every row when the last layer is a feature layer, else only the logit rows
  bool last_is_feature = false;
  for (int64_t s = 0; s < f.n_features; ++s) last_is_feature = last_is_feature || f.feature_layers[s] == L - 1;
  if (last_is_feature) {
    for (int64_t i = 0; i < M; ++i) rmsnorm_row(x.data() + i * H, w.final_norm, h.data() + i * H, H, w.rms_eps);
    store_feature(L - 1, h.data());
  }
  if (f.n_logit_rows > 0) {
    std::vector<float> sel(f.n_logit_rows * H);
    for (int64_t r = 0; r < f.n_logit_rows; ++r) {
      rmsnorm_row(x.data() + f.logit_rows[r] * H, w.final_norm, sel.data() + r * H, H, w.rms_eps);
    }
    qa.set(sel.data(), f.n_logit_rows, H, parallel);
    linear(w.head, qa, f.logits, w.head.rows, parallel);
  }
}

void context_kv(const ModelWeights& w, const float* hidden, const ForwardBatch& f, const ParallelFor& parallel) {
  check(forward_available(), "the GGUF forward needs AVX-512F");
  const int64_t H = w.hidden, Hkv = w.kv_heads, D = w.head_dim, M = f.B * f.N, half = D / 2;
  check(D % 16 == 0 && D <= 128 && H % kBlock == 0, "head_dim: a multiple of 16 up to 128; hidden: of 32");
  if (M == 0) return;
  check_cache_slots(f);
  std::vector<float> cosv, sinv, k(M * Hkv * D), v(M * Hkv * D);
  rope_tables(w, f.positions, M, cosv, sinv);
  Quantized qa;
  qa.set(hidden, M, H, parallel);  // once: every layer projects the same rows
  for (int64_t l = 0; l < static_cast<int64_t>(w.layers.size()); ++l) {
    const LayerWeights& lw = w.layers[l];
    linear(lw.k, qa, k.data(), Hkv * D, parallel);
    linear(lw.v, qa, v.data(), Hkv * D, parallel);
    for (int64_t i = 0; i < M; ++i) {
      norm_rope_heads(k.data() + i * Hkv * D, Hkv, lw.k_norm, cosv.data() + i * half, sinv.data() + i * half, D,
                      w.rms_eps);
    }
    write_cache(f, l, k.data(), v.data(), Hkv, D);
  }
}
#else
bool forward_available() { return false; }
void forward(const ModelWeights&, const ForwardBatch&, const ParallelFor&) {
  throw std::invalid_argument("the GGUF forward needs an x86-64 build with AVX-512");
}
void context_kv(const ModelWeights&, const float*, const ForwardBatch&, const ParallelFor&) {
  throw std::invalid_argument("the GGUF forward needs an x86-64 build with AVX-512");
}
#endif

void rmsnorm_rows(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  for (int64_t r = 0; r < M; ++r) rmsnorm_row(x + r * H, w, y + r * H, H, eps);
}

}  // namespace gguf
}  // namespace taps
