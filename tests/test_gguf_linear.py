"""The GGUF block kernels (csrc/gguf_linear.h) against their written-out reference, gguf-py's own block
decoder, and the row-invariance contract (every row of an M-row call equals its 1-row call bit for bit), with
one activation digit (int8, the ``gguf`` format) and two (``gguf-a16``)."""
import numpy as np
import pytest
import torch

from gguf_models import random_blocks
from taps_kernels.reference.gguf import (Q4_1, Q8_0, TWO_DIGIT_LEVELS, dequantize_blocks_reference,
                                         gguf_linear_reference, quantize_activations_digits_reference,
                                         quantize_activations_reference)

_C = pytest.importorskip("taps_kernels._C")
TYPES = [Q4_1, Q8_0]
# every path this CPU runs (an AVX-512 VNNI CPU also has AVX2; "amx-emulated" is the AMX kernel with its tile
# multiplies in plain loops, which runs wherever VNNI does)
PATHS = {"scalar": ["scalar"], "avx2": ["scalar", "avx2"], "vnni": ["scalar", "avx2", "vnni", "amx-emulated"],
         "amx": ["scalar", "avx2", "vnni", "amx-emulated", "amx"]}[_C.gguf_kernel_path()]


def _raw(rows, cols, t, seed=0):
    return torch.from_numpy(random_blocks(np.random.default_rng(seed), rows, cols, t))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("t", TYPES)
def test_dequantize_matches_reference_and_gguf_py(t):
    import gguf

    raw = _raw(37, 160, t)
    ours = _C.gguf_dequantize(raw, t, 160)
    assert torch.equal(ours, dequantize_blocks_reference(raw, t, 160))
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(t))
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs)).float())


@pytest.mark.parametrize("path", ["auto"] + PATHS)
def test_quantize_activations_matches_reference(path):
    x = torch.randn(7, 96) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(32)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    x[2, 5] = float("inf")  # a non-finite block: scale NaN, codes 0
    x[3, 70] = float("nan")
    a, s, asum = _C.gguf_quantize_activations(x, path)
    ra, rs, rasum = quantize_activations_reference(x)
    assert torch.equal(a, ra) and torch.equal(asum, rasum)
    assert torch.equal(torch.isnan(s), torch.isnan(rs)) and torch.equal(s.nan_to_num(), rs.nan_to_num())
    assert s[1, 1] == 0 and torch.isnan(s[2, 0]) and torch.isnan(s[3, 2])
    assert int(a.abs().max()) == 127


