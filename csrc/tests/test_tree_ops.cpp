// Unit tests of the C++ tree-op core (tree_ops.h), no Python and no torch: run by ctest.
// Expected values are worked out by hand or by brute force written here, never by calling the ops twice.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "check.h"
#include "tree_ops.h"

namespace {

#define CHECK_EQ(a, b)                                                                        \
  do {                                                                                        \
    const auto va = (a);                                                                      \
    const auto vb = (b);                                                                      \
    if (!(va == vb)) {                                                                        \
      std::fprintf(stderr, "%s:%d: CHECK_EQ failed: %s (%lld) != %s (%lld)\n", __FILE__, __LINE__, #a, \
                   static_cast<long long>(va), #b, static_cast<long long>(vb));               \
      ++g_failures;                                                                           \
    }                                                                                         \
  } while (0)

const float kNegInf = -std::numeric_limits<float>::infinity();

// A small tree given by its parent list (parents[0] = -1), depth derived.
struct Tree {
  std::vector<int32_t> parents, depth;
  std::vector<int64_t> tokens;
  explicit Tree(std::vector<int32_t> p) : parents(std::move(p)), depth(parents.size(), 0), tokens(parents.size(), 0) {
    for (size_t i = 1; i < parents.size(); ++i) {
      if (parents[i] >= 0) depth[i] = depth[parents[i]] + 1;
    }
  }
  int32_t n() const { return static_cast<int32_t>(parents.size()); }
};

void test_topk_row() {
  taps::TopKWorkspace ws;
  // Ties: equal values keep ascending token ids; K = V returns the full sorted row.
  const float x[] = {1.f, 3.f, 3.f, -2.f, 3.f, 0.5f, 1.f};
  float vals[7];
  int64_t ids[7];
  taps::topk_row(x, 7, 4, vals, ids, ws);
  const int64_t want_ids[] = {1, 2, 4, 0};
  for (int k = 0; k < 4; ++k) CHECK_EQ(ids[k], want_ids[k]);
  CHECK(vals[0] == 3.f && vals[3] == 1.f);
  taps::topk_row(x, 7, 7, vals, ids, ws);
  const int64_t all_ids[] = {1, 2, 4, 0, 6, 5, 3};
  for (int k = 0; k < 7; ++k) CHECK_EQ(ids[k], all_ids[k]);
  // -inf entries are ordinary values; the smallest ids win among them.
  const float y[] = {kNegInf, kNegInf, 0.f, kNegInf};
  taps::topk_row(y, 4, 3, vals, ids, ws);
  CHECK_EQ(ids[0], 2);
  CHECK_EQ(ids[1], 0);
  CHECK_EQ(ids[2], 1);
  // NaN first, in index order, as torch.sort(descending=True, stable=True) orders it.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float z[] = {1.f, nan, 5.f, nan, 2.f};
  taps::topk_row(z, 5, 3, vals, ids, ws);
  CHECK_EQ(ids[0], 1);
  CHECK_EQ(ids[1], 3);
  CHECK_EQ(ids[2], 2);
  taps::topk_row(z, 5, 1, vals, ids, ws);
  CHECK_EQ(ids[0], 1);
}

// Brute force: every prefix of the D x K lattice with its float32 mass accumulated from the root.
void enumerate_prefixes(const std::vector<float>& lp, int D, int K, int d, float acc,
                        std::vector<int>& ranks, std::vector<std::pair<float, std::vector<int>>>& out) {
  if (d == D) return;
  for (int r = 0; r < K; ++r) {
    const float s = acc + lp[d * K + r];
    ranks.push_back(r);
    out.emplace_back(s, ranks);
    enumerate_prefixes(lp, D, K, d + 1, s, ranks, out);
    ranks.pop_back();
  }
}

void test_best_first_pool_against_enumeration() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-6.f, 0.f);
  for (int trial = 0; trial < 30; ++trial) {
    const int D = 1 + trial % 4, K = 1 + (trial / 4) % 4;
    std::vector<float> lp(D * K);
    for (int d = 0; d < D; ++d) {
      for (int k = 0; k < K; ++k) lp[d * K + k] = uni(rng);
      std::sort(lp.begin() + d * K, lp.begin() + (d + 1) * K, std::greater<float>());
    }
    std::vector<int64_t> ids(D * K);
    for (int i = 0; i < D * K; ++i) ids[i] = 1000 + i;
    std::vector<std::pair<float, std::vector<int>>> all;
    std::vector<int> ranks;
    enumerate_prefixes(lp, D, K, 0, 0.f, ranks, all);
    std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    const int total = static_cast<int>(all.size());
    for (int pool : {1, 3, total / 2 + 1, total, total + 5}) {
      const int N = pool + 1;
      std::vector<int64_t> tokens(N);
      std::vector<int32_t> parents(N), depth(N), rank(N);
      std::vector<float> logq(N), step(N);
      taps::PoolWorkspace ws;
      const int32_t n = taps::best_first_pool_one(lp.data(), ids.data(), 77, D, K, pool, tokens.data(), parents.data(),
                                                  depth.data(), logq.data(), step.data(), rank.data(), ws);
      CHECK_EQ(n, std::min(pool, total) + 1);
      {
        // The record heap (used when packed keys do not fit) must give the very same pool.
        std::vector<int64_t> tokens2(N);
        std::vector<int32_t> parents2(N), depth2(N), rank2(N);
        std::vector<float> logq2(N), step2(N);
        CHECK_EQ(taps::best_first_pool_one(lp.data(), ids.data(), 77, D, K, pool, tokens2.data(), parents2.data(),
                                           depth2.data(), logq2.data(), step2.data(), rank2.data(), ws, false), n);
        CHECK(tokens2 == tokens && parents2 == parents && depth2 == depth && rank2 == rank);
        CHECK(std::memcmp(logq2.data(), logq.data(), sizeof(float) * N) == 0);
        CHECK(std::memcmp(step2.data(), step.data(), sizeof(float) * N) == 0);
      }
      CHECK_EQ(tokens[0], 77);
      CHECK_EQ(parents[0], -1);
      // Each node's rank path, rebuilt from parents.
      std::set<std::vector<int>> got;
      for (int i = 1; i < n; ++i) {
        CHECK(parents[i] >= 0 && parents[i] < i);
        CHECK_EQ(depth[i], depth[parents[i]] + 1);
        CHECK(logq[i] <= logq[i - 1] || i == 1);  // pop order is non-increasing
        CHECK_EQ(tokens[i], ids[(depth[i] - 1) * K + rank[i]]);
        std::vector<int> path;
        for (int j = i; j > 0; j = parents[j]) path.insert(path.begin(), rank[j]);
        got.insert(path);
      }
      for (int i = n; i < N; ++i) CHECK(parents[i] == -1 && logq[i] == kNegInf && rank[i] == -1);
      // Compare with the top prefixes when the boundary is not a tie.
      const int m = n - 1;
      if (m < total && all[m - 1].first == all[m].first) continue;
      std::set<std::vector<int>> want;
      for (int i = 0; i < m; ++i) want.insert(all[i].second);
      CHECK(got == want);
    }
  }
}

