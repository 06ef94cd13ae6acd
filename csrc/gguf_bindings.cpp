// taps_kernels._C: the GGUF block kernels and the decoder forward on CPU tensors.
//
// Checks here are the memory-safety ones (dtype, shape, contiguity, sizes the kernels index with); errors
// name the argument, the expectation and what arrived. Work is split over torch's intra-op threads by output
// groups / rows, which changes no bit (gguf_linear.h).
#include "gguf_bindings.h"

#include <ATen/Parallel.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "gguf_forward.h"
#include "gguf_linear.h"
#include "rows_linear.h"
#include "torch_checks.h"

namespace py = pybind11;
using taps::gguf::BlockType;

namespace taps_bind {

namespace {

BlockType block_type(int64_t t, const std::string& name) {
  if (t == static_cast<int64_t>(BlockType::Q4_1)) return BlockType::Q4_1;
  if (t == static_cast<int64_t>(BlockType::Q8_0)) return BlockType::Q8_0;
  throw py::value_error(name + ": GGML type " + std::to_string(t) +
                        " is not supported; expected Q4_1 (3) or Q8_0 (8)");
}

int64_t check_cols(int64_t K, const std::string& name) {
  if (K <= 0 || K % taps::gguf::kBlock != 0) {
    throw py::value_error(name + ": expected a positive multiple of 32 input columns (whole GGUF blocks), received " +
                          std::to_string(K));
  }
  return K;
}

void check_contiguous(const at::Tensor& t, const std::string& name) {
  if (!t.is_contiguous()) throw py::value_error(name + ": expected a contiguous tensor (rows of whole blocks)");
}

const taps::gguf::ParallelFor& torch_parallel() {
  static const taps::gguf::ParallelFor pf = [](int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    at::parallel_for(0, n, 1, fn);
  };
  return pf;
}

// Checks GGUF rows raw [N, K/32 * block_bytes] uint8 (as the file stores them) of GGML type `type`.
BlockType check_raw(const at::Tensor& raw, int64_t type, int64_t K, const std::string& name) {
  const BlockType t = block_type(type, name);
  check_cols(K, name);
  check_arg(raw, name, {at::kByte}, {-1, K / taps::gguf::kBlock * taps::gguf::block_bytes(t)});
  check_contiguous(raw, name);
  return t;
}

// raw GGUF rows -> packed uint8 [packed_bytes] (gguf_linear.h)
at::Tensor gguf_pack(const at::Tensor& raw, int64_t type, int64_t K, const std::string& name) {
  const BlockType t = check_raw(raw, type, K, name);
  at::Tensor out = at::empty({taps::gguf::packed_bytes(t, raw.size(0), K)}, raw.options());
  taps::gguf::pack_blocks(t, raw.data_ptr<uint8_t>(), raw.size(0), K, out.data_ptr<uint8_t>());
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& raw, int64_t type, int64_t K, const std::string& name) {
  const BlockType t = check_raw(raw, type, K, name);
  at::Tensor out = at::empty({raw.size(0), K}, raw.options().dtype(at::kFloat));
  taps::gguf::dequantize_blocks(t, raw.data_ptr<uint8_t>(), raw.size(0), K, out.data_ptr<float>());
  return out;
}

// path "auto" (the CPU's own: taps::gguf::kernel_path()) or a named one; an error names a path this CPU lacks.
taps::gguf::KernelPath kernel_path_arg(const std::string& path) {
  using taps::gguf::KernelPath;
  if (path == "auto") return taps::gguf::kernel_path();
  if (path == "scalar") return KernelPath::Scalar;
  if (path == "avx2") {
    if (!taps::gguf::avx2_available()) throw py::value_error("path: 'avx2' asked, but this CPU lacks AVX2/FMA/F16C");
    return KernelPath::Avx2;
  }
  if (path == "vnni" || path == "amx-emulated") {
    if (!taps::gguf::vnni_available()) {
      throw py::value_error("path: '" + path + "' asked, but this CPU lacks AVX-512 VNNI");
    }
    return path == "vnni" ? KernelPath::Vnni : KernelPath::AmxEmulated;
  }
  if (path == "amx") {
    if (!taps::gguf::amx_available()) {
      throw py::value_error("path: 'amx' asked, but this CPU lacks AMX-INT8 or its start-up check failed");
    }
    return KernelPath::Amx;
  }
  throw py::value_error("path: expected 'auto', 'amx', 'amx-emulated', 'vnni', 'avx2' or 'scalar', received '" +
                        path + "'");
}

int64_t check_digits(int64_t digits) {
  if (digits != 1 && digits != 2) {
    throw py::value_error("activation_digits: expected 1 or 2, received " + std::to_string(digits));
  }
  return digits;
}

// x [M, K] -> digits * M rows of (a, scale, asum): the leading digits of the M rows, then (two digits) their
// residual digits (gguf_linear.h).
std::vector<at::Tensor> gguf_quantize_activations(const at::Tensor& x_in, const std::string& path, int64_t digits) {
  const taps::gguf::KernelPath kp = kernel_path_arg(path);
  check_digits(digits);
  check_arg(x_in, "x", {at::kFloat}, {-1, -1});
  const int64_t M = x_in.size(0), K = check_cols(x_in.size(1), "x");
  const at::Tensor x = x_in.contiguous();
  at::Tensor a = at::empty({digits * M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({digits * M, K / 32}, x.options());
  at::Tensor asum = at::empty({digits * M, K / 32}, x.options().dtype(at::kInt));
  taps::gguf::quantize_activations_digits(x.data_ptr<float>(), M, K, a.data_ptr<int8_t>(), scale.data_ptr<float>(),
                                          asum.data_ptr<int32_t>(), digits, M, kp);
  return {a, scale, asum};
}

// x [M, K] f32 . packed [N, K]^T -> y [M, N] f32 through the kernels of `path` (kernel_path_arg).
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t type, int64_t N, int64_t K,
                       const std::string& path, int64_t digits) {
  check_digits(digits);
  const BlockType t = block_type(type, "weight");
  check_cols(K, "weight");
  check_arg(x_in, "x", {at::kFloat}, {-1, K});
  if (N <= 0) throw py::value_error("weight: expected at least one output row, received " + std::to_string(N));
  check_arg(packed, "weight", {at::kByte}, {taps::gguf::packed_bytes(t, N, K)});
  check_contiguous(packed, "weight");
  const taps::gguf::KernelPath kp = kernel_path_arg(path);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), KB = K / 32;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<int8_t> a(digits * M * K);
  std::vector<float> scale(digits * M * KB), both(digits == 2 ? 2 * M * N : 0);
  std::vector<int32_t> asum(digits * M * KB);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  py::gil_scoped_release no_gil;
  const int64_t groups = (N + taps::gguf::kGroupRows - 1) / taps::gguf::kGroupRows;
  taps::gguf::quantize_activations_digits(x.data_ptr<float>(), M, K, a.data(), scale.data(), asum.data(), digits, M,
                                          kp);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    taps::gguf::packed_linear_digits(t, w, N, K, a.data(), scale.data(), asum.data(), M, digits, both.data(), yp, N,
                                     g0, g1, kp);
  });
  return y;
}

