// Plain-CUDA bookkeeping kernels: tree mask, greedy acceptance walk, all-layer KV compaction.
// Argument shapes are documented on each launcher in tree_kernels.cuh; only cuda_runtime is used,
// so `nvcc -c tree_kernels.cu` works without torch (the CMake object library relies on that).
#include "tree_kernels.cuh"

#include <climits>

namespace taps {
namespace cuda {
namespace {

constexpr int kMaskThreads = 128;
constexpr int kAcceptThreads = 128;
constexpr int kCompactThreads = 128;
// Rows gathered per step of the compaction: all loads of a chunk are issued before its stores.
constexpr int kCompactChunk = 4;

__device__ __forceinline__ int clamp_rows(int32_t real, int64_t num_rows) {
  // The public ops validate num_nodes; clamping only keeps a malformed input inside the buffers.
  return static_cast<int>(real < 1 ? 1 : (real > num_rows ? num_rows : real));
}

// grid (ceil(N / kMaskThreads), B), one thread per row.
// The block's rows are a contiguous slab of ancestor_bits: it is zeroed cooperatively (coalesced),
// then each thread walks its own row's parent chain. Chain nodes come in decreasing index order, so
// the word being filled only moves down: one register accumulates it and each word is stored once.
__global__ void tree_mask_kernel(const int32_t* __restrict__ parents, const int32_t* __restrict__ depth,
                                 const int32_t* __restrict__ num_nodes, const int64_t* __restrict__ prefix_lens,
                                 int64_t num_rows, int64_t num_words, int64_t* __restrict__ position_ids,
                                 uint32_t* __restrict__ bits) {
  const int64_t b = blockIdx.y;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kMaskThreads;
  const int64_t row_end = min(row0 + kMaskThreads, num_rows);
  uint32_t* slab = bits + (b * num_rows + row0) * num_words;
  const int64_t slab_words = (row_end - row0) * num_words;
  for (int64_t w = threadIdx.x; w < slab_words; w += blockDim.x) slab[w] = 0u;
  __syncthreads();

  const int64_t i = row0 + threadIdx.x;
  if (i >= num_rows) return;
  const int32_t* par = parents + b * num_rows;
  position_ids[b * num_rows + i] = prefix_lens[b] + static_cast<int64_t>(depth[b * num_rows + i]);

  uint32_t* row = bits + (b * num_rows + i) * num_words;
  const bool real = i < clamp_rows(num_nodes[b], num_rows);
  int64_t cur = i;
  int64_t word = cur >> 5;
  uint32_t acc = 0u;
  while (true) {
    const int64_t w = cur >> 5;
    if (w != word) {
      row[word] = acc;
      word = w;
      acc = 0u;
    }
    acc |= 1u << (cur & 31);
    if (!real) break;  // padding rows see only themselves
    const int64_t p = __ldg(par + cur);
    if (p < 0 || p >= cur) break;  // the root (or a malformed parent: never loop)
    cur = p;
  }
  row[word] = acc;
}

// grid (B), block kAcceptThreads: one block per request. Each step scans the candidates
// (cur, num_nodes) in parallel; a thread's indices increase, so its first match is its smallest,
// and a shared atomicMin picks the smallest child overall (the reference's tie rule).
__global__ void accept_greedy_kernel(const int64_t* __restrict__ tokens, const int32_t* __restrict__ parents,
                                     const int32_t* __restrict__ num_nodes,
                                     const int64_t* __restrict__ target_tokens, int64_t num_rows, int64_t path_len,
                                     int64_t* __restrict__ path, int64_t* __restrict__ accept_len,
                                     int64_t* __restrict__ next_token) {
  __shared__ int s_best;
  const int64_t b = blockIdx.x;
  const int64_t* tok = tokens + b * num_rows;
  const int32_t* par = parents + b * num_rows;
  const int64_t* tgt = target_tokens + b * num_rows;
  int64_t* out = path + b * path_len;
  const int real = clamp_rows(num_nodes[b], num_rows);

  for (int64_t j = threadIdx.x; j < path_len; j += blockDim.x) out[j] = -1;
  __syncthreads();  // the root's entry below must land after the padding fill

  int cur = 0;  // identical in every thread: all derive it from s_best
  int64_t n = 1;
  if (threadIdx.x == 0) out[0] = 0;
  while (n < path_len) {
    const int64_t want = tgt[cur];
    if (threadIdx.x == 0) s_best = INT_MAX;
    __syncthreads();
    for (int j = cur + 1 + static_cast<int>(threadIdx.x); j < real; j += blockDim.x) {
      if (par[j] == cur && tok[j] == want) {
        atomicMin(&s_best, j);
        break;
      }
    }
    __syncthreads();
    const int best = s_best;
    __syncthreads();  // everyone has read s_best before thread 0 resets it
    if (best == INT_MAX) break;
    cur = best;
    if (threadIdx.x == 0) out[n] = cur;
    ++n;
  }
  if (threadIdx.x == 0) {
    accept_len[b] = n;
    next_token[b] = tgt[cur];
  }
}

// grid (ceil(max_heads * max_row_units / kCompactThreads), B, T). Thread = one (head, unit column) of
// one (tensor, request); it moves that column for every accepted row, in ascending row order.
//
// Why this is race-free with overlapping source and destination: different threads touch disjoint
// addresses (another column, head, request or tensor), so a race could only be within one thread's
// sequence. Entry j reads row path[j] >= j and writes row j. Rows are handled in chunks of
// kCompactChunk: all loads of a chunk precede its stores (a gather), and a later chunk's sources
// path[j'] >= j' lie past every row written before it. Hence every source is read before it is
// overwritten, exactly as the reference's gather-then-scatter.
template <typename Unit>
__global__ void compact_kv_kernel(const int64_t* __restrict__ table, int64_t cache_len,
                                  const int64_t* __restrict__ prefix_lens, const int64_t* __restrict__ path,
                                  int64_t path_len) {
  const int64_t* desc = table + static_cast<int64_t>(blockIdx.z) * kCompactNumFields;
  const int64_t heads = desc[kCompactHeads];
  const int64_t row_units = desc[kCompactRowUnits];
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t h = g / row_units;
  const int64_t u = g - h * row_units;
  if (h >= heads) return;
  const int64_t b = blockIdx.y;
  Unit* base = reinterpret_cast<Unit*>(desc[kCompactPtr]) + b * desc[kCompactStrideB] + h * desc[kCompactStrideH] + u;
  const int64_t stride_l = desc[kCompactStrideL];
  const int64_t prefix = prefix_lens[b];
  const int64_t* p = path + b * path_len;

  for (int64_t j0 = 0; j0 < path_len; j0 += kCompactChunk) {
    Unit vals[kCompactChunk];
    bool move[kCompactChunk];
    bool done = false;
#pragma unroll
    for (int c = 0; c < kCompactChunk; ++c) {
      const int64_t j = j0 + c;
      const int64_t src = (j < path_len && !done) ? __ldg(p + j) : -1;
      done = done || src < 0;
      // path[j] == j is a no-op (the root always is); out-of-range rows are skipped, never touched.
      move[c] = !done && src != j && prefix + src < cache_len && prefix + j < cache_len && prefix >= 0;
      if (move[c]) vals[c] = base[(prefix + src) * stride_l];
    }
#pragma unroll
    for (int c = 0; c < kCompactChunk; ++c) {
      if (move[c]) base[(prefix + j0 + c) * stride_l] = vals[c];
    }
    if (done) break;
  }
}

template <typename Unit>
cudaError_t launch_compact_typed(const int64_t* table, int64_t num_tensors, int64_t batch, int64_t cache_len,
                                 int64_t max_heads, int64_t max_row_units, const int64_t* prefix_lens,
                                 const int64_t* path, int64_t path_len, cudaStream_t stream) {
  const int64_t threads_needed = max_heads * max_row_units;
  const dim3 grid(static_cast<unsigned>((threads_needed + kCompactThreads - 1) / kCompactThreads),
                  static_cast<unsigned>(batch), static_cast<unsigned>(num_tensors));
  compact_kv_kernel<Unit><<<grid, kCompactThreads, 0, stream>>>(table, cache_len, prefix_lens, path, path_len);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_tree_mask(const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                             const int64_t* prefix_lens, int64_t batch, int64_t num_rows, int64_t* position_ids,
                             int32_t* ancestor_bits, cudaStream_t stream) {
  if (batch == 0 || num_rows == 0) return cudaSuccess;
  if (batch > 65535) return cudaErrorInvalidValue;
  const int64_t num_words = (num_rows + 31) / 32;
  const dim3 grid(static_cast<unsigned>((num_rows + kMaskThreads - 1) / kMaskThreads), static_cast<unsigned>(batch));
  // Bits are built as uint32 so bit 31 needs no special case; int32 storage has the same layout.
  tree_mask_kernel<<<grid, kMaskThreads, 0, stream>>>(parents, depth, num_nodes, prefix_lens, num_rows, num_words,
                                                      position_ids, reinterpret_cast<uint32_t*>(ancestor_bits));
  return cudaGetLastError();
}

cudaError_t launch_accept_greedy(const int64_t* tokens, const int32_t* parents, const int32_t* num_nodes,
                                 const int64_t* target_tokens, int64_t batch, int64_t num_rows, int64_t path_len,
                                 int64_t* path, int64_t* accept_len, int64_t* next_token, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (num_rows < 1 || num_rows > INT_MAX - kAcceptThreads || path_len < 1) return cudaErrorInvalidValue;
  accept_greedy_kernel<<<static_cast<unsigned>(batch), kAcceptThreads, 0, stream>>>(
      tokens, parents, num_nodes, target_tokens, num_rows, path_len, path, accept_len, next_token);
  return cudaGetLastError();
}

cudaError_t launch_compact_kv(const int64_t* table, int64_t num_tensors, int64_t batch, int64_t cache_len,
                              int64_t max_heads, int64_t max_row_units, int unit_bytes, const int64_t* prefix_lens,
                              const int64_t* path, int64_t path_len, cudaStream_t stream) {
  if (num_tensors == 0 || batch == 0 || path_len == 0 || max_heads == 0 || max_row_units == 0) return cudaSuccess;
  if (batch > 65535 || num_tensors > 65535) return cudaErrorInvalidValue;
  switch (unit_bytes) {
    case 2:
      return launch_compact_typed<uint16_t>(table, num_tensors, batch, cache_len, max_heads, max_row_units,
                                            prefix_lens, path, path_len, stream);
    case 4:
      return launch_compact_typed<uint32_t>(table, num_tensors, batch, cache_len, max_heads, max_row_units,
                                            prefix_lens, path, path_len, stream);
    case 8:
      return launch_compact_typed<uint2>(table, num_tensors, batch, cache_len, max_heads, max_row_units,
                                         prefix_lens, path, path_len, stream);
    case 16:
      return launch_compact_typed<uint4>(table, num_tensors, batch, cache_len, max_heads, max_row_units,
                                         prefix_lens, path, path_len, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace taps
