"""Candidate pool: top-K per draft position, then the best-first prefix search (METHOD.md section 3)."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import (FLOAT_DTYPES, check_data_device, check_finite_logits, check_int, check_log_values,
                       check_no_grad, check_nonempty, check_output_size, check_tensor, differentiable_backend,
                       first_index, grad_needed, values_checked)
from .._library import backend_for, define, fresh, values_asked
from ..backend import pool_placement, resolve
from ..layout import CandidatePool, TopKStats, Tree


def _check_logits(draft_logits: torch.Tensor) -> None:
    check_tensor("draft_logits", draft_logits, dtypes=FLOAT_DTYPES, ndim=3)
    check_data_device("draft_logits", draft_logits)
    check_nonempty("draft_logits", draft_logits, [(0, "batch row"), (1, "draft position"), (2, "vocabulary entry")])


def check_root_values(root_tokens: torch.Tensor, V: Optional[int]) -> None:
    """Root tokens are token ids ``>= 0``, and ``< V`` where the logits' columns are the token ids (``V`` None: a
    reduced vocabulary maps them, or there are no logits)."""
    bad = root_tokens < 0
    if V is not None:
        bad |= root_tokens >= V
    if bool(bad.any()):
        (b,) = first_index(bad)
        where = f"outside the vocabulary [0, {V})" if V is not None else "negative (expected a token id >= 0)"
        raise ValueError(f"root_tokens[{b}]: token {int(root_tokens[b])} is {where}")


def _check_vocab_ids(vocab_ids: torch.Tensor, draft_logits: torch.Tensor, validate: Optional[str]) -> None:
    V = draft_logits.shape[2]
    check_tensor("vocab_ids", vocab_ids, dtypes=(torch.int64,), shape=(V,), device=draft_logits.device)
    if values_checked(validate, vocab_ids.device):
        if int(vocab_ids[0]) < 0:
            raise ValueError(f"vocab_ids[0]: expected token ids >= 0, received {int(vocab_ids[0])}")
        bad = vocab_ids[1:] <= vocab_ids[:-1]
        if bool(bad.any()):
            (j,) = first_index(bad)
            raise ValueError(f"vocab_ids[{j + 1}]: expected strictly increasing token ids (ties then rank by "
                             f"token id as in the full vocabulary), received {int(vocab_ids[j + 1])} after "
                             f"{int(vocab_ids[j])}")


def topk_stats(draft_logits: torch.Tensor, top_k: int, backend: Optional[str] = None,
               validate: Optional[str] = None, vocab_ids: Optional[torch.Tensor] = None) -> TopKStats:
    """Per-position top-K of the draft marginals plus the statistics the scorer reads.

    Args:
        draft_logits: ``[B, D, V]`` float32/float16/bfloat16 logits of the D draft positions; ``B, D, V >= 1``.
            Non-finite values: ``-inf`` is an impossible token (log-prob -inf, ranked last, ties by token id,
            identical on every backend); NaN and ``+inf`` are refused, and so is a position whose logits are all
            ``-inf`` (value checks: see ``validate``).
        top_k: tokens kept per position (an int >= 1, numpy/torch integers accepted); ``K = min(top_k, V)``.
        validate: ``"auto"`` (default, or ``TAPS_VALIDATE``): value checks on CPU tensors only; ``"full"``: on any
            device (synchronises a GPU); ``"none"``: none.
        vocab_ids: optional ``[V] int64`` strictly increasing token ids: ``draft_logits`` covers a reduced draft
            vocabulary whose column ``j`` is token ``vocab_ids[j]`` (every other token impossible). The
            results equal those of the full-vocabulary logits with ``-inf`` outside it, at a fraction of the
            cost; ``topk_ids`` are token ids.
    Returns:
        :class:`TopKStats` with ``topk_logp [B,D,K] f32`` (log-softmax values, descending, ties to the
        smallest token id), ``topk_ids [B,D,K] int64``, ``entropy [B,D] f32`` (nats),
        ``margin [B,D] f32`` (top1 - top2 log-prob; 0 when no second token is possible), ``topk_mass [B,D] f32``.
    Differentiable through the reference backend only: when ``draft_logits`` requires grad, ``backend=None``
    runs the reference and another explicit backend is refused.
    """
    _check_logits(draft_logits)
    top_k = check_int("top_k", top_k)
    B, D, V = draft_logits.shape
    if vocab_ids is not None:
        _check_vocab_ids(vocab_ids, draft_logits, validate)
    backend = differentiable_backend("topk_stats", backend, [("draft_logits", draft_logits)])
    if grad_needed((draft_logits,)) is not None:  # autograd runs through the reference (the op has no backward)
        if values_checked(validate, draft_logits.device):
            check_finite_logits("draft_logits", draft_logits)
        out = _topk_stats(resolve("topk_stats", backend, draft_logits.device)[1], draft_logits, min(top_k, V))
    else:
        out = topk_stats_op(draft_logits, top_k, backend, validate)
    topk_logp, topk_ids, entropy, margin, topk_mass = out
    if vocab_ids is not None:  # sorted ids: column order is token order, so ties already fell to the smaller id
        topk_ids = vocab_ids[topk_ids]
    return TopKStats(topk_logp, topk_ids, entropy, margin, topk_mass)


def _topk_stats(fn, draft_logits: torch.Tensor, K: int, backend: str = ""):
    logp, ids, entropy, margin, mass = fn(draft_logits, K)
    # No possible runner-up (V = 1, or every other token -inf): margin 0 on every backend, never +inf (the
    # scorer's LayerNorm would turn an infinite feature into NaN). The backends do so already; this keeps
    # the guarantee for any registered implementation (the C++ one sets it in its loop: two torch ops fewer
    # in a decode round).
    if backend != "cpp":
        margin = torch.where(torch.isinf(margin), torch.zeros_like(margin), margin)
    return logp, ids, entropy, margin, mass


def _topk_meta(draft_logits, top_k):
    check_tensor("draft_logits", draft_logits, dtypes=FLOAT_DTYPES, ndim=3)
    check_nonempty("draft_logits", draft_logits, [(0, "batch row"), (1, "draft position"), (2, "vocabulary entry")])
    B, D, V = draft_logits.shape
    return B, D, min(check_int("top_k", top_k), V)


def _topk_kernel(draft_logits, top_k, backend=None, validate=None):
    check = values_asked(validate, draft_logits)
    name, fn = backend_for("topk_stats", backend, draft_logits, _topk_meta, (draft_logits, top_k), check)
    if check:
        check_finite_logits("draft_logits", draft_logits)
    out = _topk_stats(fn, draft_logits, min(top_k, draft_logits.shape[2]), name)
    return fresh(out, (draft_logits,), name)


def _topk_fake(draft_logits, top_k, backend=None, validate=None):
    B, D, K = _topk_meta(draft_logits, top_k)
    f32 = dict(dtype=torch.float32)
    return (draft_logits.new_empty((B, D, K), **f32), draft_logits.new_empty((B, D, K), dtype=torch.int64),
            draft_logits.new_empty((B, D), **f32), draft_logits.new_empty((B, D), **f32),
            draft_logits.new_empty((B, D), **f32))


topk_stats_op = define("topk_stats(Tensor draft_logits, int top_k, str? backend=None, str? validate=None) -> "
                       "(Tensor, Tensor, Tensor, Tensor, Tensor)", _topk_kernel, _topk_fake)
"""``taps::topk_stats``: ``draft_logits [B,D,V]`` float -> ``(topk_logp [B,D,K] f32, topk_ids [B,D,K] int64,
entropy, margin, topk_mass [B,D] f32)`` with ``K = min(top_k, V)``, column indices as ids; checks metadata, then
the logits' values as ``validate`` says."""


