"""Shared test helpers: tiny random target and drafter, HF greedy reference, random trees, a random scorer.

Import as ``from helpers import ...`` (``tests/`` is on ``sys.path`` under pytest's rootdir conftest).
"""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from taps.models.drafter import DFlashConfig, DFlashDrafter
from taps_kernels import Tree

V = 61


def tiny_target(seed: int = 0, vocab: int = V, ctx: int = 256, layers: int = 6, hidden: int = 32) -> LlamaForCausalLM:
    """A random Llama (hidden 32, 4 heads / 2 KV heads) in eval mode, no special tokens."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def tiny_drafter(seed: int = 0, vocab: int = V, block_size: int = 5, target_layers: int = 6, layers: int = 2,
                 hidden: int = 32) -> DFlashDrafter:
    """A random DFlash drafter that fits :func:`tiny_target` with the same ``vocab`` and ``target_layers``."""
    torch.manual_seed(seed + 1000)
    cfg = DFlashConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48, num_hidden_layers=layers, vocab_size=vocab, block_size=block_size,
                       num_target_layers=target_layers, target_layer_ids=[0, 1], mask_token_id=vocab - 1,
                       rope_theta=10000.0)
    return DFlashDrafter(cfg).eval()


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int, stops: Iterable[int] = ()) -> List[int]:
    """Plain HF ``generate(do_sample=False)``: the new tokens only (stop token kept)."""
    inp = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=list(stops) or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_tree(rows, N: Optional[int] = None) -> Tree:
    """A padded batch Tree from ``[(parents, tokens), ...]`` rows (parents[0] = -1, topological order), padded to
    ``N`` rows (default: the longest row)."""
    N = N or max(len(p) for p, _ in rows)
    B = len(rows)
    tokens = torch.zeros(B, N, dtype=torch.int64)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    depth = torch.zeros(B, N, dtype=torch.int32)
    num_nodes = torch.zeros(B, dtype=torch.int32)
    for b, (par, tok) in enumerate(rows):
        d = [0] * len(par)
        for i in range(1, len(par)):
            d[i] = d[par[i]] + 1
        n = len(par)
        parents[b, :n] = torch.tensor(par, dtype=torch.int32)
        depth[b, :n] = torch.tensor(d, dtype=torch.int32)
        tokens[b, :n] = torch.tensor(tok, dtype=torch.int64)
        num_nodes[b] = n
    return Tree(tokens, parents, depth, num_nodes)


#: How :func:`random_tree` picks node ``i``'s parent among the earlier nodes ``0..i-1``.
PARENT_RULES = ("mixed", "uniform", "recent", "chain", "star")


def random_tree(rng, B: int, N: int, vocab: int = 50, num_nodes: Optional[Sequence[int]] = None,
                parents: str = "mixed", window: int = 3) -> Tree:
    """The tests' one random-tree builder: a padded batch ``Tree`` of ``B`` rows and ``N`` columns.

    Args:
        rng: a ``random.Random`` or an int seed.
        num_nodes: real nodes per row (``B`` ints in ``[1, N]``); default: row 0 has ``N``, every other row a
            random count in ``[1, N]`` (ragged, with padding).
        parents: ``"mixed"`` (even odds of ``"uniform"`` and ``"recent"``: bushy and deep trees), ``"uniform"``
            (any earlier node), ``"recent"`` (one of the ``window`` latest nodes: deep, like draft trees),
            ``"chain"`` (``i - 1``: deepest) or ``"star"`` (the root: widest).
        vocab: tokens of real nodes (root included) uniform in ``[0, vocab)``; padding tokens are 0.
    Returns:
        ``Tree`` with ``tokens [B,N] int64``, ``parents [B,N] int32`` (topological), ``depth [B,N] int32``,
        ``num_nodes [B] int32``.
    """
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    if parents not in PARENT_RULES:
        raise ValueError(f"parents: expected one of {PARENT_RULES}, received {parents!r}")
    if num_nodes is not None and (len(num_nodes) != B or not all(1 <= n <= N for n in num_nodes)):
        raise ValueError(f"num_nodes: expected {B} counts in [1, {N}], received {list(num_nodes)}")

    def parent(i: int) -> int:
        rule = parents
        if rule == "mixed":
            rule = "uniform" if rng.random() < 0.5 else "recent"
        if rule == "uniform":
            return rng.randrange(i)
        if rule == "recent":
            return rng.randrange(max(0, i - window), i)
        return i - 1 if rule == "chain" else 0

    rows = []
    for b in range(B):
        n = num_nodes[b] if num_nodes is not None else N if b == 0 else rng.randint(1, N)
        par = [-1] + [parent(i) for i in range(1, n)]
        rows.append((par, [rng.randrange(vocab) for _ in range(n)]))
    return make_tree(rows, N)


def tree_rows(tree: Tree, b: int = 0):
    """Row ``b`` of ``tree`` as host lists ``(parents, tokens)`` of its real nodes."""
    n = int(tree.num_nodes[b])
    return tree.parents[b, :n].tolist(), tree.tokens[b, :n].tolist()


def random_root_path(rng, tree: Tree, b: int, stop: float = 0.2):
    """``[(node, token of the child taken), ...]`` down a random path from row ``b``'s root, ending at a leaf or
    with probability ``stop`` at each step: what a target must choose at each node for the walk to follow it."""
    par, tok = tree_rows(tree, b)
    cur, out = 0, []
    while True:
        kids = [v for v in range(cur + 1, len(par)) if par[v] == cur]
        if not kids or rng.random() < stop:
            return out
        nxt = rng.choice(kids)
        out.append((cur, tok[nxt]))
        cur = nxt


def assert_within_torch_error(got: torch.Tensor, torch_out: torch.Tensor, reference: torch.Tensor,
                              factor: float = 2.0, what: str = "") -> None:
    """flash-attention's tolerance rule: the largest error of ``got`` against ``reference`` (the same computation
    in higher precision, float64) is at most ``factor`` times that of ``torch_out`` (PyTorch's own computation at
    ``got``'s precision), and never below ``factor`` units in the last place of the reference's largest value at
    that precision (PyTorch's error over a few values can be far below one unit by luck: one value 7.9e-9 from
    exact, where the unit is 6e-8). Adapts to dtype and shape; no fixed tolerance table."""
    ref = reference.detach().double()
    err = (got.detach().double() - ref).abs().max().item()
    torch_err = (torch_out.detach().double() - ref).abs().max().item()
    top = ref.abs().max().to(got.dtype)
    ulp = (torch.nextafter(top, torch.tensor(float("inf"), dtype=got.dtype)) - top).double().item()
    bound = factor * max(torch_err, ulp)
    assert err <= bound, f"{what}: error {err:.3g} above {factor} x PyTorch's {torch_err:.3g} (ulp {ulp:.3g})"


def _topk_stats_float64(logits: torch.Tensor, ids: torch.Tensor):
    """``topk_stats``' float outputs evaluated in float64 at the token ids ``ids [B,D,K]``."""
    logp = torch.log_softmax(logits.double(), -1)
    top = logp.gather(-1, ids)
    p = logp.exp()
    entropy = -(p * logp).nansum(-1)
    if logits.shape[-1] > 1:
        best2 = logp.topk(2, -1).values
        margin = best2[..., 0] - best2[..., 1]
        margin = torch.where(torch.isinf(margin), torch.zeros_like(margin), margin)
    else:
        margin = torch.zeros_like(entropy)
    return top, entropy, margin, top.exp().sum(-1)


def assert_topk_stats_close(got, logits: torch.Tensor, top_k: int, what: str = "") -> None:
    """``got`` (a TopKStats or CandidatePool) against the PyTorch reference on ``logits``: the same token ids in
    the same order, -inf log-probs exactly, every other float within :func:`assert_within_torch_error` of a
    float64 evaluation."""
    from taps_kernels.reference.pool import topk_stats_reference

    logp32, ids, entropy32, margin32, mass32 = topk_stats_reference(logits, top_k)
    assert torch.equal(got.topk_ids, ids), f"{what}topk_ids: first differences at {(got.topk_ids != ids).nonzero()[:3].tolist()}"
    for name, g, w32, w64 in zip(("topk_logp", "entropy", "margin", "topk_mass"),
                                 (got.topk_logp, got.entropy, got.margin, got.topk_mass),
                                 (logp32, entropy32, margin32, mass32), _topk_stats_float64(logits, ids)):
        assert g.dtype == torch.float32 and g.shape == w32.shape, f"{what}{name}: {g.dtype}{tuple(g.shape)}"
        inf = torch.isinf(w64)
        assert torch.equal(g[inf].double(), w64[inf]), f"{what}{name}: infinite entries differ"
        if bool((~inf).any()):
            assert_within_torch_error(g[~inf], w32[~inf], w64[~inf], what=f"{what}{name}")


def random_scorer(tiny: bool, seed: int = 3, hidden: int = 32, max_depth: int = 8, top_k: int = 8):
    """A TapsScorer with perturbed weights (so every feature matters)."""
    from taps.scoring.model import TapsScorer

    torch.manual_seed(seed)
    m = TapsScorer(embed_dim=hidden, hidden_dim=hidden, max_depth=max_depth, tiny=tiny, top_k=top_k)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def load_bench_script(name: str):
    """The module of ``bench/<name>.py`` (the benchmark scripts are files, not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses in the script look their module up while it executes
    spec.loader.exec_module(mod)
    return mod
