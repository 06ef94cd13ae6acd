// The activations of one packed_linear call, block-interleaved (shared by the VNNI and AMX kernels).
#pragma once

#include <cstdint>

namespace taps {
namespace gguf {

// Block kb of row m is 32 int8 at act[(kb * M + m) * 32], its scale and float(asum) at
// meta[(kb * M + m) * 2 + {0, 1}], 128 * asum at asum128[kb * M + m]. act has kActTailRows zero rows of 32 bytes
// after its end, so a kernel may read a whole 16-row tile from any row.
// Why: one pointer walks every row of a chunk at fixed offsets (per-row pointers spilled to the stack at 8
// rows), and float(asum) is a ready broadcast operand instead of a convert + broadcast per row and block.
// float(asum) is exact (|asum| <= 32 * 127), so the bits are those of the row-major plain loop. The 211
// SmolLM2 matrices, one thread, AMD Zen 4 (the other core busy), best of 9, at 1 / 4 / 8 / 16 rows:
// 4.3-6.4 / 5.8-7.5 / 10.2-11.7 / 20.0 ms with per-row pointers, 3.7-4.2 / 5.0-5.2 / 8.5-8.9 / 17.4-17.7 ms so.
struct Interleaved {
  const int8_t* act;
  const float* meta;
  const int32_t* asum128;
  int64_t M;
};

constexpr int64_t kActTailRows = 16;

// Both kernels ask for the packed record kPrefetchRecords ahead of the one they read (past a group's end that is
// the next group's first records, which follow in memory), at every row count: the hardware prefetcher alone
// left the loads exposed. From a few rows on the block dots take longer than streaming a record (VNNI, 105 MB of
// Q4_1 matrices, one thread, AMD Zen 4, best of 5: 8 rows 13.8 -> 10.8 ms, 16 rows 26.0 -> 19.3 ms, 4 rows 6.7
// -> 6.4 ms); at 1-2 rows, where the loop only streams, it paid on a Sapphire Rapids core (53 MB of Q4_1 blocks,
// 1 row: 2.5-3.3 -> 2.0-2.3 ms, 2 rows 3.1-3.7 -> 1.9-2.1 ms; Q8_0 within noise; not measured on Zen 4), and the
// AMX tiles waited on the blocks' loads at 16 rows without it.
// `stream`: the call reads each record once (its rows fit one chunk of the kernel), so the records are a stream
// and are asked for as one (prefetchnta) rather than into every cache level (prefetcht0), where the ~96 MB of a
// step evicted what the step reads again: the KV cache, the activations, the decode loop's own code and data.
// All 211 matrices at 1 row, VNNI, one thread, AMD Zen 4, two alternating runs each: 4.43 / 4.54 -> 3.89 / 3.90
// ms (4 rows: 5.44 / 5.40 -> 5.31 / 4.74; 16 and 64 rows, which read records more than once, unchanged either
// way, and keep prefetcht0).
constexpr int64_t kPrefetchRecords = 8;

inline void prefetch_record_ahead(const uint8_t* rec, int64_t record_bytes, bool stream) {
  const uint8_t* p = rec + kPrefetchRecords * record_bytes;
  if (stream) {
    for (int64_t l = 0; l < record_bytes; l += 64) __builtin_prefetch(p + l, 0, 0);  // prefetchnta
  } else {
    for (int64_t l = 0; l < record_bytes; l += 64) __builtin_prefetch(p + l, 0, 3);  // prefetcht0
  }
}

// Both kernels run many rows in blocks: kRowBlock rows of x at a time (their activations, 18-48 KB of int8 at K =
// 576-1536, stay near the core while a block of groups runs over them) over kGroupBlock groups at a time (whose
// weights, 92-250 KB, stay in L2 while every row block passes over them). Without it each group read all M rows'
// activations, from L2 and beyond once M * K outgrew L1: per row, 64 rows cost more than 32. Each row's arithmetic
// is unchanged, so are its bits. SmolLM2's 211 matrices, one thread, Sapphire Rapids-class Xeon (16 rows, one
// block either way, as the control): 64 rows 66.3 -> 54.8 ms on the AMX tiles, 59.8 -> 50.8 on VNNI.
constexpr int64_t kRowBlock = 32, kGroupBlock = 16;

// Calls run(g, m0, m1) for every group g in [g0, g1) and every block of rows [m0, m1) of M, in that blocked order.
template <class Run>
inline void for_each_block(int64_t g0, int64_t g1, int64_t M, Run run) {
  for (int64_t gb = g0; gb < g1; gb += kGroupBlock) {
    const int64_t ge = gb + kGroupBlock < g1 ? gb + kGroupBlock : g1;
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = m0 + kRowBlock < M ? m0 + kRowBlock : M;
      for (int64_t g = gb; g < ge; ++g) run(g, m0, m1);
    }
  }
}

// a [M, K] int8, scale / asum [M, K/32] as quantize_activations writes them -> the interleaved copy, in buffers
// of the calling thread (valid until its next call).
Interleaved interleave_activations(const int8_t* a, const float* scale, const int32_t* asum, int64_t M, int64_t K);

}  // namespace gguf
}  // namespace taps
