// Unit test of the few-row linear kernel (rows_linear.h) against a double-precision brute force,
// on awkward shapes: K not a multiple of 16 (masked tail), N not a multiple of the 4-row block or
// the tile, M not a multiple of the 4-row chunk, with and without bias; the vector path and the plain-loop fallback.
#include <cmath>
#include <cstdio>
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
          const auto run = (variant & 2) ? taps::rows_linear_tiles_scalar : taps::rows_linear_tiles;
          std::vector<float> x(M * K), w(N * K), b(N), y(M * N, std::nanf(""));
          for (auto& v : x) v = normal(rng);
          for (auto& v : w) v = normal(rng);
          for (auto& v : b) v = normal(rng);
          const int64_t tiles = (N + taps::kRowsLinearTile - 1) / taps::kRowsLinearTile;
          // two calls over split tile ranges, as a parallel caller would make them
          run(x.data(), w.data(), with_bias ? b.data() : nullptr, y.data(), M, N, K, 0, tiles / 2);
          run(x.data(), w.data(), with_bias ? b.data() : nullptr, y.data(), M, N, K, tiles / 2, tiles);
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
