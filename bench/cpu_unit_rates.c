/* Peak rates of the vector instructions the CPU block kernels (csrc/gguf_linear.cpp) and the forward's attention
 * (csrc/gguf_row_ops_avx512.cpp) are built from, on one core: each loop runs 12 independent register chains of one
 * instruction (or of two alternating), so latency never limits it and the rate is what the core's pipes sustain.
 * The mixes say which instructions share pipes: vpdpbusd and vmulps alternating no faster than either alone means
 * both go through the same pipes, so the kernels' multiplies and dot products add up against one budget.
 *
 * Prints one JSON object (rates in instructions per second, 512-bit forms). Built and run by cpu_units.py with the
 * system C compiler; the asm needs an assembler that knows AVX-512 VNNI, not compiler flags. On a CPU without
 * AVX-512 VNNI it prints {"avx512_vnni": false} and runs nothing. */
#include <stdio.h>
#include <time.h>

#if !defined(__x86_64__)
int main(void) {
  printf("{\"avx512_vnni\": false}\n");
  return 0;
}
#else

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TWELVE(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)
#define SIX(op) op(0) op(1) op(2) op(3) op(4) op(5)
#define DPBUSD(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n"
#define MULPS(i) "vmulps %%zmm30, %%zmm" #i ", %%zmm" #i "\n"
#define FMA(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #i "\n"
#define CVT(i) "vcvtdq2ps %%zmm30, %%zmm" #i "\n"
#define DPBUSD_MULPS(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n vmulps %%zmm30, %%zmm1" #i ", %%zmm1" #i "\n"
#define DPBF16PS(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n"
#define DPBUSD_CVT(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n vcvtdq2ps %%zmm30, %%zmm1" #i "\n"

#define CLOBBERS                                                                                                  \
  "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
      "xmm13", "xmm14", "xmm15", "xmm30", "xmm31"
#define ONE(i) "vmovaps %%zmm30, %%zmm" #i "\n"

/* instructions per second of `body` (`per_iter` instructions), the best of 3 runs of `iters` iterations; every
 * register starts at 1.0f in each lane (no denormal or NaN operands) */
#define RATE(out, body, per_iter)                                                                    \
  do {                                                                                               \
    double best = 0.0;                                                                               \
    for (int run = 0; run < 3; ++run) {                                                              \
      const double t0 = now();                                                                       \
      __asm__ volatile("vpbroadcastd %0, %%zmm30\n vmovaps %%zmm30, %%zmm31\n" TWELVE(ONE) ONE(12) ONE(13)      \
                       ONE(14) ONE(15)::"r"(0x3F800000) : CLOBBERS);                                  \
      for (long n = 0; n < iters; ++n) __asm__ volatile(body ::: CLOBBERS);                          \
      const double r = (double)(per_iter) * iters / (now() - t0);                                    \
      if (r > best) best = r;                                                                        \
    }                                                                                                \
    out = best;                                                                                      \
  } while (0)

__attribute__((target("avx512f,avx512vnni"))) static void measure(void) {
  const long iters = 20000000;
  double dpbusd, mulps, fma, cvt, dpbusd_mulps, dpbusd_cvt;
  RATE(dpbusd, TWELVE(DPBUSD), 12);
  RATE(mulps, TWELVE(MULPS), 12);
  RATE(fma, TWELVE(FMA), 12);
  RATE(cvt, TWELVE(CVT), 12);
  RATE(dpbusd_mulps, SIX(DPBUSD_MULPS), 12);
  RATE(dpbusd_cvt, SIX(DPBUSD_CVT), 12);
  printf("{\"avx512_vnni\": true, \"vpdpbusd_per_s\": %.4g, \"vmulps_per_s\": %.4g, \"vfmadd231ps_per_s\": %.4g, "
         "\"vcvtdq2ps_per_s\": %.4g, \"vpdpbusd_vmulps_per_s\": %.4g, \"vpdpbusd_vcvtdq2ps_per_s\": %.4g",
         dpbusd, mulps, fma, cvt, dpbusd_mulps, dpbusd_cvt);
}

/* bfloat16 dot products (2 per float32 lane: 32 multiply-adds per instruction, twice an FMA's 16), what torch's
 * bfloat16 matrix products can use on a CPU without AMX */
__attribute__((target("avx512f,avx512bf16"))) static void measure_bf16(void) {
  const long iters = 20000000;
  double dpbf16ps;
  RATE(dpbf16ps, TWELVE(DPBF16PS), 12);
  printf(", \"vdpbf16ps_per_s\": %.4g", dpbf16ps);
}

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vnni")) {
    printf("{\"avx512_vnni\": false}\n");
    return 0;
  }
  measure();
  if (__builtin_cpu_supports("avx512bf16")) measure_bf16();
  printf("}\n");
  return 0;
}
#endif
