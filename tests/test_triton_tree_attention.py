"""Triton tree attention vs (a) the PyTorch reference and (b) a structural oracle.

The oracle shares no mask code with the kernel or the reference: it replays every
root-to-node path as an ordinary sequence ``[prefix keys | path nodes]`` through
``scaled_dot_product_attention(is_causal=True)``; the path's last node must get the
kernel's output. Only parent pointers are used to build the paths.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import taps_kernels
from taps_kernels.reference.attention import tree_attention_reference
from taps_kernels.reference.mask import ancestor_bits_reference

triton = pytest.importorskip("triton")
from taps_kernels.triton.tree_attention import tree_attention_triton  # noqa: E402

if torch.cuda.is_available():
    DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)]
    DTYPES = [torch.float32, torch.float16, torch.bfloat16]
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES = ["cpu"]
    DTYPES = [torch.float32, torch.float16]  # the interpreter computes bf16 wrongly (ENVIRONMENT.md)
else:
    DEVICES = [pytest.param("cpu", marks=pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET is not 1"))]
    DTYPES = [torch.float32]

# (atol, rtol) for out; lse is always computed in fp32 but from low-precision scores.
TOL_OUT = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
TOL_LSE = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-4, 1e-4), torch.bfloat16: (1e-3, 1e-3)}


def random_tree(B, N, seed, padded=True):
    """Random parent pointers in topological order; the last row keeps 3 padding nodes when ``padded``."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    num_nodes = torch.full((B,), N, dtype=torch.int32)
    if padded and N > 4:
        num_nodes[-1] = N - 3
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            # bias towards recent parents so trees get deep, like draft trees
            lo = max(0, i - 6)
            parents[b, i] = int(torch.randint(lo, i, (1,), generator=g))
    return parents, num_nodes


def make_inputs(B, Hq, Hkv, N, Dh, prefix, dtype, seed, padded=True):
    g = torch.Generator().manual_seed(seed)
    parents, num_nodes = random_tree(B, N, seed, padded)
    bits = ancestor_bits_reference(parents, num_nodes)
    prefix_lens = torch.tensor(prefix, dtype=torch.int64)
    L = max(prefix) + N + 5  # spare capacity past every row's tree must stay invisible
    q = torch.randn(B, Hq, N, Dh, generator=g).to(dtype)
    k = torch.randn(B, Hkv, L, Dh, generator=g).to(dtype)
    v = torch.randn(B, Hkv, L, Dh, generator=g).to(dtype)
    return q, k, v, bits, prefix_lens, parents, num_nodes


CASES = [
    # (B, Hq, Hkv, N, Dh, prefix per row)
    (2, 4, 1, 1, 64, [0, 7]),
    (2, 4, 1, 31, 64, [0, 70]),
    (2, 2, 2, 33, 64, [65, 3]),
    (1, 8, 2, 70, 64, [130]),
    (2, 4, 1, 33, 80, [64, 0]),   # head dim padded to 128 inside the kernel
    (2, 2, 2, 70, 80, [1, 129]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,N,Dh,prefix", CASES)
def test_matches_reference(device, dtype, B, Hq, Hkv, N, Dh, prefix):
    q, k, v, bits, plen, _, _ = make_inputs(B, Hq, Hkv, N, Dh, prefix, dtype, seed=N * 7 + Dh)
    want_out, want_lse = tree_attention_reference(q, k, v, bits, plen)
    got_out, got_lse = tree_attention_triton(*(t.to(device) for t in (q, k, v, bits, plen)))
    assert got_out.dtype == dtype and got_lse.dtype == torch.float32
    torch.testing.assert_close(got_out.cpu().float(), want_out.float(), atol=TOL_OUT[dtype][0], rtol=TOL_OUT[dtype][1])
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=TOL_LSE[dtype][0], rtol=TOL_LSE[dtype][1])


def _paths(parents, num_nodes, b):
    """Root-to-node path of every row of tree b (padding rows: just themselves)."""
    N = parents.shape[1]
    out = []
    for i in range(N):
        if i >= int(num_nodes[b]):
            out.append([i])
            continue
        path = [i]
        while path[-1] != 0:
            path.append(int(parents[b, path[-1]]))
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Hq,Hkv,N,prefix", [(4, 1, 33, [0, 45]), (2, 2, 70, [17, 64])])
def test_structural_oracle_causal_paths(device, Hq, Hkv, N, prefix):
    B, Dh = len(prefix), 64
    q, k, v, bits, plen, parents, num_nodes = make_inputs(B, Hq, Hkv, N, Dh, prefix, torch.float32, seed=N)
    got, _ = tree_attention_triton(*(t.to(device) for t in (q, k, v, bits, plen)))
    got = got.cpu()
    group = Hq // Hkv
    kq, vq = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B,Hq,L,Dh]
    for b in range(B):
        P = int(plen[b])
        for path in _paths(parents, num_nodes, b):
            idx = torch.tensor(path)
            seq_k = torch.cat([kq[b, :, :P], kq[b, :, P + idx]], dim=1)
            seq_v = torch.cat([vq[b, :, :P], vq[b, :, P + idx]], dim=1)
            # prefix positions get dummy queries: causal SDPA needs a full square sequence
            seq_q = torch.cat([torch.zeros(Hq, P, Dh), q[b][:, idx]], dim=1)
            want = F.scaled_dot_product_attention(seq_q[None], seq_k[None], seq_v[None], is_causal=True)[0]
            torch.testing.assert_close(got[b, :, path[-1]], want[:, -1], atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"row {b} node {path[-1]} (path {path}): {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_bits_above_the_diagonal_are_ignored(device):
    q, k, v, bits, plen, _, _ = make_inputs(1, 2, 1, 40, 64, [9], torch.float32, seed=5)
    noisy = bits.clone()
    noisy[0, 3, 0] |= 1 << 20   # node 3 claims node 20
    noisy[0, 5, 1] |= 1 << 3    # node 5 claims node 35 (second word)
    want = tree_attention_triton(*(t.to(device) for t in (q, k, v, bits, plen)))
    got = tree_attention_triton(*(t.to(device) for t in (q, k, v, noisy, plen)))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_public_op_scale_and_lse(device):
    q, k, v, bits, plen, _, _ = make_inputs(2, 4, 2, 20, 64, [10, 33], torch.float32, seed=9)
    want_out, want_lse = tree_attention_reference(q, k, v, bits, plen, 0.3)
    out, lse = taps_kernels.tree_attention(*(t.to(device) for t in (q, k, v, bits, plen)), scale=0.3,
                                           return_lse=True, backend="triton")
    torch.testing.assert_close(out.cpu(), want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_largest_tree_1024_nodes(device):
    # 32 mask words per row; node 1023 uses bit 31 of word 31 (the sign bit).
    q, k, v, bits, plen, _, _ = make_inputs(1, 2, 1, 1024, 64, [37], torch.float32, seed=11, padded=False)
    want_out, want_lse = tree_attention_reference(q, k, v, bits, plen)
    got_out, got_lse = tree_attention_triton(*(t.to(device) for t in (q, k, v, bits, plen)))
    torch.testing.assert_close(got_out.cpu(), want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=2e-5, rtol=1e-5)