_POOL_ROW_BYTES = 8 + 4 + 4 + 4 + 4 + 4  # tokens, parents, depth, logq, step_logq, rank per node


def _pool_meta(topk_logp, topk_ids, root_tokens, pool_size):
    check_tensor("topk_logp", topk_logp, dtypes=(torch.float32,), ndim=3)
    check_nonempty("topk_logp", topk_logp, [(0, "batch row"), (1, "draft position"), (2, "top-K entry")])
    B = topk_logp.shape[0]
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int64,), shape=tuple(topk_logp.shape), device=topk_logp.device)
    check_tensor("root_tokens", root_tokens, dtypes=(torch.int64,), shape=(B,), device=topk_logp.device)
    pool_size = check_int("pool_size", pool_size)
    check_output_size("pool_size", pool_size, B * (pool_size + 1) * _POOL_ROW_BYTES, topk_logp.device)
    return B, pool_size + 1


def _pool_kernel(topk_logp, topk_ids, root_tokens, pool_size, backend=None, validate=None):
    _pool_meta(topk_logp, topk_ids, root_tokens, pool_size)  # also before the placement, which reads pool_size
    if values_checked(validate, topk_logp.device):
        check_log_values("stats.topk_logp", topk_logp)
        for name, ids in (("stats.topk_ids", topk_ids), ("root_tokens", root_tokens)):
            if bool((ids < 0).any()):
                idx = first_index(ids < 0)
                raise ValueError(f"{name}[{','.join(map(str, idx))}]: expected a token id >= 0, received {int(ids[idx])}")
    device = topk_logp.device
    # A host search (asked for, or a pool the device kernel cannot hold) copies the lattice there and the pool
    # back: it compiles, but cannot be captured in a CUDA graph.
    name, search_device = pool_placement(backend, device, pool_size)
    fn = resolve("best_first_pool", name, search_device, pool_size=pool_size)[1]
    out = fn(*(t.to(search_device) for t in (topk_logp, topk_ids, root_tokens)), pool_size)
    return fresh(tuple(t.to(device) for t in out), (topk_logp, topk_ids, root_tokens), name)


