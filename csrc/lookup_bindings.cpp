// taps_kernels._C: prompt lookup on CPU tensors. Checks here are the ones memory safety needs (dtypes, shapes,
// the lengths and node counts the loops index with); taps_kernels.ops.lookup checks the rest.
#include "lookup_bindings.h"

#include <string>
#include <vector>

#include "lookup.h"
#include "torch_checks.h"

namespace py = pybind11;

namespace taps_bind {

namespace {

template <typename T>
void check_range(const at::Tensor& t, const std::string& name, int64_t lo, int64_t hi, const std::string& what) {
  const T* p = t.data_ptr<T>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (p[i] < lo || p[i] > hi) {
      throw py::value_error(name + "[" + std::to_string(i) + "]: expected " + what + " in [" + std::to_string(lo) +
                            ", " + std::to_string(hi) + "], received " + std::to_string(static_cast<int64_t>(p[i])));
    }
  }
}

std::vector<at::Tensor> lookup_chain(const at::Tensor& tokens, const at::Tensor& lengths, int64_t num_tokens,
                                     int64_t max_ngram) {
  check_arg(tokens, "tokens", {at::kLong}, {-1, -1});
  const int64_t B = tokens.size(0), C = tokens.size(1);
  check_arg(lengths, "lengths", {at::kLong}, {B});
  if (num_tokens < 0) throw py::value_error("num_tokens: expected >= 0, received " + std::to_string(num_tokens));
  at::Tensor tok = tokens.contiguous(), len = lengths.contiguous();
  check_range<int64_t>(len, "lengths", 0, C, "a history length");
  auto opts = tokens.options();
  at::Tensor chain = at::empty({B, num_tokens}, opts), chain_len = at::empty({B}, opts), ngram = at::empty({B}, opts),
             sibling = at::empty({B}, opts);
  {
    py::gil_scoped_release no_gil;
    taps::lookup_chain(tok.data_ptr<int64_t>(), len.data_ptr<int64_t>(), B, C, num_tokens, max_ngram,
                       chain.data_ptr<int64_t>(), chain_len.data_ptr<int64_t>(), ngram.data_ptr<int64_t>(),
                       sibling.data_ptr<int64_t>());
  }
  return {chain, chain_len, ngram, sibling};
}

std::vector<at::Tensor> graft_chain(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depth,
                                    const at::Tensor& num_nodes, const at::Tensor& log_reach, const at::Tensor& chain,
                                    const at::Tensor& chain_len, const at::Tensor& chain_log_reach) {
  check_arg(tokens, "tree.tokens", {at::kLong}, {-1, -1});
  const int64_t B = tokens.size(0), N = tokens.size(1);
  check_arg(parents, "tree.parents", {at::kInt}, {B, N});
  check_arg(depth, "tree.depth", {at::kInt}, {B, N});
  check_arg(num_nodes, "tree.num_nodes", {at::kInt}, {B});
  check_arg(log_reach, "log_reach", {at::kFloat}, {B, N});
  check_arg(chain, "chain", {at::kLong}, {B, -1});
  const int64_t K = chain.size(1);
  check_arg(chain_len, "chain_len", {at::kLong}, {B});
  check_arg(chain_log_reach, "chain_log_reach", {at::kFloat}, {B, K});
  at::Tensor tok = tokens.contiguous(), par = parents.contiguous(), dep = depth.contiguous(),
             num = num_nodes.contiguous(), reach = log_reach.contiguous(), ch = chain.contiguous(),
             clen = chain_len.contiguous(), creach = chain_log_reach.contiguous();
  check_range<int32_t>(num, "tree.num_nodes", 0, N, "a node count");
  const int64_t W = N + K;
  at::Tensor out_tok = at::empty({B, W}, tokens.options()), out_par = at::empty({B, W}, parents.options()),
             out_dep = at::empty({B, W}, depth.options()), out_num = at::empty({B}, num_nodes.options()),
             out_reach = at::empty({B, W}, log_reach.options()), nodes = at::empty({B, K}, chain.options());
  {
    py::gil_scoped_release no_gil;
    taps::graft_chain(tok.data_ptr<int64_t>(), par.data_ptr<int32_t>(), dep.data_ptr<int32_t>(),
                      num.data_ptr<int32_t>(), reach.data_ptr<float>(), B, N, ch.data_ptr<int64_t>(),
                      clen.data_ptr<int64_t>(), creach.data_ptr<float>(), K, out_tok.data_ptr<int64_t>(),
                      out_par.data_ptr<int32_t>(), out_dep.data_ptr<int32_t>(), out_num.data_ptr<int32_t>(),
                      out_reach.data_ptr<float>(), nodes.data_ptr<int64_t>());
  }
  return {out_tok, out_par, out_dep, out_num, out_reach, nodes};
}

}  // namespace

void register_lookup(py::module& m) {
  m.def("lookup_chain", &lookup_chain, "tokens [B,C] int64, lengths [B] int64, num_tokens, max_ngram -> "
        "[chain [B,K] int64, chain_len [B] int64, ngram [B] int64, sibling [B] int64 (-1: none)]", py::arg("tokens"),
        py::arg("lengths"), py::arg("num_tokens"), py::arg("max_ngram"));
  m.def("graft_chain", &graft_chain, "tree (tokens [B,N] int64, parents/depth [B,N] int32, num_nodes [B] int32), "
        "log_reach [B,N] f32, chain [B,K] int64, chain_len [B] int64, chain_log_reach [B,K] f32 -> "
        "[tokens, parents, depth, num_nodes, log_reach (width N+K), chain_nodes [B,K] int64]",
        py::arg("tokens"), py::arg("parents"), py::arg("depth"), py::arg("num_nodes"), py::arg("log_reach"),
        py::arg("chain"), py::arg("chain_len"), py::arg("chain_log_reach"));
}

}  // namespace taps_bind
