// taps_kernels._C: subtree selection on CPU tensors (the per-round rules, the batch throughput rule, the re-index
// of the kept subtree), with the timing harnesses of the two rules beside them (each loops its op's own run step in
// C++, so a benchmark separates the kernel from Python and validation).
#include "select_bindings.h"

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind_common.h"
#include "tree_ops.h"

namespace py = pybind11;

namespace taps_bind {

taps::ThroughputParams check_throughput_params(int64_t max_nodes, const at::Tensor& table, double plain_seconds,
                                               int64_t rows, at::Tensor& table_f64) {
  taps::ThroughputParams p;
  p.max_nodes = check_count("max_nodes", max_nodes, 0);
  check_arg(table, "table", {at::kDouble, at::kFloat}, {-1});
  if (table.size(0) < 1) throw py::value_error("table: expected a non-empty 1-D table, received shape (0,)");
  table_f64 = table.to(at::kDouble).contiguous();
  p.table = table_f64.data_ptr<double>();
  p.table_len = check_count("table.shape[0]", table_f64.size(0), 1);
  for (int64_t n = 0; n < p.table_len; ++n) {
    if (!std::isfinite(p.table[n])) {
      throw py::value_error("table[" + std::to_string(n) + "]: expected finite seconds, received " +
                            float_str(p.table[n]));
    }
  }
  p.plain_seconds = check_real("plain_seconds", plain_seconds);
  if (!(plain_seconds > 0)) {
    throw py::value_error("plain_seconds: expected a float > 0.0, received " + float_str(plain_seconds));
  }
  p.rows = check_count("rows", rows, 1);
  return p;
}

void run_throughput_rule(const at::Tensor& log_reach, const int32_t* num_nodes, const taps::ThroughputParams& params,
                         int64_t* pool_index, int32_t* num_selected, float* expected) {
  // torch's float64 exp, not libm's: the reference sums the reaches torch computes (tree_ops.h).
  const at::Tensor reach = at::exp(log_reach.to(at::kDouble));
  thread_local taps::ThroughputWorkspace ws;
  taps::select_throughput_batch(log_reach.data_ptr<float>(), reach.data_ptr<double>(), num_nodes, log_reach.size(0),
                                static_cast<int32_t>(log_reach.size(1)), params, pool_index, num_selected, expected,
                                ws);
}

namespace {

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
  s.params = check_throughput_params(max_nodes, table, plain_seconds, rows, s.table);
  return s;
}

void run_throughput(const ThroughputArgs& s, int64_t* pool_index, int32_t* num_selected, float* expected) {
  run_throughput_rule(s.log_reach, s.tree.num_nodes.data_ptr<int32_t>(), s.params, pool_index, num_selected, expected);
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

}  // namespace

void register_select(py::module& m) {
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
}

}  // namespace taps_bind
