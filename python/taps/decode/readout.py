"""The one host read of a decode round, with named fields.

Everything a round computes stays on the device until its end; then one ``[B, W] int64`` tensor is copied to
the host (:meth:`RoundReadout.read`) and parsed here, so adding a statistic to the round is one field in
:meth:`RoundReadout.pack` and one in :class:`HostReadout`.

Packed columns, per row ``b`` (``P`` = deepest accepted node + 1, ``A`` = the policy's aux width):

* ``[0, P)``        ``committed`` int64: the accepted path's tokens after the root, then the next token, -1 after
* ``P``             ``accept_len`` int64: tokens committed this round (the root counted, so ``>= 1`` on busy rows)
* ``P + 1``         ``next_nodes`` int64: real nodes of the row's next tree
* ``P + 2``         ``root_ok`` int64: 1 when the next tree's root is the row's bonus token
* then, when the policy gives them: ``expected`` (a float64's bits: expected tokens of the next tree) and
  ``sizes`` (int64: non-root nodes its size rule chose), then the ``A`` aux columns.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class HostReadout:
    """One round's results on the host, rows ``0 .. B-1`` (lists of Python values)."""

    committed: List[List[int]]
    accept_len: List[int]
    next_nodes: List[int]
    root_ok: List[bool]
    expected: Optional[List[float]]
    sizes: Optional[List[int]]
    aux: Optional[List[List[int]]]

    def tokens(self, b: int) -> List[int]:
        """Row ``b``'s committed tokens (its ``accept_len`` first columns)."""
        return self.committed[b][:self.accept_len[b]]


class RoundReadout:
    """The device side of the read: the packed ``[B, W] int64`` tensor and the layout to parse it.

    Args (all on one device, ``B`` rows):
        committed: ``[B, P] int64``.
        accept_len: ``[B] int64``.
        next_nodes: ``[B]`` integer.
        root_ok: ``[B] bool``.
        expected: ``[B]`` float or None; sizes: ``[B]`` integer or None (given together).
        aux: ``[B, A]`` integer or None.
    """

    def __init__(self, committed: torch.Tensor, accept_len: torch.Tensor, next_nodes: torch.Tensor,
                 root_ok: torch.Tensor, expected: Optional[torch.Tensor] = None, sizes: Optional[torch.Tensor] = None,
                 aux: Optional[torch.Tensor] = None):
        if (expected is None) != (sizes is None):
            raise ValueError("expected and sizes: expected both or neither")
        cols = [committed, accept_len[:, None], next_nodes.to(torch.int64)[:, None], root_ok.to(torch.int64)[:, None]]
        if expected is not None:
            cols += [expected.to(torch.float64).view(torch.int64)[:, None], sizes.to(torch.int64)[:, None]]
        if aux is not None:
            cols.append(aux.to(torch.int64))
        self.packed = torch.cat(cols, 1)
        self.P = committed.shape[1]
        self.has_estimates = expected is not None
        self.has_aux = aux is not None

    def read(self) -> HostReadout:
        """THE host read of the round (one ``tolist``), parsed into named fields."""
        host = self.packed.tolist()
        P = self.P
        at = P + 3
        expected = sizes = aux = None
        if self.has_estimates:
            expected = [struct.unpack("<d", struct.pack("<q", r[at]))[0] for r in host]
            sizes = [r[at + 1] for r in host]
            at += 2
        if self.has_aux:
            aux = [r[at:] for r in host]
        return HostReadout(committed=[r[:P] for r in host], accept_len=[r[P] for r in host],
                           next_nodes=[r[P + 1] for r in host], root_ok=[r[P + 2] == 1 for r in host],
                           expected=expected, sizes=sizes, aux=aux)
