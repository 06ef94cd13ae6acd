// Plain-CUDA bookkeeping kernels of taps_kernels: tree mask, greedy acceptance walk, KV compaction.
//
// Raw pointers and cudaStream_t only (no torch headers), so this header and tree_kernels.cu compile
// with nvcc alone; csrc/cuda/bindings_cuda.cpp wraps them for torch. Layout and semantics are the
// contract of docs/DESIGN.md; the PyTorch references in taps_kernels/reference are the spec.
//
// Every launcher enqueues on `stream`, never synchronises, and returns the launch status
// (cudaGetLastError) so the caller can raise with the kernel's name.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace taps {
namespace cuda {

// Position ids and packed ancestor bits of a batch of trees.
//   parents       [B, N] int32  parent node, -1 for the root and padding; parents[i] < i for real nodes
//   depth         [B, N] int32
//   num_nodes     [B]    int32  real rows, root included (clamped to [1, N] for memory safety)
//   prefix_lens   [B]    int64
//   position_ids  [B, N] int64  out: prefix_lens[b] + depth[b, i]
//   ancestor_bits [B, N, W] int32, W = ceil(N / 32)  out: bit j%32 of word j//32 of row i is set iff
//                 j is an ancestor of i or i itself; padding rows carry only their own bit.
cudaError_t launch_tree_mask(const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                             const int64_t* prefix_lens, int64_t batch, int64_t num_rows,
                             int64_t* position_ids, int32_t* ancestor_bits, cudaStream_t stream);

// Greedy acceptance walk, one thread block per request.
//   tokens        [B, N] int64  draft token of each node
//   parents       [B, N] int32
//   num_nodes     [B]    int32
//   target_tokens [B, N] int64  the target's token after each node
//   path          [B, P] int64  out: visited nodes, root first, -1 padded (P = path_len >= 1)
//   accept_len    [B]    int64  out: visited nodes (>= 1)
//   next_token    [B]    int64  out: target_tokens[b, last visited node]
// From node cur the walk moves to the smallest-index child j (cur < j < num_nodes) with
// parents[j] == cur and tokens[j] == target_tokens[cur]; it stops when there is none or P nodes are visited.
cudaError_t launch_accept_greedy(const int64_t* tokens, const int32_t* parents, const int32_t* num_nodes,
                                 const int64_t* target_tokens, int64_t batch, int64_t num_rows, int64_t path_len,
                                 int64_t* path, int64_t* accept_len, int64_t* next_token, cudaStream_t stream);

// Fields of one row of the compaction table (int64 each); strides and row length are in UNITS of
// `unit_bytes` bytes (the binding picks the widest unit that divides every row and stride).
enum CompactField : int {
  kCompactPtr = 0,       // device address of element [0, 0, 0, 0] of the cache tensor
  kCompactHeads = 1,     // H of this tensor
  kCompactRowUnits = 2,  // units per row: Dh * element_size / unit_bytes
  kCompactStrideB = 3,
  kCompactStrideH = 4,
  kCompactStrideL = 5,
  kCompactNumFields = 6,
};

// In-place KV compaction of every cache tensor (all layers, keys and values) in ONE launch.
//   table       [T, kCompactNumFields] int64 on the device: one row per cache tensor [B, H_t, L, Dh_t]
//   prefix_lens [B] int64
//   path        [B, P] int64  accepted nodes, root first, strictly increasing, -1 padded at the end
// For j < accept_len[b]: row prefix_lens[b] + path[b, j] moves to row prefix_lens[b] + j. Rows whose
// source or destination would fall outside [0, L) are skipped (the public op rejects them first).
// max_heads / max_row_units are the largest H_t and row length in the table (grid sizing).
// unit_bytes is 2, 4, 8 or 16; every pointer and stride must be a multiple of it.
cudaError_t launch_compact_kv(const int64_t* table, int64_t num_tensors, int64_t batch, int64_t cache_len,
                              int64_t max_heads, int64_t max_row_units, int unit_bytes, const int64_t* prefix_lens,
                              const int64_t* path, int64_t path_len, cudaStream_t stream);

}  // namespace cuda
}  // namespace taps
