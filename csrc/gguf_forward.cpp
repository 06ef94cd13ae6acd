// Decoder forward over GGUF blocks (see gguf_forward.h for what is row-invariant and why).
#include "gguf_forward.h"

#include "gguf_row_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

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

namespace {

// Query rows of one batch row that one attention call takes together (they read their shared prefix once);
// chunks of 8 leave tasks for a second thread when a tree has 16 rows.
constexpr int64_t kAttendChunkRows = 8;

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
void norm_rope_heads(const RowOps& ops, float* x, int64_t heads, const float* norm, const float* cs, const float* sn,
                     int64_t D, float eps) {
  float tmp[128];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    if (norm) {
      ops.rmsnorm_row(v, norm, tmp, D, eps);
      std::memcpy(v, tmp, D * sizeof(float));
    }
    rope_head(v, cs, sn, D);
  }
}

// The quantised activations of M rows: one digit (a, scale, asum [M, ...]) or two ([2M, ...]: the leading
// digits of the M rows, then their residual digits; gguf_linear.h).
struct Quantized {
  std::vector<int8_t> a;
  std::vector<float> scale;
  std::vector<int32_t> asum;
  std::vector<float> both;  // two digits: the rows of both digits before they are added, [2M, N]
  int64_t M = 0, K = 0, digits = 1;

  explicit Quantized(int64_t activation_digits) : digits(activation_digits) {}

  void set(const float* x, int64_t m, int64_t k, const ParallelFor& parallel) {
    M = m, K = k;
    const int64_t KB = k / kBlock;
    a.resize(static_cast<size_t>(digits * m * k));
    scale.resize(static_cast<size_t>(digits * m * KB));
    asum.resize(scale.size());
    parallel(m, [&](int64_t r0, int64_t r1) {
      quantize_activations_digits(x + r0 * k, r1 - r0, k, a.data() + r0 * k, scale.data() + r0 * KB,
                                  asum.data() + r0 * KB, digits, m);
    });
  }
};

