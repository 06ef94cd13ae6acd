// taps_kernels._C: a verified round's commit on CPU tensors: the round's acceptance (taps_kernels.accept_round), KV
// compaction (taps_kernels.compact_kv) and the whole commit in one call (taps_kernels.commit_round: the greedy
// tokens, the acceptance walk, the history append, the compaction and the cache lengths), each step through the
// same C++ routine as its own op, so the result is the chain of public ops' bit for bit.
//
// Why commit_round exists: after a target step on a CPU the caches are cold, and the chain of ops between the
// forward and the next tree (greedy_tokens, accept_round, compact_kv and the lengths' update) cost ~0.26 ms of a
// 4.6 ms AR round and ~0.6 ms of an 8 ms tree round here, most of it Python, dispatch and argument checks rather
// than work.
#include "commit_bindings.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind_common.h"
#include "topk_stats.h"
#include "tree_ops.h"

namespace py = pybind11;

namespace taps_bind {

namespace {

std::string cache_name(int group, size_t i) {
  return std::string(group == 0 ? "keys[" : "values[") + std::to_string(i) + "]";
}

// Views of every cache tensor (keys first, then values), after the checks a write in place needs: dtype, rank,
// at least `rows` batch rows and the same number in all, one L for all, CPU, no grad to track, no
// tensor overlapping itself (a stride-0 broadcast) or another (listed twice, or sharing memory): a tensor
// listed twice would be moved twice by these sequential loops but once by a parallel backend. Names are built
// only for an error (60 tensors a round for SmolLM2). Every view has keys[0]'s batch rows (view.B) and L.
std::vector<taps::KVView> cache_views(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                      int64_t rows) {
  if (keys.empty() || keys.size() != values.size()) {
    throw py::value_error("keys/values: expected equally long non-empty lists, received " +
                          std::to_string(keys.size()) + " and " + std::to_string(values.size()));
  }
  check_arg(keys[0], "keys[0]", {at::kFloat, at::kHalf, at::kBFloat16}, {-1, -1, -1, -1});
  const int64_t R = keys[0].size(0), L = keys[0].size(2);
  if (R < rows) {
    throw py::value_error("keys[0]: expected at least " + std::to_string(rows) + " batch rows (the tree's), received "
                          "shape " + shape_str(keys[0].sizes()));
  }
  std::vector<taps::KVView> views;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  const bool grad = at::GradMode::is_enabled();
  for (int group = 0; group < 2; ++group) {
    const auto& list = group == 0 ? keys : values;
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& c = list[i];
      const bool plain = c.defined() && c.dim() == 4 && c.size(0) == R && c.size(2) == L && c.device().is_cpu() &&
                         (c.scalar_type() == at::kFloat || c.scalar_type() == at::kHalf ||
                          c.scalar_type() == at::kBFloat16);
      if (!plain) check_arg(c, cache_name(group, i), {at::kFloat, at::kHalf, at::kBFloat16}, {R, -1, L, -1});
      if (grad && c.requires_grad()) {
        throw py::value_error(cache_name(group, i) + ": requires grad, but it is written in place without autograd; "
                              "detach it or run under torch.no_grad()");
      }
      std::vector<std::pair<int64_t, int64_t>> dims;
      for (int64_t d = 0; d < c.dim(); ++d) {
        if (c.size(d) > 1) dims.emplace_back(c.stride(d), c.size(d));
      }
      std::sort(dims.begin(), dims.end());
      int64_t reach = 0;
      for (const auto& [st, sz] : dims) {
        if (st <= reach) {
          throw py::value_error(cache_name(group, i) + ": a tensor written in place must not overlap itself, "
                                "received shape " + shape_str(c.sizes()) + " with strides " + shape_str(c.strides()) +
                                " (a stride-0 broadcast or interleaved strides)");
        }
        reach += (sz - 1) * st;
      }
      views.push_back({static_cast<char*>(c.data_ptr()), static_cast<int64_t>(c.element_size()), R, c.size(1), L,
                       c.size(3), c.stride(0), c.stride(1), c.stride(2), c.stride(3)});
      if (c.numel() == 0) {
        spans.emplace_back(0, 0);
        continue;
      }
      const uintptr_t lo = reinterpret_cast<uintptr_t>(c.data_ptr());
      const uintptr_t hi = lo + static_cast<uintptr_t>((reach + 1) * c.element_size());
      for (size_t k = 0; k < spans.size(); ++k) {
        if (lo < spans[k].second && spans[k].first < hi) {
          const std::string other = cache_name(k < keys.size() ? 0 : 1, k < keys.size() ? k : k - keys.size());
          if (lo == spans[k].first && hi == spans[k].second) {
            throw py::value_error("keys/values: the same tensor appears more than once (" + other + " and " +
                                  cache_name(group, i) + "); list each cache tensor once");
          }
          throw py::value_error(other + " and " + cache_name(group, i) + ": their memory overlaps; every cache tensor "
                                "must have its own memory");
        }
      }
      spans.emplace_back(lo, hi);
    }
  }
  return views;
}

// Moves the accepted rows of batch rows [0, B) in every view: layers one after another (as the reference), rows in
// parallel (the rows of one tensor are disjoint). `accepted[b]` nodes of path row b.
void compact_rows(const std::vector<taps::KVView>& views, int64_t B, const int64_t* prefix, const int64_t* path,
                  int64_t P, const int64_t* accepted) {
  for (const auto& v : views) {
    for_batch(B, v.H * P * v.Dh, [&](int64_t b) { taps::compact_kv_row(v, b, prefix[b], path + b * P, accepted[b]); });
  }
}

at::Tensor compact_kv(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const at::Tensor& prefix_lens_in, const at::Tensor& path_in) {
  const std::vector<taps::KVView> views = cache_views(keys, values, 0);
  const int64_t B = views[0].B, L = views[0].L;
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
  compact_rows(views, B, pl, pa, P, accepted.data());
  return new_lens;
}

// A [B] int64 tensor a round writes in place (none when absent): contiguous, so that its data pointer is its
// first row.
int64_t* written_in_place(const std::optional<at::Tensor>& t, const std::string& name, int64_t B) {
  if (!t.has_value()) return nullptr;
  check_arg(*t, name, {at::kLong}, {B});
  if (!t->is_contiguous()) {
    throw py::value_error(name + ": expected a contiguous tensor (it is written in place), received strides " +
                          shape_str(t->strides()));
  }
  return t->data_ptr<int64_t>();
}

// A round's acceptance arguments after their checks (taps_kernels.accept_round's, less the target tokens).
struct RoundArgs {
  TreeArgs t;
  at::Tensor tokens, active;
  int32_t P;
  int64_t* history = nullptr;  // [B, C + 1], column C the write sink
  int64_t* history_lengths = nullptr;
  int64_t C = 0;
};

RoundArgs check_round(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& num_nodes,
                      const at::Tensor& active, int64_t path_len, const std::optional<at::Tensor>& history_tokens,
                      const std::optional<at::Tensor>& history_lengths) {
  RoundArgs r{check_tree(parents, at::Tensor(), num_nodes), {}, {}, 0};
  check_arg(tokens, "tree.tokens", {at::kLong}, {r.t.B, r.t.N});
  check_arg(active, "active", {at::kBool}, {r.t.B});
  r.P = check_count("path_len", path_len, 1);
  if (history_tokens.has_value() != history_lengths.has_value()) {
    throw py::value_error("history_tokens/history_lengths: expected both or neither");
  }
  if (history_tokens.has_value()) {
    check_arg(*history_tokens, "history_tokens", {at::kLong}, {r.t.B, -1});
    r.C = history_tokens->size(1) - 1;  // column C is the write sink: nothing is written there
    if (r.C < 0 || !history_tokens->is_contiguous()) {
      throw py::value_error("history_tokens: expected a contiguous tensor (it is written in place) with at least one "
                            "column, received shape " + shape_str(history_tokens->sizes()) + " and strides " +
                            shape_str(history_tokens->strides()));
    }
    r.history = history_tokens->data_ptr<int64_t>();
  }
  r.history_lengths = written_in_place(history_lengths, "history_lengths", r.t.B);
  r.tokens = tokens.contiguous();
  r.active = active.contiguous();
  return r;
}

// The walk of every row given its target tokens [B, N] (contiguous), the committed tokens and the history append:
// -> {path [B, P], accept_len [B], next_token [B], committed [B, P]}. Call without the GIL.
std::vector<at::Tensor> walk_rounds(const RoundArgs& r, const at::Tensor& target) {
  const int64_t B = r.t.B, N = r.t.N, P = r.P, C = r.C;
  at::Tensor path = at::empty({B, P}, at::kLong);
  at::Tensor accept_len = at::empty({B}, at::kLong);
  at::Tensor next_token = at::empty({B}, at::kLong);
  at::Tensor committed = at::empty({B, P}, at::kLong);
  const int64_t* tk = r.tokens.data_ptr<int64_t>();
  const int64_t* tg = target.data_ptr<int64_t>();
  const bool* on = r.active.data_ptr<bool>();
  const int32_t* p = r.t.parents.data_ptr<int32_t>();
  const int32_t* nn = r.t.num_nodes.data_ptr<int32_t>();
  int64_t* pa = path.data_ptr<int64_t>();
  int64_t* al = accept_len.data_ptr<int64_t>();
  int64_t* nt = next_token.data_ptr<int64_t>();
  int64_t* cm = committed.data_ptr<int64_t>();
  int64_t* ht = r.history;
  int64_t* hl = r.history_lengths;
  for_batch(B, N * 4, [&](int64_t b) {
    thread_local taps::AcceptWorkspace ws;
    al[b] = taps::accept_round_one(tk + b * N, p + b * N, nn[b], tg + b * N, on[b], r.P, pa + b * P, nt + b, cm + b * P,
                                   ht != nullptr ? ht + b * (C + 1) : nullptr, hl != nullptr ? hl + b : nullptr, C, ws);
  });
  return {path, accept_len, next_token, committed};
}

// The decode round's acceptance (taps_kernels/reference/accept.py::accept_round_reference): the walk of every row,
// idle rows accepting nothing, the committed tokens, and the optional in-place append to the token history.
std::vector<at::Tensor> accept_round(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& num_nodes,
                                     const at::Tensor& target_in, const at::Tensor& active, int64_t path_len,
                                     const std::optional<at::Tensor>& history_tokens,
                                     const std::optional<at::Tensor>& history_lengths) {
  const RoundArgs r = check_round(tokens, parents, num_nodes, active, path_len, history_tokens, history_lengths);
  check_arg(target_in, "target_tokens", {at::kLong}, {r.t.B, r.t.N});
  const at::Tensor target = target_in.contiguous();
  py::gil_scoped_release no_gil;
  return walk_rounds(r, target);
}

// taps_kernels/reference/commit.py::commit_round_reference, one call (see commit_round in taps_kernels/ops).
std::vector<at::Tensor> commit_round(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& num_nodes,
                                     const at::Tensor& active, int64_t path_len, const std::vector<at::Tensor>& keys,
                                     const std::vector<at::Tensor>& values, const at::Tensor& lengths,
                                     const std::optional<at::Tensor>& logits_in,
                                     const std::optional<at::Tensor>& target_in,
                                     const std::optional<at::Tensor>& history_tokens,
                                     const std::optional<at::Tensor>& history_lengths, bool moves) {
  const RoundArgs r = check_round(tokens, parents, num_nodes, active, path_len, history_tokens, history_lengths);
  const int64_t B = r.t.B, N = r.t.N;
  if (logits_in.has_value() == target_in.has_value()) {
    throw py::value_error("logits/target_tokens: expected exactly one of them (logits: the greedy tokens are their "
                          "argmax), received " + std::string(logits_in.has_value() ? "both" : "neither"));
  }
  at::Tensor logits, target;
  if (logits_in.has_value()) {
    check_arg(*logits_in, "logits", {at::kFloat}, {B, N, -1});
    if (logits_in->size(2) < 1) {
      throw py::value_error("logits: expected at least one vocabulary column, received shape " +
                            shape_str(logits_in->sizes()));
    }
    logits = logits_in->contiguous();
  } else {
    check_arg(*target_in, "target_tokens", {at::kLong}, {B, N});
    target = target_in->contiguous();
  }
  int64_t* len = written_in_place(lengths, "lengths", B);
  // Without moves the caches are neither read nor written (a chain's accepted rows already sit in place).
  const std::vector<taps::KVView> views = moves ? cache_views(keys, values, B) : std::vector<taps::KVView>();
  // The verify wrote row b's N nodes at lengths[b] ..; with moves they must lie inside the cache (then every
  // accepted node does, and the compaction's path check cannot fail).
  for (int64_t b = 0; b < B; ++b) {
    if (len[b] < 0) {
      throw py::value_error("lengths[" + std::to_string(b) + "]: expected a value >= 0, received " +
                            std::to_string(len[b]));
    }
    if (moves && len[b] > views[0].L - N) {
      const int64_t L = views[0].L;
      throw py::value_error("lengths[" + std::to_string(b) + "]: expected a value in [0, L - N] = [0, " +
                            std::to_string(L - N) + "] (cache length L = " + std::to_string(L) + ", tree nodes N = " +
                            std::to_string(N) + "), received " + std::to_string(len[b]));
    }
  }
  // Everything is checked: from here on the call writes and cannot fail half way.
  py::gil_scoped_release no_gil;
  if (logits.defined()) {
    const int64_t V = logits.size(2);
    target = at::empty({B, N}, at::kLong);
    const float* x = logits.data_ptr<float>();
    int64_t* o = target.data_ptr<int64_t>();
    for_batch(B * N, V, [&](int64_t i) { o[i] = taps::argmax_row(x + i * V, V); });
  }
  std::vector<at::Tensor> out = walk_rounds(r, target);
  const int64_t* path = out[0].data_ptr<int64_t>();
  const int64_t* accept_len = out[1].data_ptr<int64_t>();
  if (moves) compact_rows(views, B, len, path, r.P, accept_len);
  for (int64_t b = 0; b < B; ++b) len[b] += accept_len[b];
  return out;
}

}  // namespace

void register_commit(py::module& m) {
  m.def("accept_round", &accept_round,
        "-> [path [B,path_len] i64, accept_len [B] i64, next_token [B] i64, committed [B,path_len] i64]; appends "
        "to the history in place",
        py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"), py::arg("target_tokens"), py::arg("active"),
        py::arg("path_len"), py::arg("history_tokens") = py::none(), py::arg("history_lengths") = py::none());
  m.def("compact_kv", &compact_kv, "In place on every cache tensor [B,H,L,Dh]; -> new_lens [B] i64", py::arg("keys"),
        py::arg("values"), py::arg("prefix_lens"), py::arg("path"));
  m.def("commit_round", &commit_round,
        "-> [path [B,path_len] i64, accept_len [B] i64, next_token [B] i64, committed [B,path_len] i64]; in place: "
        "the caches' rows [0, B), lengths and the history",
        py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"), py::arg("active"), py::arg("path_len"),
        py::arg("keys"), py::arg("values"), py::arg("lengths"), py::arg("logits") = py::none(),
        py::arg("target_tokens") = py::none(), py::arg("history_tokens") = py::none(),
        py::arg("history_lengths") = py::none(), py::arg("moves") = true);
}

}  // namespace taps_bind
