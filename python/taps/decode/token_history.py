"""Prompt lookup's state and trees: each row's committed tokens on the device, and the lookup-only tree.

Prompt lookup (n-gram drafting) proposes the tokens that followed the latest earlier occurrence of the
row's last ``n`` tokens. It costs no drafter pass and is right exactly where a block drafter is weakest:
text that repeats the prompt or itself (identifiers, quoted passages, edited code). The match and the graft
into a pool are the ops :func:`taps_kernels.lookup_chain` and :func:`taps_kernels.graft_chain`; nothing here
reads the device, so a policy can run lookup inside a round (the loop's one read per round stands).

Layout: :class:`TokenHistory` holds ``tokens [B, C + 1] int64`` (prompt + committed tokens, the last one
the root of the row's next tree; column ``C`` is a write sink never read) and ``lengths [B] int64``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from taps_kernels import Tree



class TokenHistory:
    """Per-row committed tokens on the device, appended inside rounds without host reads.

    Args:
        batch: rows.
        device: where the buffer lives (the target's device).
    """

    def __init__(self, batch: int, device: torch.device):
        self.device = torch.device(device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.int64, device=self.device)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=self.device)

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1] - 1

    def reserve(self, n: int) -> None:
        """Room for ``n`` tokens per row (host side, between rounds; grows by at least half)."""
        if n > self.capacity:
            new = max(n, self.capacity + self.capacity // 2)
            grown = torch.zeros(self.tokens.shape[0], new + 1, dtype=torch.int64, device=self.device)
            grown[:, :self.capacity] = self.tokens[:, :self.capacity]
            self.tokens = grown

    def set_row(self, row: int, tokens: List[int]) -> None:
        """Row ``row`` holds exactly ``tokens`` (a request joined: its prompt and first token)."""
        self.reserve(len(tokens))
        self.tokens[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        self.lengths[row] = len(tokens)

    def buffers(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [R, C + 1], lengths [R])`` of rows ``0 .. R-1``, the sink column included: contiguous views
        that :func:`taps_kernels.accept_round` appends the round's committed tokens to in place (the caller reserved
        room)."""
        return self.tokens[:rows], self.lengths[:rows]

    def rows(self, rows: slice) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [R, C], lengths [R])`` of a contiguous range of rows (views, the sink column dropped)."""
        return self.tokens[rows, :self.capacity], self.lengths[rows]


def accepted_prefix(accepted: List[int], chain: List[int]) -> int:
    """How many leading tokens of ``chain`` the target accepted (host lists)."""
    n = 0
    for a, c in zip(accepted, chain):
        if a != c:
            break
        n += 1
    return n


def lookup_only_tree(bonus: torch.Tensor, chain: torch.Tensor, chain_len: torch.Tensor,
                     depth_cap: Optional[torch.Tensor] = None) -> Tree:
    """``bonus -> chain[:, 0] -> ...`` with ``min(chain_len, depth_cap)`` chain nodes per row, ``[B, K + 1]``."""
    B, K = chain.shape
    dev = bonus.device
    n = chain_len if depth_cap is None else torch.minimum(chain_len, depth_cap.to(torch.int64))
    idx = torch.arange(K + 1, device=dev)[None, :]
    real = idx <= n[:, None]
    tokens = torch.where(real, torch.cat([bonus.view(B, 1).to(torch.int64), chain], 1), torch.zeros_like(idx))
    parents = torch.where(real, idx - 1, torch.full_like(idx, -1)).to(torch.int32)
    depth = torch.where(real, idx, torch.zeros_like(idx)).to(torch.int32)
    return Tree(tokens, parents, depth, (n + 1).to(torch.int32))
