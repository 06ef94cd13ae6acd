// taps_kernels._C: the edge scorer on CPU tensors (checks what memory safety needs; taps_kernels.ops.score the rest).
#include "score_bindings.h"

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bind_common.h"
#include "score_edges.h"

namespace py = pybind11;

namespace taps_bind {

// ------------------------------------------------------------------------------------------- score edges
namespace {

template <typename T>
void load_row_as_float(const taps::TokenTable& t, int64_t row, float* out) {
  const T* p = static_cast<const T*>(t.data) + row * t.row_stride;
  if (t.col_stride == 1) {
    for (int64_t e = 0; e < t.width; ++e) out[e] = static_cast<float>(p[e]);
  } else {
    for (int64_t e = 0; e < t.width; ++e) out[e] = static_cast<float>(p[e * t.col_stride]);
  }
}

}  // namespace

// The ScorerWeights fields as the binding receives them (ScorerWeights.tensors(), float32): checked one
// by one so that an error names the field; the contiguous copies are kept alive in `held`.
namespace {

const char* const kHeadFields[] = {"ln_weight", "ln_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"};
const char* const kEmbeddingFields[] = {"token_proj_weight", "token_proj_bias", "depth_embedding",
                                        "hidden_proj_weight", "hidden_proj_bias"};

}  // namespace

ScorerArgs check_scorer(const std::map<std::string, at::Tensor>& w, double ln_eps) {
  for (const auto& kv : w) {
    bool known = false;
    for (const char* f : kEmbeddingFields) known = known || kv.first == f;
    for (const char* head : {"edge_", "other_"})
      for (const char* f : kHeadFields) known = known || kv.first == std::string(head) + f;
    if (!known) throw py::value_error("weights." + kv.first + ": not a ScorerWeights tensor field");
  }
  ScorerArgs s;
  taps::ScorerNet& net = s.net;
  auto field = [&](const std::string& name, std::vector<int64_t> sizes) -> const at::Tensor& {
    auto it = w.find(name);
    if (it == w.end()) {
      throw py::value_error("weights." + name + ": missing (every scorer needs both heads; the full one also "
                            "token_proj_*, depth_embedding, hidden_proj_*)");
    }
    check_arg(it->second, "weights." + name, {at::kFloat}, std::move(sizes));
    return it->second;
  };
  auto keep = [&](const at::Tensor& t) {
    s.held.push_back(t.contiguous());
    return s.held.back().data_ptr<float>();
  };
  const int64_t F = field("edge_ln_weight", {-1}).size(0);
  net.full = w.count("token_proj_weight") > 0;
  if (net.full) {
    const at::Tensor& tok = field("token_proj_weight", {-1, -1});
    const at::Tensor& dep = field("depth_embedding", {-1, -1});
    const at::Tensor& hid = field("hidden_proj_weight", {-1, -1});
    net.Pt = check_count("weights.token_proj_weight.shape[0]", tok.size(0), 0);
    net.Pd = check_count("weights.depth_embedding.shape[1]", dep.size(1), 0);
    net.Ph = check_count("weights.hidden_proj_weight.shape[0]", hid.size(0), 0);
    net.H = check_count("weights.hidden_proj_weight.shape[1]", hid.size(1), 0);
    net.depth_rows = check_count("weights.depth_embedding.shape[0]", dep.size(0), 1);
    s.embed_dim = tok.size(1);
    net.token_proj_weight = keep(tok);
    net.token_proj_bias = keep(field("token_proj_bias", {net.Pt}));
    net.depth_embedding = keep(dep);
    net.hidden_proj_weight = keep(hid);
    net.hidden_proj_bias = keep(field("hidden_proj_bias", {net.Ph}));
  } else {
    for (const char* f : kEmbeddingFields) {
      if (w.count(f)) throw py::value_error(std::string("weights.") + f + ": the tiny scorer (no token_proj_weight) "
                                            "has no embedding parts");
    }
  }
  const int64_t want_F = 2 * int64_t{net.Pt} + net.Pd + net.Ph + 7;
  if (F != want_F) {
    throw py::value_error("weights.edge_ln_weight: expected " + std::to_string(want_F) + " features (2*Pt + Pd + Ph + 7 "
                          "with Pt=" + std::to_string(net.Pt) + ", Pd=" + std::to_string(net.Pd) + ", Ph=" +
                          std::to_string(net.Ph) + "), received shape (" + std::to_string(F) + ",)");
  }
  const int64_t M = field("edge_fc1_weight", {-1, F}).size(0);
  net.F = check_count("weights.edge_ln_weight.shape[0]", F, 1);
  net.M = check_count("weights.edge_fc1_weight.shape[0]", M, 0);
  net.ln_eps = static_cast<float>(ln_eps);
  for (int h = 0; h < 2; ++h) {
    const std::string head = h == 0 ? "edge_" : "other_";
    taps::ScorerHead& out = h == 0 ? net.edge : net.other;
    out.ln_weight = keep(field(head + "ln_weight", {F}));
    out.ln_bias = keep(field(head + "ln_bias", {F}));
    out.fc1_weight = keep(field(head + "fc1_weight", {M, F}));
    out.fc1_bias = keep(field(head + "fc1_bias", {M}));
    out.fc2_weight = keep(field(head + "fc2_weight", {1, M}));
    out.fc2_bias = keep(field(head + "fc2_bias", {1}));
  }
  return s;
}

taps::TokenTable token_table(const at::Tensor& emb) {
  // Strided reads instead of .contiguous(): a transposed or sliced table must not be copied whole.
  taps::TokenTable table;
  table.data = emb.data_ptr();
  table.rows = emb.size(0);
  table.width = emb.size(1);
  table.row_stride = emb.stride(0);
  table.col_stride = emb.stride(1);
  switch (emb.scalar_type()) {
    case at::kHalf: table.load_row = &load_row_as_float<at::Half>; break;
    case at::kBFloat16: table.load_row = &load_row_as_float<at::BFloat16>; break;
    default: table.load_row = &load_row_as_float<float>; break;
  }
  return table;
}

namespace {

// Pool tensors as in CandidatePool (tree [B,N], logq/step_logq [B,N] f32, per-position stats [B,D] f32);
// weights: ScorerWeights.tensors() as float32, or None for the marginal model.
std::vector<at::Tensor> score_edges(const at::Tensor& tokens_in, const at::Tensor& parents_in, const at::Tensor& depth_in,
                                    const at::Tensor& logq_in, const at::Tensor& step_logq_in,
                                    const at::Tensor& entropy_in, const at::Tensor& margin_in,
                                    const at::Tensor& topk_mass_in,
                                    const std::optional<std::map<std::string, at::Tensor>>& weights, double ln_eps,
                                    const std::optional<at::Tensor>& token_embeddings,
                                    const std::optional<at::Tensor>& drafter_hidden) {
  check_arg(tokens_in, "pool.tree.tokens", {at::kLong}, {-1, -1});
  const int64_t B = tokens_in.size(0), N = tokens_in.size(1);
  if (N < 1) throw py::value_error("pool.tree.tokens: expected at least one node, received shape " +
                                   shape_str(tokens_in.sizes()));
  check_count("pool.tree.tokens.shape[1]", N, 1);
  check_arg(parents_in, "pool.tree.parents", {at::kInt}, {B, N});
  check_arg(depth_in, "pool.tree.depth", {at::kInt}, {B, N});
  check_arg(logq_in, "pool.logq", {at::kFloat}, {B, N});
  check_arg(step_logq_in, "pool.step_logq", {at::kFloat}, {B, N});
  check_arg(entropy_in, "pool.entropy", {at::kFloat}, {B, -1});
  const int64_t D = entropy_in.size(1);
  check_count("pool.entropy.shape[1]", D, 0);
  if (D < 1) {
    throw py::value_error("pool.entropy: the scorer needs at least one draft position, received shape " +
                          shape_str(entropy_in.sizes()));
  }
  check_arg(margin_in, "pool.margin", {at::kFloat}, {B, D});
  check_arg(topk_mass_in, "pool.topk_mass", {at::kFloat}, {B, D});
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous(), depth = depth_in.contiguous(),
                   logq = logq_in.contiguous(), step_logq = step_logq_in.contiguous(),
                   entropy = entropy_in.contiguous(), margin = margin_in.contiguous(),
                   topk_mass = topk_mass_in.contiguous();
  check_parent_range(parents, "pool.tree.parents");
  check_log_values(logq, "pool.logq", &parents);
  check_log_values(step_logq, "pool.step_logq", &parents);
  check_no_nan(entropy, "pool.entropy");
  check_no_nan(margin, "pool.margin");
  check_no_nan(topk_mass, "pool.topk_mass");

  std::optional<ScorerArgs> scorer;
  taps::TokenTable table;
  at::Tensor hidden;
  if (weights.has_value()) {
    scorer = check_scorer(*weights, ln_eps);
    if (D < 1) {
      throw py::value_error("pool.entropy: the scorer needs at least one draft position, received shape " +
                            shape_str(entropy_in.sizes()));
    }
  }
  if (scorer && scorer->net.full) {
    const taps::ScorerNet& net = scorer->net;
    const int64_t E = scorer->embed_dim;
    if (!token_embeddings.has_value() || !token_embeddings->defined()) {
      throw py::type_error("token_embeddings: the full scorer needs a [V, E] tensor, received None");
    }
    if (!drafter_hidden.has_value() || !drafter_hidden->defined()) {
      throw py::type_error("drafter_hidden: the full scorer needs a [B, D, H] tensor, received None");
    }
    const at::Tensor& emb = *token_embeddings;
    check_arg(emb, "token_embeddings", {at::kFloat, at::kHalf, at::kBFloat16}, {-1, E});
    check_arg(*drafter_hidden, "drafter_hidden", {at::kFloat, at::kHalf, at::kBFloat16}, {B, D, net.H});
    const int64_t V = emb.size(0);
    const int64_t* tk = tokens.data_ptr<int64_t>();
    for (int64_t k = 0; k < B * N; ++k) {
      if (tk[k] < 0 || tk[k] >= V) {
        throw py::value_error("pool.tree.tokens[" + std::to_string(k / N) + "," + std::to_string(k % N) +
                              "]: token " + std::to_string(tk[k]) + " is outside token_embeddings' " +
                              std::to_string(V) + " rows");
      }
    }
    table = token_table(emb);
    hidden = drafter_hidden->to(at::kFloat).contiguous();
  }
  py::gil_scoped_release no_gil;
  at::Tensor edge_logq = at::empty({B, N}, at::kFloat), other_logq = at::empty({B, N}, at::kFloat),
             log_reach = at::empty({B, N}, at::kFloat);
  const taps::ScorerNet* net = scorer ? &scorer->net : nullptr;
  const int64_t H = net ? net->H : 0;
  float* eo = edge_logq.data_ptr<float>();
  float* oo = other_logq.data_ptr<float>();
  float* ro = log_reach.data_ptr<float>();
  for_batch(B, net ? 2 * N * net->F * net->M : N, [&](int64_t b) {
    thread_local taps::ScoreWorkspace ws;
    taps::ScoreTree t;
    t.tokens = tokens.data_ptr<int64_t>() + b * N;
    t.parents = parents.data_ptr<int32_t>() + b * N;
    t.depth = depth.data_ptr<int32_t>() + b * N;
    t.N = static_cast<int32_t>(N);
    t.logq = logq.data_ptr<float>() + b * N;
    t.step_logq = step_logq.data_ptr<float>() + b * N;
    t.entropy = entropy.data_ptr<float>() + b * D;
    t.margin = margin.data_ptr<float>() + b * D;
    t.topk_mass = topk_mass.data_ptr<float>() + b * D;
    t.D = static_cast<int32_t>(D);
    const float* hid = hidden.defined() ? hidden.data_ptr<float>() + b * D * H : nullptr;
    taps::score_edges_one(t, net, &table, hid, eo + b * N, oo + b * N, ro + b * N, ws);
  });
  return {edge_logq, other_logq, log_reach};
}


}  // namespace

void register_score(py::module& m) {
  m.def("score_edges", &score_edges,
        "pool tree tokens/parents/depth [B,N], logq/step_logq [B,N] f32, entropy/margin/topk_mass [B,D] f32, "
        "weights {ScorerWeights field: f32 tensor} or None, ln_eps, token_embeddings [V,E] f32/f16/bf16 or None, "
        "drafter_hidden [B,D,H] float or None -> [edge_logq, other_logq, log_reach] [B,N] f32",
        py::arg("tokens"), py::arg("parents"), py::arg("depth"), py::arg("logq"), py::arg("step_logq"),
        py::arg("entropy"), py::arg("margin"), py::arg("topk_mass"), py::arg("weights"), py::arg("ln_eps") = 1e-5,
        py::arg("token_embeddings") = py::none(), py::arg("drafter_hidden") = py::none());
}

}  // namespace taps_bind
