"""Few-row linear kernel (``taps_kernels.rows_linear``): C++ against torch's linear on awkward shapes,
the per-call backend choice, clear errors, and a whole HF model routed through it."""
import pytest
import torch
from torch import nn

import taps_kernels
from taps_kernels import backend
from taps_kernels.integrations.rows_linear import RowsLinear, restore_linear, use_rows_linear

_WHY = backend.available_backends("rows_linear", torch.device("cpu"))["cpp"]
needs_cpp = pytest.mark.skipif(bool(_WHY), reason=f"C++ backend unavailable: {_WHY}")

# float32 tolerance of a length-K dot product summed in another order: |err| <= RTOL * sum|x_k w_k| (+ ATOL)
RTOL, ATOL = 2e-6, 1e-6


def _check_close(out, x, w, b):
    ref = (x.double() @ w.double().T + (b.double() if b is not None else 0))
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    err = (out.double() - ref).abs()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert bool((err <= RTOL * mag + ATOL).all()), f"max err {float(err.max()):.3e}"


@needs_cpp
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 13, 32, 33, 70])
@pytest.mark.parametrize("K,N", [(1, 1), (17, 5), (16, 64), (33, 65), (576, 130), (100, 257)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpp_matches_linear(M, K, N, with_bias):
    g = torch.Generator().manual_seed(M * 1000 + K * 10 + N)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    out = taps_kernels.rows_linear(x, w, b, backend="cpp")
    _check_close(out, x, w, b)
    _check_close(taps_kernels.rows_linear(x, w, b, backend="reference"), x, w, b)


@needs_cpp
def test_cpp_non_contiguous_inputs_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 40, generator=g)[:, :, ::2]          # [3,2,20], strided
    w = torch.randn(20, 9, generator=g).T                       # [9,20], transposed view
    out = taps_kernels.rows_linear(x, w, backend="cpp")
    assert out.shape == (3, 2, 9)
    _check_close(out.reshape(6, 9), x.reshape(6, 20), w, None)


@pytest.mark.parametrize("backend_name", ["reference", pytest.param("cpp", marks=needs_cpp)])
def test_empty_inner_dimension_gives_the_bias(backend_name):
    """K == 0: every output is the bias (or 0), as torch's linear gives."""
    x, w, b = torch.randn(2, 3, 0), torch.randn(5, 0), torch.randn(5)
    out = taps_kernels.rows_linear(x, w, b, backend=backend_name)
    assert torch.equal(out, torch.nn.functional.linear(x, w, b))
    assert torch.equal(taps_kernels.rows_linear(x, w, backend=backend_name), torch.zeros(2, 3, 5))


def _distinct_inputs(M, K=577, N=67, seed=0):
    """Inputs on which the C++ kernel and BLAS give different bits (they sum in different orders), so
    the default's output shows which one ran."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    return x, w


@needs_cpp
@pytest.mark.parametrize("M", [1, 4, backend.ROWS_LINEAR_MAX_ROWS, backend.ROWS_LINEAR_MAX_ROWS + 1, 70])
def test_default_runs_the_kernel_for_few_float32_rows_only(M, monkeypatch):
    """Observed through the output bits: few float32 rows run the C++ kernel (when it is the vectorized
    build), more rows, other dtypes and TAPS_BACKEND=reference run torch's linear."""
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    x, w = _distinct_inputs(M)
    cpp = taps_kernels.rows_linear(x, w, backend="cpp")
    torch_out = torch.nn.functional.linear(x, w)
    assert not torch.equal(cpp, torch_out)  # else this input could not tell the two apart
    got = taps_kernels.rows_linear(x, w)
    kernel_fast = backend.load_extension("_C")[0].rows_linear_vectorized()
    few = M <= backend.ROWS_LINEAR_MAX_ROWS
    assert torch.equal(got, cpp if (few and kernel_fast) else torch_out)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(taps_kernels.rows_linear(xb, wb), torch.nn.functional.linear(xb, wb))
    monkeypatch.setenv("TAPS_BACKEND", "reference")
    assert torch.equal(taps_kernels.rows_linear(x, w), torch_out)


def test_zero_rows_give_an_empty_result():
    x, w = torch.randn(0, 9), torch.randn(4, 9)
    assert taps_kernels.rows_linear(x, w).shape == (0, 4)


def test_bad_inputs_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight: expected shape \(\*, 8\), received \(4, 7\)"):
        taps_kernels.rows_linear(x, torch.randn(4, 7))
    with pytest.raises(TypeError, match="weight: expected dtype float32 or bfloat16, received float64"):
        taps_kernels.rows_linear(x, torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bias: expected shape \(4,\), received \(5,\)"):
        taps_kernels.rows_linear(x, torch.randn(4, 8), torch.randn(5))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        taps_kernels.rows_linear([1.0], torch.randn(4, 8))


@needs_cpp
def test_cpp_rejects_other_dtypes_by_name():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x: expected dtype float32, received bfloat16"):
        taps_kernels.rows_linear(x, torch.randn(4, 8, dtype=torch.bfloat16), backend="cpp")


def _tiny_llama(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_model_swap_keeps_outputs_and_weights():
    model = _tiny_llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_prefill = model(ids).logits
        ref_step = model(ids[:, :5]).logits            # 5 rows: the few-row path after the swap
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert use_rows_linear(model) == n_linear > 0
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights  # nothing copied
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref_prefill, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids[:, :5]).logits, ref_step, rtol=1e-5, atol=1e-5)
    assert restore_linear(model) == n_linear
    assert not any(type(m) is RowsLinear for m in model.modules())


def test_model_swap_greedy_generate_identical():
    model = _tiny_llama(1)
    prompts = [torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 11, 26)]
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = [model.generate(p, **kw) for p in prompts]
    use_rows_linear(model)
    for p, r in zip(prompts, ref):
        assert torch.equal(model.generate(p, **kw), r)


