// Few-row linear layer over GGUF weight blocks (Q4_1, Q8_0), on raw host pointers, no torch.
//
// Why it exists: the target ships as a GGUF file of 4.5-bit Q4_1 blocks (and a Q8_0 token embedding /
// tied head). Dequantised to float32 a decode step streams ~540 MB; read as blocks it streams ~96 MB, and
// the int8 dot products run on the CPU's VNNI units (vpdpbusd: 64 byte products per instruction).
//
// Numerics (the contract the tests pin, and what makes a tree verify equal plain decoding bit for bit):
//   * activations are quantised per row and per 32-block: amax = max |x|, scale = amax / 127,
//     a = round_half_even(x * (127 / amax)) in [-127, 127] (a = 0 and scale = 0 where amax = 0);
//   * each weight block's dot with its activation block is an exact int32 sum;
//   * then one fixed float32 step per block, in block order k = 0, 1, ...:
//       Q4_1 (w = q * d + m):  blk = d * float(sum q*a) + m * float(sum a);  acc = acc + blk * scale
//       Q8_0 (w = q * d):      blk = d * float(sum q*a);                     acc = acc + blk * scale
//     (separate multiplies and adds, no FMA: the PyTorch reference reproduces every bit).
// Two digits (activation_digits = 2, an option of the model): each row is quantised again from its rounding
// residual, so the activations carry ~15 bits instead of ~8 and the layer is as close to float32 as the float32
// sums allow (SmolLM2, 6,120 held-out tokens: teacher-forced top-1 agreement with the float32 format 96.4% ->
// 99.95%, perplexity +0.33% -> +0.0003%):
//     lo = round_half_even((x * (127 / amax) - a) * 254) in [-127, 127],  scale_lo = amax / 32258 (= 127 * 254)
//   (the same float32 x * (127 / amax) that rounded to a; its difference to a is exact; lo = 0 where a's block
//   has amax = 0, scale_lo = NaN where a's scale is). The residual rows run through the same kernels as extra
//   rows of the call, and y = y(a, scale) + y(lo, scale_lo) in float32: every output still depends on its own
//   row only, on every path, at twice the integer work.
// Nothing depends on how many rows share a call, where a row sits in it, or how output columns are split
// over threads: every row of an M-row call equals its 1-row call bit for bit, on the VNNI path and on the
// plain-loop path alike (the two are the same arithmetic).
//
// Packed layout (made once at load time by pack_blocks): output rows are grouped by kGroupRows = 16;
// for each group, its K/32 blocks follow one another, each a record of
//   Q4_1: 256 bytes of nibbles + 16 fp16 d + 16 fp16 m   (320 bytes; byte 64*j + 4*r + b holds elements
//         4j+b (low nibble) and 16+4j+b (high nibble) of the group's row r: exactly GGUF's byte 4j+b)
//   Q8_0: 512 bytes of q + 128 (uint8) + 16 fp16 d        (544 bytes; byte 64*t + 4*r + b holds element 4t+b)
// so one 64-byte load feeds vpdpbusd with 4 consecutive elements of 16 rows. Rows past N are zero.
#pragma once

#include <cstdint>
#include <string>

