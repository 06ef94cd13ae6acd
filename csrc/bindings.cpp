// taps_kernels._C: torch bindings of the C++ tree ops (tree_ops.h) on CPU tensors.
//
// Each op takes the arguments of its reference in taps_kernels/reference (after the public op in
// taps_kernels/ops has validated them), re-checks what it relies on for memory safety (device, dtype,
// shape; errors name the argument, the expectation and what arrived), releases the GIL and loops over
// the batch with at::parallel_for. Per-thread workspaces are reused across calls, so a call allocates
// only its output tensors. The time_* functions loop a kernel inside C++ (outputs preallocated once) so
// a benchmark can separate the kernel from Python and validation overhead.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bind_common.h"
#include "gguf_bindings.h"
#include "lookup_bindings.h"
#include "rows_linear.h"
#include "score_bindings.h"
#include "torch_checks.h"
#include "topk_stats.h"
#include "tree_ops.h"

namespace py = pybind11;

namespace {

using namespace taps_bind;  // check_arg, shape_str, the value checks, for_batch, seconds_per_iter


// ------------------------------------------------------------------------------------------------ top-K
std::vector<at::Tensor> topk_stats(const at::Tensor& draft_logits, int64_t top_k) {
  check_arg(draft_logits, "draft_logits", {at::kFloat, at::kHalf, at::kBFloat16}, {-1, -1, -1});
  check_count("top_k", top_k, 1);
  const int64_t B = draft_logits.size(0), D = draft_logits.size(1), V = draft_logits.size(2);
  if (V < 1) throw py::value_error("draft_logits: expected a vocabulary of at least 1, received shape " +
                                   shape_str(draft_logits.sizes()));
  if (B < 1 || D < 1) throw py::value_error("draft_logits: expected at least one batch row and one draft position, "
                                            "received shape " + shape_str(draft_logits.sizes()));
  const int32_t K = static_cast<int32_t>(std::min<int64_t>(top_k, V));
  const int32_t K2 = static_cast<int32_t>(std::min<int64_t>(std::max<int32_t>(K, 2), V));  // margin needs two
  const at::Tensor x = draft_logits.to(at::kFloat).contiguous();
  at::Tensor vals = at::empty({B, D, K2}, x.options());
  at::Tensor ids = at::empty({B, D, K2}, x.options().dtype(at::kLong));
  at::Tensor entropy = at::empty({B, D}, x.options());
  at::Tensor margin = at::zeros({B, D}, x.options());
  at::Tensor topk_mass = at::empty({B, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float *vp = vals.data_ptr<float>(), *ep = entropy.data_ptr<float>(), *mp = margin.data_ptr<float>();
  float* sp = topk_mass.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  std::atomic<int64_t> first_bad{B * D};
  {
    py::gil_scoped_release no_gil;
    at::parallel_for(0, B * D, 1, [&](int64_t begin, int64_t end) {
      thread_local taps::TopKStatsWorkspace ws;
      for (int64_t r = begin; r < end; ++r) {
        float* v = vp + r * K2;
        if (!taps::topk_stats_row(xp + r * V, V, K2, v, ip + r * K2, ep + r, ws)) {
          for (int64_t seen = first_bad.load(); r < seen && !first_bad.compare_exchange_weak(seen, r);) {}
          continue;
        }
        // the logits' own difference: the log-probs' shared lse cancels exactly
        if (V > 1) mp[r] = xp[r * V + ip[r * K2]] - xp[r * V + ip[r * K2 + 1]];
        if (std::isinf(mp[r])) mp[r] = 0.0f;  // no possible runner-up: 0, as for V = 1
        double mass = 0.0;
        for (int32_t k = 0; k < K; ++k) mass += std::exp(static_cast<double>(v[k]));
        sp[r] = static_cast<float>(mass);
      }
    });
  }
  if (const int64_t r = first_bad.load(); r < B * D) {
    throw py::value_error("draft_logits[" + std::to_string(r / D) + "," + std::to_string(r % D) +
                          "]: a NaN or +inf logit, or every logit -inf; expected finite logits or -inf (an "
                          "impossible token) with at least one possible token per position");
  }
  if (K2 == K) return {vals, ids, entropy, margin, topk_mass};
  return {vals.narrow(2, 0, K).contiguous(), ids.narrow(2, 0, K).contiguous(), entropy, margin, topk_mass};
}

// ------------------------------------------------------------------------------------------------ argmax
at::Tensor argmax_rows(const at::Tensor& logits_in) {
  check_arg(logits_in, "logits", {at::kFloat}, {-1, -1});
  const int64_t R = logits_in.size(0), V = logits_in.size(1);
  if (V < 1) throw py::value_error("logits: expected at least one column, received shape " + shape_str(logits_in.sizes()));
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor out = at::empty({R}, at::kLong);
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  py::gil_scoped_release no_gil;
  for_batch(R, V, [&](int64_t r) { o[r] = taps::argmax_row(x + r * V, V); });
  return out;
}

// ------------------------------------------------------------------------------------------ best-first pool
struct PoolArgs {
  int64_t B;
  int32_t D, K, pool_size;
};

PoolArgs check_pool_args(const at::Tensor& topk_logp, const at::Tensor& topk_ids, const at::Tensor& root_tokens,
                         int64_t pool_size) {
  check_arg(topk_logp, "topk_logp", {at::kFloat}, {-1, -1, -1});
  const int64_t B = topk_logp.size(0);
  check_arg(topk_ids, "topk_ids", {at::kLong}, {B, topk_logp.size(1), topk_logp.size(2)});
  check_arg(root_tokens, "root_tokens", {at::kLong}, {B});
  const PoolArgs a{B, check_count("topk_logp.shape[1]", topk_logp.size(1), 0),
                   check_count("topk_logp.shape[2]", topk_logp.size(2), 0), check_count("pool_size", pool_size, 1)};
  check_log_values(topk_logp.contiguous(), "topk_logp");
  const at::Tensor ids = topk_ids.contiguous(), roots = root_tokens.contiguous();
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{ids, "topk_ids"}, {roots, "root_tokens"}}) {
    const int64_t* v = t.data_ptr<int64_t>();
    for (int64_t k = 0; k < t.numel(); ++k) {
      if (v[k] < 0) {
        throw py::value_error(std::string(name) + index_str(k, t.sizes()) + ": expected a token id >= 0, received " +
                              std::to_string(v[k]));
      }
    }
  }
  return a;
}

void run_pool(const PoolArgs& a, const float* lp, const int64_t* ids, const int64_t* roots, int64_t* tokens,
              int32_t* parents, int32_t* depth, int32_t* num_nodes, float* logq, float* step_logq, int32_t* rank) {
  const int64_t N = a.pool_size + 1;
  const int64_t lattice = static_cast<int64_t>(a.D) * a.K;
  for_batch(a.B, N * 8, [&](int64_t b) {
    thread_local taps::PoolWorkspace ws;
    num_nodes[b] = taps::best_first_pool_one(lp + b * lattice, ids + b * lattice, roots[b], a.D, a.K, a.pool_size,
                                             tokens + b * N, parents + b * N, depth + b * N, logq + b * N,
                                             step_logq + b * N, rank + b * N, ws);
  });
}

struct PoolOut {
  at::Tensor tokens, parents, depth, num_nodes, logq, step_logq, rank;
  PoolOut(int64_t B, int64_t N)
      : tokens(at::empty({B, N}, at::kLong)),
        parents(at::empty({B, N}, at::kInt)),
        depth(at::empty({B, N}, at::kInt)),
        num_nodes(at::empty({B}, at::kInt)),
        logq(at::empty({B, N}, at::kFloat)),
        step_logq(at::empty({B, N}, at::kFloat)),
        rank(at::empty({B, N}, at::kInt)) {}
};

std::vector<at::Tensor> best_first_pool(const at::Tensor& topk_logp, const at::Tensor& topk_ids,
                                        const at::Tensor& root_tokens, int64_t pool_size) {
  const PoolArgs a = check_pool_args(topk_logp, topk_ids, root_tokens, pool_size);
  const at::Tensor lp = topk_logp.contiguous(), ids = topk_ids.contiguous(), roots = root_tokens.contiguous();
  py::gil_scoped_release no_gil;
  PoolOut o(a.B, a.pool_size + 1);
  run_pool(a, lp.data_ptr<float>(), ids.data_ptr<int64_t>(), roots.data_ptr<int64_t>(), o.tokens.data_ptr<int64_t>(),
           o.parents.data_ptr<int32_t>(), o.depth.data_ptr<int32_t>(), o.num_nodes.data_ptr<int32_t>(),
           o.logq.data_ptr<float>(), o.step_logq.data_ptr<float>(), o.rank.data_ptr<int32_t>());
  return {o.tokens, o.parents, o.depth, o.num_nodes, o.logq, o.step_logq, o.rank};
}

std::pair<double, double> time_best_first_pool(const at::Tensor& topk_logp, const at::Tensor& topk_ids, const at::Tensor& root_tokens,
                            int64_t pool_size, int64_t iters) {
  const PoolArgs a = check_pool_args(topk_logp, topk_ids, root_tokens, pool_size);
  check_iters(iters);
  const at::Tensor lp = topk_logp.contiguous(), ids = topk_ids.contiguous(), roots = root_tokens.contiguous();
  py::gil_scoped_release no_gil;
  PoolOut o(a.B, a.pool_size + 1);
  return seconds_per_iter(iters, [&] {
    run_pool(a, lp.data_ptr<float>(), ids.data_ptr<int64_t>(), roots.data_ptr<int64_t>(),
             o.tokens.data_ptr<int64_t>(), o.parents.data_ptr<int32_t>(), o.depth.data_ptr<int32_t>(),
             o.num_nodes.data_ptr<int32_t>(), o.logq.data_ptr<float>(), o.step_logq.data_ptr<float>(),
             o.rank.data_ptr<int32_t>());
  });
}

// ------------------------------------------------------------------------------------------ propagate reach
at::Tensor propagate_reach(const at::Tensor& parents_in, const at::Tensor& edge_logq_in) {
  check_arg(parents_in, "parents", {at::kInt}, {-1, -1});
  const int64_t B = parents_in.size(0), N = parents_in.size(1);
  check_arg(edge_logq_in, "edge_logq", {at::kFloat}, {B, N});
  if (N < 1) throw py::value_error("parents: expected at least one node, received shape " + shape_str(parents_in.sizes()));
  const at::Tensor parents = parents_in.contiguous(), edge = edge_logq_in.contiguous();
  check_parent_range(parents, "parents");
  check_log_values(edge, "edge_logq", &parents);
  py::gil_scoped_release no_gil;
  at::Tensor out = at::empty({B, N}, at::kFloat);
  const int32_t* p = parents.data_ptr<int32_t>();
  const float* e = edge.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for_batch(B, N, [&](int64_t b) { taps::propagate_reach_one(p + b * N, e + b * N, static_cast<int32_t>(N), o + b * N); });
  return out;
}

// ------------------------------------------------------------------------------------------------- trees
struct TreeArgs {
  at::Tensor parents, depth, num_nodes;
  int64_t B, N;
};

// Checks tensors and the structure the walks index with (num_nodes range, parent < child); the full
// check with the public op's messages is taps_kernels.layout.validate_tree.
// ``depth`` may be undefined for ops that do not read it.
TreeArgs check_tree(const at::Tensor& parents, const at::Tensor& depth, const at::Tensor& num_nodes) {
  check_arg(parents, "tree.parents", {at::kInt}, {-1, -1});
  const int64_t B = parents.size(0), N = parents.size(1);
  if (N < 1) throw py::value_error("tree.parents: expected at least one node, received shape " + shape_str(parents.sizes()));
  check_count("tree.parents.shape[1]", N, 1);
  if (depth.defined()) check_arg(depth, "tree.depth", {at::kInt}, {B, N});
  check_arg(num_nodes, "tree.num_nodes", {at::kInt}, {B});
  TreeArgs t{parents.contiguous(), depth.defined() ? depth.contiguous() : at::Tensor(), num_nodes.contiguous(), B, N};
  const int32_t* nn = t.num_nodes.data_ptr<int32_t>();
  const int32_t* p = t.parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    if (nn[b] < 1 || nn[b] > N) {
      throw py::value_error("tree.num_nodes[" + std::to_string(b) + "]: expected a value in [1, " + std::to_string(N) +
                            "], received " + std::to_string(nn[b]));
    }
    for (int64_t i = 1; i < nn[b]; ++i) {
      const int32_t v = p[b * N + i];
      if (v < 0 || v >= i) {
        throw py::value_error("tree.parents[" + std::to_string(b) + "," + std::to_string(i) + "]: parent index " +
                              std::to_string(v) + " is out of range or not smaller than the child's index; expected "
                              "0 <= parent < " + std::to_string(i));
      }
    }
  }
  return t;
}