void test_best_first_pool_ties() {
  // All log-probs equal: priority falls to smaller parent index, then smaller rank.
  const int D = 2, K = 2;
  const std::vector<float> lp(D * K, 0.f);
  const std::vector<int64_t> ids = {10, 11, 20, 21};
  const int pool = 6;
  std::vector<int64_t> tokens(pool + 1);
  std::vector<int32_t> parents(pool + 1), depth(pool + 1), rank(pool + 1);
  std::vector<float> logq(pool + 1), step(pool + 1);
  taps::PoolWorkspace ws;
  for (bool packed : {true, false}) {
    taps::best_first_pool_one(lp.data(), ids.data(), 5, D, K, pool, tokens.data(), parents.data(), depth.data(),
                              logq.data(), step.data(), rank.data(), ws, packed);
    // pops: (0,r0)->1, (0,r1)->2, (1,r0)->3, (1,r1)->4, (2,r0)->5, (2,r1)->6
    const int32_t want_parent[] = {-1, 0, 0, 1, 1, 2, 2};
    const int32_t want_rank[] = {-1, 0, 1, 0, 1, 0, 1};
    const int64_t want_tok[] = {5, 10, 11, 20, 21, 20, 21};
    for (int i = 0; i <= pool; ++i) {
      CHECK_EQ(parents[i], want_parent[i]);
      CHECK_EQ(rank[i], want_rank[i]);
      CHECK_EQ(tokens[i], want_tok[i]);
    }
  }
}

