"""Reference round build: one round's tree as the chain of the reference ops (pool, reach, lookup graft, depth cap,
throughput rule, re-index), the specification of :func:`taps_kernels.build_tree`."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..layout import CandidatePool, Selection, Tree
from .lookup import count_kept, graft_chain_reference, lookup_chain_reference
from .pool import best_first_pool_reference, topk_stats_reference
from .score import score_edges_reference
from .select import reindex_subtree_reference, select_throughput_reference


def draft_pool_reference(logits: torch.Tensor, root_tokens: torch.Tensor, top_k: int, pool_size: int,
                         vocab_ids: Optional[torch.Tensor]) -> CandidatePool:
    """The best-first pool of ``logits [B, D, V]`` under ``root_tokens [B]`` (columns mapped by ``vocab_ids``)."""
    topk_logp, topk_ids, entropy, margin, topk_mass = topk_stats_reference(logits, top_k)
    if vocab_ids is not None:
        topk_ids = vocab_ids[topk_ids]
    tokens, parents, depth, num_nodes, logq, step_logq, rank = best_first_pool_reference(
        topk_logp, topk_ids, root_tokens, pool_size)
    return CandidatePool(Tree(tokens, parents, depth, num_nodes), logq, step_logq, rank, topk_logp, topk_ids, entropy,
                         margin, topk_mass)


def chain_log_reach_reference(ngram: torch.Tensor, log_q: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[B, K] float32``: chain token ``k`` of a row matched on ``n`` tokens has log reach ``(k + 1) * log_q[n]``."""
    depth = torch.arange(1, num_tokens + 1, dtype=torch.float32, device=ngram.device)
    return log_q.float()[ngram][:, None] * depth[None, :]


def build_tree_reference(root_tokens: torch.Tensor, depth_cap: Optional[torch.Tensor], draft, scorer,
                         token_embeddings: Optional[torch.Tensor], lookup, max_nodes: int, table: torch.Tensor,
                         plain_seconds: float, rows: int) -> Tuple[Selection, Optional[torch.Tensor], Dict[str, float]]:
    """``(Selection with expected, chain [B, 5 + K] int64 or None, {})`` (no stage times); arguments as
    :func:`taps_kernels.build_tree` (``draft``: a :class:`~taps_kernels.ops.build.DraftProposal` or None, ``lookup``:
    a :class:`~taps_kernels.ops.build.LookupProposal` or None)."""
    B = root_tokens.shape[0]
    if draft is not None:
        pool = draft_pool_reference(draft.logits.float(), root_tokens, draft.top_k, draft.pool_size, draft.vocab_ids)
        tree = pool.tree
        if scorer is None:
            log_reach = pool.logq
        else:
            hidden = draft.hidden.float() if draft.hidden is not None else None
            log_reach = score_edges_reference(pool, scorer, token_embeddings, hidden)[2]
    else:
        tree = Tree(root_tokens.view(B, 1).clone(), torch.full((B, 1), -1, dtype=torch.int32),
                    torch.zeros(B, 1, dtype=torch.int32), torch.ones(B, dtype=torch.int32))
        log_reach = torch.zeros(B, 1, dtype=torch.float32)
    chain_aux = None
    if lookup is not None:
        chain, chain_len, ngram, sibling = lookup_chain_reference(lookup.history, lookup.lengths, lookup.num_tokens,
                                                                  lookup.max_ngram)
        tree, log_reach, nodes = graft_chain_reference(
            tree, log_reach, chain, chain_len, chain_log_reach_reference(ngram, lookup.log_q, lookup.num_tokens))
        sibling_node = torch.full_like(sibling[:, None], -1)
        if lookup.log_s is not None:
            tree, log_reach, sibling_node = graft_chain_reference(
                tree, log_reach, sibling.clamp(min=0)[:, None], (sibling >= 0).long(),
                lookup.log_s.float()[ngram][:, None])
    if depth_cap is not None:
        log_reach = log_reach.masked_fill(tree.depth.long() > depth_cap.long()[:, None], float("-inf"))
    pool_index, num_selected, expected = select_throughput_reference(
        tree.parents, tree.depth, tree.num_nodes, log_reach.float(), max_nodes, table, plain_seconds, rows)
    sub = reindex_subtree_reference(tree.tokens, tree.parents, tree.depth, tree.num_nodes, pool_index, num_selected)
    if lookup is not None:
        chain_aux = torch.cat([ngram[:, None], chain_len[:, None], count_kept(nodes, pool_index)[:, None],
                               sibling[:, None], count_kept(sibling_node, pool_index)[:, None], chain], 1)
    return Selection(Tree(*sub), pool_index, num_selected, expected), chain_aux, {}