def _pool_fake(topk_logp, topk_ids, root_tokens, pool_size, backend=None, validate=None):
    B, N = _pool_meta(topk_logp, topk_ids, root_tokens, pool_size)
    i32, f32 = dict(dtype=torch.int32), dict(dtype=torch.float32)
    return (root_tokens.new_empty((B, N)), root_tokens.new_empty((B, N), **i32),
            root_tokens.new_empty((B, N), **i32), root_tokens.new_empty((B,), **i32),
            topk_logp.new_empty((B, N), **f32), topk_logp.new_empty((B, N), **f32),
            root_tokens.new_empty((B, N), **i32))


best_first_pool_op = define("best_first_pool(Tensor topk_logp, Tensor topk_ids, Tensor root_tokens, int pool_size, "
                            "str? backend=None, str? validate=None) -> "
                            "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
                            _pool_kernel, _pool_fake)
"""``taps::best_first_pool``: ``topk_logp [B,D,K] f32``, ``topk_ids [B,D,K] int64``, ``root_tokens [B] int64`` ->
``(tokens [B,N] int64, parents [B,N] int32, depth [B,N] int32, num_nodes [B] int32, logq [B,N] f32,
step_logq [B,N] f32, rank [B,N] int32)``, ``N = pool_size + 1``; checks metadata, then the lattice's values
(log-probs, ids >= 0) as ``validate`` says."""


def best_first_pool(stats: TopKStats, root_tokens: torch.Tensor, pool_size: int, backend: Optional[str] = None,
                    validate: Optional[str] = None):
    """Assemble the ``pool_size`` highest-mass prefixes from a :class:`TopKStats` lattice.

    Args:
        stats: :class:`TopKStats` with ``topk_logp [B,D,K]`` float (log-probs: finite or -inf, NaN and +inf
            refused) and ``topk_ids [B,D,K] int64`` (>= 0); ``B, D, K >= 1``.
        root_tokens: ``[B] int64`` (>= 0).
        pool_size: non-root nodes (an int in ``[1, 2**31 - 2]``).
        validate: value checks, as in :func:`topk_stats`.
    Returns ``(Tree, logq, step_logq, rank)``; ``N = pool_size + 1`` rows, nodes in pop order
    (non-increasing ``logq``, a valid topological order). Ties: smaller parent index, then smaller rank.
    A candidate of log mass ``-inf`` (an impossible token on its path) is popped after every possible one, as a
    real node with ``logq = -inf``.
    No backward: a ``topk_logp`` that requires grad (grad mode on) is refused.
    """
    if not isinstance(stats, TopKStats):
        raise TypeError(f"stats: expected a taps_kernels.TopKStats, received {type(stats).__name__}")
    check_tensor("stats.topk_logp", stats.topk_logp, dtypes=FLOAT_DTYPES, ndim=3)
    dev = check_data_device("stats.topk_logp", stats.topk_logp)
    check_nonempty("stats.topk_logp", stats.topk_logp, [(0, "batch row"), (1, "draft position"), (2, "top-K entry")])
    B, D, K = stats.topk_logp.shape
    check_tensor("stats.topk_ids", stats.topk_ids, dtypes=(torch.int64,), shape=(B, D, K), device=dev)
    pool_size = check_int("pool_size", pool_size)
    check_tensor("root_tokens", root_tokens, dtypes=(torch.int64,), shape=(B,), device=dev)
    check_output_size("pool_size", pool_size, B * (pool_size + 1) * _POOL_ROW_BYTES, dev)
    check_no_grad("best_first_pool", [("stats.topk_logp", stats.topk_logp)])
    tokens, parents, depth, num_nodes, logq, step_logq, rank = best_first_pool_op(
        stats.topk_logp.float().contiguous(), stats.topk_ids.contiguous(), root_tokens.contiguous(), pool_size, backend,
        validate)
    return Tree(tokens, parents, depth, num_nodes), logq, step_logq, rank