void linear(const PackedMatrix& w, Quantized& q, float* y, int64_t ldy, const ParallelFor& parallel) {
  const int64_t groups = (w.rows + kGroupRows - 1) / kGroupRows;
  q.both.resize(static_cast<size_t>(q.digits == 2 ? 2 * q.M * w.rows : 0));
  parallel(groups, [&](int64_t g0, int64_t g1) {
    packed_linear_digits(w.type, w.data, w.rows, w.cols, q.a.data(), q.scale.data(), q.asum.data(), q.M, q.digits,
                         q.both.data(), y, ldy, g0, g1);
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

// Row i = (b, j) of k/v [M, Hkv * D] into layer l's cache at slot prefix_lens[b] + j of cache row cache_rows[b]
// (rounded to float16 when the cache holds float16).
void write_cache(const RowOps& ops, const ForwardBatch& f, int64_t l, const float* k, const float* v, int64_t Hkv,
                 int64_t D) {
  const bool half = f.cache_type == CacheType::F16;
  for (int64_t i = 0; i < f.B * f.N; ++i) {
    const int64_t b = i / f.N, j = i % f.N, slot = f.prefix_lens[b] + j;
    for (int64_t hh = 0; hh < Hkv; ++hh) {
      const int64_t off = ((f.cache_rows[b] * Hkv + hh) * f.capacity + slot) * D;
      const float* ks = k + (i * Hkv + hh) * D;
      const float* vs = v + (i * Hkv + hh) * D;
      if (half) {
        ops.to_half(ks, static_cast<uint16_t*>(f.keys[l]) + off, D);
        ops.to_half(vs, static_cast<uint16_t*>(f.values[l]) + off, D);
      } else {
        std::memcpy(static_cast<float*>(f.keys[l]) + off, ks, D * sizeof(float));
        std::memcpy(static_cast<float*>(f.values[l]) + off, vs, D * sizeof(float));
      }
    }
  }
}

}  // namespace

const RowOps* row_ops() {
  // the AVX2 block kernels asked for on an AVX-512 CPU (TAPS_GGUF_KERNELS=avx2) bring the AVX2 row math along
  static const RowOps* ops =
      row_ops_avx512() && kernel_path() != KernelPath::Avx2 ? row_ops_avx512() : row_ops_avx2();
  return ops;
}

bool forward_available() { return row_ops() != nullptr; }

// The row ops this process runs, or the error that the forward cannot run here.
const RowOps& checked_row_ops() {
  check(forward_available(), "the GGUF forward needs an x86-64 CPU with AVX-512F, or AVX2 with FMA and F16C");
  return *row_ops();
}

void forward(const ModelWeights& w, const ForwardBatch& f, const ParallelFor& parallel) {
  const RowOps& ops = checked_row_ops();
  const int64_t H = w.hidden, Hq = w.heads, Hkv = w.kv_heads, D = w.head_dim, F = w.ffn, V = w.vocab;
  check(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "heads: expected a multiple of kv_heads, at most 8x");
  check(D % 16 == 0 && D <= 128, "head_dim: expected a multiple of 16, at most 128");
  check(H % kBlock == 0 && F % kBlock == 0 && (Hq * D) % kBlock == 0, "hidden, ffn, heads*head_dim: multiples of 32");
  const int64_t M = f.B * f.N, G = Hq / Hkv, L = static_cast<int64_t>(w.layers.size());
  const AttendFn attend_kernel = ops.attend_for(G, D, f.cache_type);
  const int64_t chunks = (f.N + kAttendChunkRows - 1) / kAttendChunkRows;
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
  Quantized qa(w.activation_digits);
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
    for (int64_t i = 0; i < M; ++i) ops.rmsnorm_row(x.data() + i * H, lw.attn_norm, h.data() + i * H, H, w.rms_eps);
    qa.set(h.data(), M, H, parallel);
    linear(lw.q, qa, q.data(), Hq * D, parallel);
    linear(lw.k, qa, k.data(), Hkv * D, parallel);
    linear(lw.v, qa, v.data(), Hkv * D, parallel);
    for (int64_t i = 0; i < M; ++i) {
      norm_rope_heads(ops, q.data() + i * Hq * D, Hq, lw.q_norm, cosv.data() + i * half, sinv.data() + i * half, D,
                      w.rms_eps);
      norm_rope_heads(ops, k.data() + i * Hkv * D, Hkv, lw.k_norm, cosv.data() + i * half, sinv.data() + i * half, D,
                      w.rms_eps);
    }
    // the new rows' keys and values go into the cache before any row attends (a node sees its ancestors)
    write_cache(ops, f, l, k.data(), v.data(), Hkv, D);
    const char* Kc = static_cast<const char*>(f.keys[l]);
    const char* Vc = static_cast<const char*>(f.values[l]);
    const int64_t elem = cache_bytes(f.cache_type);
    // Task by task (a KV head, a batch row, up to kAttendChunkRows of its query rows): the rows of a tree share
    // their prefix, which the kernel then reads once for all of them (gguf_row_ops.h).
    parallel(Hkv * f.B * chunks, [&](int64_t t0, int64_t t1) {
      thread_local std::vector<float> scores, acc;
      scores.resize(static_cast<size_t>(kAttendChunkRows * G * std::max<int64_t>(max_vis, 1)));
      acc.resize(static_cast<size_t>(kAttendChunkRows * G * D));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t hh = t / (f.B * chunks), b = t / chunks % f.B, c = t % chunks;
        const int64_t i0 = b * f.N + c * kAttendChunkRows, i1 = std::min(i0 + kAttendChunkRows, (b + 1) * f.N);
        const int64_t base = (f.cache_rows[b] * Hkv + hh) * f.capacity * D * elem;
        AttendRows a;
        a.rows = i1 - i0;
        a.q = q.data() + (i0 * Hq + hh * G) * D, a.q_stride = Hq * D;
        a.out = att.data() + (i0 * Hq + hh * G) * D, a.out_stride = Hq * D;
        a.vis = vis.data(), a.vis_start = vis_start.data() + i0;
        a.shared = f.prefix_lens[b], a.max_nv = std::max<int64_t>(max_vis, 1), a.scale = scale;
        a.scores = scores.data(), a.acc = acc.data();
        attend_kernel(a, Kc + base, Vc + base);
      }
    });
    qa.set(att.data(), M, Hq * D, parallel);
    linear(lw.o, qa, h.data(), H, parallel);
    for (int64_t e = 0; e < M * H; ++e) x[e] = x[e] + h[e];
    for (int64_t i = 0; i < M; ++i) ops.rmsnorm_row(x.data() + i * H, lw.ffn_norm, h.data() + i * H, H, w.rms_eps);
    qa.set(h.data(), M, H, parallel);
    linear(lw.gate, qa, gate.data(), F, parallel);
    linear(lw.up, qa, up.data(), F, parallel);
    parallel(M, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) ops.swiglu(gate.data() + i * F, up.data() + i * F, F);
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
    for (int64_t i = 0; i < M; ++i) ops.rmsnorm_row(x.data() + i * H, w.final_norm, h.data() + i * H, H, w.rms_eps);
    store_feature(L - 1, h.data());
  }
  if (f.n_logit_rows > 0) {
    std::vector<float> sel(f.n_logit_rows * H);
    for (int64_t r = 0; r < f.n_logit_rows; ++r) {
      ops.rmsnorm_row(x.data() + f.logit_rows[r] * H, w.final_norm, sel.data() + r * H, H, w.rms_eps);
    }
    qa.set(sel.data(), f.n_logit_rows, H, parallel);
    linear(w.head, qa, f.logits, w.head.rows, parallel);
  }
}

void context_kv(const ModelWeights& w, const float* hidden, const ForwardBatch& f, const ParallelFor& parallel) {
  const RowOps& ops = checked_row_ops();
  const int64_t H = w.hidden, Hkv = w.kv_heads, D = w.head_dim, M = f.B * f.N, half = D / 2;
  check(D % 16 == 0 && D <= 128 && H % kBlock == 0, "head_dim: a multiple of 16 up to 128; hidden: of 32");
  if (M == 0) return;
  check_cache_slots(f);
  std::vector<float> cosv, sinv, k(M * Hkv * D), v(M * Hkv * D);
  rope_tables(w, f.positions, M, cosv, sinv);
  Quantized qa(w.activation_digits);
  qa.set(hidden, M, H, parallel);  // once: every layer projects the same rows
  for (int64_t l = 0; l < static_cast<int64_t>(w.layers.size()); ++l) {
    const LayerWeights& lw = w.layers[l];
    linear(lw.k, qa, k.data(), Hkv * D, parallel);
    linear(lw.v, qa, v.data(), Hkv * D, parallel);
    for (int64_t i = 0; i < M; ++i) {
      norm_rope_heads(ops, k.data() + i * Hkv * D, Hkv, lw.k_norm, cosv.data() + i * half, sinv.data() + i * half, D,
                      w.rms_eps);
    }
    write_cache(ops, f, l, k.data(), v.data(), Hkv, D);
  }
}
void rmsnorm_rows(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  const RowOps& ops = checked_row_ops();
  for (int64_t r = 0; r < M; ++r) ops.rmsnorm_row(x + r * H, w, y + r * H, H, eps);
}

}  // namespace gguf
}  // namespace taps