// --------------------------------------------------------------------------------------------- selection
struct SelectArgs {
  TreeArgs tree;
  at::Tensor log_reach, latency;
  taps::SelectParams params;
};

SelectArgs check_select(const at::Tensor& parents, const at::Tensor& depth, const at::Tensor& num_nodes,
                        const at::Tensor& log_reach, int64_t max_nodes, const std::optional<at::Tensor>& latency,
                        double t0, const std::string& rule, double lambda_node, double lambda_depth,
                        double min_utility) {
  SelectArgs s{check_tree(parents, depth, num_nodes), at::Tensor(), at::Tensor(), taps::SelectParams()};
  check_arg(log_reach, "log_reach", {at::kFloat}, {s.tree.B, s.tree.N});
  s.log_reach = log_reach.contiguous();
  check_log_values(s.log_reach, "log_reach", &s.tree.parents);
  s.params.max_nodes = check_count("max_nodes", max_nodes, 1);
  if (rule == "reach") {
    s.params.rule = taps::Rule::kReach;
  } else if (rule == "utility") {
    s.params.rule = taps::Rule::kUtility;
  } else {
    throw py::value_error("rule: expected 'reach' or 'utility', received '" + rule + "'");
  }
  if (latency.has_value() && latency->defined()) {
    check_arg(*latency, "latency", {at::kDouble, at::kFloat}, {-1});
    if (latency->size(0) < 1) throw py::value_error("latency: expected a non-empty 1-D table, received shape (0,)");
    if (s.params.rule != taps::Rule::kReach) throw py::value_error("latency: the throughput rule needs rule='reach'");
    s.latency = latency->to(at::kDouble).contiguous();
    s.params.latency = s.latency.data_ptr<double>();
    s.params.latency_len = check_count("latency.shape[0]", s.latency.size(0), 1);
  }
  s.params.t0 = check_real("t0", t0);
  for (int64_t n = 0; n < s.params.latency_len; ++n) {
    const double l = s.params.latency[n];
    if (!std::isfinite(l) || !(t0 + l > 0)) {
      throw py::value_error("latency[" + std::to_string(n) + "]: expected finite seconds with t0 + latency[n] > 0, "
                            "received " + float_str(l) + " (t0=" + float_str(t0) + ")");
    }
  }
  s.params.lambda_node = check_real("lambda_node", lambda_node);
  if (!(lambda_node > 0)) throw py::value_error("lambda_node: expected a float > 0.0, received " + float_str(lambda_node));
  s.params.lambda_depth = check_real("lambda_depth", lambda_depth);
  if (!(lambda_depth >= 0)) {
    throw py::value_error("lambda_depth: expected a float >= 0.0, received " + float_str(lambda_depth));
  }
  s.params.min_utility = check_real("min_utility", min_utility, /*finite=*/false);
  return s;
}

