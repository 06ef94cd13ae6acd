// TAPS edge scorer of one tree (see score_edges.h; definitions in taps_kernels/reference/score.py).
//
// Cost (129-node pool, trained scorer): the token projection, fc1 of both heads and SiLU are nearly all
// of it. Token rows are projected once per distinct token of the pool (tokens repeat across depths), never
// for the whole vocabulary, by the few-row linear kernel (rows_linear.h); fc1 and SiLU have their own
// AVX-512 loops below. Every AVX-512 path is taken only where rows_linear_vectorized() says the CPU has
// AVX-512F, and has a plain-loop twin that ScorerNet::vectorized = false selects (for the unit test).
#include "score_edges.h"

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's avx512fintrin.h trips its own -Wuninitialized in the masked loads (a known false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define TAPS_SCORE_AVX512 1
#endif

#include "rows_linear.h"
#include "simd_math.h"
#include "tree_ops.h"

namespace taps {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kOtherMassFloor = 1e-6f;  // reference OTHER_MASS_FLOOR
constexpr int32_t kScalars = 7;

inline int32_t clamp_index(int32_t x, int32_t lo, int32_t hi) { return std::min(std::max(x, lo), hi); }

// max that keeps a NaN, as torch's amax does (std::max would drop a NaN in its second argument)
inline float nan_max(float a, float b) { return (std::isnan(a) || b <= a) ? a : b; }

// y [R, out] = x [R, in] . w^T + b
void linear(const float* x, const float* w, const float* b, float* y, int64_t R, int64_t out, int64_t in) {
  if (R == 0 || out == 0) return;
  rows_linear_tiles(x, w, b, y, R, out, in, 0, (out + kRowsLinearTile - 1) / kRowsLinearTile);
}

// fc1 of one head: y [R, M] = x [R, F] . w^T + b, from wt = w^T [F, M]. With F ~ 100 and M ~ 64 the
// few-row kernel (rows_linear.h) would spend most of its time in one horizontal reduction per output;
// here a row's M outputs stay in registers while x's entries are broadcast, so there is none.
void narrow_linear_scalar(const float* x, const float* wt, const float* b, float* y, int64_t R, int32_t F, int32_t M) {
  for (int64_t r = 0; r < R; ++r) {
    float* out = y + r * M;
    std::copy_n(b, M, out);
    for (int32_t f = 0; f < F; ++f) {
      const float xf = x[r * F + f];
      for (int32_t m = 0; m < M; ++m) out[m] += xf * wt[static_cast<int64_t>(f) * M + m];
    }
  }
}

#ifdef TAPS_SCORE_AVX512
// Rows [r0, r0 + RB) x columns [c0, c0 + 16 * V) (the last vector masked by `last`): RB * V accumulators
// give enough independent FMA chains to hide their latency, and each loaded weight vector serves RB rows.
template <int RB, int V>
__attribute__((target("avx512f"))) void narrow_block_avx512(const float* x, const float* wt, const float* b, float* y,
                                                            int64_t r0, int32_t F, int32_t M, int32_t c0,
                                                            __mmask16 last) {
  // Fully unrolled so that GCC keeps acc in registers (with loops over the array it also stored every
  // accumulator to the stack on each step).
  __m512 acc[RB * V];
#pragma GCC unroll 16
  for (int k = 0; k < RB * V; ++k) acc[k] = _mm512_maskz_loadu_ps(k % V + 1 < V ? 0xFFFF : last, b + c0 + 16 * (k % V));
  for (int32_t f = 0; f < F; ++f) {
    const float* w = wt + static_cast<int64_t>(f) * M + c0;
    __m512 wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) wv[v] = _mm512_maskz_loadu_ps(v + 1 < V ? 0xFFFF : last, w + 16 * v);
#pragma GCC unroll 16
    for (int k = 0; k < RB * V; ++k) {
      acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(x[(r0 + k / V) * F + f]), wv[k % V], acc[k]);
    }
  }
#pragma GCC unroll 16
  for (int k = 0; k < RB * V; ++k) {
    _mm512_mask_storeu_ps(y + (r0 + k / V) * M + c0 + 16 * (k % V), k % V + 1 < V ? 0xFFFF : last, acc[k]);
  }
}

template <int V>
__attribute__((target("avx512f"))) void narrow_columns_avx512(const float* x, const float* wt, const float* b,
                                                              float* y, int64_t R, int32_t F, int32_t M, int32_t c0,
                                                              __mmask16 last) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) narrow_block_avx512<4, V>(x, wt, b, y, r, F, M, c0, last);
  for (; r < R; ++r) narrow_block_avx512<1, V>(x, wt, b, y, r, F, M, c0, last);
}

