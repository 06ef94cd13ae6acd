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
// the next group's first records, which follow in memory): the hardware prefetcher alone left the loads exposed.
constexpr int64_t kPrefetchRecords = 8;

// a [M, K] int8, scale / asum [M, K/32] as quantize_activations writes them -> the interleaved copy, in buffers
// of the calling thread (valid until its next call).
Interleaved interleave_activations(const int8_t* a, const float* scale, const int32_t* asum, int64_t M, int64_t K);

}  // namespace gguf
}  // namespace taps