void run_select(const SelectArgs& s, int64_t* pool_index, int32_t* num_selected) {
  const int64_t N = s.tree.N, M = s.params.max_nodes + 1;
  const int32_t* p = s.tree.parents.data_ptr<int32_t>();
  const int32_t* d = s.tree.depth.data_ptr<int32_t>();
  const int32_t* nn = s.tree.num_nodes.data_ptr<int32_t>();
  const float* lr = s.log_reach.data_ptr<float>();
  for_batch(s.tree.B, N * 4, [&](int64_t b) {
    thread_local taps::SelectWorkspace ws;
    num_selected[b] = taps::select_subtree_one(p + b * N, d + b * N, nn[b], lr + b * N, s.params, pool_index + b * M, ws);
  });
}

std::vector<at::Tensor> select_subtree(const at::Tensor& parents, const at::Tensor& depth, const at::Tensor& num_nodes,
                                       const at::Tensor& log_reach, int64_t max_nodes,
                                       const std::optional<at::Tensor>& latency, double t0, const std::string& rule,
                                       double lambda_node, double lambda_depth, double min_utility) {
  const SelectArgs s = check_select(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node,
                                    lambda_depth, min_utility);
  py::gil_scoped_release no_gil;
  at::Tensor pool_index = at::empty({s.tree.B, max_nodes + 1}, at::kLong);
  at::Tensor num_selected = at::empty({s.tree.B}, at::kInt);
  run_select(s, pool_index.data_ptr<int64_t>(), num_selected.data_ptr<int32_t>());
  return {pool_index, num_selected};
}

std::pair<double, double> time_select_subtree(const at::Tensor& parents, const at::Tensor& depth, const at::Tensor& num_nodes,
                           const at::Tensor& log_reach, int64_t max_nodes, const std::optional<at::Tensor>& latency,
                           double t0, const std::string& rule, double lambda_node, double lambda_depth,
                           double min_utility, int64_t iters) {
  const SelectArgs s = check_select(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node,
                                    lambda_depth, min_utility);
  check_iters(iters);
  py::gil_scoped_release no_gil;
  at::Tensor pool_index = at::empty({s.tree.B, max_nodes + 1}, at::kLong);
  at::Tensor num_selected = at::empty({s.tree.B}, at::kInt);
  return seconds_per_iter(iters, [&] { run_select(s, pool_index.data_ptr<int64_t>(), num_selected.data_ptr<int32_t>()); });
}

