"""``greedy_tokens``: every backend equals ``torch.argmax`` exactly (ties to the first index, NaN largest), on
awkward shapes and dtypes; bad input refused with the argument named."""
import pytest
import torch

import taps_kernels as tk
from taps_kernels import backend as bk

CPU = torch.device("cpu")
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(bool(bk.unavailable_reason(b, CPU, "greedy_tokens")),
                                                     reason=bk.unavailable_reason(b, CPU, "greedy_tokens") or "-"))
            for b in ("reference", "cpp")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 5, 16), (1, 4, 49152), (7, 1001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_equals_torch_argmax(backend, shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    logits = torch.randint(-3, 3, shape, generator=g).to(dtype)  # many ties: the first index must win
    logits.view(-1, shape[-1])[0] = float("-inf")  # a row of -inf only: index 0
    if logits.numel() > 40:
        flat = logits.view(-1)
        flat[11] = float("nan")  # NaN is the largest
        flat[-3] = float("inf")
    got = tk.greedy_tokens(logits, backend=backend)
    assert got.dtype == torch.int64 and got.shape == shape[:-1]
    assert torch.equal(got, logits.argmax(dim=-1))


@pytest.mark.parametrize("bad,exc,match", [
    (torch.zeros(2, 3, dtype=torch.int64), TypeError, "logits: expected dtype"),
    (torch.zeros(2, 0), ValueError, "logits"),
    (torch.tensor(1.0), ValueError, "logits: expected at least one dimension"),
    ([1.0, 2.0], TypeError, "logits"),
])
def test_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        tk.greedy_tokens(bad)