namespace taps {
namespace gguf {

// GGML type ids (the values the GGUF file stores).
enum class BlockType : int { Q4_1 = 3, Q8_0 = 8 };

constexpr int64_t kBlock = 32;      // elements per block (both types)
constexpr int64_t kGroupRows = 16;  // output rows per packed group
constexpr int64_t kQ41Record = 320;  // bytes of one packed record (kGroupRows rows, one block): layout above
constexpr int64_t kQ80Record = 544;

// The kernels that quantize_activations and packed_linear run: by default kernel_path(), AMX tiles where the CPU
// has AMX-INT8 and passes amx_available()'s start-up check (the rows amx_tile_rows gives it; VNNI the rest), else
// VNNI, else AVX2, else the plain loops (a path this CPU lacks falls back the same way). The environment
// variable TAPS_GGUF_KERNELS=vnni|avx2|scalar asks for a slower one, and =amx-emulated for the AMX kernel with
// its tile multiplies in plain loops (on CPUs with VNNI: to test that kernel there); read once per process.
// Every path gives the same bits.
enum class KernelPath : int { Scalar = 0, Avx2 = 1, Vnni = 2, Amx = 3, AmxEmulated = 4 };
// Rows of an M-row call that the AMX path gives its tiles (16 at a time, and a last partial tile from
// kAmxMinRows rows); the rest run VNNI. A tile multiply costs the same at 1 and 16 rows, so few rows pay for
// idle ones: on a Sapphire Rapids core the tiles were 1.3-1.7x slower than VNNI at 4-8 rows, even at 12 and
// 1.2x faster at 16 (SmolLM2's matrices, one thread).
constexpr int64_t kAmxMinRows = 12;
inline int64_t amx_tile_rows(int64_t M) { return M % 16 >= kAmxMinRows ? M : M / 16 * 16; }
KernelPath kernel_path();
const char* kernel_path_name(KernelPath p);  // "scalar", "avx2", "vnni", "amx", "amx-emulated"
// TAPS_GGUF_KERNELS as set ("" when not), read once per process; the top-K rows (topk_stats.h) follow it too.
const std::string& kernels_requested();

// IEEE half -> float (exact: every half is a float); half_at reads the little-endian half at p.
float half_to_float(uint16_t h);
float half_at(const uint8_t* p);

// Bytes of one GGUF block (what the file holds) and of one packed record (kGroupRows rows, one block).
int64_t block_bytes(BlockType t);
int64_t record_bytes(BlockType t);
// Bytes of a packed [N, K] weight.
int64_t packed_bytes(BlockType t, int64_t N, int64_t K);

// Repacks N GGUF rows (row-major, K/32 blocks each, exactly as the file stores them) into the layout above.
void pack_blocks(BlockType t, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst);

// The exact float32 weights of the GGUF rows [N, K] (w = q * d + m, or q * d: exact in float32).
void dequantize_blocks(BlockType t, const uint8_t* src, int64_t N, int64_t K, float* dst);

// Quantises x [M, K] per row and 32-block: a [M, K] int8, scale [M, K/32] float32, asum [M, K/32] int32.
// A block whose amax is not finite gets scale = NaN (its outputs become NaN, never garbage ints).
void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* a, float* scale, int32_t* asum,
                          KernelPath path = kernel_path());

constexpr float kResidualSteps = 254.0f;     // the residual digit's steps per step of the leading digit
constexpr float kTwoDigitLevels = 32258.0f;  // 127 * 254: scale_lo = amax / kTwoDigitLevels

// The quantisation of x [M, K] in `digits` (1 or 2) int8 digits: rows [0, M) of a / scale / asum as
// quantize_activations writes them, and with two digits the residual digits of row r (the numerics above)
// `lo_rows` rows further on (lo_rows = M: one call's [2M, K], [2M, K/32], [2M, K/32] layout; a part of a call's
// rows passes the whole call's M).
void quantize_activations_digits(const float* x, int64_t M, int64_t K, int8_t* a, float* scale, int32_t* asum,
                                 int64_t digits, int64_t lo_rows, KernelPath path = kernel_path());

// The plain-loop quantiser (what quantize_activations runs without AVX-512); exposed for the tests.
void quantize_activations_scalar(const float* x, int64_t M, int64_t K, int8_t* a, float* scale, int32_t* asum);

// y[m, n] for n in groups [g0, g1) (rows g*16 ... min(N, g*16+16)), all M rows; ldy is y's row stride.
// Groups write disjoint columns of y, so callers may run group ranges in parallel.
void packed_linear(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a, const float* scale,
                   const int32_t* asum, int64_t M, float* y, int64_t ldy, int64_t g0, int64_t g1,
                   KernelPath path = kernel_path());

// packed_linear of a quantisation in `digits` digits (quantize_activations_digits with lo_rows = M) on groups
// [g0, g1): one digit is packed_linear itself (`both` unused); two digits put both digits' rows into `both`
// ([2M, N], the caller's; groups write disjoint columns of it), then y[m, n] = both[m, n] + both[M + m, n] for those
// groups' columns n.
void packed_linear_digits(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                          const float* scale, const int32_t* asum, int64_t M, int64_t digits, float* both, float* y,
                          int64_t ldy, int64_t g0, int64_t g1, KernelPath path = kernel_path());

// The plain-loop path on its own (what packed_linear runs without AVX-512 VNNI); exposed for the tests.
void packed_linear_scalar(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                          const float* scale, const int32_t* asum, int64_t M, float* y, int64_t ldy, int64_t g0,
                          int64_t g1);

// The same two operations on AVX2 (gguf_linear_avx2.cpp: vpmaddubsw sums that cannot saturate), for CPUs
// without AVX-512; the same bits as the plain loops. Callers check avx2_available() first.
void quantize_activations_avx2(const float* x, int64_t M, int64_t K, int8_t* a, float* scale, int32_t* asum);
// The residual digits (two-digit quantisation) of rows x already quantised to a, into lo / lo_scale / lo_sum
// (blocks holding inf or NaN: any codes; quantize_activations_digits clears them).
void residual_digits_avx2(const float* x, int64_t M, int64_t K, const int8_t* a, int8_t* lo, float* lo_scale,
                          int32_t* lo_sum);
void packed_linear_avx2(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                        const float* scale, const int32_t* asum, int64_t M, float* y, int64_t ldy, int64_t g0,
                        int64_t g1);

// The AMX kernel (gguf_linear_amx.cpp) on rows [g0, g1) of groups, every row count through tiles; `emulated`:
// the tile multiplies in plain loops (any CPU with AVX-512 VNNI). The same bits as the plain loops.
void packed_linear_amx(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                       const float* scale, const int32_t* asum, int64_t M, float* y, int64_t ldy, int64_t g0,
                       int64_t g1, bool emulated);

// Whether this CPU runs the AVX-512 VNNI path / the AVX2 path / the AMX tiles (each probed once per process;
// AMX: the CPU's flags, the kernel's permission for the tile state, and the tile kernel's result on random
// blocks equal to the VNNI path's, checked in a child process).
bool vnni_available();
bool avx2_available();
bool amx_available();

// Runs check() in a forked child process: true only when it returned true there (false, a crash or no fork on
// this platform: false). How amx_available() tries the tile kernel without risking this process.
bool passes_in_child(bool (*check)());


}  // namespace gguf
}  // namespace taps