// ------------------------------------------------------------------------------------ batch throughput rule
struct ThroughputArgs {
  TreeArgs tree;
  at::Tensor log_reach, table;
  taps::ThroughputParams params;
};

ThroughputArgs check_throughput(const at::Tensor& parents, const at::Tensor& depth, const at::Tensor& num_nodes,
                                const at::Tensor& log_reach, int64_t max_nodes, const at::Tensor& table,
                                double plain_seconds, int64_t rows) {
  ThroughputArgs s{check_tree(parents, depth, num_nodes), at::Tensor(), at::Tensor(), taps::ThroughputParams()};
  check_arg(log_reach, "log_reach", {at::kFloat}, {s.tree.B, s.tree.N});
  s.log_reach = log_reach.contiguous();
  // Real non-root nodes only: the root column and padding are not read.
  const float* lr = s.log_reach.data_ptr<float>();
  const int32_t* nn = s.tree.num_nodes.data_ptr<int32_t>();
  for (int64_t b = 0; b < s.tree.B; ++b) {
    for (int64_t i = 1; i < nn[b]; ++i) {
      const float v = lr[b * s.tree.N + i];
      if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) {
        throw py::value_error("log_reach[" + std::to_string(b) + "," + std::to_string(i) +
                              "]: expected a log reach (finite or -inf), received " + float_str(v));
      }
    }
  }
  s.params.max_nodes = check_count("max_nodes", max_nodes, 0);
  check_arg(table, "table", {at::kDouble, at::kFloat}, {-1});
  if (table.size(0) < 1) throw py::value_error("table: expected a non-empty 1-D table, received shape (0,)");
  s.table = table.to(at::kDouble).contiguous();
  s.params.table = s.table.data_ptr<double>();
  s.params.table_len = check_count("table.shape[0]", s.table.size(0), 1);
  for (int64_t n = 0; n < s.params.table_len; ++n) {
    if (!std::isfinite(s.params.table[n])) {
      throw py::value_error("table[" + std::to_string(n) + "]: expected finite seconds, received " +
                            float_str(s.params.table[n]));
    }
  }
  s.params.plain_seconds = check_real("plain_seconds", plain_seconds);
  if (!(plain_seconds > 0)) {
    throw py::value_error("plain_seconds: expected a float > 0.0, received " + float_str(plain_seconds));
  }
  s.params.rows = check_count("rows", rows, 1);
  return s;
}

void run_throughput(const ThroughputArgs& s, int64_t* pool_index, int32_t* num_selected, float* expected) {
  // torch's float64 exp, not libm's: the reference sums the reaches torch computes (tree_ops.h).
  const at::Tensor reach = at::exp(s.log_reach.to(at::kDouble));
  thread_local taps::ThroughputWorkspace ws;
  taps::select_throughput_batch(s.log_reach.data_ptr<float>(), reach.data_ptr<double>(),
                                s.tree.num_nodes.data_ptr<int32_t>(), s.tree.B, static_cast<int32_t>(s.tree.N),
                                s.params, pool_index, num_selected, expected, ws);
}

std::vector<at::Tensor> select_throughput(const at::Tensor& parents, const at::Tensor& depth,
                                          const at::Tensor& num_nodes, const at::Tensor& log_reach, int64_t max_nodes,
                                          const at::Tensor& table, double plain_seconds, int64_t rows) {
  const ThroughputArgs s =
      check_throughput(parents, depth, num_nodes, log_reach, max_nodes, table, plain_seconds, rows);
  py::gil_scoped_release no_gil;
  at::Tensor pool_index = at::empty({s.tree.B, max_nodes + 1}, at::kLong);
  at::Tensor num_selected = at::empty({s.tree.B}, at::kInt);
  at::Tensor expected = at::empty({s.tree.B}, at::kFloat);
  run_throughput(s, pool_index.data_ptr<int64_t>(), num_selected.data_ptr<int32_t>(), expected.data_ptr<float>());
  return {pool_index, num_selected, expected};
}

std::pair<double, double> time_select_throughput(const at::Tensor& parents, const at::Tensor& depth,
                                                 const at::Tensor& num_nodes, const at::Tensor& log_reach,
                                                 int64_t max_nodes, const at::Tensor& table, double plain_seconds,
                                                 int64_t rows, int64_t iters) {
  const ThroughputArgs s =
      check_throughput(parents, depth, num_nodes, log_reach, max_nodes, table, plain_seconds, rows);
  check_iters(iters);
  py::gil_scoped_release no_gil;
  at::Tensor pool_index = at::empty({s.tree.B, max_nodes + 1}, at::kLong);
  at::Tensor num_selected = at::empty({s.tree.B}, at::kInt);
  at::Tensor expected = at::empty({s.tree.B}, at::kFloat);
  return seconds_per_iter(iters, [&] {
    run_throughput(s, pool_index.data_ptr<int64_t>(), num_selected.data_ptr<int32_t>(), expected.data_ptr<float>());
  });
}