// A packed matrix handed over from Python: (packed uint8 tensor, GGML type, N, K).
taps::gguf::PackedMatrix matrix(const py::tuple& m, const std::string& name, std::vector<at::Tensor>& keep) {
  if (m.size() != 4) throw py::value_error(name + ": expected (packed, type, rows, cols)");
  at::Tensor data = m[0].cast<at::Tensor>();
  taps::gguf::PackedMatrix out;
  out.type = block_type(m[1].cast<int64_t>(), name);
  out.rows = m[2].cast<int64_t>();
  out.cols = check_cols(m[3].cast<int64_t>(), name);
  check_arg(data, name, {at::kByte}, {taps::gguf::packed_bytes(out.type, out.rows, out.cols)});
  check_contiguous(data, name);
  out.data = data.data_ptr<uint8_t>();
  keep.push_back(data);
  return out;
}

const float* vector_arg(const py::object& o, const std::string& name, int64_t n, std::vector<at::Tensor>& keep) {
  if (o.is_none()) return nullptr;
  at::Tensor t = o.cast<at::Tensor>();
  check_arg(t, name, {at::kFloat}, {n});
  t = t.contiguous();
  keep.push_back(t);
  return t.data_ptr<float>();
}

class GGUFModel {
 public:
  // config: hidden, heads, kv_heads, head_dim, ffn, vocab, rms_eps, rope_base; layers: one dict per layer with
  // attn_norm, ffn_norm, q_norm/k_norm (or None) and q, k, v, o, gate, up, down as packed-matrix tuples.
  GGUFModel(const py::dict& config, const py::list& layers, const py::object& embed, const at::Tensor& final_norm,
            const py::object& head) {
    w_.hidden = config["hidden"].cast<int64_t>();
    w_.heads = config["heads"].cast<int64_t>();
    w_.kv_heads = config["kv_heads"].cast<int64_t>();
    w_.head_dim = config["head_dim"].cast<int64_t>();
    w_.ffn = config["ffn"].cast<int64_t>();
    w_.vocab = config["vocab"].cast<int64_t>();
    w_.rms_eps = config["rms_eps"].cast<float>();
    w_.rope_base = config["rope_base"].cast<double>();
    if (config.contains("activation_digits")) {
      w_.activation_digits = check_digits(config["activation_digits"].cast<int64_t>());
    }
    const int64_t H = w_.hidden, QD = w_.heads * w_.head_dim, KD = w_.kv_heads * w_.head_dim;
    auto expect = [&](const taps::gguf::PackedMatrix& m, int64_t n, int64_t k, const std::string& name) {
      if (m.rows != n || m.cols != k) {
        throw py::value_error(name + ": expected [" + std::to_string(n) + ", " + std::to_string(k) + "], received [" +
                              std::to_string(m.rows) + ", " + std::to_string(m.cols) + "]");
      }
      return m;
    };
    for (size_t l = 0; l < layers.size(); ++l) {
      const py::dict d = layers[l].cast<py::dict>();
      const std::string p = "layers[" + std::to_string(l) + "].";
      taps::gguf::LayerWeights lw;
      lw.attn_norm = vector_arg(d["attn_norm"], p + "attn_norm", H, keep_);
      lw.ffn_norm = vector_arg(d["ffn_norm"], p + "ffn_norm", H, keep_);
      lw.q_norm = vector_arg(d["q_norm"], p + "q_norm", w_.head_dim, keep_);
      lw.k_norm = vector_arg(d["k_norm"], p + "k_norm", w_.head_dim, keep_);
      lw.q = expect(matrix(d["q"].cast<py::tuple>(), p + "q", keep_), QD, H, p + "q");
      lw.k = expect(matrix(d["k"].cast<py::tuple>(), p + "k", keep_), KD, H, p + "k");
      lw.v = expect(matrix(d["v"].cast<py::tuple>(), p + "v", keep_), KD, H, p + "v");
      lw.o = expect(matrix(d["o"].cast<py::tuple>(), p + "o", keep_), H, QD, p + "o");
      lw.gate = expect(matrix(d["gate"].cast<py::tuple>(), p + "gate", keep_), w_.ffn, H, p + "gate");
      lw.up = expect(matrix(d["up"].cast<py::tuple>(), p + "up", keep_), w_.ffn, H, p + "up");
      lw.down = expect(matrix(d["down"].cast<py::tuple>(), p + "down", keep_), H, w_.ffn, p + "down");
      w_.layers.push_back(lw);
    }
    // embed and head None: a model that only writes context keys and values (context_kv)
    if (!embed.is_none()) w_.embed = expect(matrix(embed.cast<py::tuple>(), "embed", keep_), w_.vocab, H, "embed");
    w_.final_norm = vector_arg(py::cast(final_norm), "final_norm", H, keep_);
    if (!head.is_none()) {
      w_.head = matrix(head.cast<py::tuple>(), "head", keep_);  // any number of rows: a draft vocabulary's subset
      if (w_.head.cols != H) {
        throw py::value_error("head: expected " + std::to_string(H) + " input columns, received " +
                              std::to_string(w_.head.cols));
      }
    }
  }

