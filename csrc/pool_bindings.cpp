// taps_kernels._C: the candidate pool's ops on CPU tensors (per-position top-K statistics, the row argmax,
// the best-first pool and reach propagation), with the pool's timing harness beside it. Checks here are the ones
// memory safety needs; taps_kernels.ops checks the rest.
#include "pool_bindings.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "bind_common.h"
#include "topk_stats.h"
#include "tree_ops.h"

namespace py = pybind11;

namespace taps_bind {

namespace {

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
  at::Tensor margin = at::empty({B, D}, x.options());
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
        if (!taps::position_stats(xp + r * V, V, K, K2, vp + r * K2, ip + r * K2, ep + r, mp + r, sp + r, ws)) {
          for (int64_t seen = first_bad.load(); r < seen && !first_bad.compare_exchange_weak(seen, r);) {}
        }
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

}  // namespace

void register_pool(py::module& m) {
  m.def("argmax_rows", &argmax_rows, "logits [R,V] float32 -> [R] int64: first index of each row's largest (NaN "
        "largest), as torch.argmax", py::arg("logits"));
  m.def("topk_rows_path", &taps::row_path_name, "the rows topk_stats and argmax_rows run: 'avx512', 'avx2' or "
        "'scalar' (TAPS_GGUF_KERNELS=avx2|scalar asks for a slower one)");
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
}

}  // namespace taps_bind
