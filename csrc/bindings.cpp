// taps_kernels._C: torch bindings of the C++ tree ops (tree_ops.h) on CPU tensors.
//
// Each op takes the arguments of its reference in taps_kernels/reference (after the public op in
// taps_kernels/ops has validated them), re-checks what it relies on for memory safety (device, dtype,
// shape; errors name the argument, the expectation and what arrived), releases the GIL and loops over
// the batch with at::parallel_for. Per-thread workspaces are reused across calls, so a call allocates
// only its output tensors. This unit holds the tree mask, the greedy acceptance walk, the structural check and
// rows_linear, and registers the module; the other families live in their own *_bindings.cpp (a round's commit:
// commit_bindings.cpp).
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
#include "commit_bindings.h"
#include "pool_bindings.h"
#include "round_bindings.h"
#include "select_bindings.h"
#include "gguf_bindings.h"
#include "lookup_bindings.h"
#include "rows_linear.h"
#include "score_bindings.h"
#include "torch_checks.h"
#include "tree_ops.h"

namespace py = pybind11;

namespace {

using namespace taps_bind;  // check_arg, shape_str, the value checks, for_batch, seconds_per_iter


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
  taps_bind::register_pool(m);
  taps_bind::register_select(m);
  taps_bind::register_commit(m);
  m.def("tree_mask", &tree_mask, "-> [position_ids [B,N] i64, ancestor_bits [B,N,ceil(N/32)] i32]", py::arg("parents"),
        py::arg("depth"), py::arg("num_nodes"), py::arg("prefix_lens"));
  m.def("accept_greedy", &accept_greedy, "-> [path [B,path_len] i64, accept_len [B] i64, next_token [B] i64]",
        py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"), py::arg("target_tokens"), py::arg("path_len"));
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
  taps_bind::register_round(m);
}
