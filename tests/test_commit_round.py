"""``commit_round`` (a verified round's commit in one call: the target's tokens, the walk, the history append, KV
compaction, the lengths): the C++ backend against the reference and against the chain of public ops it replaces,
bit for bit in every output and every tensor it writes, and bad input refused before anything is written."""
import random

import pytest
import torch

import taps_kernels as tk
from taps_kernels import backend as bk
from taps_kernels.reference import commit_round_reference

from helpers import random_root_path, random_tree

CPU = torch.device("cpu")
CPP = pytest.mark.skipif(bool(bk.unavailable_reason("cpp", CPU, "commit_round")),
                         reason=bk.unavailable_reason("cpp", CPU, "commit_round") or "-")


def _case(seed: int, B: int, N: int, R: int, dtype=torch.float32, layers: int = 3, V: int = 7):
    """A tree batch, logits whose argmax follows a random root path for a while (integer-valued, so rows have ties
    the first index must win), an active mask, caches of ``R >= B`` rows with the tree at ``lengths``, and a history
    with rows close to full."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tree = random_tree(rng, B, N, vocab=V, parents="recent")
    logits = torch.randint(0, 3, (B, N, V), generator=g).float()
    for b in range(B):  # steer the argmax down one child at a time
        for node, token in random_root_path(rng, tree, b):
            logits[b, node, token] = 5.0
    active = torch.tensor([rng.random() < 0.75 for _ in range(B)])
    Lc = N + rng.randint(0, 9)
    keys = [torch.randn(R, 2, Lc, 16, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(R, 2, Lc, 16, generator=g).to(dtype) for _ in range(layers)]
    lengths = torch.tensor([rng.randint(0, Lc - N) for _ in range(B)])
    C = 10
    history = (torch.randint(0, 9, (B, C + 1), generator=g), torch.tensor([rng.choice([0, 3, C - 1, C])
                                                                            for _ in range(B)]))
    return tree, logits, active, keys, values, lengths, history


def _clone(case):
    tree, logits, active, keys, values, lengths, history = case
    return (tree, logits, active, [k.clone() for k in keys], [v.clone() for v in values], lengths.clone(),
            tuple(h.clone() for h in history))


def _writes(case):
    """Every tensor a commit may write (the history's last column is its write sink: never read, so left out)."""
    _, _, _, keys, values, lengths, (h_tokens, h_lengths) = case
    return keys + values + [lengths, h_tokens[:, :-1], h_lengths]


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@CPP
@pytest.mark.parametrize("seed,B,N,R", [(0, 1, 1, 1), (1, 1, 9, 2), (2, 3, 17, 3), (3, 5, 33, 7), (4, 2, 40, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("moves", [True, False])
@pytest.mark.parametrize("use_history", [True, False])
def test_cpp_equals_reference(seed, B, N, R, dtype, moves, use_history):
    case = _case(seed, B, N, R, dtype)
    tree = case[0]
    P = int(tree.depth.max()) + 1 - (seed % 2)  # sometimes short of the deepest node
    outs, writes = [], []
    for backend in ("cpp", "reference"):
        c = _clone(case)
        _, logits, active, keys, values, lengths, history = c
        outs.append(tk.commit_round(tree, active, P - 1, keys, values, lengths, logits=logits,
                                    history=history if use_history else None, moves=moves, backend=backend))
        writes.append(_writes(c))
    _assert_same(outs[0], outs[1])
    _assert_same(writes[0], writes[1])
    path, accept_len, _, _ = outs[0]
    assert torch.equal(writes[0][-3], case[5] + accept_len)  # lengths advanced
    assert torch.equal(accept_len, torch.where(case[2], (path >= 0).sum(1), 0))


@CPP
@pytest.mark.parametrize("seed", range(4))
def test_cpp_equals_the_chain_of_public_ops(seed):
    """The one call gives what the loop's chain of ops gave: greedy tokens, accept_round, compact_kv, lengths."""
    case = _case(seed + 10, 4, 13, 6)
    tree = case[0]
    P = int(tree.depth.max()) + 1
    c = _clone(case)
    got = tk.commit_round(tree, c[2], P - 1, c[3], c[4], c[5], logits=c[1], history=c[6])
    d = _clone(case)
    _, logits, active, keys, values, lengths, history = d
    target = tk.greedy_tokens(logits)
    want = tk.accept_round(tree, target, active, P - 1, history=history)
    tk.compact_kv([k[:4] for k in keys], [v[:4] for v in values], lengths, want[0])
    lengths += want[1]
    _assert_same(got, want)
    _assert_same(_writes(c), _writes(d))


@CPP
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_given_target_tokens(backend):
    """Sampled rounds pass the target's tokens: the same commit as logits whose argmax they are."""
    case = _case(5, 3, 11, 3)
    tree, logits = case[0], case[1]
    P = int(tree.depth.max()) + 1
    a, b = _clone(case), _clone(case)
    got = tk.commit_round(tree, a[2], P - 1, a[3], a[4], a[5], target_tokens=logits.argmax(-1), history=a[6],
                          backend=backend)
    want = tk.commit_round(tree, b[2], P - 1, b[3], b[4], b[5], logits=logits, history=b[6], backend=backend)
    _assert_same(got, want)
    _assert_same(_writes(a), _writes(b))


@CPP
@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("validate", ["auto", "none"])
def test_bad_input_names_the_argument_and_writes_nothing(backend, validate):
    case = _case(6, 3, 9, 4)
    tree, logits, active, keys, values, lengths, history = case
    P = int(tree.depth.max()) + 1
    before = [t.clone() for t in _writes(case)]

    def call(**kw):
        args = dict(logits=logits, history=history, backend=backend, validate=validate)
        args.update(kw)
        lens = args.pop("lengths", lengths)
        ks, vs = args.pop("keys", keys), args.pop("values", values)
        return tk.commit_round(tree, args.pop("active", active), P - 1, ks, vs, lens, **args)

    cases = [
        (dict(logits=None), "logits/target_tokens"),
        (dict(target_tokens=logits.argmax(-1)), "logits/target_tokens"),
        (dict(logits=logits[:, :-1]), "logits"),
        (dict(active=active.long()), "active"),
        (dict(lengths=lengths.int()), "lengths"),
        (dict(keys=keys[:1] + [keys[0]] + keys[2:]), "keys"),
        (dict(keys=[k[:2] for k in keys], values=[v[:2] for v in values]), "keys[0]"),
    ]
    if backend == "cpp" or validate == "auto":  # the reference trusts the values under validate="none"
        far = lengths.clone()
        far[1] = keys[0].shape[2] - tree.tokens.shape[1] + 1
        cases.append((dict(lengths=far), "lengths[1]"))
        neg = lengths.clone()
        neg[2] = -1
        cases.append((dict(lengths=neg, moves=False), "lengths[2]"))
    for kwargs, name in cases:
        with pytest.raises((ValueError, TypeError)) as err:
            call(**kwargs)
        assert name in str(err.value), (name, str(err.value))
        _assert_same(_writes(case), before)


@pytest.mark.gpu
@pytest.mark.parametrize("moves", [True, False])
def test_cuda_backend_equals_the_cpu_commit(moves):
    """On a GPU the default backend chains torch's argmax, the CUDA walk and the CUDA compaction: the same commit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = bk.unavailable_reason("cuda", torch.device("cuda"), "commit_round")
    if why:
        pytest.skip(why)
    case = _case(7, 4, 21, 5, torch.float16)
    tree = case[0]
    P = int(tree.depth.max()) + 1
    cpu = _clone(case)
    want = tk.commit_round(tree, cpu[2], P - 1, cpu[3], cpu[4], cpu[5], logits=cpu[1], history=cpu[6], moves=moves)
    gpu = _clone(case)
    dev = torch.device("cuda")
    tree_d = tree.to(dev)
    keys, values = [k.to(dev) for k in gpu[3]], [v.to(dev) for v in gpu[4]]
    lengths, history = gpu[5].to(dev), tuple(h.to(dev) for h in gpu[6])
    got = tk.commit_round(tree_d, gpu[2].to(dev), P - 1, keys, values, lengths, logits=gpu[1].to(dev), history=history,
                          moves=moves, validate="none")
    _assert_same([t.cpu() for t in got], want)
    _assert_same([t.cpu() for t in _writes((None, None, None, keys, values, lengths, history))], _writes(cpu))