__attribute__((target("avx512f"))) void narrow_linear_avx512(const float* x, const float* wt, const float* b, float* y,
                                                             int64_t R, int32_t F, int32_t M) {
  for (int32_t c0 = 0; c0 < M; c0 += 64) {
    const int32_t n = std::min(64, M - c0);
    const int32_t rem = n % 16;
    const __mmask16 last = rem ? static_cast<__mmask16>((1u << rem) - 1u) : static_cast<__mmask16>(0xFFFF);
    switch ((n + 15) / 16) {
      case 4: narrow_columns_avx512<4>(x, wt, b, y, R, F, M, c0, last); break;
      case 3: narrow_columns_avx512<3>(x, wt, b, y, R, F, M, c0, last); break;
      case 2: narrow_columns_avx512<2>(x, wt, b, y, R, F, M, c0, last); break;
      default: narrow_columns_avx512<1>(x, wt, b, y, R, F, M, c0, last); break;
    }
  }
}
#endif

// SiLU in place, a / (1 + exp(-a)). The scalar loop calls expf once per activation, which took about
// as long as both heads' matrix work; the vector path evaluates exp as 2^n * P(r) with r = x - n*ln2
// (|r| <= ln2/2, two-part ln2) and P the degree-7 Taylor polynomial (truncation < 1e-8 relative, below
// float32 rounding), scaled by vscalefps, which overflows to inf and underflows to 0 like expf.
void silu_scalar(float* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = a[i] / (1.0f + std::exp(-a[i]));
}

#ifdef TAPS_SCORE_AVX512
#endif

void silu(float* a, int64_t n, bool vectorized) {
#ifdef TAPS_SCORE_AVX512
  if (vectorized && rows_linear_vectorized()) return silu_avx512(a, n);
#endif
  silu_scalar(a, n);
}

void narrow_linear(const float* x, const float* wt, const float* b, float* y, int64_t R, int32_t F, int32_t M,
                   bool vectorized) {
  if (R == 0 || M == 0) return;
#ifdef TAPS_SCORE_AVX512
  if (vectorized && rows_linear_vectorized()) return narrow_linear_avx512(x, wt, b, y, R, F, M);
#endif
  narrow_linear_scalar(x, wt, b, y, R, F, M);
}

// Sum of term(i) for i < n in 8 interleaved partial sums: no serial add chain, so the loop runs at add
// throughput and vectorises without -ffast-math (the order differs from torch's either way).
template <typename Term>
inline float lane_sum(int32_t n, Term term) {
  constexpr int32_t kLanes = 8;
  float part[kLanes] = {};
  int32_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int32_t j = 0; j < kLanes; ++j) part[j] += term(i + j);
  }
  for (; i < n; ++i) part[i % kLanes] += term(i);
  float total = 0.0f;
  for (float p : part) total += p;
  return total;
}

// LayerNorm rows in place, then fc1 -> SiLU -> fc2; one logit per row.
void run_head(const ScorerHead& h, int32_t F, int32_t M, float eps, bool vectorized, float* x, int64_t R,
              std::vector<float>& fc1_t, std::vector<float>& hidden, float* logits) {
  if (R == 0) return;
  for (int64_t r = 0; r < R; ++r) {
    float* row = x + r * F;
    // two passes, not E[x^2] - E[x]^2: the log-prob scalars can make |mean| >> std
    const float mean = lane_sum(F, [&](int32_t f) { return row[f]; }) / static_cast<float>(F);
    const float var = lane_sum(F, [&](int32_t f) { return (row[f] - mean) * (row[f] - mean); }) / static_cast<float>(F);
    const float rstd = 1.0f / std::sqrt(var + eps);
    for (int32_t f = 0; f < F; ++f) row[f] = (row[f] - mean) * rstd * h.ln_weight[f] + h.ln_bias[f];
  }
  fc1_t.resize(static_cast<size_t>(F) * M);
  for (int32_t m = 0; m < M; ++m)
    for (int32_t f = 0; f < F; ++f) fc1_t[static_cast<size_t>(f) * M + m] = h.fc1_weight[static_cast<int64_t>(m) * F + f];
  hidden.resize(static_cast<size_t>(R) * M);
  narrow_linear(x, fc1_t.data(), h.fc1_bias, hidden.data(), R, F, M, vectorized);
  silu(hidden.data(), R * M, vectorized);
  for (int64_t r = 0; r < R; ++r) {
    const float* a = hidden.data() + r * M;
    logits[r] = lane_sum(M, [&](int32_t m) { return a[m] * h.fc2_weight[m]; }) + h.fc2_bias[0];
  }
}