  // tokens/positions [B, N] i64, prefix_lens/cache_rows [B] i64, bits [B, N, W] i32, keys/values: one
  // [R, kv_heads, capacity, head_dim] f32 or f16 per layer (written in place at prefix + j), feature_layers [F] i64,
  // logit_rows [n] i64 -> (logits [n, head rows] f32, features [B, N, F * hidden] f32)
  std::vector<at::Tensor> forward(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& prefix_lens,
                                  const at::Tensor& cache_rows, const at::Tensor& bits, const std::vector<at::Tensor>& keys,
                                  const std::vector<at::Tensor>& values, const at::Tensor& feature_layers,
                                  const at::Tensor& logit_rows) {
    if (w_.embed.data == nullptr || w_.head.data == nullptr) {
      throw py::value_error("forward: this model was built without an embedding and a head (context_kv only)");
    }
    check_arg(tokens, "tokens", {at::kLong}, {-1, -1});
    const int64_t B = tokens.size(0), N = tokens.size(1);
    check_arg(positions, "position_ids", {at::kLong}, {B, N});
    check_arg(prefix_lens, "prefix_lens", {at::kLong}, {B});
    check_arg(cache_rows, "cache_rows", {at::kLong}, {B});
    check_arg(bits, "ancestor_bits", {at::kInt}, {B, N, (N + 31) / 32});
    check_arg(feature_layers, "feature_layers", {at::kLong}, {-1});
    check_arg(logit_rows, "logit_rows", {at::kLong}, {-1});
    const int64_t L = static_cast<int64_t>(w_.layers.size());
    taps::gguf::ForwardBatch f;
    std::vector<void*> kp, vp;
    cache_pointers(keys, values, kp, vp, f);
    const at::Tensor tok = tokens.contiguous(), pos = positions.contiguous(), pre = prefix_lens.contiguous(),
                     rows = cache_rows.contiguous(), bt = bits.contiguous(), fl = feature_layers.contiguous(),
                     lr = logit_rows.contiguous();
    const int64_t* flp = fl.data_ptr<int64_t>();
    for (int64_t s = 0; s < fl.numel(); ++s) {
      if (flp[s] < 0 || flp[s] >= L) {
        throw py::value_error("feature_layers[" + std::to_string(s) + "]: expected a layer id in [0, " +
                              std::to_string(L) + "), received " + std::to_string(flp[s]));
      }
    }
    at::Tensor logits = at::empty({lr.numel(), w_.head.rows}, tokens.options().dtype(at::kFloat));
    at::Tensor feats = at::empty({B, N, fl.numel() * w_.hidden}, tokens.options().dtype(at::kFloat));
    f.B = B, f.N = N;
    f.tokens = tok.data_ptr<int64_t>(), f.positions = pos.data_ptr<int64_t>();
    f.prefix_lens = pre.data_ptr<int64_t>(), f.cache_rows = rows.data_ptr<int64_t>();
    f.bits = bt.data_ptr<int32_t>(), f.words = (N + 31) / 32;
    f.feature_layers = flp, f.n_features = fl.numel(), f.features = feats.data_ptr<float>();
    f.logit_rows = lr.data_ptr<int64_t>(), f.n_logit_rows = lr.numel(), f.logits = logits.data_ptr<float>();
    try {
      py::gil_scoped_release no_gil;
      taps::gguf::forward(w_, f, torch_parallel());
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
    return {logits, feats};
  }

  // hidden [B, N, hidden] f32 (every layer's input), prefix_lens/cache_rows [B] i64, keys/values as forward's:
  // writes each layer's keys (k-normed, rotated at prefix + j) and values at slot prefix + j; returns nothing.
  void context_kv(const at::Tensor& hidden, const at::Tensor& prefix_lens, const at::Tensor& cache_rows,
                  const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) {
    check_arg(hidden, "hidden", {at::kFloat}, {-1, -1, w_.hidden});
    const int64_t B = hidden.size(0), N = hidden.size(1);
    check_arg(prefix_lens, "prefix_lens", {at::kLong}, {B});
    check_arg(cache_rows, "cache_rows", {at::kLong}, {B});
    taps::gguf::ForwardBatch f;
    std::vector<void*> kp, vp;
    cache_pointers(keys, values, kp, vp, f);
    const at::Tensor h = hidden.contiguous(), pre = prefix_lens.contiguous(), rows = cache_rows.contiguous();
    const at::Tensor pos = (pre.unsqueeze(1) + at::arange(N, pre.options())).contiguous();
    f.B = B, f.N = N;
    f.positions = pos.data_ptr<int64_t>(), f.prefix_lens = pre.data_ptr<int64_t>(),
    f.cache_rows = rows.data_ptr<int64_t>();
    try {
      py::gil_scoped_release no_gil;
      taps::gguf::context_kv(w_, h.data_ptr<float>(), f, torch_parallel());
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
  }

  // The drafter's context rows from the target's features in one call: features [B, N, F] f32 -> hidden_norm(fc(.))
  // ([H, F] f32 or bf16 weight, the few-row kernel; RMSNorm with norm_weight [H] f32), then context_kv of it.
  void project_context_kv(const at::Tensor& features, const at::Tensor& fc_weight, const at::Tensor& norm_weight,
                          double eps, const at::Tensor& prefix_lens, const at::Tensor& cache_rows,
                          const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) {
    const int64_t H = w_.hidden;
    check_arg(features, "ctx_features", {at::kFloat}, {-1, -1, -1});
    const int64_t B = features.size(0), N = features.size(1), F = features.size(2);
    check_arg(fc_weight, "fc.weight", {at::kFloat, at::kBFloat16}, {H, F});
    check_arg(norm_weight, "hidden_norm.weight", {at::kFloat}, {H});
    const at::Tensor x = features.contiguous(), wfc = fc_weight.contiguous(), wn = norm_weight.contiguous();
    at::Tensor h = at::empty({B, N, H}, x.options());
    {
      py::gil_scoped_release no_gil;
      const int64_t M = B * N, tiles = (H + taps::kRowsLinearTile - 1) / taps::kRowsLinearTile;
      float* y = h.data_ptr<float>();
      const float* xp = x.data_ptr<float>();
      const bool bf16 = wfc.scalar_type() == at::kBFloat16;
      const auto* w16 = bf16 ? reinterpret_cast<const taps::Bf16*>(wfc.data_ptr<at::BFloat16>()) : nullptr;
      const float* w32 = bf16 ? nullptr : wfc.data_ptr<float>();
      at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
        if (bf16) {
          taps::rows_linear_tiles(xp, w16, nullptr, y, M, H, F, t0, t1);
        } else {
          taps::rows_linear_tiles(xp, w32, nullptr, y, M, H, F, t0, t1);
        }
      });
      taps::gguf::rmsnorm_rows(y, wn.data_ptr<float>(), y, M, H, static_cast<float>(eps));
    }
    context_kv(h, prefix_lens, cache_rows, keys, values);
  }