// Re-indexed kept subtree (the Selection.tree of select_subtree) from the pool and pool_index.
std::vector<at::Tensor> reindex_subtree(const at::Tensor& tokens_in, const at::Tensor& parents, const at::Tensor& depth,
                                        const at::Tensor& num_nodes, const at::Tensor& pool_index_in,
                                        const at::Tensor& num_selected_in) {
  const TreeArgs t = check_tree(parents, depth, num_nodes);
  check_arg(tokens_in, "tree.tokens", {at::kLong}, {t.B, t.N});
  check_arg(pool_index_in, "pool_index", {at::kLong}, {t.B, -1});
  check_arg(num_selected_in, "num_selected", {at::kInt}, {t.B});
  const int32_t M = check_count("pool_index.shape[1]", pool_index_in.size(1), 1);
  const at::Tensor tokens = tokens_in.contiguous(), pool_index = pool_index_in.contiguous();
  const int64_t* pi = pool_index.data_ptr<int64_t>();
  for (int64_t k = 0; k < t.B * M; ++k) {
    if (pi[k] < -1 || pi[k] >= t.N) {
      throw py::value_error("pool_index[" + std::to_string(k / M) + "," + std::to_string(k % M) +
                            "]: expected -1 or a pool node in [0, " + std::to_string(t.N) + "), received " +
                            std::to_string(pi[k]));
    }
  }
  py::gil_scoped_release no_gil;
  at::Tensor out_tokens = at::empty({t.B, M}, at::kLong);
  at::Tensor out_parents = at::empty({t.B, M}, at::kInt);
  at::Tensor out_depth = at::empty({t.B, M}, at::kInt);
  at::Tensor out_num_nodes = (num_selected_in + 1).to(at::kInt);
  const int64_t* tk = tokens.data_ptr<int64_t>();
  const int32_t* p = t.parents.data_ptr<int32_t>();
  const int32_t* d = t.depth.data_ptr<int32_t>();
  int64_t* ot = out_tokens.data_ptr<int64_t>();
  int32_t* op = out_parents.data_ptr<int32_t>();
  int32_t* od = out_depth.data_ptr<int32_t>();
  for_batch(t.B, t.N + M, [&](int64_t b) {
    thread_local std::vector<int32_t> new_of_old;
    new_of_old.resize(static_cast<size_t>(t.N));
    taps::reindex_subtree_one(tk + b * t.N, p + b * t.N, d + b * t.N, static_cast<int32_t>(t.N), pi + b * M, M,
                              ot + b * M, op + b * M, od + b * M, new_of_old.data());
  });
  return {out_tokens, out_parents, out_depth, out_num_nodes};
}

// --------------------------------------------------------------------------------------------- tree mask
std::vector<at::Tensor> tree_mask(const at::Tensor& parents, const at::Tensor& depth, const at::Tensor& num_nodes,
                                  const at::Tensor& prefix_lens_in) {
  const TreeArgs t = check_tree(parents, depth, num_nodes);
  check_arg(prefix_lens_in, "prefix_lens", {at::kLong, at::kInt}, {t.B});
  const at::Tensor prefix_lens = prefix_lens_in.to(at::kLong).contiguous();
  {
    // prefix + depth must fit in int64: compared as prefix <= INT64_MAX - depth, which cannot overflow.
    const int64_t* pl = prefix_lens.data_ptr<int64_t>();
    const int32_t* d = t.depth.data_ptr<int32_t>();
    for (int64_t b = 0; b < t.B; ++b) {
      int32_t deepest = 0;
      for (int64_t i = 0; i < t.N; ++i) deepest = std::max(deepest, d[b * t.N + i]);
      const int64_t bound = std::numeric_limits<int64_t>::max() - deepest;
      if (pl[b] < 0 || pl[b] > bound) {
        throw py::value_error("prefix_lens[" + std::to_string(b) + "]: expected 0 <= prefix_len <= 2**63 - 1 - "
                              "(deepest node's depth) = " + std::to_string(bound) + ", received " +
                              std::to_string(pl[b]));
      }
    }
  }
  py::gil_scoped_release no_gil;
  const int64_t W = (t.N + 31) / 32;
  at::Tensor position_ids = at::empty({t.B, t.N}, at::kLong);
  at::Tensor bits = at::empty({t.B, t.N, W}, at::kInt);
  const int32_t* p = t.parents.data_ptr<int32_t>();
  const int32_t* d = t.depth.data_ptr<int32_t>();
  const int32_t* nn = t.num_nodes.data_ptr<int32_t>();
  const int64_t* pl = prefix_lens.data_ptr<int64_t>();
  int64_t* pos = position_ids.data_ptr<int64_t>();
  int32_t* bp = bits.data_ptr<int32_t>();
  for_batch(t.B, t.N * W, [&](int64_t b) {
    taps::tree_mask_one(p + b * t.N, d + b * t.N, nn[b], static_cast<int32_t>(t.N), pl[b], pos + b * t.N,
                        bp + b * t.N * W);
  });
  return {position_ids, bits};
}

// ------------------------------------------------------------------------------------------------ accept
std::vector<at::Tensor> accept_greedy(const at::Tensor& tokens_in, const at::Tensor& parents,
                                      const at::Tensor& num_nodes, const at::Tensor& target_in, int64_t path_len) {
  const TreeArgs t = check_tree(parents, at::Tensor(), num_nodes);
  check_arg(tokens_in, "tree.tokens", {at::kLong}, {t.B, t.N});
  check_arg(target_in, "target_tokens", {at::kLong}, {t.B, t.N});
  if (path_len < 1 || path_len > std::numeric_limits<int32_t>::max() - 1) {
    throw py::value_error("path_len: expected an int in [1, 2**31 - 2] (max_depth + 1, so max_depth in [0, 2**31 - 3]), "
                          "received " + std::to_string(path_len) + " (max_depth " + std::to_string(path_len - 1) + ")");
  }
  const int32_t P = static_cast<int32_t>(path_len);
  const at::Tensor tokens = tokens_in.contiguous(), target = target_in.contiguous();
  py::gil_scoped_release no_gil;
  at::Tensor path = at::empty({t.B, P}, at::kLong);
  at::Tensor accept_len = at::empty({t.B}, at::kLong);
  at::Tensor next_token = at::empty({t.B}, at::kLong);
  const int64_t* tk = tokens.data_ptr<int64_t>();
  const int64_t* tg = target.data_ptr<int64_t>();
  const int32_t* p = t.parents.data_ptr<int32_t>();
  const int32_t* nn = t.num_nodes.data_ptr<int32_t>();
  int64_t* pa = path.data_ptr<int64_t>();
  int64_t* al = accept_len.data_ptr<int64_t>();
  int64_t* nt = next_token.data_ptr<int64_t>();
  for_batch(t.B, t.N * 4, [&](int64_t b) {
    thread_local taps::AcceptWorkspace ws;
    al[b] = taps::accept_greedy_one(tk + b * t.N, p + b * t.N, nn[b], tg + b * t.N, P, pa + b * P, nt + b, ws);
  });
  return {path, accept_len, next_token};
}

