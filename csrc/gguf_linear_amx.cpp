// The GGUF block kernels on AMX-INT8 tiles: the numerics of gguf_linear.h, bit for bit.
//
// One tile multiply per packed record and 16 rows of x (tdpbsud: signed activation bytes times unsigned
// weight bytes, int32 sums):
//   A = 16 rows of x, block kb: 32 int8 per row, in element order (the interleaved activations, stride 32);
//   B = the record's weights as 8 rows of 64 bytes, row kk holding elements 4kk..4kk+3 of each of the 16
//       output rows: exactly the packed layout (Q8_0: the record's first 512 bytes, q + 128; Q4_1: the low
//       nibbles of its 256 bytes, elements 0..15, then the high nibbles, elements 16..31);
//   C = [16 rows of x, 16 outputs] int32: each block's exact sum, the int32 vector vpdpbusd builds.
// Then the float step of the VNNI path, the same multiplies and adds in the same order, so every row equals
// the VNNI path's (and the plain loops') row bit for bit, whatever the row count.
//
// The tile multiplies run a few blocks ahead of the float step (a ring of C buffers and unpacked B operands,
// two sets of tiles), so that no load waits on a store just made; see kTileAhead.
//
// The same driver runs with the tile multiplies done by plain loops (EmulatedTiles, the path "amx-emulated"):
// that is how the layout, the chunking and the float step are tested on CPUs without AMX. The hardware path
// is used only after amx_available()'s start-up check: the permission granted by the kernel, and the
// hardware kernel run in a child process on random blocks of both types, equal bit for bit to the VNNI path
// (a child that dies or differs leaves the VNNI path in use).
#include "gguf_linear.h"
#include "gguf_linear_interleave.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <cpuid.h>
#include <immintrin.h>
#define TAPS_HAVE_AMX_PATH 1
#endif
#if defined(TAPS_HAVE_AMX_PATH) && defined(__linux__)  // the tile permission and the check's child process
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#define TAPS_HAVE_AMX_CHECK 1
#endif