@pytest.mark.parametrize("path", ["auto"] + PATHS)
def test_two_digit_quantisation_matches_reference(path):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, 96, generator=g) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(32)
    x[1, 32:64] = 0.0  # an all-zero block: both scales 0, codes 0
    x[2, 5] = float("inf")  # non-finite blocks: both scales NaN, codes 0
    x[3, 70] = float("nan")
    x[4, 0:32] = torch.arange(32) / 31 * 2 - 1  # codes on rounding boundaries of the leading digit
    a, s, asum = _C.gguf_quantize_activations(x, path, 2)
    ra, rs, rasum = quantize_activations_digits_reference(x, 2)
    assert a.shape == (14, 96) and s.shape == asum.shape == (14, 3)
    assert torch.equal(a, ra) and torch.equal(asum, rasum)
    assert torch.equal(torch.isnan(s), torch.isnan(rs)) and torch.equal(s.nan_to_num(), rs.nan_to_num())
    assert torch.equal(a[:7], quantize_activations_reference(x)[0])  # the leading digit is the int8 one
    assert s[8, 1] == 0 and bool(torch.isnan(s[9, 0])) and bool(torch.isnan(s[10, 2]))
    # what the second digit is for: the two digits hold every finite element to half a step of amax / 32258, plus
    # float32's roundings of 127 / amax, x * (127 / amax) and the two scales (each ~1e-7 of amax: ~0.005 step)
    fin = torch.isfinite(s[:7])
    s = s.double()
    back = a[:7].double().view(7, 3, 32) * s[:7, :, None] + a[7:].double().view(7, 3, 32) * s[7:, :, None]
    amax = x.double().abs().view(7, 3, 32).amax(-1)
    err = (back - x.double().view(7, 3, 32)).abs().amax(-1)
    assert bool((err[fin] <= amax[fin] / TWO_DIGIT_LEVELS * 0.51).all())


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("N,K", [(1, 32), (17, 96), (33, 160), (100, 64)])
@pytest.mark.parametrize("M", [1, 3, 9, 17])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("digits", [1, 2])
def test_linear_matches_reference_bit_for_bit(t, N, K, M, path, digits):
    raw = _raw(N, K, t, seed=N * K + M)
    x = torch.randn(M, K) * 3
    y = _C.gguf_linear(x, _C.gguf_pack(raw, t, K), t, N, K, path, digits)
    assert torch.equal(_bits(y), _bits(gguf_linear_reference(x, raw, t, digits)))
    # and it is the product it claims to approximate: within the activation quantisation error (one code step per
    # element: amax / 127 with one digit, amax / 32258 with two), plus float32 rounding
    exact = x @ dequantize_blocks_reference(raw, t, K).T
    levels = 127 if digits == 1 else TWO_DIGIT_LEVELS
    step = x.abs().reshape(M, -1, 32).amax(-1).repeat_interleave(32, 1) / levels
    w_abs = dequantize_blocks_reference(raw, t, K).abs().T
    bound = (step / 2) @ w_abs + 1e-6 * (x.abs() @ w_abs)
    assert ((y - exact).abs() <= bound * 1.001 + 1e-5).all()


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("path", PATHS)
def test_extreme_codes_do_not_saturate(t, path):
    # the largest products every path must sum exactly: nibbles 15 (Q4_1) or codes -128 / 127 (Q8_0) against
    # activation codes +-127 of one sign per block (AVX2 sums byte pairs in int16, which saturates at 32767)
    N, K, M = 19, 128, 5
    raw = _raw(N, K, t).view(N, K // 32, -1).clone()
    if t == Q4_1:
        raw[..., 4:] = 0xFF
    else:
        raw[..., 2:] = torch.tensor([-128, 127], dtype=torch.int8).view(torch.uint8).repeat(16)
        raw[N // 2:, :, 2:] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
        raw[N - 3:, :, 2:] = 127
    raw = raw.view(N, -1).contiguous()
    x = torch.ones(M, K) * torch.tensor([1.0, -1.0, 3.0, -0.5, 1.0]).view(M, 1)
    x[4, ::2] = -1.0  # alternating signs: +-127 against the alternating Q8_0 codes
    y = _C.gguf_linear(x, _C.gguf_pack(raw, t, K), t, N, K, path)
    assert torch.equal(_bits(y), _bits(gguf_linear_reference(x, raw, t)))


def row_invariance_violations(linear, K, rows_per_call=range(1, 65), seed=0):
    """Calls where some row of an M-row call differs (in any bit) from the same row alone; rows are placed at
    random positions among other random rows."""
    g = torch.Generator().manual_seed(seed)
    probe = torch.randn(8, K, generator=g) * 2
    alone = [linear(probe[i:i + 1]) for i in range(len(probe))]
    bad = []
    for M in rows_per_call:
        x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10
        where = torch.randperm(M, generator=g)[:min(M, len(probe))]
        for j, r in enumerate(where.tolist()):
            x[r] = probe[j]
        y = linear(x)
        for j, r in enumerate(where.tolist()):
            if not torch.equal(_bits(y[r:r + 1]), _bits(alone[j])):
                bad.append((M, r))
    return bad


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("digits", [1, 2])
def test_rows_do_not_depend_on_the_call(t, threads, path, digits):
    N, K = 50, 96
    packed = _C.gguf_pack(_raw(N, K, t), t, K)
    torch.set_num_threads(threads)
    assert row_invariance_violations(lambda x: _C.gguf_linear(x, packed, t, N, K, path, digits), K) == []


def test_row_invariance_check_catches_a_kernel_that_depends_on_the_call():
    # the planted kernel quantises activations with one scale per block over the whole call (as per-tensor
    # int8 GEMMs do): a row's result then depends on the rows beside it, and the check must say so
    N, K = 50, 96
    raw = _raw(N, K, Q4_1)

    w = dequantize_blocks_reference(raw, Q4_1, K).double()

    def shared_scale(x):
        peak = x.abs().reshape(x.shape[0], -1, 32).amax(-1).amax(0).repeat_interleave(32)  # [K] over all rows
        q = torch.round(x * (127 / peak)) * (peak / 127)
        return (q.double() @ w.T).float()

    bad = row_invariance_violations(shared_scale, K, rows_per_call=range(1, 9))
    assert len(bad) > 0


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("path", PATHS)
def test_many_rows_and_groups_run_in_blocks_with_the_same_bits(t, path):
    # past the kernels' loop blocking (32 rows of x over 16 groups of 16 outputs at a time, gguf_linear_interleave.h):
    # 19 groups and up to 70 rows cross both blocks' edges, with partial blocks of each
    N, K = 19 * 16 - 7, 96
    raw = _raw(N, K, t, seed=5)
    packed = _C.gguf_pack(raw, t, K)
    x = torch.randn(70, K) * 3
    y = _C.gguf_linear(x, packed, t, N, K, path)
    assert torch.equal(_bits(y), _bits(gguf_linear_reference(x, raw, t)))
    assert row_invariance_violations(lambda v: _C.gguf_linear(v, packed, t, N, K, path), K,
                                     rows_per_call=(31, 33, 64, 65, 70)) == []


@pytest.mark.parametrize("t", TYPES)
def test_pack_of_smollm2_sizes_matches_reference(t):
    # SmolLM2's shapes: [576 x 576] attention, [1536 x 576] MLP, [576 x 1536] down
    for N, K in ((576, 576), (1536, 576), (576, 1536)):
        raw = _raw(N, K, t, seed=N + K)
        x = torch.randn(2, K)
        y = _C.gguf_linear(x, _C.gguf_pack(raw, t, K), t, N, K)
        assert torch.equal(_bits(y), _bits(gguf_linear_reference(x, raw, t)))


def test_bad_inputs_name_the_argument():
    raw = _raw(16, 64, Q4_1)
    packed = _C.gguf_pack(raw, Q4_1, 64)
    with pytest.raises(ValueError, match="GGML type 2 is not supported"):
        _C.gguf_pack(raw, 2, 64)
    with pytest.raises(ValueError, match="weight: expected shape"):
        _C.gguf_pack(raw[:, :-1].contiguous(), Q4_1, 64)  # truncated rows
    with pytest.raises(ValueError, match="multiple of 32"):
        _C.gguf_pack(raw, Q4_1, 48)
    with pytest.raises(ValueError, match="contiguous"):
        _C.gguf_pack(torch.cat([raw, raw], 1)[:, ::2], Q4_1, 64)
    with pytest.raises(TypeError, match="weight: expected dtype uint8"):
        _C.gguf_pack(raw.to(torch.int32), Q4_1, 64)
    with pytest.raises(ValueError, match="x: expected shape"):
        _C.gguf_linear(torch.randn(2, 32), packed, Q4_1, 16, 64)
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        _C.gguf_linear(torch.randn(2, 64, dtype=torch.float64), packed, Q4_1, 16, 64)
    with pytest.raises(ValueError, match="weight: expected shape"):
        _C.gguf_linear(torch.randn(2, 64), packed[:-1], Q4_1, 16, 64)  # packed bytes of another size
    with pytest.raises(ValueError, match="path: expected 'auto', 'amx'"):
        _C.gguf_linear(torch.randn(2, 64), packed, Q4_1, 16, 64, "int4")
    with pytest.raises(ValueError, match="activation_digits: expected 1 or 2, received 3"):
        _C.gguf_linear(torch.randn(2, 64), packed, Q4_1, 16, 64, "auto", 3)
    with pytest.raises(ValueError, match="activation_digits: expected 1 or 2, received 0"):
        _C.gguf_quantize_activations(torch.randn(2, 64), "auto", 0)
    for lacking in {"scalar": ["avx2", "vnni", "amx-emulated", "amx"], "avx2": ["vnni", "amx-emulated", "amx"],
                    "vnni": ["amx"], "amx": []}[_C.gguf_kernel_path()]:
        with pytest.raises(ValueError, match=f"path: '{lacking}' asked, but this CPU lacks"):
            _C.gguf_linear(torch.randn(2, 64), packed, Q4_1, 16, 64, lacking)
    y = _C.gguf_linear(torch.randn(0, 64), packed, Q4_1, 16, 64)
    assert y.shape == (0, 16)


def test_explain_names_the_gguf_path_this_cpu_runs():
    import taps_kernels
    from taps_kernels.backend import gguf_linear_backend

    want = _C.gguf_kernel_path() if _C.gguf_forward_available() else "unavailable"
    assert gguf_linear_backend()[0] == want
    assert f"gguf_linear (GGUF target format): {want} - " in taps_kernels.explain()


def test_q4_1_quantiser_round_trips_within_half_a_step():
    from taps_kernels.reference.gguf import Q4_1, dequantize_blocks_reference, quantize_q4_1_reference

    w = torch.randn(7, 96, generator=torch.Generator().manual_seed(3))
    w[2, :32] = 0.25  # a constant block: d = 0, every code 0, exact
    raw = quantize_q4_1_reference(w)
    assert raw.dtype == torch.uint8 and raw.shape == (7, 3 * 20)
    back = dequantize_blocks_reference(raw, Q4_1, 96)
    blocks = w.view(7, 3, 32)
    step = (blocks.amax(-1) - blocks.amin(-1)) / 15
    err = (back - w).abs().view(7, 3, 32).amax(-1)
    assert bool((err <= step / 2 + 1e-3 * step + 1e-3).all())  # fp16 d and m round too
    assert torch.equal(back[2, :32], w[2, :32])