void test_propagate_reach() {
  const int32_t parents[] = {-1, 0, 1, 0, -1};
  const float edge[] = {9.f, -1.f, -0.5f, -2.f, -3.f};
  float out[5];
  taps::propagate_reach_one(parents, edge, 5, out);
  CHECK(out[0] == 0.f && out[1] == -1.f && out[2] == -1.5f && out[3] == -2.f && out[4] == kNegInf);
}

std::vector<int64_t> select(const Tree& t, int32_t num_nodes, const std::vector<float>& lr, taps::SelectParams params) {
  std::vector<int64_t> out(params.max_nodes + 1, -7);
  taps::SelectWorkspace ws;
  const int32_t count = taps::select_subtree_one(t.parents.data(), t.depth.data(), num_nodes, lr.data(), params,
                                                 out.data(), ws);
  out.resize(static_cast<size_t>(count) + 1);
  return out;
}

void test_select_reach() {
  //        0
  //      1   2
  //     3 4   5
  Tree t({-1, 0, 0, 1, 1, 2});
  taps::SelectParams p;
  p.max_nodes = 3;
  std::vector<float> lr = {0.f, -0.1f, -0.5f, -0.3f, -2.f, -0.2f};
  // Child 5 claims more reach than its parent 2: its effective reach is capped at -0.5.
  CHECK(select(t, 6, lr, p) == (std::vector<int64_t>{0, 1, 2, 3}));
  p.max_nodes = 2;
  CHECK(select(t, 6, lr, p) == (std::vector<int64_t>{0, 1, 3}));
  // Ties go to the smaller index, so parents precede children.
  std::vector<float> flat(6, -1.f);
  flat[0] = 0.f;
  p.max_nodes = 3;
  CHECK(select(t, 6, flat, p) == (std::vector<int64_t>{0, 1, 2, 3}));
  // -0.0 and +0.0 are equal reaches: index order decides.
  std::vector<float> zeros = {0.f, 0.f, -0.f, 0.f, -0.f, 0.f};
  p.max_nodes = 2;
  CHECK(select(t, 6, zeros, p) == (std::vector<int64_t>{0, 1, 2}));
  // Fewer real nodes than the budget, and a root-only tree.
  p.max_nodes = 10;
  CHECK(select(t, 3, lr, p) == (std::vector<int64_t>{0, 1, 2}));
  CHECK(select(t, 1, lr, p) == (std::vector<int64_t>{0}));
}