namespace taps {
namespace gguf {

#ifdef TAPS_HAVE_AMX_PATH
namespace {

// One target for the tile steps and the float step around them: a tile step compiled for another target than its
// caller's is not inlined, and a call between the float steps makes each of their accumulators a spill (no vector
// register survives a call in the SysV ABI).
#define TAPS_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c,amx-tile,amx-int8")))

constexpr int kTileRows = 16;  // rows of x per tile multiply

// C[16][16] = A . B as tdpbsud computes it (A: 16 rows x 32 int8, stride 32; B: 8 rows x 64 uint8), into the
// product of tile set `set` (0 or 1); store(set, c) writes that product to c.
struct EmulatedTiles {
  static void begin() {}
  static void end() {}
  static void multiply(int set, const int8_t* a, const uint8_t* b) {
    int32_t* c = product(set);
    for (int m = 0; m < kTileRows; ++m) {
      for (int n = 0; n < 16; ++n) {
        int32_t s = 0;
        for (int kk = 0; kk < 8; ++kk) {
          for (int e = 0; e < 4; ++e) s += a[m * 32 + 4 * kk + e] * static_cast<int32_t>(b[kk * 64 + 4 * n + e]);
        }
        c[m * 16 + n] = s;
      }
    }
  }
  static void store(int set, int32_t* c) { std::memcpy(c, product(set), sizeof(int32_t) * kTileRows * 16); }
  static int32_t* product(int set) {
    thread_local int32_t products[2][kTileRows * 16];
    return products[set];
  }
};

// The tile configuration (palette 1): tiles 0 / 3 = C (16 rows x 64 bytes), 1 / 4 = A (16 x 32), 2 / 5 = B (8 x 64).
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// the layout ldtilecfg reads (palette 1): byte 0 palette, 1 start row, 16..47 colsb, 48..63 rows
static_assert(sizeof(TileConfig) == 64 && offsetof(TileConfig, colsb) == 16 && offsetof(TileConfig, rows) == 48,
              "TileConfig must be the 64-byte palette-1 layout");

struct HardwareTiles {
  TAPS_AMX_TARGET static void begin() {
    static const TileConfig cfg = [] {
      TileConfig c;
      std::memset(&c, 0, sizeof c);
      c.palette = 1;
      const uint16_t colsb[6] = {64, 32, 64, 64, 32, 64};
      const uint8_t rows[6] = {16, 16, 8, 16, 16, 8};
      for (int t = 0; t < 6; ++t) c.colsb[t] = colsb[t], c.rows[t] = rows[t];
      return c;
    }();
    // the config is a static object whose stores happened before this call: ldtilecfg reads them from memory
    // (a local struct's stores have been dropped by compilers before ldtilecfg, which then faults)
    _tile_loadconfig(&cfg);
  }
  TAPS_AMX_TARGET static void end() { _tile_release(); }
  // Inline assembly rather than the intrinsics: these name the bytes each instruction reads or writes, where the
  // intrinsics' tile store clobbers all memory.
  TAPS_AMX_TARGET __attribute__((always_inline)) static void multiply(int set, const int8_t* a, const uint8_t* b) {
    const auto& am = *reinterpret_cast<const int8_t(*)[kTileRows * 32]>(a);
    const auto& bm = *reinterpret_cast<const uint8_t(*)[512]>(b);
    if (set == 0) {
      asm volatile("tilezero %%tmm0\n\ttileloadd (%0,%1,1), %%tmm1\n\ttileloadd (%2,%3,1), %%tmm2\n\t"
                   "tdpbsud %%tmm2, %%tmm1, %%tmm0"
                   :
                   : "r"(a), "r"(int64_t{32}), "r"(b), "r"(int64_t{64}), "m"(am), "m"(bm));
    } else {
      asm volatile("tilezero %%tmm3\n\ttileloadd (%0,%1,1), %%tmm4\n\ttileloadd (%2,%3,1), %%tmm5\n\t"
                   "tdpbsud %%tmm5, %%tmm4, %%tmm3"
                   :
                   : "r"(a), "r"(int64_t{32}), "r"(b), "r"(int64_t{64}), "m"(am), "m"(bm));
    }
  }
  TAPS_AMX_TARGET __attribute__((always_inline)) static void store(int set, int32_t* c) {
    auto& cm = *reinterpret_cast<int32_t(*)[kTileRows * 16]>(c);
    if (set == 0) {
      asm volatile("tilestored %%tmm0, (%1,%2,1)" : "=m"(cm) : "r"(c), "r"(int64_t{64}));
    } else {
      asm volatile("tilestored %%tmm3, (%1,%2,1)" : "=m"(cm) : "r"(c), "r"(int64_t{64}));
    }
  }
};

// B of a Q4_1 record: low nibbles (elements 0..15 of each output row) then high nibbles (16..31).
TAPS_AMX_TARGET inline void unpack_q4_1(const uint8_t* rec, uint8_t* b) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i p = _mm512_loadu_si512(rec + 64 * j);
    _mm512_store_si512(b + 64 * j, _mm512_and_si512(p, low));
    _mm512_store_si512(b + 256 + 64 * j, _mm512_and_si512(_mm512_srli_epi16(p, 4), low));
  }
}

// The tile unit runs kTileAhead blocks ahead of the float step (a ring of kRing C buffers and unpacked B
// operands): a tile store read back at once, or a tile load of B just written by vector stores, waits for the
// store to land in L1, and a loop of one-block steps is then bound by that round trip (~100 cycles a block on
// a Sapphire Rapids core: slower than VNNI at every row count). Ahead by 2 and 5 measured within noise of 3.
constexpr int64_t kTileAhead = 3, kRing = 2 * kTileAhead + 2;

// Stage kb of the tile pipeline (issued before the float step of block kb - kTileAhead): unpack the B of block
// kb + kTileAhead (Q4_1), store the product of block kb - 1, then multiply block kb, whose B was unpacked
// kTileAhead stages earlier. A product is stored one stage after its multiply: a tile store right behind its
// multiply waits for it, and there the tile stores took half the kernel's time (sampled, 16 rows).
template <class Tiles, BlockType T>
TAPS_AMX_TARGET inline void tile_stage(const uint8_t* rec, int64_t kb, int64_t KB, const Interleaved& x, int64_t m0,
                                      uint8_t (*b)[512], int32_t (*c)[kTileRows * 16]) {
  const int64_t R = T == BlockType::Q4_1 ? kQ41Record : kQ80Record;
  if (T == BlockType::Q4_1 && kb + kTileAhead < KB) {
    unpack_q4_1(rec + (kb + kTileAhead) * R, b[(kb + kTileAhead) % kRing]);
  }
  if (kb >= 1 && kb <= KB) Tiles::store(static_cast<int>((kb - 1) & 1), c[(kb - 1) % kRing]);
  if (kb < KB) {
    prefetch_record_ahead(rec + kb * R, R, /*stream=*/false);  // a tile call has 12 rows or more
    const uint8_t* w = T == BlockType::Q4_1 ? b[kb % kRing] : rec + kb * R;
    Tiles::multiply(static_cast<int>(kb & 1), x.act + (kb * x.M + m0) * kBlock, w);
  }
}

// Rows m0 .. m0 + MC (MC <= 16) of x over one group of 16 output rows; rows past N are masked out of the store.
template <class Tiles, BlockType T, int MC>
TAPS_AMX_TARGET void group_rows(const uint8_t* rec, int64_t KB, const Interleaved& x, int64_t m0, float* y,
                               int64_t ldy, __mmask16 store) {
  alignas(64) int32_t c[kRing][kTileRows * 16];
  alignas(64) uint8_t b[kRing][512];
  const int64_t R = T == BlockType::Q4_1 ? kQ41Record : kQ80Record;
  if (T == BlockType::Q4_1) {
    for (int64_t kb = 0; kb < std::min(KB, kTileAhead); ++kb) unpack_q4_1(rec + kb * R, b[kb]);
  }
  for (int64_t kb = 0; kb < kTileAhead; ++kb) tile_stage<Tiles, T>(rec, kb, KB, x, m0, b, c);
  // The loops over rows are unrolled early (the pragmas), so that acc becomes MC registers: as an array in memory,
  // the tile store's write kept it there, one load and one store of each accumulator per block.
  __m512 acc[MC];
#pragma GCC unroll 16
  for (int r = 0; r < MC; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    tile_stage<Tiles, T>(rec, kb + kTileAhead, KB, x, m0, b, c);
    const int32_t* cb = c[kb % kRing];
    const uint8_t* r = rec + kb * R;
    const float* meta = x.meta + (kb * x.M + m0) * 2;
    if (T == BlockType::Q4_1) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 256)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 288)));