// The decode round's acceptance (taps_kernels/reference/accept.py::accept_round_reference): the walk of every row,
// idle rows accepting nothing, the committed tokens, and the optional in-place append to the token history.
std::vector<at::Tensor> accept_round(const at::Tensor& tokens_in, const at::Tensor& parents,
                                     const at::Tensor& num_nodes, const at::Tensor& target_in,
                                     const at::Tensor& active_in, int64_t path_len,
                                     const std::optional<at::Tensor>& history_tokens,
                                     const std::optional<at::Tensor>& history_lengths) {
  const TreeArgs t = check_tree(parents, at::Tensor(), num_nodes);
  check_arg(tokens_in, "tree.tokens", {at::kLong}, {t.B, t.N});
  check_arg(target_in, "target_tokens", {at::kLong}, {t.B, t.N});
  check_arg(active_in, "active", {at::kBool}, {t.B});
  if (path_len < 1 || path_len > std::numeric_limits<int32_t>::max() - 1) {
    throw py::value_error("path_len: expected an int in [1, 2**31 - 2], received " + std::to_string(path_len));
  }
  if (history_tokens.has_value() != history_lengths.has_value()) {
    throw py::value_error("history_tokens/history_lengths: expected both or neither");
  }
  int64_t C = 0;
  if (history_tokens.has_value()) {
    check_arg(*history_tokens, "history_tokens", {at::kLong}, {t.B, -1});
    check_arg(*history_lengths, "history_lengths", {at::kLong}, {t.B});
    C = history_tokens->size(1) - 1;  // column C is the write sink: nothing is written there
    if (C < 0 || !history_tokens->is_contiguous() || !history_lengths->is_contiguous()) {
      throw py::value_error("history_tokens/history_lengths: expected contiguous tensors (they are written in "
                            "place), history_tokens with at least one column, received shape " +
                            shape_str(history_tokens->sizes()));
    }
  }
  const int32_t P = static_cast<int32_t>(path_len);
  const at::Tensor tokens = tokens_in.contiguous(), target = target_in.contiguous(), active = active_in.contiguous();
  py::gil_scoped_release no_gil;
  at::Tensor path = at::empty({t.B, P}, at::kLong);
  at::Tensor accept_len = at::empty({t.B}, at::kLong);
  at::Tensor next_token = at::empty({t.B}, at::kLong);
  at::Tensor committed = at::empty({t.B, P}, at::kLong);
  const int64_t* tk = tokens.data_ptr<int64_t>();
  const int64_t* tg = target.data_ptr<int64_t>();
  const bool* on = active.data_ptr<bool>();
  const int32_t* p = t.parents.data_ptr<int32_t>();
  const int32_t* nn = t.num_nodes.data_ptr<int32_t>();
  int64_t* pa = path.data_ptr<int64_t>();
  int64_t* al = accept_len.data_ptr<int64_t>();
  int64_t* nt = next_token.data_ptr<int64_t>();
  int64_t* cm = committed.data_ptr<int64_t>();
  int64_t* ht = history_tokens.has_value() ? history_tokens->data_ptr<int64_t>() : nullptr;
  int64_t* hl = history_lengths.has_value() ? history_lengths->data_ptr<int64_t>() : nullptr;
  for_batch(t.B, t.N * 4, [&](int64_t b) {
    thread_local taps::AcceptWorkspace ws;
    int64_t* row = pa + b * P;
    int64_t acc = taps::accept_greedy_one(tk + b * t.N, p + b * t.N, nn[b], tg + b * t.N, P, row, nt + b, ws);
    if (!on[b]) {
      acc = 0;
      std::fill(row + 1, row + P, int64_t{-1});
    }
    al[b] = acc;
    int64_t* out = cm + b * P;
    for (int64_t j = 0; j < P; ++j) out[j] = j < acc - 1 ? tk[b * t.N + row[j + 1]] : (j == acc - 1 ? nt[b] : -1);
    if (ht != nullptr) {
      int64_t* hist = ht + b * (C + 1);
      for (int64_t j = 0; j < acc; ++j) {
        if (hl[b] + j >= 0 && hl[b] + j < C) hist[hl[b] + j] = out[j];
      }
      hl[b] += acc;
    }
  });
  return {path, accept_len, next_token, committed};
}

