// GGUF block kernels without Python: the VNNI path equals the plain loops bit for bit, every row of an M-row
// call equals its 1-row call (memcmp), and dequantised blocks give the product the kernel approximates.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "gguf_linear.h"

using taps::gguf::BlockType;

namespace {

std::vector<uint8_t> random_rows(BlockType t, int64_t N, int64_t K, std::mt19937& rng) {
  std::vector<uint8_t> raw(N * K / 32 * taps::gguf::block_bytes(t));
  for (auto& b : raw) b = static_cast<uint8_t>(rng());
  const int64_t bb = taps::gguf::block_bytes(t);
  for (int64_t i = 0; i < N * K / 32; ++i) {  // finite fp16 scales: 0x2400 (~0.0156) and 0xA800 (~-0.03125)
    raw[i * bb] = 0x00, raw[i * bb + 1] = 0x24;
    if (t == BlockType::Q4_1) raw[i * bb + 2] = 0x00, raw[i * bb + 3] = 0xA8;
  }
  return raw;
}

void run(BlockType t, int64_t N, int64_t K, std::mt19937& rng) {
  const auto raw = random_rows(t, N, K, rng);
  std::vector<uint8_t> packed(taps::gguf::packed_bytes(t, N, K));
  taps::gguf::pack_blocks(t, raw.data(), N, K, packed.data());
  std::vector<float> w(N * K);
  taps::gguf::dequantize_blocks(t, raw.data(), N, K, w.data());
  const int64_t KB = K / 32, G = (N + 15) / 16;
  for (int64_t M : {1, 2, 7, 8, 9, 12, 13, 17, 25, 33, 64}) {
    std::normal_distribution<float> nd(0.0f, 2.0f);
    std::vector<float> x(M * K);
    for (auto& v : x) v = nd(rng);
    std::vector<int8_t> a(M * K), a1(M * K);
    std::vector<float> s(M * KB), s1(M * KB);
    std::vector<int32_t> as(M * KB), as1(M * KB);
    taps::gguf::quantize_activations(x.data(), M, K, a.data(), s.data(), as.data());
    taps::gguf::quantize_activations_scalar(x.data(), M, K, a1.data(), s1.data(), as1.data());
    CHECK(a == a1 && std::memcmp(s.data(), s1.data(), s.size() * 4) == 0 && as == as1);
    std::vector<float> y(M * N), ys(M * N);
    taps::gguf::packed_linear(t, packed.data(), N, K, a.data(), s.data(), as.data(), M, y.data(), N, 0, G);
    taps::gguf::packed_linear_scalar(t, packed.data(), N, K, a.data(), s.data(), as.data(), M, ys.data(), N, 0, G);
    CHECK(std::memcmp(y.data(), ys.data(), y.size() * 4) == 0);
    for (int64_t m = 0; m < M; ++m) {
      std::vector<float> one(N);
      taps::gguf::packed_linear(t, packed.data(), N, K, a.data() + m * K, s.data() + m * KB, as.data() + m * KB, 1,
                                one.data(), N, 0, G);
      CHECK(std::memcmp(one.data(), y.data() + m * N, N * 4) == 0);
      for (int64_t n = 0; n < N; ++n) {  // within the activation rounding of the exact product
        double exact = 0.0, bound = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          exact += static_cast<double>(x[m * K + k]) * w[n * K + k];
          bound += 0.5 * s[m * KB + k / 32] * std::fabs(w[n * K + k]);
        }
        CHECK(std::fabs(y[m * N + n] - exact) <= bound * 1.001 + 1e-4);
      }
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  for (BlockType t : {BlockType::Q4_1, BlockType::Q8_0}) {
    run(t, 16, 32, rng);
    run(t, 37, 96, rng);
    run(t, 50, 160, rng);
  }
  return g_failures != 0;
}