def candidate_pool(draft_logits: torch.Tensor, root_tokens: torch.Tensor, top_k: int, pool_size: int,
                   backend: Optional[str] = None, pool_backend: Optional[str] = None,
                   validate: Optional[str] = None, vocab_ids: Optional[torch.Tensor] = None) -> CandidatePool:
    """Build the candidate pool of a draft block.

    Args:
        draft_logits: ``[B, D, V]`` float logits of the D draft positions (position ``i`` predicts depth ``i+1``).
        root_tokens: ``[B] int64`` bonus tokens (node 0 of each tree).
        top_k: tokens per position (``>= 1``; clamped to V).
        pool_size: non-root nodes in the pool (``>= 1``). With ``pool_size = B`` this is the DDTree tree of budget B.
        backend: backend of the top-K pass; ``pool_backend`` of the best-first search (default: same rule).
        validate: value checks (non-finite logits, root token range), as in :func:`topk_stats`.
        vocab_ids: optional ``[V] int64`` token id of each logit column (a reduced draft vocabulary), as in
            :func:`topk_stats`; the pool's tokens are token ids, and root tokens are only checked to be ``>= 0``.
    Non-finite logits follow :func:`topk_stats`; no backward (``draft_logits`` requiring grad is refused).
    Returns:
        :class:`CandidatePool`: ``.tree`` (``N = pool_size + 1`` rows, see ``taps_kernels.layout``),
        ``.logq``/``.step_logq [B,N] f32``, ``.rank [B,N] int32`` and the per-position statistics.
    """
    _check_logits(draft_logits)
    B = draft_logits.shape[0]
    check_tensor("root_tokens", root_tokens, dtypes=(torch.int64,), shape=(B,), device=draft_logits.device)
    top_k = check_int("top_k", top_k)
    pool_size = check_int("pool_size", pool_size)
    check_output_size("pool_size", pool_size, B * (pool_size + 1) * _POOL_ROW_BYTES, draft_logits.device)
    check_no_grad("candidate_pool", [("draft_logits", draft_logits)])
    V = draft_logits.shape[2]
    if values_checked(validate, draft_logits.device):
        check_root_values(root_tokens, V if vocab_ids is None else None)
    if vocab_ids is not None:
        _check_vocab_ids(vocab_ids, draft_logits, validate)
    # The two ops straight after this op's own checks (the public topk_stats / best_first_pool would repeat them,
    # tens of microseconds per call in a decode round): the lattice is the op's output, so its shapes hold, and it
    # comes from checked (or, under validate="none" / on a GPU, trusted) logits: no second scan of its values.
    topk_logp, topk_ids, entropy, margin, topk_mass = topk_stats_op(draft_logits, top_k, backend, validate)
    if vocab_ids is not None:  # sorted ids: column order is token order, so ties already fell to the smaller id
        topk_ids = vocab_ids[topk_ids]
    tokens, parents, depth, num_nodes, logq, step_logq, rank = best_first_pool_op(
        topk_logp, topk_ids, root_tokens.contiguous(), pool_size, pool_backend, "none")
    return CandidatePool(Tree(tokens, parents, depth, num_nodes), logq, step_logq, rank, topk_logp, topk_ids, entropy,
                         margin, topk_mass)
