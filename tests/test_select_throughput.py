"""``select_throughput`` (the batch throughput rule as a library op) against the policies' rule and across backends.

The oracle is the policies' own host implementation of the rule, kept here verbatim (:func:`joint_sizes`, and
:func:`policy_choice` for the keep mask ``GatedPolicy`` built from it before the policies called this op): the
reference must equal it exactly (kept nodes, sizes, ``expected`` bit for bit); the C++ and Triton backends must
equal the reference exactly. Triton runs compiled on CUDA when present (integers exact, ``expected`` within one
float32 step: the device's float64 ``exp`` is not the host's), else under the interpreter (conftest sets it;
exact).
"""
import os
import random

import pytest
import torch

import taps_kernels
from helpers import random_tree
from taps.decode.latency import LatencyTable
from taps.decode.tree_ops import depth_mask
from taps_kernels import backend as bk
from taps_kernels.reference.select import select_throughput_reference

NEG_INF = float("-inf")
SHAPES = [(B, N) for B in (1, 2, 3, 7, 16) for N in (1, 2, 5, 33, 65)]

_CPP_WHY = bk.unavailable_reason("cpp", "cpu", "select_throughput")
needs_cpp = pytest.mark.skipif(bool(_CPP_WHY), reason=f"C++ backend unavailable: {_CPP_WHY}")

if torch.cuda.is_available():
    TRITON_DEVICE, TRITON_MARKS = "cuda", [pytest.mark.gpu]
elif os.environ.get("TRITON_INTERPRET") == "1":
    TRITON_DEVICE, TRITON_MARKS = "cpu", []
