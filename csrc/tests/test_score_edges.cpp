// Unit tests of the C++ edge scorer core (score_edges.h), no Python and no torch: run by ctest.
// The Python tests compare it with the PyTorch reference; these check what can be worked out by hand:
// a scorer whose logits are all equal (q = 1 / (children + 1) at every parent), the marginal model,
// padding and root conventions, and the AVX-512 path against the plain loops.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "rows_linear.h"
#include "score_edges.h"

namespace {

const float kNegInf = -std::numeric_limits<float>::infinity();

bool near(float a, float b, float tol) { return std::fabs(a - b) <= tol; }

// Tree of 9 rows, D = 3: root 0 -> {1, 2}, 1 -> {3, 4, 5}, 3 -> {6}; rows 7, 8 padding.
struct Fixture {
  std::vector<int64_t> tokens{4, 1, 2, 3, 1, 0, 2, 0, 0};
  std::vector<int32_t> parents{-1, 0, 0, 1, 1, 1, 3, -1, -1};
  std::vector<int32_t> depth{0, 1, 1, 2, 2, 2, 3, 0, 0};
  std::vector<float> step{0.f, -0.5f, -1.5f, -0.3f, -2.f, -2.5f, -0.1f, kNegInf, kNegInf};
  std::vector<float> logq;
  std::vector<float> entropy{1.f, 2.f, 0.5f}, margin{0.3f, 0.1f, 2.f}, mass{0.9f, 0.6f, 0.999999f};
  Fixture() {
    logq.assign(9, kNegInf);
    logq[0] = 0.f;
    for (int i = 1; i < 7; ++i) logq[i] = logq[parents[i]] + step[i];
  }
  taps::ScoreTree tree() const {
    taps::ScoreTree t;
    t.tokens = tokens.data();
    t.parents = parents.data();
    t.depth = depth.data();
    t.N = 9;
    t.logq = logq.data();
    t.step_logq = step.data();
    t.entropy = entropy.data();
    t.margin = margin.data();
    t.topk_mass = mass.data();
    t.D = 3;
    return t;
  }
};

const int kChildren[9] = {2, 3, 0, 1, 0, 0, 0, 0, 0};

void load_float_row(const taps::TokenTable& t, int64_t row, float* out) {
  const float* p = static_cast<const float*>(t.data) + row * t.row_stride;
  for (int64_t e = 0; e < t.width; ++e) out[e] = p[e * t.col_stride];
}

// Random full or tiny scorer with its storage.
struct Net {
  std::vector<std::vector<float>> store;
  taps::ScorerNet net;
  const float* make(std::mt19937& rng, size_t n, float scale, float offset = 0.f) {
    std::normal_distribution<float> normal(0.f, scale);
    store.emplace_back(n);
    for (auto& v : store.back()) v = offset + normal(rng);
    return store.back().data();
  }
  Net(std::mt19937& rng, bool full, int Pt, int Pd, int Ph, int M, int E, int H, int depth_rows, float fc1_scale) {
    store.reserve(32);
    net.full = full;
    if (full) {
      net.Pt = Pt, net.Pd = Pd, net.Ph = Ph, net.H = H, net.depth_rows = depth_rows;
      net.token_proj_weight = make(rng, size_t(Pt) * E, 0.2f);
      net.token_proj_bias = make(rng, Pt, 0.1f);
      net.depth_embedding = make(rng, size_t(depth_rows) * Pd, 1.f);
      net.hidden_proj_weight = make(rng, size_t(Ph) * H, 0.2f);
      net.hidden_proj_bias = make(rng, Ph, 0.1f);
    }
    net.F = 2 * net.Pt + net.Pd + net.Ph + 7;
    net.M = M;
    for (taps::ScorerHead* h : {&net.edge, &net.other}) {
      h->ln_weight = make(rng, net.F, 0.1f, 1.f);
      h->ln_bias = make(rng, net.F, 0.1f);
      h->fc1_weight = make(rng, size_t(M) * net.F, fc1_scale);
      h->fc1_bias = make(rng, M, 0.1f);
      h->fc2_weight = make(rng, M, 0.3f);
      h->fc2_bias = make(rng, 1, 0.1f);
    }
  }
};

void test_equal_logits_give_uniform_siblings() {
  Fixture fx;
  std::mt19937 rng(1);
  Net n(rng, false, 0, 0, 0, 5, 0, 0, 0, 1.f);
  std::vector<float> zero(5, 0.f), bias{0.7f};
  for (taps::ScorerHead* h : {&n.net.edge, &n.net.other}) h->fc2_weight = zero.data(), h->fc2_bias = bias.data();
  for (bool vectorized : {true, false}) {
    n.net.vectorized = vectorized;
    std::vector<float> edge(9), other(9), reach(9);
    taps::ScoreWorkspace ws;
    taps::score_edges_one(fx.tree(), &n.net, nullptr, nullptr, edge.data(), other.data(), reach.data(), ws);
    CHECK(edge[0] == 0.f && reach[0] == 0.f);
    for (int i = 0; i < 9; ++i) {
      if (i >= 7) {
        CHECK(edge[i] == kNegInf && other[i] == kNegInf && reach[i] == kNegInf);
        continue;
      }
      const int u = fx.parents[i];
      if (i > 0) {
        CHECK(near(edge[i], -std::log(kChildren[u] + 1.f), 1e-6f));
        CHECK(near(reach[i], reach[u] + edge[i], 0.f));
      }
      // childless nodes keep the whole mass, exactly (node 6 sits at depth D: no "other" logit at all)
      CHECK(kChildren[i] == 0 ? other[i] == 0.f : near(other[i], -std::log(kChildren[i] + 1.f), 1e-6f));
    }
  }
}

void test_marginal_model() {
  Fixture fx;
  std::vector<float> edge(9), other(9), reach(9);
  taps::ScoreWorkspace ws;
  taps::score_edges_one(fx.tree(), nullptr, nullptr, nullptr, edge.data(), other.data(), reach.data(), ws);
  for (int i = 0; i < 7; ++i) {
    CHECK(edge[i] == fx.step[i]);
    CHECK(reach[i] == fx.logq[i]);  // logq was built by the same sums along the path
  }
  CHECK(near(other[0], std::log(1.f - std::exp(-0.5f) - std::exp(-1.5f)), 1e-6f));
  CHECK(near(other[1], std::log(1.f - std::exp(-0.3f) - std::exp(-2.f) - std::exp(-2.5f)), 1e-6f));
  CHECK(other[2] == 0.f);
  for (int i = 7; i < 9; ++i) CHECK(edge[i] == kNegInf && other[i] == kNegInf && reach[i] == kNegInf);
}

// The AVX-512 fc1 / SiLU (when the CPU has them) against the plain loops, on awkward widths and on
// activations far into exp's overflow and underflow (fc1_scale 40).
void test_vector_path_matches_plain_loops() {
  if (!taps::rows_linear_vectorized()) {
    std::printf("score_edges: no AVX-512 here, vector path not tested\n");
    return;
  }
  Fixture fx;
  const int E = 23, H = 19, V = 6;
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> emb(size_t(V) * E), hidden(size_t(3) * H);
  for (auto& v : emb) v = normal(rng);
  for (auto& v : hidden) v = normal(rng);
  taps::TokenTable table;
  table.data = emb.data(), table.rows = V, table.width = E, table.row_stride = E, table.load_row = load_float_row;
  struct Shape { bool full; int Pt, Pd, Ph, M; float fc1_scale; };
  const Shape shapes[] = {{true, 32, 8, 32, 64, 0.1f}, {true, 7, 3, 5, 37, 0.3f}, {true, 2, 1, 1, 70, 0.3f},
                          {false, 0, 0, 0, 19, 1.f}, {true, 5, 4, 3, 17, 40.f}, {false, 0, 0, 0, 33, 40.f}};
  for (const Shape& s : shapes) {
    Net n(rng, s.full, s.Pt, s.Pd, s.Ph, s.M, E, H, 5, s.fc1_scale);
    std::vector<float> out[2][3];
    for (int path = 0; path < 2; ++path) {
      n.net.vectorized = path == 0;
      for (auto& o : out[path]) o.assign(9, 0.f);
      taps::ScoreWorkspace ws;
      taps::score_edges_one(fx.tree(), &n.net, &table, hidden.data(), out[path][0].data(), out[path][1].data(),
                            out[path][2].data(), ws);
    }
    for (int k = 0; k < 3; ++k)
      for (int i = 0; i < 9; ++i) {
        const float a = out[0][k][i], b = out[1][k][i];
        const bool ok = (std::isinf(a) && a == b) || near(a, b, 2e-5f * (1.f + std::fabs(b)));
        if (!ok) std::fprintf(stderr, "M=%d output %d node %d: vector %g, plain %g\n", s.M, k, i, a, b);
        CHECK(ok);
      }
  }
}

}  // namespace

int main() {
  test_equal_logits_give_uniform_siblings();
  test_marginal_model();
  test_vector_path_matches_plain_loops();
  std::printf("score_edges: %d failures\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
