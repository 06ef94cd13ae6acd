"""Shared test helpers: tiny random target and drafter, HF greedy reference, random trees, a random scorer.

Import as ``from helpers import ...`` (``tests/`` is on ``sys.path`` under pytest's rootdir conftest).
"""
from __future__ import annotations

import random
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


def random_tree(rng: random.Random, B: int, N: int, vocab: int = 50, full: bool = False) -> Tree:
    """Random ragged trees: row 0 (or every row with ``full``) has ``N`` nodes; bushy and deep parents mixed."""
    rows = []
    for b in range(B):
        n = N if (full or b == 0) else rng.randint(1, N)
        par = [-1] + [rng.randrange(i) if rng.random() < 0.5 else rng.randrange(max(0, i - 3), i) for i in range(1, n)]
        rows.append((par, [rng.randrange(vocab) for _ in range(n)]))
    return make_tree(rows, N)


def random_scorer(tiny: bool, seed: int = 3, hidden: int = 32, max_depth: int = 8, top_k: int = 8):
    """A TapsScorer with perturbed weights (so every feature matters)."""
    from taps.scoring.model import TapsScorer

    torch.manual_seed(seed)
    m = TapsScorer(embed_dim=hidden, hidden_dim=hidden, max_depth=max_depth, tiny=tiny, top_k=top_k)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m
