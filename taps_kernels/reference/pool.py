"""Reference candidate pool: per-position top-K statistics and the best-first prefix search (METHOD.md section 3)."""
from __future__ import annotations

import heapq

import numpy as np
import torch


def topk_stats_reference(draft_logits: torch.Tensor, top_k: int):
    """``draft_logits [B,D,V]`` -> ``(topk_logp [B,D,K] f32, topk_ids [B,D,K] int64, entropy, margin, topk_mass [B,D] f32)``.

    ``K = min(top_k, V)``; sorted by log-prob descending, ties to the smallest token id
    (a stable descending sort keeps equal values in index order). ``margin`` is 0 when no second token
    is possible (V = 1, or every other logit -inf).
    """
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    V = logp.shape[-1]
    K = min(top_k, V)
    sorted_logp, sorted_ids = torch.sort(logp, dim=-1, descending=True, stable=True)
    topk_logp = sorted_logp[..., :K].contiguous()
    topk_ids = sorted_ids[..., :K].contiguous()
    p = logp.exp()
    # p * logp is NaN only where p == 0 (logp == -inf), whose term is 0: nansum drops exactly those.
    entropy = -(p * logp).nansum(-1)
    margin = sorted_logp[..., 0] - sorted_logp[..., 1] if V > 1 else torch.zeros_like(entropy)
    # no possible runner-up (every other token -inf): 0, as for V = 1 (an infinite scorer feature would be NaN)
    margin = torch.where(torch.isinf(margin), torch.zeros_like(margin), margin)
    topk_mass = topk_logp.exp().sum(-1)
    return topk_logp, topk_ids, entropy, margin, topk_mass


def best_first_pool_reference(topk_logp: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor,
                              pool_size: int):
    """Best-first search for the ``pool_size`` highest-mass prefixes (root not counted).

    Inputs ``topk_logp [B,D,K] f32``, ``topk_ids [B,D,K] int64``, ``root_tokens [B] int64``.
    Returns ``tokens, parents, depth, num_nodes, logq, step_logq, rank`` with ``N = pool_size + 1`` rows.
    Priority: larger float32 ``logq`` first, then smaller parent node index, then smaller rank.
    """
    B, D, K = topk_logp.shape
    N = pool_size + 1
    tokens = torch.zeros(B, N, dtype=torch.int64)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    depth = torch.zeros(B, N, dtype=torch.int32)
    num_nodes = torch.ones(B, dtype=torch.int32)
    logq = torch.full((B, N), float("-inf"), dtype=torch.float32)
    step_logq = torch.full((B, N), float("-inf"), dtype=torch.float32)
    rank = torch.full((B, N), -1, dtype=torch.int32)
    lp = topk_logp.detach().cpu().float().numpy()
    ids = topk_ids.detach().cpu().numpy()
    for b in range(B):
        tokens[b, 0] = int(root_tokens[b])
        logq[b, 0] = 0.0
        step_logq[b, 0] = 0.0
        node_logq = [np.float32(0.0)]
        node_depth = [0]
        # heap entries: (-score, parent node, rank); the score is an exact float32 value.
        heap = [(-float(np.float32(lp[b, 0, 0])), 0, 0)] if D > 0 and K > 0 else []
        n = 1
        while heap and n < N:
            neg, parent, r = heapq.heappop(heap)
            d = node_depth[parent] + 1
            step = np.float32(lp[b, d - 1, r])
            score = np.float32(node_logq[parent] + step)
            tokens[b, n] = int(ids[b, d - 1, r])
            parents[b, n] = parent
            depth[b, n] = d
            logq[b, n] = float(score)
            step_logq[b, n] = float(step)
            rank[b, n] = r
            node_logq.append(score)
            node_depth.append(d)
            if r + 1 < K:
                heapq.heappush(heap, (-float(np.float32(node_logq[parent] + np.float32(lp[b, d - 1, r + 1]))), parent, r + 1))
            if d < D:
                heapq.heappush(heap, (-float(np.float32(score + np.float32(lp[b, d, 0]))), n, 0))
            n += 1
        num_nodes[b] = n
    dev = topk_logp.device
    return tuple(t.to(dev) for t in (tokens, parents, depth, num_nodes, logq, step_logq, rank))