// Per-node projected tokens (one row per distinct token) and per-position projected
// hidden states.
void project_embeddings(const ScoreTree& t, const ScorerNet& net, const TokenTable& table, const float* drafter_hidden,
                        ScoreWorkspace& ws) {
  const int32_t N = t.N;
  // Padding rows too (their token is 0 in pools: one extra row at most): a malformed tree whose node
  // hangs off a padding row then still reads that row's token, as the reference does.
  ws.token_nodes.clear();
  for (int32_t i = 0; i < N; ++i) ws.token_nodes.emplace_back(t.tokens[i], i);
  std::sort(ws.token_nodes.begin(), ws.token_nodes.end());
  ws.token_row.assign(static_cast<size_t>(N), 0);
  const int64_t E = table.width;
  ws.emb_rows.resize(ws.token_nodes.size() * static_cast<size_t>(E));
  int64_t U = 0;
  for (size_t k = 0; k < ws.token_nodes.size(); ++k) {
    if (k == 0 || ws.token_nodes[k].first != ws.token_nodes[k - 1].first) {
      table.load_row(table, ws.token_nodes[k].first, ws.emb_rows.data() + U * E);
      ++U;
    }
    ws.token_row[ws.token_nodes[k].second] = static_cast<int32_t>(U - 1);
  }
  ws.tok_proj.resize(static_cast<size_t>(U) * net.Pt);
  linear(ws.emb_rows.data(), net.token_proj_weight, net.token_proj_bias, ws.tok_proj.data(), U, net.Pt, E);
  ws.hid_proj.resize(static_cast<size_t>(t.D) * net.Ph);
  linear(drafter_hidden, net.hidden_proj_weight, net.hidden_proj_bias, ws.hid_proj.data(), t.D, net.Ph, net.H);
}

// Writes the embedding part of a feature row: [child token | parent token | depth | hidden]; child < 0
// leaves the child slot zero (the "other" bucket's virtual child).
void embedding_features(const ScorerNet& net, const ScoreWorkspace& ws, int32_t child, int32_t parent, int32_t depth_row,
                        int32_t position, float* out) {
  const int32_t Pt = net.Pt, Pd = net.Pd, Ph = net.Ph;
  if (child >= 0) {
    std::copy_n(ws.tok_proj.data() + static_cast<int64_t>(ws.token_row[child]) * Pt, Pt, out);
  } else {
    std::fill_n(out, Pt, 0.0f);
  }
  std::copy_n(ws.tok_proj.data() + static_cast<int64_t>(ws.token_row[parent]) * Pt, Pt, out + Pt);
  std::copy_n(net.depth_embedding + static_cast<int64_t>(depth_row) * Pd, Pd, out + 2 * Pt);
  std::copy_n(ws.hid_proj.data() + static_cast<int64_t>(position) * Ph, Ph, out + 2 * Pt + Pd);
}

void marginal(const ScoreTree& t, float* edge_logq, float* other_logq, ScoreWorkspace& ws) {
  const int32_t N = t.N;
  ws.seg_sum.assign(static_cast<size_t>(N), 0.0f);
  edge_logq[0] = 0.0f;
  for (int32_t v = 1; v < N; ++v) {
    const int32_t u = t.parents[v];
    edge_logq[v] = u >= 0 ? t.step_logq[v] : kNegInf;
    if (u >= 0) ws.seg_sum[u] += std::exp(t.step_logq[v]);
  }
  for (int32_t u = 0; u < N; ++u) {
    const bool real = u == 0 || t.parents[u] >= 0;
    other_logq[u] = real ? std::log(std::max(1.0f - ws.seg_sum[u], 0.0f)) : kNegInf;
  }
}

// Per-parent softmax over [other] + children (reference normalise_siblings, same formulas so that the
// odd inputs it tolerates come out the same way).
void normalise(const ScoreTree& t, const float* el, const float* ol, float* edge_logq, float* other_logq,
               ScoreWorkspace& ws) {
  const int32_t N = t.N;
  const int32_t* parents = t.parents;
  auto real = [&](int32_t i) { return i == 0 || parents[i] >= 0; };
  ws.seg_max.assign(ol, ol + N);
  for (int32_t v = 1; v < N; ++v) {
    if (parents[v] >= 0) ws.seg_max[parents[v]] = nan_max(ws.seg_max[parents[v]], el[v]);
  }
  ws.seg_sum.resize(static_cast<size_t>(N));
  for (int32_t u = 0; u < N; ++u) {
    if (!real(u)) ws.seg_max[u] = 0.0f;
    ws.seg_sum[u] = std::exp(ol[u] - ws.seg_max[u]);
  }
  for (int32_t v = 1; v < N; ++v) {
    const int32_t u = parents[v];
    if (u >= 0) ws.seg_sum[u] += std::exp(el[v] - ws.seg_max[u]);
  }
  // seg_sum becomes log Z
  for (int32_t u = 0; u < N; ++u) ws.seg_sum[u] = ws.seg_max[u] + std::log(ws.seg_sum[u]);
  edge_logq[0] = 0.0f;
  for (int32_t v = 1; v < N; ++v) edge_logq[v] = parents[v] >= 0 ? el[v] - ws.seg_sum[parents[v]] : kNegInf;
  for (int32_t u = 0; u < N; ++u) other_logq[u] = real(u) ? ol[u] - ws.seg_sum[u] : kNegInf;
}

}  // namespace

