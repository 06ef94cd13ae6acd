// Unit test of the few-row linear kernel (rows_linear.h) against a double-precision brute force,
// on awkward shapes: K not a multiple of 16 (masked tail), N not a multiple of the 4-row block or
// the tile, M not a multiple of the 4-row chunk, with and without bias; the vector path and the plain-loop fallback;
// float32 weights and bfloat16 ones (whose float32 widening must give the float32 weights' exact outputs).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "rows_linear.h"

int main() {
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int failures = 0;
  const int64_t Ms[] = {1, 2, 3, 4, 5, 7, 9, 16, 33};
  const int64_t Ks[] = {1, 15, 16, 17, 100, 576};
  const int64_t Ns[] = {1, 3, 5, 63, 64, 65, 130};
  for (int64_t M : Ms)
    for (int64_t K : Ks)
      for (int64_t N : Ns)
        for (int variant = 0; variant < 4; ++variant) {
          const int with_bias = variant & 1;
          using F32 = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                               int64_t);
          using B16 = void (*)(const float*, const taps::Bf16*, const float*, float*, int64_t, int64_t, int64_t,
                               int64_t, int64_t);
          const F32 run = (variant & 2) ? F32(taps::rows_linear_tiles_scalar) : F32(taps::rows_linear_tiles);
          const B16 run16 = (variant & 2) ? B16(taps::rows_linear_tiles_scalar) : B16(taps::rows_linear_tiles);
          std::vector<float> x(M * K), w(N * K), b(N), y(M * N, std::nanf("")), y16(M * N, std::nanf(""));
          std::vector<taps::Bf16> w16(N * K);
          for (auto& v : x) v = normal(rng);
          for (int64_t i = 0; i < N * K; ++i) {  // weights that bf16 holds exactly: its outputs must equal these
            uint32_t bits;
            const float f = normal(rng);
            std::memcpy(&bits, &f, sizeof(bits));
            w16[i].bits = static_cast<uint16_t>(bits >> 16);
            bits &= 0xFFFF0000u;
            std::memcpy(&w[i], &bits, sizeof(bits));
          }
          for (auto& v : b) v = normal(rng);
          const int64_t tiles = (N + taps::kRowsLinearTile - 1) / taps::kRowsLinearTile;
          // two calls over split tile ranges, as a parallel caller would make them
          run(x.data(), w.data(), with_bias ? b.data() : nullptr, y.data(), M, N, K, 0, tiles / 2);
          run(x.data(), w.data(), with_bias ? b.data() : nullptr, y.data(), M, N, K, tiles / 2, tiles);
          run16(x.data(), w16.data(), with_bias ? b.data() : nullptr, y16.data(), M, N, K, 0, tiles);
          if (std::memcmp(y.data(), y16.data(), y.size() * sizeof(float)) != 0) {
            if (failures < 10)
              std::fprintf(stderr, "variant %d: M=%lld K=%lld N=%lld: bf16 weights differ from their float32 copy\n",
                           variant, static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N));
            ++failures;
          }
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
              double ref = with_bias ? b[n] : 0.0, mag = std::fabs(ref);
              for (int64_t k = 0; k < K; ++k) {
                ref += static_cast<double>(x[m * K + k]) * w[n * K + k];
                mag += std::fabs(static_cast<double>(x[m * K + k]) * w[n * K + k]);
              }
              const double err = std::fabs(y[m * N + n] - ref);
              if (!(err <= 1e-6 * mag + 1e-6)) {  // NaN (an unwritten output) fails too
                if (failures < 10)
                  std::fprintf(stderr, "variant %d: M=%lld K=%lld N=%lld bias=%d y[%lld,%lld]=%g, expected %g\n",
                               variant, static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N),
                               with_bias, static_cast<long long>(m), static_cast<long long>(n), y[m * N + n], ref);
                ++failures;
              }
            }
        }
  std::printf("rows_linear (%s path): %d failures\n", taps::rows_linear_vectorized() ? "AVX-512" : "scalar", failures);
  return failures == 0 ? 0 : 1;
}