#pragma GCC unroll 16
      for (int i = 0; i < MC; ++i) {
        const __m512i is = _mm512_load_si512(cb + 16 * i);
        const __m512 blk = _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(is)),
                                         _mm512_mul_ps(mv, _mm512_set1_ps(meta[2 * i + 1])));
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(blk, _mm512_set1_ps(meta[2 * i])));
      }
    } else {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 512)));
      const int32_t* a128 = x.asum128 + kb * x.M + m0;
#pragma GCC unroll 16
      for (int i = 0; i < MC; ++i) {
        // the weights are stored as q + 128: take 128 * sum a back
        const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(cb + 16 * i), _mm512_set1_epi32(a128[i]));
        const __m512 blk = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(exact));
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(blk, _mm512_set1_ps(meta[2 * i])));
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MC; ++i) _mm512_mask_storeu_ps(y + i * ldy, store, acc[i]);
}

using GroupFn = void (*)(const uint8_t*, int64_t, const Interleaved&, int64_t, float*, int64_t, __mmask16);

template <class Tiles, BlockType T, int... MC>
GroupFn* table(std::integer_sequence<int, MC...>) {
  static GroupFn fns[] = {nullptr, group_rows<Tiles, T, MC + 1>...};
  return fns;
}

template <class Tiles>
void packed_linear_tiles(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                         const float* scale, const int32_t* asum, int64_t M, float* y, int64_t ldy, int64_t g0,
                         int64_t g1) {
  const GroupFn* fns = t == BlockType::Q4_1 ? table<Tiles, BlockType::Q4_1>(std::make_integer_sequence<int, 16>())
                                            : table<Tiles, BlockType::Q8_0>(std::make_integer_sequence<int, 16>());
  const int64_t KB = K / kBlock, rec = record_bytes(t);
  const Interleaved x = interleave_activations(a, scale, asum, M, K);
  Tiles::begin();
  for_each_block(g0, g1, M, [&](int64_t g, int64_t m0, int64_t m1) {
    const int64_t live = std::min<int64_t>(kGroupRows, N - g * kGroupRows);
    const __mmask16 store = static_cast<__mmask16>((1u << live) - 1u);
    const uint8_t* grec = packed + g * KB * rec;
    for (int64_t m = m0; m < m1; m += kTileRows) {
      const int64_t mc = std::min<int64_t>(kTileRows, m1 - m);
      fns[mc](grec, KB, x, m, y + m * ldy + g * kGroupRows, ldy, store);
    }
  });
  Tiles::end();
}

