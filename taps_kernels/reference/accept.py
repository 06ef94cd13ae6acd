"""Reference acceptance walk: follow the target's token from the root while a child carries it."""
from __future__ import annotations

import torch


def accept_greedy_reference(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                            target_tokens: torch.Tensor, path_len: int):
    """Return ``(path [B,path_len] int64 (-1 padded), accept_len [B] int64, next_token [B] int64)``.

    Among children carrying the target's token the smallest node index wins.
    """
    B, N = tokens.shape
    tok = tokens.detach().cpu()
    par = parents.detach().cpu()
    tgt = target_tokens.detach().cpu()
    path = torch.full((B, path_len), -1, dtype=torch.int64)
    accept_len = torch.zeros(B, dtype=torch.int64)
    next_token = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        real = int(num_nodes[b])
        cur, n = 0, 0
        path[b, 0] = 0
        n = 1
        while True:
            want = int(tgt[b, cur])
            nxt = next((j for j in range(cur + 1, real) if int(par[b, j]) == cur and int(tok[b, j]) == want), None)
            if nxt is None or n >= path_len:
                break
            cur = nxt
            path[b, n] = cur
            n += 1
        accept_len[b] = n
        next_token[b] = int(tgt[b, cur])
    dev = tokens.device
    return path.to(dev), accept_len.to(dev), next_token.to(dev)