else:
    TRITON_DEVICE, TRITON_MARKS = "cpu", [pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET is not 1")]
TRITON = pytest.param(TRITON_DEVICE, marks=TRITON_MARKS)
#: ``(backend, device)`` of every implementation.
EVERY_BACKEND = [pytest.param("reference", "cpu", id="reference"),
                 pytest.param("cpp", "cpu", marks=needs_cpp, id="cpp"),
                 pytest.param("triton", TRITON_DEVICE, marks=TRITON_MARKS, id="triton")]


# --- the oracle ------------------------------------------------------------------------------------------------

def joint_sizes(log_reach: torch.Tensor, table: torch.Tensor, plain_s: float, rows: int, max_nodes: int,
                return_order: bool = False):
    """The batch throughput rule as the policies computed it on the host with torch ops (``gate.joint_sizes``).

    Args:
        log_reach: ``[B, N]`` log reach, root first, non-increasing along paths; padding and nodes past a row's
            depth cap ``-inf``.
        table: ``[L] float64`` seconds to verify the batch's roots plus ``n`` nodes in total.
        plain_s: seconds of a plain round of the batch.
        rows: running rows (the batch's plain round makes ``rows`` tokens).
        max_nodes: per-row cap.
        return_order: also return each row's non-root nodes in rank order ``[B, N-1]`` (by ``(-reach, index)``:
            the first ``sizes[b]`` are the row's tree).
    Returns:
        ``(sizes [B] int64, expected [B] float32, total int64 scalar[, order])``, all on the device: nodes kept
        per row, ``1 + sum`` of their reach, and the batch's total. Ties go to the smaller tree, then the
        smaller row.
    """
    B, N = log_reach.shape
    dev = log_reach.device
    cap = max(0, min(max_nodes, N - 1))
    # one stable sort per row: rank order by (-reach, node index), as select_subtree's reach rule
    neg, order = torch.sort(-log_reach[:, 1:].float(), dim=1, stable=True)
    if cap == 0:
        z = torch.zeros(B, dtype=torch.int64, device=dev)
        out = (z, torch.ones(B, dtype=torch.float32, device=dev), z.sum())
        return out + (order,) if return_order else out
    per_row = (-neg[:, :cap]).double().exp()  # [B, cap] reach, descending; -inf -> 0
    cost = (table[:table.numel()].to(dev) - table[0]) * (rows / plain_s)
    if B == 1:
        K = min(cap, table.numel() - 1)
        mass = torch.cat([per_row.new_zeros(1, 1), per_row[:, :K].cumsum(1)], 1)
        k = (mass[0] - cost[:K + 1]).argmax()  # first maximum: the smaller tree on ties
        out = (k.view(1), (1.0 + mass[0, k]).float().view(1), k)
        return out + (order,) if return_order else out
    flat = per_row.reshape(-1)
    merged = torch.sort(-flat, stable=True).indices  # row-major ties: lower row, then lower rank first
    K = min(flat.numel(), table.numel() - 1)
    merged = merged[:K]
    gain = torch.cat([flat.new_zeros(1), flat[merged].cumsum(0)]) - cost[:K + 1]
    k = gain.argmax()  # first maximum: the smaller batch tree on ties
    taken = (torch.arange(K, device=dev) < k).to(flat.dtype)
    row_of = merged // cap
    sizes = torch.zeros(B, dtype=torch.float64, device=dev).index_add_(0, row_of, taken).to(torch.int64)
    mass = torch.zeros(B, dtype=torch.float64, device=dev).index_add_(0, row_of, taken * flat[merged])
    out = (sizes, (1.0 + mass).float(), k)
    return out + (order,) if return_order else out


# --- inputs --------------------------------------------------------------------------------------------------

def path_reach(tree, rng: random.Random, quantised: bool, dead: float = 0.0) -> torch.Tensor:
    """``[B, N] float32`` log reach, non-increasing along paths: float32 sums of per-edge log-probabilities from
    the root. ``quantised``: edges in {0, -0.5, -1, -1.5} (equal reaches everywhere, within and across rows);
    ``dead``: share of -inf edges. Padding holds finite garbage (the op must treat it as -inf)."""
    B, N = tree.tokens.shape
    lr = torch.zeros(B, N)
    for b in range(B):
        for i in range(1, N):
            if i >= int(tree.num_nodes[b]):
                lr[b, i] = rng.uniform(-1.0, 0.0)
                continue
            edge = -0.5 * rng.randrange(4) if quantised else -rng.expovariate(1.0)
            if rng.random() < dead:
                edge = NEG_INF
            lr[b, i] = lr[b, int(tree.parents[b, i])] + edge
    lr[:, 0] = rng.uniform(-3.0, 0.0)  # the root column is not read
    return lr


def synthetic_table(rng: random.Random, L: int, kind: str) -> torch.Tensor:
    """``[L] float64`` seconds: ``increasing`` (random steps) or ``flat`` (runs of equal timings: gain ties)."""
    steps = [rng.choice([0.0, 0.002, 0.004]) if kind == "flat" else rng.uniform(0.0005, 0.006) for _ in range(L - 1)]
    return torch.tensor([0.02] + steps, dtype=torch.float64).cumsum(0)


def latency_table(rng: random.Random, B: int, measured: int) -> LatencyTable:
    """A one-row table of ``measured`` entries (non-decreasing, as calibration writes), with a measured
    ``B``-row table for B > 1 every other time; shorter than the candidates: the extension rule prices the rest."""
    one = sorted(0.02 + rng.uniform(0.0, 0.05) for _ in range(measured))
    record = {"latency": one, "t0_parts": {"context": 0.003}}
    if B > 1 and rng.random() < 0.5:
        record["batch_latency"] = {str(B): sorted(0.03 + rng.uniform(0.0, 0.1) for _ in range(measured))}
    return LatencyTable(record)


def random_case(seed: int, B: int, N: int):
    """One call's arguments ``(tree, log_reach, depth_cap, max_nodes, table, plain_seconds, rows)``: awkward
    caps, tables of every kind and length, depth caps, ties and -inf."""
    rng = random.Random(seed)
    tree = random_tree(rng, B, N)
    lr = path_reach(tree, rng, quantised=rng.random() < 0.5, dead=rng.choice([0.0, 0.0, 0.2]))
    max_nodes = rng.choice([0, 1, 2, max(1, N // 3), N - 1, N, 2 * N + 3])
    rows = rng.choice([B, max(1, B - 1)])
    if rng.random() < 0.5:
        lat = latency_table(rng, rows, rng.choice([1, 2, 5, N + 1]))
        n_total = rng.choice([0, 1, B * N // 2, rows * max_nodes])
        table = torch.tensor(lat.batch_seconds(rows, n_total), dtype=torch.float64)
        plain = lat.plain_round_seconds(rows)
    else:
        table = synthetic_table(rng, rng.choice([1, 2, 4, B * N // 2 + 1, B * N + 5]), rng.choice(["increasing",
                                                                                                   "flat"]))
        plain = rng.choice([0.02, 0.0371, 0.5])
    depth_cap = torch.tensor([rng.randrange(0, 4) for _ in range(B)]) if rng.random() < 0.3 else None
    return tree, lr, depth_cap, max_nodes, table, plain, rows


def op_args(tree, lr, depth_cap, max_nodes, table, plain, rows):
    """The op's arguments as a policy passes them: depth-capped nodes -inf (padding may stay as it is)."""
    masked = lr.masked_fill(~depth_mask(tree, depth_cap), NEG_INF)
    return tree.parents, tree.depth, tree.num_nodes, masked, max_nodes, table, plain, rows


def policy_choice(tree, lr, depth_cap, max_nodes, table, plain, rows):
    """What the policies kept from :func:`joint_sizes` (``GatedPolicy._throughput_keep``: its top ``sizes[b]`` by rank
    order within the depth cap, then real nodes only, as ``keep_nodes`` re-indexes):
    ``(kept nodes per row (root first), sizes [B] int64, expected [B] float32)``."""
    B, N = tree.tokens.shape
    ok = depth_mask(tree, depth_cap) & (torch.arange(N)[None, :] < tree.num_nodes[:, None])  # keep_nodes: real only
    e = lr.float().masked_fill(~ok, NEG_INF)
    e[:, 0] = 0.0
    sizes, expected, _, order = joint_sizes(e, table, plain, rows, max_nodes, return_order=True)
    taken = torch.arange(N - 1)[None, :] < sizes[:, None]
    keep = torch.cat([ok[:, :1], torch.zeros_like(taken).scatter_(1, order, taken)], 1) & ok
    return [keep[b].nonzero()[:, 0].tolist() for b in range(B)], sizes, expected


def kept_rows(pool_index: torch.Tensor):
    return [[i for i in row if i >= 0] for row in pool_index.cpu().tolist()]


def assert_identical(got, want):
    """Same dtypes and shapes; integers equal; ``expected`` equal bit for bit."""
    for g, w, name in zip(got, want, ("pool_index", "num_selected", "expected")):
        g = g.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if w.dtype.is_floating_point:
            g, w = g.view(torch.int32), w.view(torch.int32)
        bad = g != w
        assert not bad.any(), f"{name}: first mismatch at {bad.nonzero()[0].tolist()}: {g[bad][:4]} vs {w[bad][:4]}"


def assert_expected(got: torch.Tensor, want: torch.Tensor, device: str):
    """Bit for bit on CPU; within one float32 step on CUDA (the device's float64 ``exp``)."""
    got = got.cpu()
    if device == "cpu":
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got, want)
    else:
        assert ((got - want).abs() <= torch.nextafter(want, torch.tensor(2.0 ** 30)) - want).all(), (got, want)


def cases():
    return [pytest.param(seed, B, N, id=f"B{B}-N{N}-s{seed}") for B, N in SHAPES for seed in range(4)]


# --- the reference is the policies' rule ---------------------------------------------------------------------

@pytest.mark.parametrize("seed,B,N", cases())
def test_reference_is_joint_sizes_and_the_policy_keep_mask(seed, B, N):
    case = random_case(1000 * seed + 17 * B + N, B, N)
    kept, sizes, expected = policy_choice(*case)
    pool_index, num_selected, got_expected = select_throughput_reference(*op_args(*case))
    max_nodes = case[3]
    assert pool_index.shape == (B, max_nodes + 1) and pool_index.dtype == torch.int64
    assert kept_rows(pool_index) == kept
    assert (pool_index[:, 0] == 0).all()
    assert num_selected.dtype == torch.int32 and num_selected.tolist() == sizes.tolist()
    assert got_expected.dtype == torch.float32
    assert torch.equal(got_expected.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("backend,device", EVERY_BACKEND)
def test_ties_go_to_the_smaller_tree_then_the_lower_row_then_the_lower_index(backend, device):
    star = random_tree(0, 2, 6, num_nodes=[6, 6], parents="star")
    reach = torch.zeros(2, 6)  # every node reach 1 (exp(0) is exact everywhere)
    fn = bk.resolve("select_throughput", backend, device)[1]

    def both(table):
        table = torch.tensor(table, dtype=torch.float64)
        pool_index, sizes, expected = fn(star.parents.to(device), star.depth.to(device), star.num_nodes.to(device),
                                         reach.to(device), 5, table.to(device), 1.0, 1)
        kept, want_sizes, want_expected = policy_choice(star, reach, None, 5, table, 1.0, 1)
        assert kept_rows(pool_index) == kept and sizes.tolist() == want_sizes.tolist()
        assert expected.tolist() == want_expected.tolist()
        return kept_rows(pool_index), sizes.tolist(), expected.tolist()

    # each node adds exactly the plain rate's cost: every size has gain 0, the first maximum is the empty tree
    assert both([float(k) for k in range(11)]) == ([[0], [0]], [0, 0], [1.0, 1.0])
    # three nodes are free, the fourth costs more than it brings: equal reaches go to the lower row, and within
    # it to the lowest indices
    assert both([0.0] * 4 + [9.0] * 7) == ([[0, 1, 2, 3], [0]], [3, 0], [4.0, 1.0])
    assert both([0.0] * 7 + [9.0] * 4) == ([[0, 1, 2, 3, 4, 5], [0, 1]], [5, 1], [6.0, 2.0])


@pytest.mark.parametrize("backend,device", EVERY_BACKEND)
def test_nodes_of_reach_zero_are_never_written(backend, device):
    # a table that gets cheaper at its last entry makes joint_sizes count reach-0 nodes (padding, depth-capped); the op
    # writes only real nodes above -inf, as the policy's keep mask does, and counts what it writes
    rng = random.Random(3)
    tree = random_tree(rng, 3, 12, num_nodes=[4, 12, 2])
    lr = path_reach(tree, rng, quantised=False)
    cap = torch.tensor([5, 1, 5])
    table = torch.tensor([0.02 + 0.0001 * k for k in range(33)] + [0.0], dtype=torch.float64)  # B * cap = 33
    kept, sizes, expected = policy_choice(tree, lr, cap, 11, table, 0.02, 3)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in op_args(tree, lr, cap, 11, table, 0.02, 3)]
    pool_index, num_selected, got_expected = bk.resolve("select_throughput", backend, device)[1](*args)
    assert kept_rows(pool_index) == kept
    assert num_selected.tolist() == [len(k) - 1 for k in kept]
    assert (sizes > num_selected.long().cpu()).any()  # the case this test is about
    assert_expected(got_expected, expected, device)


# --- backends --------------------------------------------------------------------------------------------------

@needs_cpp
@pytest.mark.parametrize("seed,B,N", cases())
def test_cpp_equals_the_reference(seed, B, N):
    args = op_args(*random_case(1000 * seed + 17 * B + N, B, N))
    assert_identical(bk.resolve("select_throughput", "cpp", "cpu")[1](*args), select_throughput_reference(*args))


@pytest.mark.parametrize("device", [TRITON])
@pytest.mark.parametrize("seed,B,N", [c for c in cases() if c.values[0] < 2])
def test_triton_equals_the_reference(device, seed, B, N):
    args = op_args(*random_case(1000 * seed + 17 * B + N, B, N))
    want = select_throughput_reference(*args)
    on = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    got = bk.resolve("select_throughput", "triton", device)[1](*on)
    if device == "cpu":
        assert_identical(got, want)
    else:
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
        assert_expected(got[2], want[2], device)


@pytest.mark.parametrize("device", [TRITON])
def test_triton_declines_more_candidates_than_one_program_ranks(device):
    from taps_kernels.triton.select_throughput import MAX_CANDIDATES, supports

    assert supports(batch_size=32, max_nodes=64) == "" and supports(batch_size=64, max_nodes=64, columns=33) == ""
    assert str(MAX_CANDIDATES) in supports(batch_size=33, max_nodes=64)
    assert bk.unavailable_reason("triton", device, "select_throughput", batch_size=33, max_nodes=64)
    tree = random_tree(0, 33, 66)
    args = (tree.parents, tree.depth, tree.num_nodes, torch.zeros(33, 66), 64, torch.ones(3, dtype=torch.float64), 1.0,
            33)
    with pytest.raises(ValueError, match="candidates"):
        bk.resolve("select_throughput", "triton", device)[1](*[a.to(device) if isinstance(a, torch.Tensor) else a
                                                               for a in args])


# --- recorded inputs: real candidate pools, as ddtree-cost builds them --------------------------------------------

@pytest.fixture(scope="module")
def ddtree_pools():
    """``(B, pool, depth_cap)`` cases from ``taps_kernels.candidate_pool`` on random peaked logits, the pool's
    log-masses ``pool.logq`` as the reach (the ``ddtree-cost`` policy's input), budget 64 as its default."""
    g = torch.Generator().manual_seed(11)
    out = []
    for B, D, V in [(1, 8, 40), (4, 6, 61), (16, 5, 33)]:
        logits = torch.randn(B, D, V, generator=g) * 3.0
        logits[:, :, V // 2:] = (logits[:, :, V // 2:] * 2).round() / 2  # some equal log-probs
        roots = torch.randint(0, V, (B,), generator=g)
        pool = taps_kernels.candidate_pool(logits, roots, top_k=min(64, V), pool_size=64, backend="reference",
                                           pool_backend="reference")
        out.append((B, pool, None))
        out.append((B, pool, torch.randint(0, D + 1, (B,), generator=g)))
    return out


@pytest.mark.parametrize("device", [TRITON])
def test_ddtree_cost_pools(ddtree_pools, device):
    rng = random.Random(2)
    for B, pool, depth_cap in ddtree_pools:
        tree = pool.tree
        for rows in sorted({1, B}):
            # the policies' tables: the rows-row batch table up to rows * max_nodes nodes, the plain round
            lat = latency_table(rng, rows, 40)
            table = torch.tensor(lat.batch_seconds(rows, rows * 64), dtype=torch.float64)
            case = (tree, pool.logq, depth_cap, 64, table, lat.plain_round_seconds(rows), rows)
            kept, sizes, expected = policy_choice(*case)
            args = op_args(*case)
            want = select_throughput_reference(*args)
            assert kept_rows(want[0]) == kept
            assert want[1].tolist() == sizes.tolist()
            assert torch.equal(want[2].view(torch.int32), expected.view(torch.int32))
            if not _CPP_WHY:
                assert_identical(bk.resolve("select_throughput", "cpp", "cpu")[1](*args), want)
            on = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
            got = bk.resolve("select_throughput", "triton", device)[1](*on)
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
            assert_expected(got[2], want[2], device)


# --- the C++ binding's checks ----------------------------------------------------------------------------------

@needs_cpp
def test_cpp_refuses_what_it_cannot_run():
    from taps_kernels import _C

    tree = random_tree(0, 2, 5, num_nodes=[5, 3])
    lr = torch.full((2, 5), -1.0)
    table = torch.tensor([0.02, 0.03], dtype=torch.float64)
    ok = (tree.parents, tree.depth, tree.num_nodes, lr, 4, table, 0.02, 2)
    _C.select_throughput(*ok)
    lr_pad = lr.clone()
    lr_pad[1, 4] = float("nan")  # padding is not read
    _C.select_throughput(tree.parents, tree.depth, tree.num_nodes, lr_pad, 4, table, 0.02, 2)
    bad = [
        ((3, torch.tensor([[0.0, float("nan"), -1, -1, -1]] * 2)), ValueError, r"log_reach\[0,1\]"),
        ((3, torch.tensor([[0.0, float("inf"), -1, -1, -1]] * 2)), ValueError, "log reach"),
        ((3, lr.double()), TypeError, "log_reach: expected dtype float32"),
        ((4, -1), ValueError, "max_nodes"),
        ((5, torch.zeros(0, dtype=torch.float64)), ValueError, "table: expected a non-empty"),
        ((5, torch.tensor([0.02, float("inf")], dtype=torch.float64)), ValueError, r"table\[1\]"),
        ((6, 0.0), ValueError, "plain_seconds"),
        ((6, float("nan")), ValueError, "plain_seconds"),
        ((7, 0), ValueError, "rows"),
        ((2, torch.tensor([5, 6], dtype=torch.int32)), ValueError, "num_nodes"),
    ]
    for (pos, value), exc, match in bad:
        args = list(ok)
        args[pos] = value
        with pytest.raises(exc, match=match):
            _C.select_throughput(*args)
