// The target's decode / verify forward over GGUF blocks (Llama and Qwen3 decoder layers), on raw host
// pointers, no torch: embedding, RMSNorm, RoPE, GQA attention over a preallocated cache with a tree's
// visibility, SwiGLU, the final norm and the head, in one call (no per-op dispatch). The cache holds float32 or
// float16 (CacheType); a float16 cache rounds each key and value once, when its row writes it.
//
// Rows are independent by construction: every float a row's outputs depend on is computed by the same
// sequence of operations whatever the other rows are, how many there are, where the row sits in the call
// and how work is split over threads. The linear layers follow gguf_linear.h. Attention of query row i sees
// its visible keys in cache order (the row's committed prefix, then its tree ancestors in node order, then
// itself) and reduces over that sequence only: scores in tiles of 16 consecutive visible keys, the softmax
// max / sum and the value sum in that order. So a tree node's row equals the same token's row in plain
// decoding (its path committed, the node decoded alone) bit for bit, and a prefill leaves the same cache as
// decoding the prompt one token at a time.
//
// The per-row math runs on AVX-512F or on AVX2 + FMA + F16C (gguf_row_ops.h picks one per process);
// gguf::packed_linear picks VNNI, AVX2 or its plain loops by itself.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "gguf_linear.h"

namespace taps {
namespace gguf {

// What the KV cache stores: float32, or float16 (IEEE binary16 bits; written rounded to nearest even, read
// back exactly as float32, so a key's float32 value does not depend on when or by which row it was read).
enum class CacheType { F32, F16 };

inline int64_t cache_bytes(CacheType t) { return t == CacheType::F16 ? 2 : 4; }

struct PackedMatrix {
  BlockType type = BlockType::Q4_1;
  const uint8_t* data = nullptr;  // packed layout of gguf_linear.h
  int64_t rows = 0, cols = 0;     // N (outputs), K (inputs)
};

struct LayerWeights {
  const float* attn_norm = nullptr;  // [hidden]
  const float* q_norm = nullptr;     // [head_dim] or null (Qwen3 normalises q and k per head)
  const float* k_norm = nullptr;
  const float* ffn_norm = nullptr;   // [hidden]
  PackedMatrix q, k, v, o, gate, up, down;
};

struct ModelWeights {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0, vocab = 0;
  float rms_eps = 1e-5f;
  double rope_base = 10000.0;
  std::vector<LayerWeights> layers;
  PackedMatrix embed;              // [vocab, hidden], Q8_0 or Q4_1 (rows are dequantised for the lookup)
  const float* final_norm = nullptr;
  PackedMatrix head;               // [head rows, hidden]: the embedding again when tied, or a vocabulary subset
  int64_t activation_digits = 1;   // 1 or 2: int8 activations, or two int8 digits of them (gguf_linear.h)
};

// One forward over B rows of N new tokens each (M = B * N query rows, row index b * N + j).
struct ForwardBatch {
  int64_t B = 0, N = 0;
  const int64_t* tokens = nullptr;       // [B, N]
  const int64_t* positions = nullptr;    // [B, N] RoPE positions
  const int64_t* prefix_lens = nullptr;  // [B] committed keys of each row; node j is written at prefix + j
  const int64_t* cache_rows = nullptr;   // [B] cache row each batch row reads and writes
  const int32_t* bits = nullptr;         // [B, N, words]: bit j%32 of word j/32 = node j visible (self included)
  int64_t words = 0;
  // cache: one K and one V buffer per layer, [cache_batch, kv_heads, capacity, head_dim] of cache_type
  void* const* keys = nullptr;
  void* const* values = nullptr;
  CacheType cache_type = CacheType::F32;
  int64_t cache_batch = 0, capacity = 0;
  // outputs: hidden states after the listed layers ([M, n_features * hidden]; an id equal to the last layer
  // gives the final-normed state, as transformers' hidden_states[-1]) and logits of the listed rows
  const int64_t* feature_layers = nullptr;
  int64_t n_features = 0;
  float* features = nullptr;
  const int64_t* logit_rows = nullptr;   // [n_logit_rows] query rows whose logits are computed
  int64_t n_logit_rows = 0;
  float* logits = nullptr;               // [n_logit_rows, head rows]
};

// Runs fn(begin, end) over [0, n) split into chunks (the caller's thread pool; chunking changes no bit).
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& fn)>;

// Whether this CPU can run the forward (AVX-512F, or AVX2 with FMA and F16C).
bool forward_available();

// Throws std::invalid_argument on inconsistent sizes (the bindings check tensors before calling).
void forward(const ModelWeights& w, const ForwardBatch& batch, const ParallelFor& parallel);

// Only the keys and values of every layer for rows whose layer input is given (a DFlash drafter's context rows:
// each layer projects the same hidden rows). hidden [B * N, hidden] f32; keys are RMS-normed per head (k_norm)
// and rotated at f.positions, like the forward's; both are written at slot prefix_lens[b] + j of cache row
// cache_rows[b]. Reads f.B, f.N, positions, prefix_lens, cache_rows, keys, values, cache_batch, capacity.
void context_kv(const ModelWeights& w, const float* hidden, const ForwardBatch& batch, const ParallelFor& parallel);

// RMSNorm of M rows of x [M, H] times w [H] into y (y may be x): the forward's own norm.
void rmsnorm_rows(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps);

// Dequantised rows of a packed matrix: out[i, :] = row ids[i] (exact float32 weights).
void dequantize_packed_rows(const PackedMatrix& m, const int64_t* ids, int64_t n, float* out);

}  // namespace gguf
}  // namespace taps
