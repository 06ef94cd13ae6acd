"""Int8 linear layer (``taps_kernels.integrations.int8_linear``): fbgemm against the written-out reference on
awkward shapes, the reference against float32 within the quantisation bound, input checks, the drafter's int8
head."""
import pytest
import torch
from torch import nn

from taps_kernels import backend
from taps_kernels.integrations.int8_linear import Int8Linear
from taps_kernels.reference import int8_linear_reference, quantize_int8_rows_reference

_BACKEND, _WHY = backend.int8_linear_backend("cpu")
needs_fbgemm = pytest.mark.skipif(_BACKEND != "fbgemm", reason=_WHY)

SHAPES = [(1, 5, 1), (7, 576, 1003), (3, 130, 17), (33, 64, 250), (2, 1, 9)]


def _activation_step(x: torch.Tensor, reduce_range: bool) -> float:
    qmax = 127 if reduce_range else 255
    return (max(float(x.max()), 0.0) - min(float(x.min()), 0.0)) / qmax


def test_row_quantisation_rounds_to_nearest_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 29, generator=g) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    q, s = quantize_int8_rows_reference(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (37,)
    assert int(q.abs().max()) == 127 and torch.equal(q[5], torch.zeros(29, dtype=torch.int8)) and float(s[5]) == 1.0
    err = (w - q.float() * s[:, None]).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5)).all()
    assert torch.equal(q.abs().amax(1)[torch.arange(37) != 5], torch.full((36,), 127, dtype=torch.int8))


@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_reference_is_float32_linear_within_the_quantisation_bound(M, K, N, reduce_range):
    """|x.w - xq.wq| <= sum_k |x_k| s_w / 2 + |wq_k s_w| s_x / 2 (each factor is off by half a step at most)."""
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x, w, b = torch.randn(M, K, generator=g) * 3, torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    q, s = quantize_int8_rows_reference(w)
    got = int8_linear_reference(x, q, s, b, reduce_range)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    sx = _activation_step(x, reduce_range)
    bound = x.double().abs() @ (s.double()[:, None] / 2).expand(N, K).t() + sx / 2 * (q.double().abs() * s.double()[:, None]).sum(1)
    assert ((got.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-4).all()


@needs_fbgemm
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_fbgemm_matches_the_reference(M, K, N, reduce_range):
    """The two quantise the same activations; they may round an element whose x / s_x sits on a boundary the
    other way: one activation step times the weight row's absolute sum at most (plus float32 rounding)."""
    if not reduce_range and backend.int8_reduce_range():
        # without VNNI fbgemm sums uint8 x int8 pairs in int16, which 8-bit activations can saturate; this is
        # why Int8Linear defaults to 7 bits on such CPUs, and the 8-bit case is not a configuration it runs
        pytest.skip("8-bit activations saturate fbgemm's 16-bit pair sums on a CPU without VNNI")
    g = torch.Generator().manual_seed(7 * M + K + N)
    x, w, b = torch.randn(M, K, generator=g) * 2 - 0.5, torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    lin = Int8Linear(w, b)
    assert lin.reduce_range == backend.int8_reduce_range()
    lin.reduce_range = reduce_range
    got = lin(x)
    ref = int8_linear_reference(x, lin.qweight, lin.weight_scale, lin.bias, reduce_range)
    step = _activation_step(x, reduce_range) * (lin.qweight.float().abs().sum(1) * lin.weight_scale)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert ((got - ref).abs() <= step[None, :] + 1e-4 * ref.abs() + 1e-5).all()
    # most elements agree to float32 rounding: a looser rule would hide a wrong zero point or scale
    assert ((got - ref).abs() <= 1e-4 * ref.abs() + 1e-4).float().mean() >= 0.9


def test_module_shapes_dtypes_and_checks():
    g = torch.Generator().manual_seed(3)
    lin = Int8Linear.from_linear(nn.Linear(12, 5))
    x = torch.randn(2, 3, 12, generator=g)
    y = lin(x)
    assert y.shape == (2, 3, 5) and y.dtype == torch.float32
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    assert lin(torch.zeros(0, 12)).shape == (0, 5)
    torch.testing.assert_close(lin(x[0]), y[0], atol=0.05, rtol=0)  # other rows, other activation range
    with pytest.raises(ValueError, match=r"x: expected a float tensor \[\.\.\., 12\].*\(2, 11\)"):
        lin(torch.randn(2, 11))
    with pytest.raises(ValueError, match="x: expected a float tensor"):
        lin(torch.ones(2, 12, dtype=torch.long))
    with pytest.raises(RuntimeError, match="inference only"):
        lin(torch.randn(2, 12, requires_grad=True))
    with pytest.raises(ValueError, match=r"weight: expected a 2-D float tensor"):
        Int8Linear(torch.randn(4))
    with pytest.raises(ValueError, match=r"bias: expected shape \(4,\), received \(3,\)"):
        Int8Linear(torch.randn(4, 2), torch.randn(3))


def test_backend_choice_says_why():
    name, why = backend.int8_linear_backend("meta")
    assert name == "reference" and "CPU" in why
    assert backend.int8_linear_backend("cpu")[0] in ("fbgemm", "reference")
    assert isinstance(backend.int8_reduce_range(), bool)


def test_drafter_int8_head_is_the_int8_layer_over_the_draft_vocabulary():
    """head_dtype=int8: draft() projects with Int8Linear over the draft vocabulary's rows of the LM head;
    the argmax proposals stay close to the float32 head's; an in-place head update re-quantises."""
    from test_models_drafter import _drafter_with_context

    m, emb, head, st = _drafter_with_context(2)
    ids = torch.arange(3, 90, 2, dtype=torch.int64)
    m.set_draft_vocab(ids)
    exact, hidden = m.draft(st, torch.tensor([3]), emb, head, full_vocab_logits=False)
    m.head_dtype = torch.int8
    low = m.draft(st, torch.tensor([3]), emb, head, full_vocab_logits=False)[0]
    want = Int8Linear(head.weight[ids])(hidden.reshape(-1, hidden.shape[-1])).view_as(low)
    torch.testing.assert_close(low, want, atol=0, rtol=0)
    torch.testing.assert_close(low, exact, atol=0.05 * exact.abs().max().item(), rtol=0)
    with torch.no_grad():
        head.weight.mul_(2)
    torch.testing.assert_close(m.draft(st, torch.tensor([3]), emb, head, full_vocab_logits=False)[0], 2 * low,
                               atol=0.05 * low.abs().max().item(), rtol=0)