void score_edges_one(const ScoreTree& t, const ScorerNet* net, const TokenTable* table, const float* drafter_hidden,
                     float* edge_logq, float* other_logq, float* log_reach, ScoreWorkspace& ws) {
  const int32_t N = t.N;
  if (N <= 0) return;
  if (net == nullptr) {
    marginal(t, edge_logq, other_logq, ws);
    propagate_reach_one(t.parents, edge_logq, N, log_reach);
    return;
  }
  const int32_t D = t.D, F = net->F;
  const float Df = static_cast<float>(D);
  const int32_t emb_width = F - kScalars;  // 0 for the tiny scorer
  if (net->full) project_embeddings(t, *net, *table, drafter_hidden, ws);

  // edge rows: every node with a parent (the root and padding have none)
  ws.edge_nodes.clear();
  for (int32_t v = 1; v < N; ++v) {
    if (t.parents[v] >= 0) ws.edge_nodes.push_back(v);
  }
  const int64_t Re = static_cast<int64_t>(ws.edge_nodes.size());
  ws.feats.resize(static_cast<size_t>(Re) * F);
  for (int64_t r = 0; r < Re; ++r) {
    const int32_t v = ws.edge_nodes[r];
    const int32_t d = t.depth[v];
    const int32_t p = clamp_index(d - 1, 0, D - 1);
    const float df = static_cast<float>(std::max(d, 1));
    float* row = ws.feats.data() + r * F;
    if (net->full) embedding_features(*net, ws, v, t.parents[v], clamp_index(d, 0, net->depth_rows - 1), p, row);
    float* s = row + emb_width;
    const float lq = t.logq[v];
    s[0] = t.step_logq[v];
    s[1] = t.entropy[p];
    s[2] = t.margin[p];
    s[3] = t.topk_mass[p];
    s[4] = df / Df;
    s[5] = lq;
    s[6] = lq / df;
  }
  ws.edge_logit.assign(static_cast<size_t>(N), kNegInf);
  ws.row_logit.resize(static_cast<size_t>(N));  // at most N rows per head
  run_head(net->edge, F, net->M, net->ln_eps, net->vectorized, ws.feats.data(), Re, ws.fc1_t, ws.hidden, ws.row_logit.data());
  for (int64_t r = 0; r < Re; ++r) ws.edge_logit[ws.edge_nodes[r]] = ws.row_logit[r];

  // "other" rows: real nodes that can still have children (depth < D)
  ws.other_nodes.clear();
  ws.other_logit.assign(static_cast<size_t>(N), kNegInf);
  for (int32_t u = 0; u < N; ++u) {
    if (u != 0 && t.parents[u] < 0) continue;
    if (t.depth[u] < D) {
      ws.other_nodes.push_back(u);
    } else {
      ws.other_logit[u] = 0.0f;  // never normalised against a child, any finite value gives other_logq = 0
    }
  }
  const int64_t Ro = static_cast<int64_t>(ws.other_nodes.size());
  ws.feats.resize(static_cast<size_t>(Ro) * F);
  for (int64_t r = 0; r < Ro; ++r) {
    const int32_t u = ws.other_nodes[r];
    const int32_t du = t.depth[u];
    const int32_t p = clamp_index(du, 0, D - 1);
    const float df = static_cast<float>(du + 1);
    float* row = ws.feats.data() + r * F;
    if (net->full) embedding_features(*net, ws, -1, u, clamp_index(du + 1, 0, net->depth_rows - 1), p, row);
    float* s = row + emb_width;
    const float lq = t.logq[u];
    const float mass = t.topk_mass[p];
    s[0] = std::log(std::max(1.0f - mass, kOtherMassFloor));
    s[1] = t.entropy[p];
    s[2] = t.margin[p];
    s[3] = mass;
    s[4] = df / Df;
    s[5] = lq;
    s[6] = lq / df;
  }
  run_head(net->other, F, net->M, net->ln_eps, net->vectorized, ws.feats.data(), Ro, ws.fc1_t, ws.hidden, ws.row_logit.data());
  for (int64_t r = 0; r < Ro; ++r) ws.other_logit[ws.other_nodes[r]] = ws.row_logit[r];

  normalise(t, ws.edge_logit.data(), ws.other_logit.data(), edge_logq, other_logq, ws);
  propagate_reach_one(t.parents, edge_logq, N, log_reach);
}

}  // namespace taps
