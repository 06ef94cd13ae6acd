"""Triton tree attention vs (a) the PyTorch reference and (b) a structural oracle.

K/V are always strided views ``cache[:, :, :L]`` of a larger preallocated cache whose unused rows
(past L, and past each row's own tree) hold NaN: a kernel that reads a key it must not see fails.
Cases cover head dims 64/80/128/256, GQA ratios 1/3/4, ragged batches of 1-3 rows and both the
single-pass and the split-prefix (flash-decoding) paths.

The oracle shares no mask code with the kernel or the reference: it replays every root-to-node
path as an ordinary sequence ``[prefix keys | path nodes]`` through
``scaled_dot_product_attention(is_causal=True)``; the path's last node must get the kernel's output.

Every float comparison follows flash-attention's rule (``helpers.assert_within_torch_error``): against the same
attention in float64 (:func:`attention_in`), the kernel's error is at most twice that of PyTorch's own computation
at the kernel's precision (the float32 reference; for 16-bit outputs the same math run in that dtype, as
flash-attention's ``attention_ref(upcast=False)``: the reference computes in float32 whatever its inputs are).

Under the interpreter bf16 is computed in float32 by the launcher (documented there); fp16 runs natively.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import taps_kernels
from helpers import assert_within_torch_error, random_tree
from taps_kernels.reference.attention import tree_attention_reference, tree_visibility
from taps_kernels.reference.mask import ancestor_bits_reference

triton = pytest.importorskip("triton")
from taps_kernels.triton import tree_attention as TA  # noqa: E402
from taps_kernels.triton.tree_attention import tree_attention_triton  # noqa: E402

if torch.cuda.is_available():
    DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)]
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES = ["cpu"]
else:
    DEVICES = [pytest.param("cpu", marks=pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET is not 1"))]


def attention_in(dtype, q, k, v, bits, plen, scale=None):
    """:func:`tree_attention_reference`'s math, non-finite rules included, computed in ``dtype`` (float64: the
    rule's reference; a 16-bit dtype: PyTorch's own attention at that precision). ``(out, lse)`` in ``dtype``."""
    B, Hq, N, Dh = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    visible = tree_visibility(bits, plen.long().clamp(0, max(L - N, 0)), L, ignore_above_diagonal=True)
    kx = k.to(dtype).repeat_interleave(Hq // Hkv, dim=1)
    vx = v.to(dtype).repeat_interleave(Hq // Hkv, dim=1)
    scores = (torch.einsum("bhnd,bhld->bhnl", q.to(dtype), kx) * scale).masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)[..., None])
    finite = torch.isfinite(vx)
    out = torch.einsum("bhnl,bhld->bhnd", p, torch.where(finite, vx, torch.zeros_like(vx)))
    hits = torch.einsum("bnl,bhld->bhnd", visible.float(), (~finite).float())  # visible non-finite values
    q_bad = ~torch.isfinite(q).all(dim=-1)
    return (out.masked_fill(hits > 0, float("nan")).masked_fill(q_bad[..., None], float("nan")),
            lse.masked_fill(q_bad, float("nan")))


def assert_attention_close(got, want, exact, what=""):
    """``got``/``want``/``exact``: ``(out, lse)`` of the kernel, of PyTorch at the kernel's precision and of
    :func:`attention_in` float64; the tolerance rule on both."""
    assert_within_torch_error(got[0], want[0], exact[0], what=f"{what} out")
    assert_within_torch_error(got[1], want[1], exact[1], what=f"{what} lse")


def make_inputs(B, Hq, Hkv, N, Dh, prefix, dtype, seed, padded=True, spare=37):
    """q as a transposed view of ``[B, N, Hq, Dh]``; k/v as ``cache[:, :, :L]`` views with NaN in every row
    that no query may read (past L, and past each batch row's own tree)."""
    g = torch.Generator().manual_seed(seed)
    counts = [N] * (B - 1) + [N - 3 if padded and N > 4 else N]  # the last row keeps 3 padding nodes
    tree = random_tree(seed, B, N, num_nodes=counts, parents="recent", window=6)  # deep, like draft trees
    parents, num_nodes = tree.parents, tree.num_nodes
    bits = ancestor_bits_reference(parents, num_nodes)
    prefix_lens = torch.tensor(prefix, dtype=torch.int64)
    L = max(prefix) + N + 5
    q = torch.randn(B, N, Hq, Dh, generator=g).to(dtype).transpose(1, 2)
    caches = []
    for _ in range(2):
        cache = torch.full((B, Hkv, L + spare, Dh), float("nan"), dtype=dtype)
        for b in range(B):
            end = int(prefix_lens[b]) + N
            cache[b, :, :end] = torch.randn(Hkv, end, Dh, generator=g).to(dtype)
        caches.append(cache[:, :, :L])
    k, v = caches
    return q, k, v, bits, prefix_lens, parents, num_nodes


def to_device(t, device):
    """``t`` on ``device`` with the same strides (``Tensor.to`` would make a strided view contiguous)."""
    base = t if t._base is None else t._base
    return base.to(device).as_strided(t.size(), t.stride(), t.storage_offset())


def run(device, q, k, v, bits, plen, **kw):
    out, lse = tree_attention_triton(*(to_device(t, device) for t in (q, k, v, bits, plen)), **kw)
    return out.cpu(), lse.cpu()


CASES = [
    # (B, Hq, Hkv, N, Dh, prefix per row, num_splits)
    (2, 4, 1, 1, 64, [0, 7], None),
    (2, 4, 1, 31, 64, [0, 70], None),
    (2, 2, 2, 33, 64, [65, 3], None),
    (1, 8, 2, 70, 64, [130], None),
    (2, 4, 1, 33, 80, [64, 0], 3),          # head dim padded to 128; a row whose prefix is shorter than a split
    (3, 3, 1, 20, 128, [300, 5, 129], 4),   # GQA 3, three ragged rows
    (2, 4, 4, 40, 128, [0, 257], None),
    (1, 6, 2, 17, 256, [200], 2),
    (3, 9, 3, 9, 64, [513, 64, 1], 5),      # SmolLM2's 9/3 heads
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,Hq,Hkv,N,Dh,prefix,splits", CASES)
def test_matches_reference_fp32(device, B, Hq, Hkv, N, Dh, prefix, splits):
    q, k, v, bits, plen, _, _ = make_inputs(B, Hq, Hkv, N, Dh, prefix, torch.float32, seed=N * 7 + Dh)
    assert k.stride(2) == Dh and k.stride(1) > k.shape[2] * Dh  # a view of a larger cache
    if splits:
        dev = torch.device(device)
        block_n = TA.launch_config(N * Hq // Hkv, Dh, torch.float32, TA.shared_memory_limit(dev),
                                   interpreter=dev.type == "cpu")[1]
        assert TA.split_plan(k.shape[2] - N, splits, block_n)[0] > 1  # the split path really runs
    want = tree_attention_reference(q, k, v, bits, plen)
    got_out, got_lse = run(device, q, k, v, bits, plen, num_splits=splits)
    assert got_out.dtype == torch.float32 and got_lse.dtype == torch.float32
    assert torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()
    assert_attention_close((got_out, got_lse), want, attention_in(torch.float64, q, k, v, bits, plen))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv,N,Dh,prefix,splits", [CASES[3], CASES[5], CASES[7]])
def test_matches_reference_16bit(device, dtype, B, Hq, Hkv, N, Dh, prefix, splits):
    q, k, v, bits, plen, _, _ = make_inputs(B, Hq, Hkv, N, Dh, prefix, dtype, seed=N + Dh)
    got_out, got_lse = run(device, q, k, v, bits, plen, num_splits=splits)
    assert got_out.dtype == dtype
    # out: PyTorch's attention in dtype; lse (float32, from the same rounded inputs): the float32 reference
    want = attention_in(dtype, q, k, v, bits, plen)[0], tree_attention_reference(q, k, v, bits, plen)[1]
    assert_attention_close((got_out, got_lse), want, attention_in(torch.float64, q, k, v, bits, plen))


@pytest.mark.parametrize("device", DEVICES)
def test_split_and_single_pass_agree(device):
    q, k, v, bits, plen, _, _ = make_inputs(2, 4, 2, 12, 64, [450, 190], torch.float32, seed=3)
    want, exact = tree_attention_reference(q, k, v, bits, plen), attention_in(torch.float64, q, k, v, bits, plen)
    for s in (1, 2, 7):  # every split count within the rule of the same float64 reference
        assert_attention_close(run(device, q, k, v, bits, plen, num_splits=s), want, exact, what=f"{s} splits")


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
@pytest.mark.parametrize("Hq,Hkv,N,prefix,splits", [(4, 1, 33, [0, 45], None), (3, 3, 70, [17, 300], 3)])
def test_structural_oracle_causal_paths(device, Hq, Hkv, N, prefix, splits):
    B, Dh = len(prefix), 64
    q, k, v, bits, plen, parents, num_nodes = make_inputs(B, Hq, Hkv, N, Dh, prefix, torch.float32, seed=N)
    got, _ = run(device, q, k, v, bits, plen, num_splits=splits)
    group = Hq // Hkv
    kq, vq = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B,Hq,L,Dh]
    want, exact = torch.empty_like(got), torch.empty_like(got, dtype=torch.float64)  # every node's path replay
    for b in range(B):
        P = int(plen[b])
        for path in _paths(parents, num_nodes, b):
            idx = torch.tensor(path)
            seq_k = torch.cat([kq[b, :, :P], kq[b, :, P + idx]], dim=1)
            seq_v = torch.cat([vq[b, :, :P], vq[b, :, P + idx]], dim=1)
            # prefix positions get dummy queries: causal SDPA needs a full square sequence
            seq_q = torch.cat([torch.zeros(Hq, P, Dh), q[b][:, idx]], dim=1)
            for dst, dt in ((want, torch.float32), (exact, torch.float64)):
                dst[b, :, path[-1]] = F.scaled_dot_product_attention(
                    seq_q[None].to(dt), seq_k[None].to(dt), seq_v[None].to(dt), is_causal=True)[0, :, -1]
    # the rule on the whole output (a per-node maximum over a few hundred values is too noisy a yardstick)
    worst = (got.double() - exact).abs().amax(dim=(1, 3)).argmax().item()
    assert_within_torch_error(got, want, exact, what=f"path replay (largest error: row {worst // N} node "
                                                     f"{worst % N})")


@pytest.mark.parametrize("device", DEVICES)
def test_bits_above_the_diagonal_are_ignored_by_every_backend(device):
    q, k, v, bits, plen, _, _ = make_inputs(1, 2, 1, 40, 64, [9], torch.float32, seed=5)
    noisy = bits.clone()
    noisy[0, 3, 0] |= 1 << 20   # node 3 claims node 20
    noisy[0, 5, 1] |= 1 << 3    # node 5 claims node 35 (second word)
    want, exact = tree_attention_reference(q, k, v, bits, plen), attention_in(torch.float64, q, k, v, bits, plen)
    for got in (run(device, q, k, v, noisy, plen), tree_attention_reference(q, k, v, noisy, plen)):
        assert_attention_close(got, want, exact)


# --- non-finite contract -------------------------------------------------------------------------------------------

def _same_with_nan(got, want, exact, what=""):
    """NaN where ``want`` (the float32 reference) has NaN, the same infinities, and the tolerance rule (against
    ``exact``, the float64 reference) on the finite entries."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), \
        f"{what}: NaN pattern differs at {(torch.isnan(got) != torch.isnan(want)).nonzero()[:5].tolist()}"
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]), f"{what}: infinities differ"
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(exact), fin), f"{what}: the float64 reference has another non-finite pattern"
    assert_within_torch_error(got[fin], want[fin], exact[fin], what=what)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # numpy's max under the interpreter
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 3])
def test_nan_propagates_to_exactly_the_rows_that_see_it(device, splits):
    B, Hq, Hkv, N, Dh = 2, 4, 2, 20, 64
    q, k, v, bits, plen, parents, _ = make_inputs(B, Hq, Hkv, N, Dh, [200, 70], torch.float32, seed=8)
    q, k, v = q.clone(), k.clone(), v.clone()
    P0, P1 = int(plen[0]), int(plen[1])
    q[0, 1, 4] = float("nan")            # one query row
    k[0, 1, 17] = float("nan")           # a prefix key of row 0, kv head 1 (query heads 2, 3)
    v[1, 0, 5, 7] = float("nan")         # a prefix value of row 1, kv head 0, column 7
    par1 = parents[1].tolist()
    j = next(i for i in range(1, N) if i in par1)  # a tree node of row 1 with a child: its v holds +inf in col 3
    v[1, 1, P1 + j, 3] = float("inf")
    k[1, 0, P1 + 11, 0] = float("nan")   # a tree key of row 1, kv head 0
    got = run(device, q, k, v, bits, plen, num_splits=splits)
    want = tree_attention_reference(q, k, v, bits, plen)
    for name, g, w, x in zip(("out", "lse"), got, want, attention_in(torch.float64, q, k, v, bits, plen)):
        _same_with_nan(g, w, x, name)
    out, lse = got
    assert torch.isnan(out[0, 1, 4]).all() and torch.isnan(lse[0, 1, 4])
    assert torch.isnan(lse[0, 2:]).all() and torch.isfinite(lse[0, :2, :4]).all()
    assert torch.isnan(out[1, :2, :, 7]).all() and torch.isfinite(lse[1, :2, :3]).all()
    sees = torch.tensor([bool((int(bits[1, i, j // 32]) >> (j % 32)) & 1) for i in range(N)])
    assert sees.sum() >= 2 and (~sees).sum() >= 2
    assert torch.isnan(out[1, 2:, sees, 3]).all()                 # rows below node j: NaN in that column
    assert torch.isfinite(out[1, 2:, ~sees]).all()                 # every other row of those heads: untouched
    assert torch.isfinite(out[1, 2:, sees][..., [c for c in range(Dh) if c != 3]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_scale_and_a_row_without_visible_keys(device):
    q, k, v, bits, plen, _, _ = make_inputs(2, 2, 1, 5, 64, [0, 3], torch.float32, seed=2)
    out, lse = run(device, q, k, v, bits, plen, scale=float("nan"))
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    bad = bits.clone()
    bad[0, 2] = 0  # malformed: node 2 of row 0 (prefix 0) sees nothing, not even itself
    for splits in (None, 2):
        got = run(device, q, k, v, bad, plen, num_splits=splits)
        want = tree_attention_reference(q, k, v, bad, plen)
        for name, g, w, x in zip(("out", "lse"), got, want, attention_in(torch.float64, q, k, v, bad, plen)):
            _same_with_nan(g, w, x, f"{splits} splits {name}")
        assert torch.equal(got[0][0, :, 2], torch.zeros(2, 64)) and (got[1][0, :, 2] == float("-inf")).all()
        assert torch.isfinite(got[1][0, :, 3]).all() and torch.isfinite(got[1][1]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_prefix_values_are_clamped(device):
    # The op rejects these on the host; the launcher alone must stay in bounds and give the clamped result.
    B, N = 3, 6
    q, k, v, bits, _, _, _ = make_inputs(B, 2, 1, N, 64, [40, 40, 40], torch.float32, seed=4)
    L = k.shape[2]
    wild = torch.tensor([-7, L, 2 ** 40], dtype=torch.int64)
    clamped = wild.clamp(0, L - N)
    got = run(device, q, k, v, bits, wild)
    for p in (clamped, wild):
        want, exact = tree_attention_reference(q, k, v, bits, p), attention_in(torch.float64, q, k, v, bits, p)
        _same_with_nan(got[0], want[0], exact[0], f"prefix_lens {p.tolist()} out")
        _same_with_nan(got[1], want[1], exact[1], f"prefix_lens {p.tolist()} lse")


# --- launcher checks and configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_launcher_rejects_bad_shapes_and_dtypes(device):
    q, k, v, bits, plen, _, _ = make_inputs(2, 2, 1, 40, 64, [3, 3], torch.float32, seed=1)
    args = [t.to(device) for t in (q, k, v, bits, plen)]

    def call(i, value, exc, match):
        bad = list(args)
        bad[i] = value
        with pytest.raises(exc, match=match):
            tree_attention_triton(*bad)

    call(0, torch.zeros(2, 2, 40, 257, device=device), ValueError, "head_dim=257")
    call(0, torch.zeros(2, 2, 40, 0, device=device), ValueError, "head_dim=0")
    call(2, args[2][:, :, :-1], ValueError, "^v: ")                      # V shorter than K
    call(3, args[3][..., :1], ValueError, "^ancestor_bits: ")           # too few bit words
    call(3, args[3].long(), TypeError, "^ancestor_bits: .*int64")
    call(4, args[4][:1], ValueError, "^prefix_lens: ")                  # batch mismatch
    call(1, args[1][:1], ValueError, "^k: ")
    call(1, args[1].half(), TypeError, "^k: ")
    with pytest.raises(ValueError, match="at least N=40"):
        tree_attention_triton(args[0], args[1][:, :, :39], args[2][:, :, :39], *args[3:])
    call(1, args[1].expand(2, 3, 48, 64), ValueError, "kv heads dividing")
    with pytest.raises(ValueError, match="num_splits"):
        tree_attention_triton(*args, num_splits=0)
    with pytest.raises(ValueError, match="no backward"):
        tree_attention_triton(args[0].clone().requires_grad_(), *args[1:])
    with torch.no_grad():
        tree_attention_triton(args[0].clone().requires_grad_(), *args[1:])


def test_split_heuristic_fills_the_gpu():
    # Qwen3-8B-like decode: B=1, 8 KV heads, 64 nodes x 4:1 GQA = 256 rows = 4 tiles -> 32 programs
    s = TA.choose_num_splits(programs=32, max_prefix=4096, block_n=64, sm_count=132)
    assert 32 * s >= 2 * 132 and s <= 4096 // TA.MIN_KEYS_PER_SPLIT
    assert TA.choose_num_splits(programs=200, max_prefix=4096, block_n=64, sm_count=132) == 1  # already full
    assert TA.choose_num_splits(programs=8, max_prefix=300, block_n=64, sm_count=132) == 1     # too short to split
    assert TA.choose_num_splits(programs=1, max_prefix=10 ** 6, block_n=64, sm_count=132) == TA.MAX_SPLITS
    splits, chunk = TA.split_plan(4096, s, 64)
    assert chunk % 64 == 0 and (splits - 1) * chunk < 4096 <= splits * chunk


def test_every_launch_choice_is_compiled_ahead_of_time():
    # tests/test_triton_gpu_compile.py compiles aot_configs(arch) and checks shared memory per arch: every
    # configuration the launcher can pick must be among them
    for arch, limit in TA.SHARED_MEMORY_LIMITS.items():
        compiled = {(c[1]["q_ptr"], c[1]["out_ptr"], c[2]["BLOCK_M"], c[2]["BLOCK_N"], c[2]["BLOCK_D"], c[4], c[5])
                    for c in TA.aot_configs(arch) if c[0] is TA._tree_attention_kernel}
        names = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
        for dh in (1, 63, 64, 80, 128, 200, 256):
            for rows in (1, 16, 17, 4096):
                for dt, name in names.items():
                    bm, bn, bd, warps, stages = TA.launch_config(rows, dh, dt, limit)
                    assert bd >= dh
                    for out_name in (name, "*fp32"):
                        assert (name, out_name, bm, bn, bd, warps, stages) in compiled, (arch, dh, rows, dt)


@pytest.mark.parametrize("device", DEVICES)
def test_gpu_fp32_tiles_under_the_interpreter(device, monkeypatch):
    # the interpreter uses the largest tiles; the GPU's fp32 tiles (16 x 16) must be right too
    q, k, v, bits, plen, _, _ = make_inputs(2, 3, 1, 21, 80, [70, 33], torch.float32, seed=12)
    real = TA.launch_config
    monkeypatch.setattr(TA, "launch_config", lambda rows, dh, dt, limit, interpreter=False: real(rows, dh, dt, limit))
    assert TA.launch_config(63, 80, torch.float32, 0)[:2] == (16, 16)
    want, exact = tree_attention_reference(q, k, v, bits, plen), attention_in(torch.float64, q, k, v, bits, plen)
    for splits in (None, 2):
        assert_attention_close(run(device, q, k, v, bits, plen, num_splits=splits), want, exact,
                               what=f"{splits} splits")


@pytest.mark.parametrize("device", DEVICES)
def test_public_op_scale_and_lse(device):
    q, k, v, bits, plen, _, _ = make_inputs(2, 4, 2, 20, 64, [10, 33], torch.float32, seed=9)
    want = tree_attention_reference(q, k, v, bits, plen, 0.3)
    out, lse = taps_kernels.tree_attention(*(to_device(t, device) for t in (q, k, v, bits, plen)), scale=0.3,
                                           return_lse=True, backend="triton")
    assert_attention_close((out.cpu(), lse.cpu()), want, attention_in(torch.float64, q, k, v, bits, plen, 0.3))


@pytest.mark.parametrize("device", DEVICES)
def test_largest_tree_1024_nodes(device):
    # 32 mask words per row; node 1023 uses bit 31 of word 31 (the sign bit).
    q, k, v, bits, plen, _, _ = make_inputs(1, 1, 1, 1024, 64, [37], torch.float32, seed=11, padded=False)
    want = tree_attention_reference(q, k, v, bits, plen)
    got_out, got_lse = run(device, q, k, v, bits, plen)
    assert_attention_close((got_out, got_lse), want, attention_in(torch.float64, q, k, v, bits, plen))
    assert math.isfinite(float(got_lse.max()))