def test_gradients_still_flow_through_swapped_layers():
    layer = nn.Linear(12, 5)
    ref = nn.Linear(12, 5)
    ref.load_state_dict(layer.state_dict())
    use_rows_linear(layer)
    assert type(layer) is RowsLinear
    x = torch.randn(3, 12)
    layer(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("M", [1, 3, 8, 40])
def test_bfloat16_weights_give_their_float32_copy_bit_for_bit(M):
    # stored bf16 (what a bf16 checkpoint holds), widened exactly: the same outputs as the float32 copy, on the
    # C++ kernel and on torch's linear (more rows than the kernel takes)
    g = torch.Generator().manual_seed(M)
    x, w16, b = torch.randn(M, 200, generator=g), torch.randn(70, 200, generator=g).bfloat16(), torch.randn(70)
    w32 = w16.float()
    assert torch.equal(taps_kernels.rows_linear(x, w16, b), taps_kernels.rows_linear(x, w32, b))
    if M <= backend.ROWS_LINEAR_MAX_ROWS and backend.load_extension("_C")[0] is not None:
        assert torch.equal(taps_kernels.rows_linear(x, w16, b, backend="cpp"),
                           taps_kernels.rows_linear(x, w32, b, backend="cpp"))


def test_store_bf16_if_exact_only_when_nothing_is_lost():
    from taps_kernels.integrations.rows_linear import store_bf16_if_exact, use_rows_linear

    exact, inexact = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        exact.weight.copy_(exact.weight.bfloat16().float())
    use_rows_linear(exact), use_rows_linear(inexact)
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = exact(x)
        assert store_bf16_if_exact(exact) and exact.weight.dtype == torch.bfloat16
        assert torch.equal(exact(x), before)
        assert not store_bf16_if_exact(inexact) and inexact.weight.dtype == torch.float32
