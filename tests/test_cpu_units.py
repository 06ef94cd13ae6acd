"""``bench/cpu_units.py``: the floors' arithmetic on made-up rates, and the rate probe on this CPU."""
import math

import pytest

from helpers import load_bench_script


@pytest.fixture(scope="module")
def units():
    return load_bench_script("cpu_units")


def _rates(dots, muls, mix, fma=1e9):
    return {"vpdpbusd_per_s": dots, "vmulps_per_s": muls, "vpdpbusd_vmulps_per_s": mix, "vfmadd231ps_per_s": fma}


def test_block_floor_counts_dots_and_multiplies_per_row_block(units):
    # Q4_1 [N=17, K=64]: 2 groups of 16 outputs x 2 blocks x 3 rows = 12 row-blocks; Q8_0 [16, 32]: 1 x 1 x 3 = 3
    mats = [(3, 17, 64), (8, 16, 32)]
    shared = _rates(1e9, 1e9, 1e9)
    assert units.shared_multiply_pipes(shared)
    floor_ms, dots_ms = units.block_kernel_floor_ms(mats, 3, shared)
    assert dots_ms == pytest.approx(1e3 * 8 * 15 / 1e9)
    assert floor_ms == pytest.approx(1e3 * (12 * (8 + 3) + 3 * (8 + 2)) / 1e9)
    # separate pipes: the slower of the two streams bounds it
    apart = _rates(1e9, 1e8, 2e9)
    assert not units.shared_multiply_pipes(apart)
    floor_ms, dots_ms = units.block_kernel_floor_ms(mats, 3, apart)
    assert floor_ms == pytest.approx(max(dots_ms, 1e3 * (12 * 3 + 3 * 2) / 1e8))


def test_attention_floor_is_two_multiply_adds_per_key_and_dimension(units):
    # 2 layers x 2 (scores, values) x 3 heads x 10 keys x 64 dims / 16 lanes = 480 FMAs
    assert units.attention_floor_ms_per_row(2, 3, 64, 10, _rates(1, 1, 1, fma=1e6)) == pytest.approx(0.48)


def test_unit_rates_measures_this_cpu_or_says_why_not(units):
    rates, why = units.unit_rates()
    if rates is None:
        assert why  # no compiler, no AVX-512 VNNI: named
        return
    assert why == ""
    for key in ("vpdpbusd_per_s", "vmulps_per_s", "vfmadd231ps_per_s", "vcvtdq2ps_per_s", "vpdpbusd_vmulps_per_s"):
        assert math.isfinite(rates[key]) and rates[key] > 1e8, key  # any AVX-512 core runs >0.1 G of each per s