// ------------------------------------------------------------------------------------------------ KV cache
at::Tensor compact_kv(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const at::Tensor& prefix_lens_in, const at::Tensor& path_in) {
  if (keys.empty() || keys.size() != values.size()) {
    throw py::value_error("keys/values: expected equally long non-empty lists, received " +
                          std::to_string(keys.size()) + " and " + std::to_string(values.size()));
  }
  check_arg(keys[0], "keys[0]", {at::kFloat, at::kHalf, at::kBFloat16}, {-1, -1, -1, -1});
  const int64_t B = keys[0].size(0), L = keys[0].size(2);
  std::vector<taps::KVView> views;
  for (int group = 0; group < 2; ++group) {
    const auto& list = group == 0 ? keys : values;
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& c = list[i];
      const std::string name = std::string(group == 0 ? "keys[" : "values[") + std::to_string(i) + "]";
      check_arg(c, name, {at::kFloat, at::kHalf, at::kBFloat16}, {B, -1, L, -1});
      views.push_back({static_cast<char*>(c.data_ptr()), static_cast<int64_t>(c.element_size()), B, c.size(1), L,
                       c.size(3), c.stride(0), c.stride(1), c.stride(2), c.stride(3)});
    }
  }
  // Tensors written in place must own their memory (as taps_kernels/_checks.py::check_writable_disjoint):
  // no internal overlap (stride-0 broadcasts), no two tensors whose byte spans intersect. A tensor listed twice
  // would be moved twice by this sequential loop but once by a parallel backend.
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  std::vector<std::string> names;
  for (int group = 0; group < 2; ++group) {
    const auto& list = group == 0 ? keys : values;
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& c = list[i];
      const std::string name = std::string(group == 0 ? "keys[" : "values[") + std::to_string(i) + "]";
      if (at::GradMode::is_enabled() && c.requires_grad()) {
        throw py::value_error(name + ": requires grad, but compact_kv writes it in place without autograd; detach it "
                              "or run under torch.no_grad()");
      }
      std::vector<std::pair<int64_t, int64_t>> dims;
      for (int64_t d = 0; d < c.dim(); ++d) {
        if (c.size(d) > 1) dims.emplace_back(c.stride(d), c.size(d));
      }
      std::sort(dims.begin(), dims.end());
      int64_t reach = 0;
      for (const auto& [st, sz] : dims) {
        if (st <= reach) {
          throw py::value_error(name + ": a tensor written in place must not overlap itself, received shape " +
                                shape_str(c.sizes()) + " with strides " + shape_str(c.strides()) +
                                " (a stride-0 broadcast or interleaved strides)");
        }
        reach += (sz - 1) * st;
      }
      if (c.numel() == 0) continue;
      const uintptr_t lo = reinterpret_cast<uintptr_t>(c.data_ptr());
      const uintptr_t hi = lo + static_cast<uintptr_t>((reach + 1) * c.element_size());
      for (size_t k = 0; k < spans.size(); ++k) {
        if (lo < spans[k].second && spans[k].first < hi) {
          if (lo == spans[k].first && hi == spans[k].second) {
            throw py::value_error("keys/values: the same tensor appears more than once (" + names[k] + " and " + name +
                                  "); list each cache tensor once");
          }
          throw py::value_error(names[k] + " and " + name + ": their memory overlaps; every cache tensor must have "
                                "its own memory");
        }
      }
      spans.emplace_back(lo, hi);
      names.push_back(name);
    }
  }
  check_arg(prefix_lens_in, "prefix_lens", {at::kLong, at::kInt}, {B});
  check_arg(path_in, "path", {at::kLong}, {B, -1});
  const at::Tensor prefix_lens = prefix_lens_in.to(at::kLong).contiguous(), path = path_in.contiguous();
  const int64_t P = path.size(1);
  const int64_t* pl = prefix_lens.data_ptr<int64_t>();
  const int64_t* pa = path.data_ptr<int64_t>();
  // Everything is checked before the first write: a rejected call leaves every cache untouched.
  const int64_t bad = taps::check_compact_path(pa, B, P, pl, L);
  if (bad >= 0) {
    const int64_t b = bad / P, j = bad % P;
    throw py::value_error("path[" + std::to_string(b) + "," + std::to_string(j) + "]: expected strictly increasing "
                          "node indices followed by -1 padding, with 0 <= prefix_lens[b] <= L = " + std::to_string(L) +
                          " and node <= L - 1 - prefix_lens[b]; received " + std::to_string(pa[bad]) +
                          " (prefix_lens[" + std::to_string(b) + "] = " + std::to_string(pl[b]) + ")");
  }
  py::gil_scoped_release no_gil;
  at::Tensor new_lens = at::empty({B}, at::kLong);
  int64_t* nl = new_lens.data_ptr<int64_t>();
  std::vector<int64_t> accepted(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    while (n < P && pa[b * P + n] >= 0) ++n;
    accepted[b] = n;
    nl[b] = pl[b] + n;
  }
  // Layers one after another (as the reference), batch rows in parallel: rows of one tensor are disjoint.
  for (const auto& v : views) {
    for_batch(B, v.H * P * v.Dh, [&](int64_t b) { taps::compact_kv_row(v, b, pl[b], pa + b * P, accepted[b]); });
  }
  return new_lens;
}

// ------------------------------------------------------------------------------------------------ validation
std::vector<int64_t> validate_tree(const at::Tensor& tokens_in, const at::Tensor& parents_in, const at::Tensor& depth_in,
                                   const at::Tensor& num_nodes_in, int64_t vocab_size) {
  check_arg(tokens_in, "tree.tokens", {at::kLong}, {-1, -1});
  const int64_t B = tokens_in.size(0), N = tokens_in.size(1);
  check_arg(parents_in, "tree.parents", {at::kInt}, {B, N});
  check_arg(depth_in, "tree.depth", {at::kInt}, {B, N});
  check_arg(num_nodes_in, "tree.num_nodes", {at::kInt}, {B});
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous(), depth = depth_in.contiguous(),
                   num_nodes = num_nodes_in.contiguous();
  py::gil_scoped_release no_gil;
  const taps::TreeCheck c = taps::validate_tree(tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(),
                                                depth.data_ptr<int32_t>(), num_nodes.data_ptr<int32_t>(), B, N, vocab_size);
  return {static_cast<int64_t>(c.kind), c.b, c.i};
}