  // Exact float32 rows of the embedding: ids [n] i64 -> [n, hidden].
  at::Tensor embed_rows(const at::Tensor& ids_in) const {
    if (w_.embed.data == nullptr) throw py::value_error("embed_rows: this model was built without an embedding");
    check_arg(ids_in, "ids", {at::kLong}, {-1});
    const at::Tensor ids = ids_in.contiguous();
    const int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) {
      if (p[i] < 0 || p[i] >= w_.vocab) throw py::value_error("ids: token " + std::to_string(p[i]) + " outside the vocabulary");
    }
    at::Tensor out = at::empty({ids.numel(), w_.hidden}, ids.options().dtype(at::kFloat));
    taps::gguf::dequantize_packed_rows(w_.embed, p, ids.numel(), out.data_ptr<float>());
    return out;
  }

 private:
  // One contiguous [R, kv_heads, capacity, head_dim] cache tensor per layer, all of one shape and one dtype
  // (float32 or float16): f's keys, values, cache_type, cache_batch and capacity (kp / vp hold the pointers).
  void cache_pointers(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      std::vector<void*>& kp, std::vector<void*>& vp, taps::gguf::ForwardBatch& f) const {
    const int64_t L = static_cast<int64_t>(w_.layers.size());
    if (static_cast<int64_t>(keys.size()) != L || static_cast<int64_t>(values.size()) != L) {
      throw py::value_error("keys/values: expected one cache tensor per layer (" + std::to_string(L) + "), received " +
                            std::to_string(keys.size()) + " / " + std::to_string(values.size()));
    }
    kp.assign(L, nullptr), vp.assign(L, nullptr);
    check_arg(keys[0], "keys[0]", {at::kFloat, at::kHalf}, {-1, w_.kv_heads, -1, w_.head_dim});
    const at::ScalarType dtype = keys[0].scalar_type();
    const int64_t R = keys[0].size(0), cap = keys[0].size(2);
    for (int64_t l = 0; l < L; ++l) {
      const std::string kn = "keys[" + std::to_string(l) + "]", vn = "values[" + std::to_string(l) + "]";
      check_arg(keys[l], kn, {dtype}, {R, w_.kv_heads, cap, w_.head_dim});
      check_arg(values[l], vn, {dtype}, {R, w_.kv_heads, cap, w_.head_dim});
      check_contiguous(keys[l], kn);
      check_contiguous(values[l], vn);
      kp[l] = keys[l].data_ptr();
      vp[l] = values[l].data_ptr();
    }
    f.keys = kp.data(), f.values = vp.data(), f.cache_batch = R, f.capacity = cap;
    f.cache_type = dtype == at::kHalf ? taps::gguf::CacheType::F16 : taps::gguf::CacheType::F32;
  }

  taps::gguf::ModelWeights w_;
  std::vector<at::Tensor> keep_;
};

}  // namespace

