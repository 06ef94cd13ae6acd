"""Prompt lookup in plain torch ops: the n-gram match of each row's last tokens against its history
(:func:`lookup_chain_reference`) and the graft of the matched continuation into a tree
(:func:`graft_chain_reference`). Static shapes, no host reads: on a GPU these are the path that runs; on a CPU
the C++ backend gives the same tensors in one scan per row."""
from __future__ import annotations

from typing import Tuple

import torch

from ..layout import Tree


def lookup_chain_reference(tokens: torch.Tensor, lengths: torch.Tensor, num_tokens: int,
                           max_ngram: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompt-lookup continuation of every row, and the sibling of its first token.

    For ``n = max_ngram .. 1`` (the longest that matches wins), the row's last ``n`` tokens are searched in its
    earlier tokens; of the occurrences the latest is used (recent text predicts the next tokens best), and the
    chain is the up to ``num_tokens`` tokens that followed it (fewer when the history ends first). The sibling is
    the token after the latest occurrence (of the same ``n`` tokens) whose next token differs from the chain's first.

    Args:
        tokens: ``[B, C] int64``; row b's history is ``tokens[b, :lengths[b]]``.
        lengths: ``[B] int64``.
        num_tokens: ``K``, the longest chain.
        max_ngram: longest suffix matched.
    Returns:
        ``(chain [B, K] int64 (0 past the end), chain_len [B] int64, ngram [B] int64, sibling [B] int64)``:
        ``ngram`` is the matched suffix length, 0 when nothing matched (``chain_len`` 0); ``sibling`` -1 when none.
    """
    B, C = tokens.shape
    dev = tokens.device
    lengths = lengths.to(torch.int64)
    cont = torch.full((B,), -1, dtype=torch.int64, device=dev)  # where the continuation starts
    ngram = torch.zeros(B, dtype=torch.int64, device=dev)
    sibling = torch.full((B,), -1, dtype=torch.int64, device=dev)
    for n in range(min(max_ngram, C - 1), 0, -1):
        suffix = tokens.gather(1, (lengths[:, None] - n + torch.arange(n, device=dev)).clamp(0, C - 1))
        hit = (tokens.unfold(1, n, 1) == suffix[:, None, :]).all(-1)  # [B, C - n + 1]: window starting at s
        s = torch.arange(C - n + 1, device=dev)[None, :]
        # an earlier occurrence with at least one token after it (s + n < length also excludes the suffix itself)
        hit &= s + n < lengths[:, None]
        latest = torch.where(hit, s, torch.full_like(s, -1)).max(1).values
        take = (ngram == 0) & (latest >= 0)
        nxt = tokens.gather(1, (s + n).clamp(max=C - 1).expand(B, -1))  # the token after window s
        first = nxt.gather(1, latest.clamp(min=0)[:, None])
        other = torch.where(hit & (nxt != first), s, torch.full_like(s, -1)).max(1).values
        sibling = torch.where(take & (other >= 0), nxt.gather(1, other.clamp(min=0)[:, None])[:, 0], sibling)
        cont = torch.where(take, latest + n, cont)
        ngram = torch.where(take, torch.full_like(ngram, n), ngram)
    at = cont[:, None] + torch.arange(num_tokens, device=dev)[None, :]
    valid = (ngram[:, None] > 0) & (at < lengths[:, None])
    chain = torch.where(valid, tokens.gather(1, at.clamp(0, C - 1)), torch.zeros_like(at))
    return chain, valid.sum(1), ngram, sibling


def graft_chain_reference(tree: Tree, log_reach: torch.Tensor, chain: torch.Tensor, chain_len: torch.Tensor,
                          chain_log_reach: torch.Tensor) -> Tuple[Tree, torch.Tensor, torch.Tensor]:
    """Merge each row's chain ``root -> chain[b, 0] -> chain[b, 1] -> ...`` into its tree.

    A chain node that the tree already has (same parent, same token) is reused and its log reach becomes the
    larger of the two estimates; the others are appended after the row's real nodes, so node order stays
    topological. Along the chain both estimates are non-increasing, so the merged log reach stays
    non-increasing along every path (the throughput rule's top-``n`` stays prefix-closed).

    Args:
        tree: ``[B, N]`` (siblings carry distinct tokens, as pools and selected subtrees do).
        log_reach: ``[B, N] float32``, padding ``-inf``.
        chain: ``[B, K] int64``; ``chain_len [B] int64`` real tokens per row.
        chain_log_reach: ``[B, K] float32`` log reach of the chain node at depth ``k + 1``, non-increasing in k.
    Returns:
        ``(tree [B, N + K], log_reach [B, N + K], chain_nodes [B, K] int64)``: the merged trees, their log
        reach, and the node index of each chain token (-1 past ``chain_len``).
    """
    B, N = tree.tokens.shape
    K = chain.shape[1]
    dev = tree.device
    width = N + K
    grow = lambda t, v: torch.cat([t, t.new_full((B, K), v)], 1)  # noqa: E731
    tokens, parents, depth = grow(tree.tokens, 0), grow(tree.parents, -1), grow(tree.depth, 0)
    reach = grow(log_reach.float(), float("-inf"))
    num = tree.num_nodes.to(torch.int64)
    idx = torch.arange(width, device=dev)[None, :]
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    nodes = []
    for k in range(K):
        tok = chain[:, k:k + 1]
        live = (k < chain_len)[:, None]
        same = (idx < num[:, None]) & (parents.to(torch.int64) == cur[:, None]) & (tokens == tok)
        found = same.any(1, keepdim=True)
        child = torch.where(found[:, 0], same.to(torch.int8).argmax(1), num)
        new = (idx == num[:, None]) & live & ~found
        tokens = torch.where(new, tok, tokens)
        parents = torch.where(new, cur[:, None].to(parents.dtype), parents)
        depth = torch.where(new, torch.full_like(depth, k + 1), depth)
        num = num + new.any(1).to(torch.int64)
        at = (idx == child[:, None]) & live
        reach = torch.where(at, torch.maximum(reach, chain_log_reach[:, k:k + 1].float()), reach)
        cur = child
        nodes.append(torch.where(live[:, 0], child, torch.full_like(child, -1)))
    chain_nodes = torch.stack(nodes, 1) if nodes else torch.zeros(B, 0, dtype=torch.int64, device=dev)
    return Tree(tokens, parents, depth, num.to(tree.num_nodes.dtype)), reach, chain_nodes


def count_kept(nodes: torch.Tensor, pool_index: torch.Tensor) -> torch.Tensor:
    """``[B] int64``: how many of ``nodes [B, K]`` (-1: none) the selection ``pool_index [B, M]`` holds."""
    return ((nodes[:, :, None] == pool_index[:, None, :]).any(-1) & (nodes >= 0)).sum(1)