#ifdef TAPS_HAVE_AMX_CHECK
// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25); the kernel grants the tile data state on request.
bool amx_cpu_and_permission() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Random blocks of both types, the hardware tiles against the VNNI path: equal bytes or not (run in a child).
bool hardware_matches_vnni() {
  std::mt19937 rng(1234);
  const int64_t N = 40, K = 96, M = 37;
  std::vector<float> x(M * K);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x) v = normal(rng);
  std::vector<int8_t> a(M * K);
  std::vector<float> scale(M * K / kBlock);
  std::vector<int32_t> asum(M * K / kBlock);
  quantize_activations(x.data(), M, K, a.data(), scale.data(), asum.data(), KernelPath::Vnni);
  for (BlockType t : {BlockType::Q4_1, BlockType::Q8_0}) {
    std::vector<uint8_t> raw(N * K / kBlock * block_bytes(t));
    for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>(rng());
    for (int64_t blk = 0; blk < N * K / kBlock; ++blk) {  // finite fp16 scales: exponent bits below 0x7C00
      uint8_t* p = raw.data() + blk * block_bytes(t);
      p[1] &= 0x3B;
      if (t == BlockType::Q4_1) p[3] &= 0x3B;
    }
    std::vector<uint8_t> packed(packed_bytes(t, N, K));
    pack_blocks(t, raw.data(), N, K, packed.data());
    const int64_t G = (N + kGroupRows - 1) / kGroupRows;
    std::vector<float> want(M * N), got(M * N);
    packed_linear(t, packed.data(), N, K, a.data(), scale.data(), asum.data(), M, want.data(), N, 0, G,
                  KernelPath::Vnni);
    packed_linear_tiles<HardwareTiles>(t, packed.data(), N, K, a.data(), scale.data(), asum.data(), M, got.data(),
                                       N, 0, G);
    if (std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) != 0) return false;
  }
  return true;
}
#endif

}  // namespace

#ifdef TAPS_HAVE_AMX_CHECK
bool passes_in_child(bool (*check)()) {
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) _exit(check() ? 0 : 1);  // _exit: the child runs no atexit handlers or destructors of the parent's
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool amx_available() {
  static const bool ok = vnni_available() && amx_cpu_and_permission() && passes_in_child(hardware_matches_vnni);
  return ok;
}
#else
bool passes_in_child(bool (*)()) { return false; }

bool amx_available() { return false; }  // the hardware tiles run only where the check can run first
#endif

void packed_linear_amx(BlockType t, const uint8_t* packed, int64_t N, int64_t K, const int8_t* a,
                       const float* scale, const int32_t* asum, int64_t M, float* y, int64_t ldy, int64_t g0,
                       int64_t g1, bool emulated) {
  if (emulated) {
    packed_linear_tiles<EmulatedTiles>(t, packed, N, K, a, scale, asum, M, y, ldy, g0, g1);
  } else {
    packed_linear_tiles<HardwareTiles>(t, packed, N, K, a, scale, asum, M, y, ldy, g0, g1);
  }
}
#else
bool passes_in_child(bool (*)()) { return false; }

bool amx_available() { return false; }

void packed_linear_amx(BlockType, const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const int32_t*,
                       int64_t, float*, int64_t, int64_t, int64_t, bool) {
  throw std::logic_error("packed_linear_amx: not an x86-64 build");
}
#endif

}  // namespace gguf
}  // namespace taps
