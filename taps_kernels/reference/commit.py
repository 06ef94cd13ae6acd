"""Reference commit of a verified decode round: the greedy tokens (or given target tokens), the acceptance walk with
its history append, KV compaction and the cache lengths, one op after another."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .accept import accept_round_reference
from .greedy import greedy_tokens_reference
from .kv import compact_kv_reference


def commit_round_with(greedy: Callable, accept_round: Callable, compact_kv: Callable, tokens: torch.Tensor,
                      parents: torch.Tensor, num_nodes: torch.Tensor, active: torch.Tensor, path_len: int,
                      keys: List[torch.Tensor], values: List[torch.Tensor], lengths: torch.Tensor,
                      logits: Optional[torch.Tensor] = None, target_tokens: Optional[torch.Tensor] = None,
                      history_tokens: Optional[torch.Tensor] = None, history_lengths: Optional[torch.Tensor] = None,
                      moves: bool = True):
    """``commit_round`` from implementations of its parts (``greedy(logits [R, V]) -> [R]``, ``accept_round`` and
    ``compact_kv`` with their references' signatures): the reference with the reference parts; on a GPU with the
    CUDA ones, without a host read. Arguments and results as :func:`taps_kernels.commit_round`."""
    B, N = tokens.shape
    if target_tokens is None:
        target_tokens = greedy(logits.reshape(B * N, logits.shape[-1])).view(B, N)
    path, accept_len, next_token, committed = accept_round(tokens, parents, num_nodes, target_tokens, active,
                                                           path_len, history_tokens, history_lengths)
    if moves:
        whole = keys[0].shape[0] == B  # no per-layer views to make (60 for SmolLM2)
        compact_kv(keys if whole else [k[:B] for k in keys], values if whole else [v[:B] for v in values], lengths,
                   path)
    lengths += accept_len
    return path, accept_len, next_token, committed


def commit_round_reference(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                           active: torch.Tensor, path_len: int, keys: List[torch.Tensor], values: List[torch.Tensor],
                           lengths: torch.Tensor, logits: Optional[torch.Tensor] = None,
                           target_tokens: Optional[torch.Tensor] = None, history_tokens: Optional[torch.Tensor] = None,
                           history_lengths: Optional[torch.Tensor] = None, moves: bool = True):
    """``(path [B,path_len], accept_len [B], next_token [B], committed [B,path_len])`` int64 and the writes in place
    (see :func:`taps_kernels.commit_round`), through the reference argmax, walk and compaction."""
    return commit_round_with(greedy_tokens_reference, accept_round_reference, compact_kv_reference, tokens, parents,
                             num_nodes, active, path_len, keys, values, lengths, logits, target_tokens, history_tokens,
                             history_lengths, moves)
