"""Reference acceptance walk (follow the target's token from the root while a child carries it) and the decode
round's acceptance built on it (committed tokens, the history append)."""
from __future__ import annotations

from typing import Optional

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


def committed_tokens_reference(tokens: torch.Tensor, path: torch.Tensor, accept_len: torch.Tensor,
                               next_token: torch.Tensor) -> torch.Tensor:
    """``[B, P] int64``: the accepted path's tokens after the root, then ``next_token``, -1 after (``accept_len [B]``
    counts the root; a row that accepts nothing is all -1). Device ops only."""
    B, P = path.shape
    path_tokens = tokens.gather(1, path.clamp(min=0))
    shifted = torch.cat([path_tokens[:, 1:], path_tokens.new_zeros(B, 1)], 1)
    j = torch.arange(P, device=path.device)[None, :]
    last = (accept_len - 1)[:, None]
    return torch.where(j < last, shifted, torch.where(j == last, next_token[:, None], torch.full_like(shifted, -1)))


def append_history_reference(history_tokens: torch.Tensor, history_lengths: torch.Tensor, committed: torch.Tensor,
                             counts: torch.Tensor) -> None:
    """Write ``committed [B, P]``'s first ``counts [B]`` tokens of each row at ``history_lengths`` in
    ``history_tokens [B, C + 1]`` (column ``C`` a write sink: what does not fit, and every write past a row's count,
    lands there), then ``history_lengths += counts``. In place, device ops only."""
    C = history_tokens.shape[1] - 1
    j = torch.arange(committed.shape[1], device=committed.device)[None, :]
    at = torch.where(j < counts[:, None], history_lengths[:, None] + j, torch.full_like(j, C))
    history_tokens.scatter_(1, at.clamp(max=C), committed.clamp(min=0))
    history_lengths += counts


def accept_round_from_walk(walk, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                           target_tokens: torch.Tensor, active: torch.Tensor, path_len: int,
                           history_tokens: Optional[torch.Tensor], history_lengths: Optional[torch.Tensor]):
    """``accept_round`` from an ``accept_greedy`` implementation ``walk`` and device ops (the reference with the
    reference walk; on a GPU with the CUDA walk, without a host read)."""
    path, accept_len, next_token = walk(tokens, parents, num_nodes, target_tokens, path_len)
    accept_len = torch.where(active, accept_len, torch.zeros_like(accept_len))
    keep = active[:, None] | (torch.arange(path_len, device=path.device) == 0)[None, :]
    path = torch.where(keep, path, torch.full_like(path, -1))
    committed = committed_tokens_reference(tokens, path, accept_len, next_token)
    if history_tokens is not None:
        append_history_reference(history_tokens, history_lengths, committed, accept_len)
    return path, accept_len, next_token, committed


def accept_round_reference(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                           target_tokens: torch.Tensor, active: torch.Tensor, path_len: int,
                           history_tokens: Optional[torch.Tensor] = None,
                           history_lengths: Optional[torch.Tensor] = None):
    """``(path [B,path_len], accept_len [B], next_token [B], committed [B,path_len])`` int64 (see
    :func:`taps_kernels.accept_round`); the history, when given, is appended to in place."""
    return accept_round_from_walk(accept_greedy_reference, tokens, parents, num_nodes, target_tokens, active,
                                  path_len, history_tokens, history_lengths)
