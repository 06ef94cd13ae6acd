// torch bindings of the plain-CUDA kernels (module taps_kernels._C_cuda).
//
// Checks here are the cheap, host-side ones (device, dtype, shape, contiguity): they read tensor
// metadata only, never tensor values, so nothing synchronises with the device and the calls can be
// captured into CUDA graphs. Value checks (tree structure, path order) belong to the public ops.
// Kernels run on the current CUDA stream of the tensors' device.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>
#include <tuple>

#include "cuda/tree_kernels.cuh"

namespace {

std::string dtype_name(at::ScalarType t) { return std::string(c10::toString(t)); }

void check_cuda_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t ndim,
                       const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, received one on ", t.device());
  TORCH_CHECK(t.device() == device, name, ": expected a tensor on ", device, ", received one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected dtype ", dtype_name(dtype), ", received ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.dim() == ndim, name, ": expected a ", ndim, "-D tensor, received shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef want) {
  TORCH_CHECK(t.sizes() == want, name, ": expected shape ", want, ", received ", t.sizes());
}

void check_launch(cudaError_t err, const char* kernel) {
  TORCH_CHECK(err == cudaSuccess, "taps_kernels._C_cuda.", kernel, ": launch failed: ", cudaGetErrorString(err));
}

// (position_ids [B,N] int64, ancestor_bits [B,N,ceil(N/32)] int32); inputs as in tree_kernels.cuh.
std::tuple<at::Tensor, at::Tensor> tree_mask(const at::Tensor& parents, const at::Tensor& depth,
                                             const at::Tensor& num_nodes, const at::Tensor& prefix_lens) {
  const at::Device dev = parents.device();
  check_cuda_tensor(parents, "parents", at::kInt, 2, dev);
  const int64_t B = parents.size(0), N = parents.size(1);
  check_cuda_tensor(depth, "depth", at::kInt, 2, dev);
  check_shape(depth, "depth", {B, N});
  check_cuda_tensor(num_nodes, "num_nodes", at::kInt, 1, dev);
  check_shape(num_nodes, "num_nodes", {B});
  check_cuda_tensor(prefix_lens, "prefix_lens", at::kLong, 1, dev);
  check_shape(prefix_lens, "prefix_lens", {B});
  TORCH_CHECK(N >= 1, "parents: expected at least one node (the root), received shape ", parents.sizes());
  TORCH_CHECK(B <= 65535, "parents: at most 65535 trees per launch, received ", B);

  const c10::cuda::CUDAGuard guard(dev);
  auto position_ids = at::empty({B, N}, parents.options().dtype(at::kLong));
  auto bits = at::empty({B, N, (N + 31) / 32}, parents.options().dtype(at::kInt));
  check_launch(taps::cuda::launch_tree_mask(parents.data_ptr<int32_t>(), depth.data_ptr<int32_t>(),
                                            num_nodes.data_ptr<int32_t>(), prefix_lens.data_ptr<int64_t>(), B, N,
                                            position_ids.data_ptr<int64_t>(), bits.data_ptr<int32_t>(),
                                            c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               "tree_mask");
  return {position_ids, bits};
}

// (path [B,path_len] int64, accept_len [B] int64, next_token [B] int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor> accept_greedy(const at::Tensor& tokens, const at::Tensor& parents,
                                                             const at::Tensor& num_nodes,
                                                             const at::Tensor& target_tokens, int64_t path_len) {
  const at::Device dev = tokens.device();
  check_cuda_tensor(tokens, "tokens", at::kLong, 2, dev);
  const int64_t B = tokens.size(0), N = tokens.size(1);
  check_cuda_tensor(parents, "parents", at::kInt, 2, dev);
  check_shape(parents, "parents", {B, N});
  check_cuda_tensor(num_nodes, "num_nodes", at::kInt, 1, dev);
  check_shape(num_nodes, "num_nodes", {B});
  check_cuda_tensor(target_tokens, "target_tokens", at::kLong, 2, dev);
  check_shape(target_tokens, "target_tokens", {B, N});
  TORCH_CHECK(N >= 1, "tokens: expected at least one node (the root), received shape ", tokens.sizes());
  TORCH_CHECK(path_len >= 1, "path_len: expected >= 1, received ", path_len);

  const c10::cuda::CUDAGuard guard(dev);
  auto path = at::empty({B, path_len}, tokens.options());
  auto accept_len = at::empty({B}, tokens.options());
  auto next_token = at::empty({B}, tokens.options());
  check_launch(taps::cuda::launch_accept_greedy(tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(),
                                                num_nodes.data_ptr<int32_t>(), target_tokens.data_ptr<int64_t>(), B,
                                                N, path_len, path.data_ptr<int64_t>(), accept_len.data_ptr<int64_t>(),
                                                next_token.data_ptr<int64_t>(),
                                                c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               "accept_greedy");
  return {path, accept_len, next_token};
}

// In-place compaction of every cache tensor described by `table` ([T, 6] int64 on the device, rows
// as taps::cuda::CompactField; built by taps_kernels/cuda_impls.py, which keeps it alive).
void compact_kv(const at::Tensor& table, int64_t batch, int64_t cache_len, int64_t max_heads, int64_t max_row_units,
                int64_t unit_bytes, const at::Tensor& prefix_lens, const at::Tensor& path) {
  const at::Device dev = path.device();
  check_cuda_tensor(table, "table", at::kLong, 2, dev);
  TORCH_CHECK(table.size(1) == taps::cuda::kCompactNumFields, "table: expected ", taps::cuda::kCompactNumFields,
              " columns, received shape ", table.sizes());
  check_cuda_tensor(path, "path", at::kLong, 2, dev);
  check_shape(path, "path", {batch, path.size(1)});
  check_cuda_tensor(prefix_lens, "prefix_lens", at::kLong, 1, dev);
  check_shape(prefix_lens, "prefix_lens", {batch});
  TORCH_CHECK(unit_bytes == 2 || unit_bytes == 4 || unit_bytes == 8 || unit_bytes == 16,
              "unit_bytes: expected 2, 4, 8 or 16, received ", unit_bytes);
  TORCH_CHECK(batch <= 65535 && table.size(0) <= 65535, "compact_kv: at most 65535 requests and cache tensors, "
              "received ", batch, " and ", table.size(0));

  const c10::cuda::CUDAGuard guard(dev);
  check_launch(taps::cuda::launch_compact_kv(table.data_ptr<int64_t>(), table.size(0), batch, cache_len, max_heads,
                                             max_row_units, static_cast<int>(unit_bytes),
                                             prefix_lens.data_ptr<int64_t>(), path.data_ptr<int64_t>(), path.size(1),
                                             c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               "compact_kv");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "taps_kernels CUDA bookkeeping kernels (tree mask, greedy acceptance walk, KV compaction)";
  m.def("tree_mask", &tree_mask, "(parents, depth, num_nodes, prefix_lens) -> (position_ids, ancestor_bits)",
        py::arg("parents"), py::arg("depth"), py::arg("num_nodes"), py::arg("prefix_lens"));
  m.def("accept_greedy", &accept_greedy,
        "(tokens, parents, num_nodes, target_tokens, path_len) -> (path, accept_len, next_token)", py::arg("tokens"),
        py::arg("parents"), py::arg("num_nodes"), py::arg("target_tokens"), py::arg("path_len"));
  m.def("compact_kv", &compact_kv,
        "(table, batch, cache_len, max_heads, max_row_units, unit_bytes, prefix_lens, path): in place",
        py::arg("table"), py::arg("batch"), py::arg("cache_len"), py::arg("max_heads"), py::arg("max_row_units"),
        py::arg("unit_bytes"), py::arg("prefix_lens"), py::arg("path"));
  m.attr("COMPACT_NUM_FIELDS") = static_cast<int>(taps::cuda::kCompactNumFields);
}