void register_gguf(py::module& m) {
  m.def("gguf_pack", &gguf_pack, "raw GGUF rows [N, K/32*block_bytes] u8, GGML type, K -> packed u8 (gguf_linear.h)",
        py::arg("raw"), py::arg("type"), py::arg("cols"), py::arg("name") = "weight");
  m.def("gguf_dequantize", &gguf_dequantize, "raw GGUF rows [N, K/32*block_bytes] u8, GGML type, K -> [N, K] f32",
        py::arg("raw"), py::arg("type"), py::arg("cols"), py::arg("name") = "weight");
  m.def("gguf_quantize_activations", &gguf_quantize_activations,
        "x [M, K] f32 -> [a [D*M, K] i8, scale [D*M, K/32] f32, asum [D*M, K/32] i32] for D = activation_digits "
        "(2: the M rows' leading digits, then their residual digits); path auto|amx|amx-emulated|vnni|avx2|scalar",
        py::arg("x"), py::arg("path") = "auto", py::arg("activation_digits") = 1);
  m.def("gguf_linear", &gguf_linear,
        "x [M, K] f32, packed weight, GGML type, N, K, path, activation_digits (1 or 2) -> [M, N] f32",
        py::arg("x"), py::arg("packed"), py::arg("type"), py::arg("rows"), py::arg("cols"), py::arg("path") = "auto",
        py::arg("activation_digits") = 1);
  m.def("gguf_amx_available", &taps::gguf::amx_available,
        "whether the AMX tile kernel runs here: AMX-INT8, the tile permission, and its start-up check against VNNI");
  m.def("gguf_kernel_path", [] { return std::string(taps::gguf::kernel_path_name(taps::gguf::kernel_path())); },
        "the block kernels gguf_linear and the GGUF forward run here: 'amx' (tiles for 16-row chunks, VNNI for the "
        "rest), 'vnni', 'avx2' or 'scalar' ('amx-emulated' where TAPS_GGUF_KERNELS asks for it)");
  m.def("gguf_forward_available", &taps::gguf::forward_available,
        "whether the GGUF forward runs here (AVX-512F, or AVX2 with FMA and F16C)");
  py::class_<GGUFModel>(m, "GGUFModel")
      .def(py::init<const py::dict&, const py::list&, const py::object&, const at::Tensor&, const py::object&>(),
           py::arg("config"), py::arg("layers"), py::arg("embed"), py::arg("final_norm"), py::arg("head"))
      .def("forward", &GGUFModel::forward, py::arg("tokens"), py::arg("position_ids"), py::arg("prefix_lens"),
           py::arg("cache_rows"), py::arg("ancestor_bits"), py::arg("keys"), py::arg("values"),
           py::arg("feature_layers"), py::arg("logit_rows"))
      .def("project_context_kv", &GGUFModel::project_context_kv, py::arg("ctx_features"), py::arg("fc_weight"),
           py::arg("norm_weight"), py::arg("eps"), py::arg("prefix_lens"), py::arg("cache_rows"), py::arg("keys"),
           py::arg("values"))
      .def("context_kv", &GGUFModel::context_kv, py::arg("hidden"), py::arg("prefix_lens"), py::arg("cache_rows"),
           py::arg("keys"), py::arg("values"))
      .def("embed_rows", &GGUFModel::embed_rows, py::arg("ids"));
}

}  // namespace taps_bind
