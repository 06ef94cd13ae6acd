// Unit test of the fused per-position statistics (topk_stats.h) against a double-precision brute force, for
// the vector path and the plain-loop fallback: V not a multiple of 16 (masked tail), impossible tokens (-inf),
// ties, K = V, and the refused rows (NaN, +inf, every entry -inf); argmax_row against a plain scan (ties, NaN, +-inf).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "check.h"
#include "topk_stats.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

void check_row(const std::vector<float>& x, int32_t K, bool vector_path) {
  const auto run = vector_path ? taps::topk_stats_row : taps::topk_stats_row_scalar;
  const int64_t V = static_cast<int64_t>(x.size());
  std::vector<float> vals(K);
  std::vector<int64_t> ids(K);
  float entropy = std::nanf("");
  taps::TopKStatsWorkspace ws;
  CHECK(run(x.data(), V, K, vals.data(), ids.data(), &entropy, ws));
  double mx = -INFINITY, s = 0.0, t = 0.0;
  for (float v : x) mx = std::max(mx, static_cast<double>(v));
  for (float v : x) s += std::exp(v - mx);
  std::vector<double> logp(V);
  for (int64_t i = 0; i < V; ++i) logp[i] = x[i] - mx - std::log(s);
  for (int64_t i = 0; i < V; ++i)
    if (x[i] != -kInf) t -= std::exp(logp[i]) * logp[i];
  // order: larger log-prob (equal logits give equal log-probs), then smaller id
  std::vector<int64_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  for (int32_t k = 0; k < K; ++k) {
    CHECK(ids[k] == order[k]);
    const double want = logp[order[k]];
    CHECK(want == -INFINITY ? vals[k] == -kInf : std::fabs(vals[k] - want) <= 4e-6 * (1.0 + std::fabs(want)));
  }
  CHECK(std::fabs(entropy - t) <= 4e-6 * (1.0 + t));
}

}  // namespace

int main() {
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int vector_path = 0; vector_path < 2; ++vector_path) {
    for (int64_t V : {1, 2, 15, 16, 17, 33, 1001, 24000}) {
      for (int32_t K : {1, 2, 7, 64}) {
        if (K > V) continue;
        std::vector<float> x(V);
        for (auto& v : x) v = normal(rng);
        check_row(x, K, vector_path);
        for (int64_t i = 1; i < V; i += 3) x[i] = -kInf;  // impossible tokens, one of every three
        check_row(x, K, vector_path);
        for (auto& v : x) v = std::round(v);  // ties (a -inf stays -inf)
        check_row(x, K, vector_path);
      }
    }
    std::vector<float> one_hot(37, -kInf);
    one_hot[36] = 2.0f;  // one possible token, in the masked tail: entropy 0
    check_row(one_hot, 3, vector_path);
    const auto run = vector_path ? taps::topk_stats_row : taps::topk_stats_row_scalar;
    for (float bad : {std::nanf(""), kInf}) {
      std::vector<float> x(40, 0.5f);
      x[39] = bad;
      std::vector<float> vals(4);
      std::vector<int64_t> ids(4);
      float entropy;
      taps::TopKStatsWorkspace ws;
      CHECK(!run(x.data(), 40, 4, vals.data(), ids.data(), &entropy, ws));
      std::fill(x.begin(), x.end(), -kInf);
      CHECK(!run(x.data(), 40, 4, vals.data(), ids.data(), &entropy, ws));
    }
  }
  for (int64_t V : {1, 2, 15, 16, 17, 100, 49152}) {
    for (int rep = 0; rep < 40; ++rep) {
      std::vector<float> x(V);
      for (auto& v : x) v = std::round(normal(rng));  // ties
      if (rep % 5 == 1) x[rng() % V] = std::nanf("");
      if (rep % 5 == 2) x[rng() % V] = kInf;
      if (rep % 5 == 3) std::fill(x.begin(), x.end(), -kInf);
      int64_t want = 0;  // first of the largest; the first NaN beats every number
      for (int64_t i = 1; i < V && !std::isnan(x[want]); ++i)
        if (std::isnan(x[i]) || x[i] > x[want]) want = i;
      CHECK(taps::argmax_row(x.data(), V) == want);
    }
  }
  return g_failures != 0;
}