void test_select_throughput() {
  Tree t({-1, 0, 1, 2, 3});
  const std::vector<float> lr = {0.f, std::log(0.9f), std::log(0.5f), std::log(0.1f), std::log(0.01f)};
  taps::SelectParams p;
  p.max_nodes = 4;
  // tau(n) = 1, 1.9, 2.4, 2.5, 2.51 over latency 1, 1.1, 1.2, 1.3, 1.4 -> ratios .909 1.727 2.0 1.923 1.79: n* = 2.
  const double latency[] = {1.0, 1.1, 1.2, 1.3, 1.4};
  p.latency = latency;
  p.latency_len = 5;
  p.t0 = 0.0;
  CHECK(select(t, 5, lr, p) == (std::vector<int64_t>{0, 1, 2}));
  // The table caps the size: only n <= latency_len - 1 is considered.
  p.latency_len = 2;
  CHECK(select(t, 5, lr, p) == (std::vector<int64_t>{0, 1}));
  // A big fixed cost favours the largest tree.
  p.latency_len = 5;
  p.t0 = 100.0;
  CHECK(select(t, 5, lr, p) == (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // Equal ratios: the first (smallest) n wins.
  const double flat_latency[] = {1.0, 1.0, 1.0};
  const std::vector<float> zero = {0.f, kNegInf, kNegInf, kNegInf, kNegInf};
  p.latency = flat_latency;
  p.latency_len = 3;
  p.t0 = 0.0;
  CHECK(select(t, 5, zero, p) == (std::vector<int64_t>{0}));
}

// The batch rule on B rows of N nodes; reach = exp of the key (values chosen so that libm's exp is exact).
struct Joint {
  std::vector<std::vector<int64_t>> kept;
  std::vector<int32_t> sizes;
  std::vector<float> expected;
};
Joint select_joint(const std::vector<float>& lr, const std::vector<int32_t>& num_nodes, int32_t N,
                   const std::vector<double>& table, int32_t max_nodes, double plain_seconds, int64_t rows,
                   std::vector<double> reach = {}) {
  const int64_t B = static_cast<int64_t>(num_nodes.size());
  if (reach.empty()) {
    for (float v : lr) reach.push_back(std::exp(static_cast<double>(v)));
  }
  taps::ThroughputParams p;
  p.max_nodes = max_nodes;
  p.table = table.data();
  p.table_len = static_cast<int32_t>(table.size());
  p.plain_seconds = plain_seconds;
  p.rows = rows;
  std::vector<int64_t> pool_index(static_cast<size_t>(B * (max_nodes + 1)), -7);
  Joint out{{}, std::vector<int32_t>(B, -7), std::vector<float>(B, -7.f)};
  taps::ThroughputWorkspace ws;
  taps::select_throughput_batch(lr.data(), reach.data(), num_nodes.data(), B, N, p, pool_index.data(),
                                out.sizes.data(), out.expected.data(), ws);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = pool_index.data() + b * (max_nodes + 1);
    out.kept.emplace_back(row, row + out.sizes[b] + 1);
    for (int32_t k = out.sizes[b] + 1; k <= max_nodes; ++k) CHECK(row[k] == -1);
  }
  return out;
}

void test_select_throughput_batch() {
  // Two rows of five children of the root, every reach 1; rate rows / plain_seconds = 1.
  const std::vector<float> ones(12, 0.f);
  // Each node costs exactly what it brings: all sizes tie at gain 0, the smallest (empty) batch tree wins.
  std::vector<double> linear;
  for (int k = 0; k <= 10; ++k) linear.push_back(k);
  Joint j = select_joint(ones, {6, 6}, 6, linear, 5, 1.0, 1);
  CHECK(j.sizes == (std::vector<int32_t>{0, 0}) && j.expected == (std::vector<float>{1.f, 1.f}));
  // Three free nodes: equal reaches go to the lower row, within it to the lower indices.
  const std::vector<double> three = {0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9};
  j = select_joint(ones, {6, 6}, 6, three, 5, 1.0, 1);
  CHECK(j.kept[0] == (std::vector<int64_t>{0, 1, 2, 3}) && j.kept[1] == (std::vector<int64_t>{0}));
  CHECK(j.expected == (std::vector<float>{4.f, 1.f}));
  // A short table caps the batch: K = table_len - 1 = 2 nodes in total.
  j = select_joint(ones, {6, 6}, 6, {0, 0, 0}, 5, 1.0, 1);
  CHECK(j.sizes == (std::vector<int32_t>{2, 0}));
  // Padding (index >= num_nodes) and -inf nodes are never written, even when a table that gets cheaper makes
  // "keeping" them pay; the per-row cap is min(max_nodes, N - 1).
  std::vector<float> lr(12, 0.f);
  lr[2] = kNegInf;
  j = select_joint(lr, {4, 2}, 6, {0, 1, 1, 1, 1, 1, 1, 1, 1, 1, -5}, 5, 1.0, 1);
  CHECK(j.kept[0] == (std::vector<int64_t>{0, 1, 3}) && j.kept[1] == (std::vector<int64_t>{0, 1}));
  CHECK(j.expected == (std::vector<float>{3.f, 2.f}));
  // max_nodes = 0: root only.
  j = select_joint(ones, {6, 6}, 6, three, 0, 1.0, 1);
  CHECK(j.sizes == (std::vector<int32_t>{0, 0}) && j.kept[1] == (std::vector<int64_t>{0}));
  // An exp that is not monotone (reach given here): row 0's second-ranked node has the larger reach. The merged
  // order is still by reach (the reference's sort), and row 0 is credited that reach though it keeps its
  // first-ranked node: merged (0.5 row 0, 0.375 row 1, ...), two nodes pay for themselves.
  j = select_joint({0.f, -1.f, -2.f, 0.f, -1.f, -3.f}, {3, 3}, 3, {0, 0, 0, 10, 10}, 2, 1.0, 1,
                   {1.0, 0.25, 0.5, 1.0, 0.375, 0.125});
  CHECK(j.kept[0] == (std::vector<int64_t>{0, 1}) && j.kept[1] == (std::vector<int64_t>{0, 1}));
  CHECK(j.expected == (std::vector<float>{1.5f, 1.375f}));
}

void test_select_utility() {
  //        0
  //      1   2
  //      |   |
  //      3   4
  Tree t({-1, 0, 0, 1, 2});
  taps::SelectParams p;
  p.rule = taps::Rule::kUtility;
  p.lambda_node = 1.0;
  p.lambda_depth = 0.0;
  p.max_nodes = 2;
  // Node 3 has the highest utility but needs 1 as well; node 4 next, needs 2 which no longer fits.
  std::vector<float> lr = {0.f, std::log(0.1f), std::log(0.3f), std::log(0.9f), std::log(0.5f)};
  CHECK(select(t, 5, lr, p) == (std::vector<int64_t>{0, 1, 3}));
  // Budget 1: node 3 (needs 2 slots) is skipped, 4 too, 2 fits.
  p.max_nodes = 1;
  CHECK(select(t, 5, lr, p) == (std::vector<int64_t>{0, 2}));
  // The threshold stops the walk.
  p.max_nodes = 4;
  p.min_utility = 0.6;
  CHECK(select(t, 5, lr, p) == (std::vector<int64_t>{0, 1, 3}));
  p.min_utility = 0.95;
  CHECK(select(t, 5, lr, p) == (std::vector<int64_t>{0}));
}

void test_reindex_subtree() {
  //      0
  //    1   2
  //    3   4
  Tree t({-1, 0, 0, 1, 2});
  t.tokens = {10, 11, 12, 13, 14};
  const int64_t keep[] = {0, 2, 3, 4, -1};  // 3 is kept without its parent 1
  int64_t tok[5];
  int32_t par[5], dep[5], scratch[5];
  taps::reindex_subtree_one(t.tokens.data(), t.parents.data(), t.depth.data(), 5, keep, 5, tok, par, dep, scratch);
  const int64_t want_tok[] = {10, 12, 13, 14, 0};
  const int32_t want_par[] = {-1, 0, -1, 1, -1};
  const int32_t want_dep[] = {0, 1, 2, 2, 0};
  for (int k = 0; k < 5; ++k) {
    CHECK_EQ(tok[k], want_tok[k]);
    CHECK_EQ(par[k], want_par[k]);
    CHECK_EQ(dep[k], want_dep[k]);
  }
}

void test_tree_mask() {
  // The example of taps_kernels/layout.py: 0 -> 1 -> 3 and 0 -> 2.
  Tree t({-1, 0, 0, 1});
  int64_t pos[4];
  int32_t bits[4];
  taps::tree_mask_one(t.parents.data(), t.depth.data(), 4, 4, 10, pos, bits);
  CHECK(bits[0] == 0b0001 && bits[1] == 0b0011 && bits[2] == 0b0101 && bits[3] == 0b1011);
  CHECK(pos[0] == 10 && pos[1] == 11 && pos[2] == 11 && pos[3] == 12);
  // A 34-node chain: bit 31 is the sign bit of word 0, node 32 lives in word 1; the last row is padding.
  std::vector<int32_t> chain(34);
  for (int i = 0; i < 34; ++i) chain[i] = i - 1;
  chain[33] = -1;
  Tree c(chain);
  std::vector<int64_t> cpos(34);
  std::vector<int32_t> cbits(34 * 2);
  taps::tree_mask_one(c.parents.data(), c.depth.data(), 33, 34, 0, cpos.data(), cbits.data());
  CHECK_EQ(cbits[31 * 2], static_cast<int32_t>(0xFFFFFFFFu));
  CHECK_EQ(cbits[31 * 2 + 1], 0);
  CHECK_EQ(cbits[32 * 2], static_cast<int32_t>(0xFFFFFFFFu));
  CHECK_EQ(cbits[32 * 2 + 1], 1);
  CHECK_EQ(cbits[33 * 2], 0);
  CHECK_EQ(cbits[33 * 2 + 1], 2);
  CHECK_EQ(cpos[33], 0);
}

void test_accept_greedy() {
  //        0(5)
  //    1(7)  2(7)  3(8)
  //    4(9)        5(9)
  Tree t({-1, 0, 0, 0, 1, 3});
  t.tokens = {5, 7, 7, 8, 9, 9};
  taps::AcceptWorkspace ws;
  int64_t path[4], next = -1;
  // Two children carry 7: the smaller index (1) wins, then 4, then no child of 4.
  std::vector<int64_t> target = {7, 9, 0, 9, 42, 0};
  CHECK_EQ(taps::accept_greedy_one(t.tokens.data(), t.parents.data(), 6, target.data(), 4, path, &next, ws), 3);
  CHECK(path[0] == 0 && path[1] == 1 && path[2] == 4 && path[3] == -1);
  CHECK_EQ(next, 42);
  // path_len caps the walk.
  CHECK_EQ(taps::accept_greedy_one(t.tokens.data(), t.parents.data(), 6, target.data(), 2, path, &next, ws), 2);
  CHECK_EQ(next, 9);
  // Nothing matches: only the root.
  target[0] = 3;
  CHECK_EQ(taps::accept_greedy_one(t.tokens.data(), t.parents.data(), 6, target.data(), 4, path, &next, ws), 1);
  CHECK_EQ(next, 3);
  // A padding node (5 beyond num_nodes) is never entered.
  target = {8, 0, 0, 9, 0, 0};
  CHECK_EQ(taps::accept_greedy_one(t.tokens.data(), t.parents.data(), 5, target.data(), 4, path, &next, ws), 2);
  CHECK_EQ(next, 9);
}

void test_compact_kv() {
  // [B=2, H=2, L=8, Dh=3] float, row value = 100*b + 10*h + l (+ d/10).
  const int64_t B = 2, H = 2, L = 8, Dh = 3;
  std::vector<float> cache(B * H * L * Dh);
  auto at = [&](int64_t b, int64_t h, int64_t l, int64_t d) -> float& { return cache[((b * H + h) * L + l) * Dh + d]; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t d = 0; d < Dh; ++d) at(b, h, l, d) = 100.f * b + 10.f * h + l + 0.1f * d;
  const std::vector<float> before = cache;
  const int64_t prefix[] = {1, 3};
  const int64_t path[] = {0, 2, 3, 5, 0, 1, -1, -1};  // overlapping: row 1+2 -> 1+1, 1+3 -> 1+2, 1+5 -> 1+3
  CHECK_EQ(taps::check_compact_path(path, B, 4, prefix, L), -1);
  taps::KVView v{reinterpret_cast<char*>(cache.data()), sizeof(float), B, H, L, Dh, H * L * Dh, L * Dh, Dh, 1};
  taps::compact_kv_row(v, 0, prefix[0], path, 4);
  taps::compact_kv_row(v, 1, prefix[1], path + 4, 2);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < Dh; ++d) {
      CHECK(at(0, h, 1, d) == before[((0 * H + h) * L + 1) * Dh + d]);
      CHECK(at(0, h, 2, d) == before[((0 * H + h) * L + 3) * Dh + d]);
      CHECK(at(0, h, 3, d) == before[((0 * H + h) * L + 4) * Dh + d]);
      CHECK(at(0, h, 4, d) == before[((0 * H + h) * L + 6) * Dh + d]);
      CHECK(at(0, h, 0, d) == before[((0 * H + h) * L + 0) * Dh + d]);  // prefix untouched
      for (int64_t l = 0; l < L; ++l) CHECK(at(1, h, l, d) == before[((1 * H + h) * L + l) * Dh + d]);
    }
  // Bad paths are reported at the first offending entry.
  const int64_t gap[] = {0, -1, 2, -1, 0, 1, -1, -1};
  CHECK_EQ(taps::check_compact_path(gap, B, 4, prefix, L), 2);
  const int64_t down[] = {0, 2, 1, -1, 0, -1, -1, -1};
  CHECK_EQ(taps::check_compact_path(down, B, 4, prefix, L), 2);
  const int64_t far[] = {0, 1, -1, -1, 0, 5, -1, -1};  // 3 + 5 = 8 = L
  CHECK_EQ(taps::check_compact_path(far, B, 4, prefix, L), 5);
  const int64_t neg[] = {0, -2, -1, -1, 0, -1, -1, -1};
  CHECK_EQ(taps::check_compact_path(neg, B, 4, prefix, L), 1);
  // prefix + node past INT64_MAX must not wrap into the cache (3 + (2^63 - 2) wraps to a small negative).
  const int64_t wrap[] = {0, -1, -1, -1, 0, INT64_MAX - 1, -1, -1};
  CHECK_EQ(taps::check_compact_path(wrap, B, 4, prefix, L), 5);
  const int64_t huge_prefix[] = {INT64_MAX, 3};
  CHECK_EQ(taps::check_compact_path(path, B, 4, huge_prefix, L), 0);
}