// ------------------------------------------------------------------------------------------------ rows_linear
// x [M,K] f32, weight [N,K] f32 or bf16 (widened exactly), bias [N] f32 or None -> y [M,N] f32 (see rows_linear.h).
at::Tensor rows_linear(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in) {
  check_arg(x_in, "x", {at::kFloat}, {-1, -1});
  const int64_t M = x_in.size(0), K = x_in.size(1);
  check_arg(weight_in, "weight", {at::kFloat, at::kBFloat16}, {-1, K});
  const int64_t N = weight_in.size(0);
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    check_arg(*bias_in, "bias", {at::kFloat}, {N});
    bias = bias_in->contiguous();
  }
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const float* wp = bf16 ? nullptr : weight.data_ptr<float>();
  const auto* wp16 = bf16 ? reinterpret_cast<const taps::Bf16*>(weight.data_ptr<at::BFloat16>()) : nullptr;
  py::gil_scoped_release no_gil;
  // K == 0 needs no branch: the kernels then write bias (or 0) without reading x or weight.
  const int64_t tiles = (N + taps::kRowsLinearTile - 1) / taps::kRowsLinearTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    if (bf16) {
      taps::rows_linear_tiles(xp, wp16, bp, yp, M, N, K, t0, t1);
    } else {
      taps::rows_linear_tiles(xp, wp, bp, yp, M, N, K, t0, t1);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "taps_kernels C++ CPU backend: tree ops on CPU tensors (see taps_kernels/cpp_impls.py and docs/DESIGN.md)";
  m.def("argmax_rows", &argmax_rows, "logits [R,V] float32 -> [R] int64: first index of each row's largest (NaN "
        "largest), as torch.argmax", py::arg("logits"));
  m.def("topk_stats", &topk_stats, "draft_logits [B,D,V] float, top_k -> [topk_logp, topk_ids, entropy, margin, topk_mass]",
        py::arg("draft_logits"), py::arg("top_k"));
  m.def("best_first_pool", &best_first_pool,
        "topk_logp [B,D,K] f32, topk_ids [B,D,K] i64, root_tokens [B] i64, pool_size -> "
        "[tokens, parents, depth, num_nodes, logq, step_logq, rank]",
        py::arg("topk_logp"), py::arg("topk_ids"), py::arg("root_tokens"), py::arg("pool_size"));
  m.def("time_best_first_pool", &time_best_first_pool,
        "(wall, thread-CPU) seconds per best_first_pool call over the whole batch, looped in C++ (outputs allocated once)",
        py::arg("topk_logp"), py::arg("topk_ids"), py::arg("root_tokens"), py::arg("pool_size"), py::arg("iters"));
  m.def("propagate_reach", &propagate_reach, "parents [B,N] i32, edge_logq [B,N] f32 -> log_reach [B,N] f32",
        py::arg("parents"), py::arg("edge_logq"));
  m.def("select_subtree", &select_subtree, "-> [pool_index [B,max_nodes+1] i64, num_selected [B] i32]",
        py::arg("parents"), py::arg("depth"), py::arg("num_nodes"), py::arg("log_reach"), py::arg("max_nodes"),
        py::arg("latency") = py::none(), py::arg("t0") = 0.0, py::arg("rule") = "reach", py::arg("lambda_node") = 1.0,
        py::arg("lambda_depth") = 0.002, py::arg("min_utility") = 0.0);
  m.def("time_select_subtree", &time_select_subtree,
        "(wall, thread-CPU) seconds per select_subtree call over the whole batch, looped in C++ (outputs allocated once)",
        py::arg("parents"), py::arg("depth"), py::arg("num_nodes"), py::arg("log_reach"), py::arg("max_nodes"),
        py::arg("latency") = py::none(), py::arg("t0") = 0.0, py::arg("rule") = "reach", py::arg("lambda_node") = 1.0,
        py::arg("lambda_depth") = 0.002, py::arg("min_utility") = 0.0, py::arg("iters") = 1000);
  m.def("select_throughput", &select_throughput,
        "batch throughput rule: tree parents/depth [B,N] i32, num_nodes [B] i32, log_reach [B,N] f32, max_nodes, "
        "table [L] f64, plain_seconds, rows -> "
        "[pool_index [B,max_nodes+1] i64, num_selected [B] i32, expected [B] f32]",
        py::arg("parents"), py::arg("depth"), py::arg("num_nodes"), py::arg("log_reach"), py::arg("max_nodes"),
        py::arg("table"), py::arg("plain_seconds"), py::arg("rows"));
  m.def("time_select_throughput", &time_select_throughput,
        "(wall, thread-CPU) seconds per select_throughput call over the whole batch, looped in C++ "
        "(outputs allocated once)",
        py::arg("parents"), py::arg("depth"), py::arg("num_nodes"), py::arg("log_reach"), py::arg("max_nodes"),
        py::arg("table"), py::arg("plain_seconds"), py::arg("rows"), py::arg("iters") = 1000);
  m.def("reindex_subtree", &reindex_subtree,
        "pool tree (tokens, parents, depth, num_nodes), pool_index [B,M] i64, num_selected [B] i32 -> "
        "[tokens [B,M] i64, parents [B,M] i32, depth [B,M] i32, num_nodes [B] i32] of the kept subtree",
        py::arg("tokens"), py::arg("parents"), py::arg("depth"), py::arg("num_nodes"), py::arg("pool_index"),
        py::arg("num_selected"));
  m.def("tree_mask", &tree_mask, "-> [position_ids [B,N] i64, ancestor_bits [B,N,ceil(N/32)] i32]", py::arg("parents"),
        py::arg("depth"), py::arg("num_nodes"), py::arg("prefix_lens"));
  m.def("accept_greedy", &accept_greedy, "-> [path [B,path_len] i64, accept_len [B] i64, next_token [B] i64]",
        py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"), py::arg("target_tokens"), py::arg("path_len"));
  m.def("accept_round", &accept_round,
        "-> [path [B,path_len] i64, accept_len [B] i64, next_token [B] i64, committed [B,path_len] i64]; appends "
        "to the history in place",
        py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"), py::arg("target_tokens"), py::arg("active"),
        py::arg("path_len"), py::arg("history_tokens") = py::none(), py::arg("history_lengths") = py::none());
  m.def("compact_kv", &compact_kv, "In place on every cache tensor [B,H,L,Dh]; -> new_lens [B] i64", py::arg("keys"),
        py::arg("values"), py::arg("prefix_lens"), py::arg("path"));
  taps_bind::register_score(m);
  m.def("rows_linear", &rows_linear, "x [M,K] f32, weight [N,K] f32 or bf16, bias [N] f32 or None -> x . weight^T + bias "
        "[M,N] f32",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("rows_linear_vectorized", &taps::rows_linear_vectorized, "whether rows_linear runs its AVX-512 path here");
  m.def("validate_tree", &validate_tree,
        "-> [fault kind (0 ok, see tree_ops.h TreeFault), b, i] of the first structural violation; vocab_size < 0 skips tokens",
        py::arg("tokens"), py::arg("parents"), py::arg("depth"), py::arg("num_nodes"), py::arg("vocab_size") = -1);
  taps_bind::register_gguf(m);
  taps_bind::register_lookup(m);
}
