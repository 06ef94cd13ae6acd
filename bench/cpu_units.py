"""What this core's vector units allow the CPU target, measured: the peak rates of the instructions the block
kernels and the attention are built from (``cpu_unit_rates.c``, built with the system C compiler), and the
floors they set.

The block kernels' floor (VNNI path): every 16 outputs, row and 32-block cost 8 ``vpdpbusd`` (512 byte products,
64 each) and the float step's multiplies, which the numerics fix as separate IEEE products (``gguf_linear.h``):
3 for Q4_1 (``d * sum``, ``m * asum``, ``* scale``), 2 for Q8_0. Where the measured mix of ``vpdpbusd`` and
``vmulps`` runs no faster than either alone, both share pipes and the floor is their sum at that joint rate; the
additions, conversions and nibble masks run on other pipes and are left out (a floor, not a model).
The attention floor: a row's scores and value sums over ``prefix`` keys are ``2 * heads * prefix * head_dim``
float32 multiply-adds per layer, 16 per ``vfmadd231ps``. Where the CPU has AVX-512 BF16, ``vdpbf16ps`` is timed
too (32 bfloat16 multiply-adds per instruction: what bounds torch's bfloat16 GEMMs without AMX).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from typing import Iterable, Optional, Tuple

DOTS_PER_ROW_BLOCK = 8                 # vpdpbusd per 16 outputs, one row, one 32-block
FLOAT_MULS_PER_ROW_BLOCK = {3: 3, 8: 2}  # GGML type (Q4_1, Q8_0) -> the float step's multiplies there


def unit_rates() -> Tuple[Optional[dict], str]:
    """``(rates, why)``: the JSON ``cpu_unit_rates.c`` prints (instructions per second), or ``None`` and the
    reason when there is no C compiler, the build fails or the CPU lacks AVX-512 VNNI."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (set CC)"
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_unit_rates.c")
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "cpu_unit_rates")
        built = subprocess.run([cc, "-O2", src, "-o", exe], capture_output=True, text=True)
        if built.returncode != 0:
            return None, f"{os.path.basename(cc)} could not build cpu_unit_rates.c: {built.stderr.strip()[:200]}"
        try:
            ran = subprocess.run([exe], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return None, "cpu_unit_rates ran past 120 s"
    if ran.returncode != 0:
        return None, f"cpu_unit_rates exited with {ran.returncode}"
    rates = json.loads(ran.stdout)
    if not rates.get("avx512_vnni"):
        return None, "this CPU has no AVX-512 VNNI"
    return rates, ""


def shared_multiply_pipes(rates: dict) -> bool:
    """Whether ``vpdpbusd`` and ``vmulps`` share pipes: their alternation runs (within 10%) no faster than the
    slower of the two alone."""
    return rates["vpdpbusd_vmulps_per_s"] < 1.1 * min(rates["vpdpbusd_per_s"], rates["vmulps_per_s"])


def block_kernel_floor_ms(mats: Iterable[Tuple[int, int, int]], rows: int, rates: dict) -> Tuple[float, float]:
    """``(floor_ms, dots_only_ms)`` of one call per matrix at ``rows`` rows; ``mats``: (GGML type, N, K)."""
    dots = muls = 0
    for ggml_type, N, K in mats:
        row_blocks = -(-N // 16) * (K // 32) * rows
        dots += DOTS_PER_ROW_BLOCK * row_blocks
        muls += FLOAT_MULS_PER_ROW_BLOCK[ggml_type] * row_blocks
    dots_ms = 1e3 * dots / rates["vpdpbusd_per_s"]
    if shared_multiply_pipes(rates):
        floor_ms = 1e3 * (dots + muls) / rates["vpdpbusd_vmulps_per_s"]
    else:
        floor_ms = max(dots_ms, 1e3 * muls / rates["vmulps_per_s"])
    return floor_ms, dots_ms


def attention_floor_ms_per_row(layers: int, heads: int, head_dim: int, prefix: int, rates: dict) -> float:
    """float32 FMA floor of one query row's attention over ``prefix`` keys in every layer."""
    return 1e3 * layers * 2 * heads * prefix * head_dim / 16 / rates["vfmadd231ps_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/cpu_unit_rates.json")
    args = ap.parse_args()
    from taps.decode.latency import cpu_name

    rates, why = unit_rates()
    if rates is None:
        print(f"no unit rates: {why}")
        return
    print(f"# {cpu_name()}, one core: instructions per second (512-bit forms)")
    for key, value in rates.items():
        if key.endswith("_per_s"):
            print(f"{key[:-6]:>22} {value / 1e9:6.2f} G")
    print(f"vpdpbusd and vmulps share pipes: {'yes' if shared_multiply_pipes(rates) else 'no'}")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"cpu": cpu_name(), "threads": 1, "rates": rates,
                   "shared_multiply_pipes": shared_multiply_pipes(rates)}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