void test_validate_tree() {
  // B=2, N=4; row 1 has 3 real nodes.
  std::vector<int64_t> tokens = {1, 2, 3, 4, 5, 6, 7, 0};
  std::vector<int32_t> parents = {-1, 0, 1, 0, -1, 0, 0, -1};
  std::vector<int32_t> depth = {0, 1, 2, 1, 0, 1, 1, 0};
  std::vector<int32_t> num_nodes = {4, 3};
  auto run = [&](int64_t vocab) {
    return taps::validate_tree(tokens.data(), parents.data(), depth.data(), num_nodes.data(), 2, 4, vocab);
  };
  CHECK(run(8).kind == taps::TreeFault::kOk);
  CHECK(run(-1).kind == taps::TreeFault::kOk);
  auto expect = [&](taps::TreeFault kind, int64_t b, int64_t i, int64_t vocab) {
    const taps::TreeCheck c = run(vocab);
    CHECK(c.kind == kind);
    CHECK_EQ(c.b, b);
    if (i >= 0) CHECK_EQ(c.i, i);
  };
  expect(taps::TreeFault::kToken, 0, 3, 4);  // token 4 outside [0, 4)
  num_nodes[1] = 5;
  expect(taps::TreeFault::kNumNodes, 1, -1, 8);
  num_nodes[1] = 3;
  parents[2] = 2;  // not smaller than the child
  expect(taps::TreeFault::kParent, 0, 2, 8);
  parents[2] = 1;
  parents[4] = 0;  // root of row 1
  expect(taps::TreeFault::kRootParent, 1, 0, 8);
  parents[4] = -1;
  parents[7] = 2;  // padding
  expect(taps::TreeFault::kPaddingParent, 1, 3, 8);
  parents[7] = -1;
  depth[6] = 2;
  expect(taps::TreeFault::kDepth, 1, 2, 8);
  depth[6] = 1;
  depth[4] = 1;  // a root of depth 1 is inconsistent too
  expect(taps::TreeFault::kDepth, 1, 0, 8);
}

}  // namespace

int main() {
  test_topk_row();
  test_best_first_pool_against_enumeration();
  test_best_first_pool_ties();
  test_propagate_reach();
  test_select_reach();
  test_select_throughput();
  test_select_throughput_batch();
  test_select_utility();
  test_reindex_subtree();
  test_tree_mask();
  test_accept_greedy();
  test_compact_kv();
  test_validate_tree();
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("all tree_ops checks passed\n");
  return 0;
}
