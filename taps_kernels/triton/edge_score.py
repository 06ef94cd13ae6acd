"""TAPS edge scoring in Triton (op ``score_edges``); definitions in :mod:`taps_kernels.reference.score`.

Two launches, because the two halves have opposite shapes:

1. ``_edge_logits_kernel``, grid ``(B, cdiv(N, BLOCK_R), 2)``: every node independently computes
   the logit of its incoming edge (head 0) and, in a second program, the logit of its own "other"
   bucket (head 1): gathered projections (token slots, the hidden state at the child's position),
   the depth embedding, the 7 scalars, then LayerNorm + Linear + SiLU + Linear. One head per
   program keeps half the projections live (with 16-wide K chunks and 8 warps: ~128 registers, no
   spills, where both heads at once used 255; ``bench/results/triton_aot_resources.json``). The parent's token projection is recomputed by
   the child rather than read from another program, so nodes never wait on each other; the
   LayerNorm is applied slot by slot
   (``LN(x) @ W1^T = sum over slots of LN(x)[slot] @ W1[:, slot]^T``) so the 111-wide feature
   row is never materialised. This is where the FLOPs are, and it spreads over the whole GPU.
2. ``_normalise_propagate_kernel``, grid ``(B,)``: one program per tree does the sibling
   softmax (segment max with ``atomic_max``; segment sum in 2**-40 fixed point with int64
   ``atomic_add``, which is exact and therefore deterministic whatever the order) and then
   propagates log-reach depth by depth (a barrier between depths, parents are final before
   children read them; the float32 sum runs root-down exactly as ``propagate_reach``).
   Normalisation needs every sibling and propagation needs the parent's final value: both are
   dependencies across the programs of launch 1, so one launch would need a grid-wide barrier.

The no-scorer model (``weights=None``) skips launch 1 and runs launch 2 on ``step_logq``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scorer_weights import OTHER_MASS_FLOOR, ScorerWeights

OTHER_FLOOR = tl.constexpr(OTHER_MASS_FLOOR)
EDGE_BLOCK_R = 16  # nodes per program (tl.dot needs >= 16 rows)
EDGE_BLOCK_K = 16  # with 64 the fp32 FMA dot operands spilled at 255 registers
EDGE_WARPS = 8  # ~128 registers per thread, no spills (4 warps: 186-254)
NORM_BLOCK = 128


@triton.jit
def _project(src_ptr, row_off, row_ok, w_ptr, b_ptr, IN, OUT: tl.constexpr, OUT_PAD: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # [BLOCK_R, OUT_PAD] = src[row_off + :IN] @ W[OUT, IN]^T + b (pad columns are 0)
    o = tl.arange(0, OUT_PAD)
    om = o < OUT
    acc = tl.zeros([BLOCK_R, OUT_PAD], dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < IN
        a = tl.load(src_ptr + row_off[:, None] + kk[None, :], mask=row_ok[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + o[None, :] * IN + kk[:, None], mask=km[:, None] & om[None, :], other=0.0)
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    bias = tl.load(b_ptr + o, mask=om, other=0.0)
    return acc + bias[None, :]


@triton.jit
def _slot_sums(x, P: tl.constexpr, PAD: tl.constexpr, mean):
    cm = tl.arange(0, PAD) < P
    dx = tl.where(cm[None, :], x - mean[:, None], 0.0)
    return tl.sum(dx * dx, 1)


@triton.jit
def _slot_fc1(x, mean, rstd, mlp_ptr, OFF: tl.constexpr, P: tl.constexpr, PAD: tl.constexpr, F: tl.constexpr,
              M: tl.constexpr, M_PAD: tl.constexpr):
    # LayerNorm of one feature slot (columns OFF..OFF+P of the feature row), times its W1 columns.
    c = tl.arange(0, PAD)
    cm = c < P
    gamma = tl.load(mlp_ptr + OFF + c, mask=cm, other=0.0)
    beta = tl.load(mlp_ptr + F + OFF + c, mask=cm, other=0.0)
    xn = (x - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
    xn = tl.where(cm[None, :], xn, 0.0)
    m = tl.arange(0, M_PAD)
    w1t = tl.load(mlp_ptr + 2 * F + m[None, :] * F + (OFF + c)[:, None], mask=cm[:, None] & (m < M)[None, :],
                  other=0.0)
    return tl.dot(xn, w1t, input_precision="ieee")


@triton.jit
def _mlp_logit(x_child, x_parent, x_depth, x_hidden, x_scal, mlp_ptr, eps,
               PT: tl.constexpr, PT_PAD: tl.constexpr, PD: tl.constexpr, PD_PAD: tl.constexpr,
               PH: tl.constexpr, PH_PAD: tl.constexpr, F: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
               FULL: tl.constexpr):
    # mlp_ptr: [ln_w F | ln_b F | fc1_w M*F | fc1_b M | fc2_w M | fc2_b 1] float32.
    # Slot x tiles hold zeros in their pad columns, so plain row sums give the LayerNorm mean.
    total = tl.sum(x_scal, 1)
    if FULL:
        total += tl.sum(x_child, 1) + tl.sum(x_parent, 1) + tl.sum(x_depth, 1) + tl.sum(x_hidden, 1)
    mean = total / F
    var = _slot_sums(x_scal, 7, 16, mean)
    if FULL:
        var += _slot_sums(x_child, PT, PT_PAD, mean) + _slot_sums(x_parent, PT, PT_PAD, mean)
        var += _slot_sums(x_depth, PD, PD_PAD, mean) + _slot_sums(x_hidden, PH, PH_PAD, mean)
    rstd = 1.0 / tl.sqrt(var / F + eps)
    m = tl.arange(0, M_PAD)
    mm = m < M
    h = _slot_fc1(x_scal, mean, rstd, mlp_ptr, F - 7, 7, 16, F, M, M_PAD)
    if FULL:
        h += _slot_fc1(x_child, mean, rstd, mlp_ptr, 0, PT, PT_PAD, F, M, M_PAD)
        h += _slot_fc1(x_parent, mean, rstd, mlp_ptr, PT, PT, PT_PAD, F, M, M_PAD)
        h += _slot_fc1(x_depth, mean, rstd, mlp_ptr, 2 * PT, PD, PD_PAD, F, M, M_PAD)
        h += _slot_fc1(x_hidden, mean, rstd, mlp_ptr, 2 * PT + PD, PH, PH_PAD, F, M, M_PAD)
    h += tl.load(mlp_ptr + 2 * F + M * F + m, mask=mm, other=0.0)[None, :]
    h = h * tl.sigmoid(h)
    w2 = tl.load(mlp_ptr + 2 * F + M * F + M + m, mask=mm, other=0.0)
    b2 = tl.load(mlp_ptr + 2 * F + M * F + 2 * M)
    return tl.sum(h * w2[None, :], 1) + b2


@triton.jit
def _scalars(s0, ent, mar, mass, dfrac, lq, lq_d):
    # [BLOCK_R, 16] tile of the 7 scalar features (pad columns 0)
    c = tl.arange(0, 16)[None, :]
    x = tl.where(c == 0, s0[:, None], 0.0)
    x = tl.where(c == 1, ent[:, None], x)
    x = tl.where(c == 2, mar[:, None], x)
    x = tl.where(c == 3, mass[:, None], x)
    x = tl.where(c == 4, dfrac[:, None], x)
    x = tl.where(c == 5, lq[:, None], x)
    x = tl.where(c == 6, lq_d[:, None], x)
    return x


@triton.jit
def _edge_logits_kernel(tokens_ptr, parents_ptr, depth_ptr, logq_ptr, step_ptr, ent_ptr, mar_ptr, mass_ptr,
                        emb_ptr, emb_stride, hid_ptr, hid_sb, hid_sd, tok_w_ptr, tok_b_ptr, dep_emb_ptr, dep_rows,
                        hid_w_ptr, hid_b_ptr, mlp_ptr, mlp_size, logits_ptr,
                        B, N, D, V, E, H, eps,
                        PT: tl.constexpr, PT_PAD: tl.constexpr, PD: tl.constexpr, PD_PAD: tl.constexpr,
                        PH: tl.constexpr, PH_PAD: tl.constexpr, F: tl.constexpr, M: tl.constexpr,
                        M_PAD: tl.constexpr, FULL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # tokens [B,N] i64, parents/depth [B,N] i32, logq/step [B,N] f32, ent/mar/mass [B,D] f32 (D >= 1),
    # emb [V,E] (row stride emb_stride), hid [B,D,H], weights f32 contiguous, mlp [2, mlp_size] f32,
    # logits [2,B,N] f32 out: [0] edge logits, [1] "other" logits (0 where the logit is not defined).
    # Grid axis 2 is the head (0 edge, 1 other): one head per program halves the live projections.
    # Every index read from memory is clamped into its table, so no value can address outside it.
    b = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    head = tl.program_id(2)
    is_edge = head == 0
    rm = r < N
    row = b.to(tl.int64) * N + r
    par = tl.load(parents_ptr + row, mask=rm, other=-1)
    dep = tl.load(depth_ptr + row, mask=rm, other=0)
    edge_ok = rm & (par >= 0)
    real = rm & ((r == 0) | (par >= 0))
    other_ok = real & (dep < D)
    lq = tl.load(logq_ptr + row, mask=real, other=0.0)
    lq = tl.where(real, lq, 0.0)
    # edge: child at depth dep, position dep-1; other: virtual child at depth dep+1, position dep;
    # positions clamped into [0, D-1] like the reference (a node deeper than D reads position D-1)
    pos = tl.minimum(tl.maximum(tl.where(is_edge, dep - 1, dep), 0), D - 1)
    stat = b.to(tl.int64) * D + pos
    mass = tl.load(mass_ptr + stat, mask=rm, other=0.0)
    if is_edge:
        d_f = tl.maximum(dep, 1).to(tl.float32)
        lq_s = tl.where(edge_ok, lq, 0.0)
        s0 = tl.load(step_ptr + row, mask=edge_ok, other=0.0)
    else:
        d_f = (dep + 1).to(tl.float32)
        lq_s = lq
        s0 = tl.log(tl.maximum(1.0 - mass, OTHER_FLOOR))
    sc = _scalars(s0, tl.load(ent_ptr + stat, mask=rm, other=0.0), tl.load(mar_ptr + stat, mask=rm, other=0.0),
                  mass, d_f / D, lq_s, lq_s / d_f)
    head_ptr = mlp_ptr + head * mlp_size
    if FULL:
        # token slots: edge = (child, parent) = (proj(tokens[v]), proj(tokens[u])); other = (0, proj(tokens[u]))
        tok = tl.load(tokens_ptr + row, mask=rm, other=0)
        pu = tl.minimum(tl.maximum(par, 0), N - 1)
        ptok = tl.load(tokens_ptr + b.to(tl.int64) * N + pu, mask=rm, other=0)
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)
        ptok = tl.minimum(tl.maximum(ptok, 0), V - 1)
        x_parent = _project(emb_ptr, tl.where(is_edge, ptok, tok) * emb_stride, rm, tok_w_ptr, tok_b_ptr, E, PT,
                            PT_PAD, BLOCK_R, BLOCK_K)
        x_child = tl.zeros([BLOCK_R, PT_PAD], dtype=tl.float32)
        if is_edge:
            x_child = _project(emb_ptr, tok * emb_stride, rm, tok_w_ptr, tok_b_ptr, E, PT, PT_PAD, BLOCK_R, BLOCK_K)
        x_hid = _project(hid_ptr + b.to(tl.int64) * hid_sb, pos.to(tl.int64) * hid_sd, rm, hid_w_ptr, hid_b_ptr, H,
                         PH, PH_PAD, BLOCK_R, BLOCK_K)
        c = tl.arange(0, PD_PAD)
        dep_row = tl.minimum(tl.maximum(tl.where(is_edge, dep, dep + 1), 0), dep_rows - 1)
        x_dep = tl.load(dep_emb_ptr + dep_row[:, None] * PD + c[None, :], mask=rm[:, None] & (c < PD)[None, :],
                        other=0.0)
        logit = _mlp_logit(x_child, x_parent, x_dep, x_hid, sc, head_ptr, eps,
                           PT, PT_PAD, PD, PD_PAD, PH, PH_PAD, F, M, M_PAD, True)
    else:
        logit = _mlp_logit(sc, sc, sc, sc, sc, head_ptr, eps, 1, 16, 1, 16, 1, 16, F, M, M_PAD, False)
    keep = tl.where(is_edge, edge_ok, other_ok)
    tl.store(logits_ptr + head.to(tl.int64) * B * N + row, tl.where(keep, logit, 0.0), mask=rm)


@triton.jit
def _normalise_propagate_kernel(parents_ptr, depth_ptr, l_edge_ptr, l_other_ptr, seg_max_ptr, seg_sum_ptr,
                                edge_logq_ptr, other_logq_ptr, reach_ptr, N,
                                NORMALISE: tl.constexpr, BLOCK: tl.constexpr):
    # parents/depth [B,N] i32; l_edge/l_other [B,N] f32 (NORMALISE) or step_logq / exp(step_logq) (marginal model);
    # scratch seg_max [B,N] f32, seg_sum [B,N] int64 (zeroed by the host); outputs [B,N] f32.
    b = tl.program_id(0)
    base = b.to(tl.int64) * N
    if NORMALISE:
        # segment max, seeded with each parent's own "other" logit
        for t0 in range(0, N, BLOCK):
            r = t0 + tl.arange(0, BLOCK)
            rm = r < N
            par = tl.load(parents_ptr + base + r, mask=rm, other=-1)
            real = rm & ((r == 0) | (par >= 0))
            tl.store(seg_max_ptr + base + r, tl.load(l_other_ptr + base + r, mask=real, other=0.0), mask=real)
        tl.debug_barrier()
        for t0 in range(0, N, BLOCK):
            r = t0 + tl.arange(0, BLOCK)
            rm = r < N
            par = tl.load(parents_ptr + base + r, mask=rm, other=-1)
            edge_ok = rm & (par >= 0)
            le = tl.load(l_edge_ptr + base + r, mask=edge_ok, other=0.0)
            tl.atomic_max(seg_max_ptr + base + tl.minimum(tl.maximum(par, 0), N - 1), le, mask=edge_ok)
        tl.debug_barrier()
        for t0 in range(0, N, BLOCK):
            r = t0 + tl.arange(0, BLOCK)
            rm = r < N
            par = tl.load(parents_ptr + base + r, mask=rm, other=-1)
            real = rm & ((r == 0) | (par >= 0))
            lo = tl.load(l_other_ptr + base + r, mask=real, other=0.0)
            mx = tl.load(seg_max_ptr + base + r, mask=real, other=0.0)
            tl.atomic_add(seg_sum_ptr + base + r, (tl.exp(lo - mx) * 1099511627776.0).to(tl.int64), mask=real)
        tl.debug_barrier()
    if NORMALISE:
        # children's terms exp(l - max), summed in fixed point (order-independent atomics)
        for t0 in range(0, N, BLOCK):
            r = t0 + tl.arange(0, BLOCK)
            rm = r < N
            par = tl.load(parents_ptr + base + r, mask=rm, other=-1)
            edge_ok = rm & (par >= 0)
            pu = tl.minimum(tl.maximum(par, 0), N - 1)
            le = tl.load(l_edge_ptr + base + r, mask=edge_ok, other=0.0)
            le = le - tl.load(seg_max_ptr + base + pu, mask=edge_ok, other=0.0)
            term = tl.where(edge_ok, tl.exp(le), 0.0)
            tl.atomic_add(seg_sum_ptr + base + pu, (term * 1099511627776.0).to(tl.int64), mask=edge_ok)
        tl.debug_barrier()
    for t0 in range(0, N, BLOCK):
        r = t0 + tl.arange(0, BLOCK)
        rm = r < N
        par = tl.load(parents_ptr + base + r, mask=rm, other=-1)
        edge_ok = rm & (par >= 0)
        real = rm & ((r == 0) | (par >= 0))
        pu = tl.minimum(tl.maximum(par, 0), N - 1)
        le = tl.load(l_edge_ptr + base + r, mask=edge_ok, other=0.0)
        if NORMALISE:
            own_sum = tl.load(seg_sum_ptr + base + r, mask=real, other=0).to(tl.float32) * (1.0 / 1099511627776.0)
            par_sum = tl.load(seg_sum_ptr + base + pu, mask=edge_ok, other=1099511627776).to(tl.float32)
            par_lz = tl.load(seg_max_ptr + base + pu, mask=edge_ok, other=0.0) + tl.log(
                par_sum * (1.0 / 1099511627776.0))
            e = le - par_lz
            lo = tl.load(l_other_ptr + base + r, mask=real, other=0.0)
            own_mx = tl.load(seg_max_ptr + base + r, mask=real, other=0.0)
            o = lo - own_mx - tl.log(tl.where(real, own_sum, 1.0))
        else:
            # marginal model: 1 - sum exp(step_logq) is ill-conditioned when the children cover the position, so
            # the children's mass is summed in float32 in node order, as the reference's scatter_add does (a
            # serial loop over the N nodes per tile of parents), of the probabilities torch computed (l_other)
            e = le
            own_sum = tl.zeros([BLOCK], dtype=tl.float32)
            for c in range(0, N):
                pc = tl.load(parents_ptr + base + c)
                tc = tl.load(l_other_ptr + base + c)
                own_sum = tl.where(r == pc, own_sum + tc, own_sum)
            o = tl.log(tl.maximum(1.0 - own_sum, 0.0))
        e = tl.where(r == 0, 0.0, tl.where(edge_ok, e, float("-inf")))
        o = tl.where(real, o, float("-inf"))
        tl.store(edge_logq_ptr + base + r, e, mask=rm)
        tl.store(other_logq_ptr + base + r, o, mask=rm)
        tl.store(reach_ptr + base + r, tl.where(r == 0, 0.0, float("-inf")), mask=rm)
    tl.debug_barrier()
    # reach, one depth at a time so that every parent is final before its children read it; up to the deepest
    # real node (a tree may be deeper than D: its deep nodes read position D - 1 but still get a reach)
    max_dep = 0
    for t0 in range(0, N, BLOCK):
        r = t0 + tl.arange(0, BLOCK)
        rm = r < N
        par = tl.load(parents_ptr + base + r, mask=rm, other=-1)
        dep = tl.load(depth_ptr + base + r, mask=rm & (par >= 0), other=0)
        max_dep = tl.maximum(max_dep, tl.max(dep, 0))
    for d in range(1, tl.minimum(max_dep, N - 1) + 1):  # a valid tree is at most N - 1 deep
        for t0 in range(0, N, BLOCK):
            r = t0 + tl.arange(0, BLOCK)
            rm = r < N
            par = tl.load(parents_ptr + base + r, mask=rm, other=-1)
            dep = tl.load(depth_ptr + base + r, mask=rm, other=0)
            sel = rm & (par >= 0) & (dep == d)
            val = tl.load(reach_ptr + base + tl.minimum(tl.maximum(par, 0), N - 1), mask=sel, other=0.0) + tl.load(
                edge_logq_ptr + base + r, mask=sel, other=0.0)
            tl.store(reach_ptr + base + r, val, mask=sel)
        tl.debug_barrier()


def _pack_head(weights: ScorerWeights, head: str) -> torch.Tensor:
    parts = [getattr(weights, f"{head}_{n}").reshape(-1) for n in
             ("ln_weight", "ln_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")]
    return torch.cat(parts).float()


def _check(pool, weights, token_embeddings, drafter_hidden):
    """Shape checks that keep every kernel read inside its tensor (no tensor values are read)."""
    tree = pool.tree
    B, N = tree.tokens.shape
    D = pool.topk_logp.shape[1]
    for name in ("parents", "depth"):
        if tuple(getattr(tree, name).shape) != (B, N):
            raise ValueError(f"pool.tree.{name}: expected shape {(B, N)}, received {tuple(getattr(tree, name).shape)}")
    for name in ("logq", "step_logq"):
        if tuple(getattr(pool, name).shape) != (B, N):
            raise ValueError(f"pool.{name}: expected shape {(B, N)}, received {tuple(getattr(pool, name).shape)}")
    if weights is None:
        return
    if D == 0:
        raise ValueError("pool.topk_logp: the scorer reads per-position statistics, expected at least one draft "
                         "position (D >= 1), received D = 0")
    for name in ("entropy", "margin", "topk_mass"):
        if tuple(getattr(pool, name).shape) != (B, D):
            raise ValueError(f"pool.{name}: expected shape {(B, D)}, received {tuple(getattr(pool, name).shape)}")
    if weights.full:
        E, H = weights.token_proj_weight.shape[1], weights.hidden_proj_weight.shape[1]
        if token_embeddings is None or token_embeddings.dim() != 2 or token_embeddings.shape[1] != E \
                or token_embeddings.shape[0] < 1:
            got = None if token_embeddings is None else tuple(token_embeddings.shape)
            raise ValueError(f"token_embeddings: expected shape [V >= 1, {E}], received {got}")
        if drafter_hidden is None or tuple(drafter_hidden.shape) != (B, D, H):
            got = None if drafter_hidden is None else tuple(drafter_hidden.shape)
            raise ValueError(f"drafter_hidden: expected shape {(B, D, H)}, received {got}")
        if weights.depth_embedding.shape[0] < 1:
            raise ValueError("weights.depth_embedding: expected at least one row")


def score_edges_triton(pool, weights, token_embeddings, drafter_hidden):
    """Triton ``score_edges``: same contract as :func:`taps_kernels.reference.score.score_edges_reference`.

    ``pool`` tensors ``[B, N]`` / ``[B, D]``; ``token_embeddings [V, E]`` and ``drafter_hidden [B, D, H]``
    (any float dtype, read as float32) only for the full scorer. Returns ``edge_logq``, ``other_logq``,
    ``log_reach``, each ``[B, N] float32`` in pool node order.

    Safe on its own (the op validates more): shapes are checked here, a scorer with ``D = 0`` per-position
    statistics raises ValueError (the reference cannot index them either), a node deeper than ``D`` reads
    position ``D - 1`` like the reference, and token, parent, depth and position VALUES are clamped into their
    tables inside the kernels, so no value reads out of bounds (out-of-contract values give unspecified results).
    """
    _check(pool, weights, token_embeddings, drafter_hidden)
    tree = pool.tree
    B, N = tree.tokens.shape
    D = pool.topk_logp.shape[1]
    dev = tree.device
    parents = tree.parents.contiguous()
    depth = tree.depth.contiguous()
    edge_logq = torch.empty(B, N, dtype=torch.float32, device=dev)
    other_logq = torch.empty_like(edge_logq)
    log_reach = torch.empty_like(edge_logq)
    seg_max = torch.empty_like(edge_logq)
    seg_sum = torch.zeros(B, N, dtype=torch.int64, device=dev)
    if B == 0 or N == 0:
        return edge_logq, other_logq, log_reach
    if weights is None:
        step = pool.step_logq.float().contiguous()
        # l_other carries exp(step_logq) from torch: the reference's exp, bit for bit (see the kernel)
        _normalise_propagate_kernel[(B,)](parents, depth, step, step.exp(), seg_max, seg_sum, edge_logq, other_logq,
                                          log_reach, N, NORMALISE=False, BLOCK=NORM_BLOCK, num_warps=4)
        return edge_logq, other_logq, log_reach

    pt, pd, ph, F, M = weights.dims
    mlp = torch.stack([_pack_head(weights, "edge"), _pack_head(weights, "other")]).contiguous()
    logits = torch.empty(2, B, N, dtype=torch.float32, device=dev)  # [edge, other]
    stats = [t.float().contiguous() for t in (pool.logq, pool.step_logq, pool.entropy, pool.margin, pool.topk_mass)]
    full = weights.full
    if full:
        w = weights.to(dtype=torch.float32)
        emb = token_embeddings if token_embeddings.stride(1) == 1 else token_embeddings.contiguous()
        hid = drafter_hidden if drafter_hidden.stride(2) == 1 else drafter_hidden.contiguous()
        tok_w, tok_b, dep_emb, hid_w, hid_b = (t.contiguous() for t in (
            w.token_proj_weight, w.token_proj_bias, w.depth_embedding, w.hidden_proj_weight, w.hidden_proj_bias))
        V, E, H = emb.shape[0], emb.shape[1], hid.shape[2]
        emb_args = (emb, emb.stride(0), hid, hid.stride(0), hid.stride(1), tok_w, tok_b, dep_emb, dep_emb.shape[0],
                    hid_w, hid_b)
    else:
        V = E = H = 0
        emb_args = (mlp, 0, mlp, 0, 0, mlp, mlp, mlp, 1, mlp, mlp)  # never read: FULL is off
    c = edge_constexprs(pt, pd, ph, F, M, full)
    _edge_logits_kernel[(B, triton.cdiv(N, c["BLOCK_R"]), 2)](
        tree.tokens.contiguous(), parents, depth, *stats, *emb_args, mlp, mlp.shape[1], logits,
        B, N, D, V, E, H, float(weights.ln_eps), **c, num_warps=EDGE_WARPS)
    _normalise_propagate_kernel[(B,)](parents, depth, logits[0], logits[1], seg_max, seg_sum, edge_logq, other_logq,
                                      log_reach, N, NORMALISE=True, BLOCK=NORM_BLOCK, num_warps=4)
    return edge_logq, other_logq, log_reach


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))  # tl.dot needs dims >= 16


def edge_constexprs(pt: int, pd: int, ph: int, F: int, M: int, full: bool) -> dict:
    """Compile-time arguments of ``_edge_logits_kernel`` for a scorer of dims ``(Pt, Pd, Ph, F, M)``."""
    return dict(PT=max(pt, 1), PT_PAD=_pad(pt), PD=max(pd, 1), PD_PAD=_pad(pd), PH=max(ph, 1), PH_PAD=_pad(ph), F=F,
                M=M, M_PAD=_pad(M), FULL=full, BLOCK_R=EDGE_BLOCK_R, BLOCK_K=EDGE_BLOCK_K)


def aot_configs():
    """Launch configurations for ahead-of-time compile checks (format: ``bench/aot_resources.py``): the published
    full (32/8/32, M=64) and tiny (M=32) scorers with bf16 and fp32 embeddings, and both propagation variants."""
    out = []
    for emb in ("*bf16", "*fp16", "*fp32"):
        ptrs = {"tokens_ptr": "*i64", "parents_ptr": "*i32", "depth_ptr": "*i32", "emb_ptr": emb, "hid_ptr": emb}
        out.append((_edge_logits_kernel, ptrs, edge_constexprs(32, 8, 32, 111, 64, True), ("eps",), EDGE_WARPS))
    ptrs = {"tokens_ptr": "*i64", "parents_ptr": "*i32", "depth_ptr": "*i32"}
    out.append((_edge_logits_kernel, ptrs, edge_constexprs(0, 0, 0, 7, 32, False), ("eps",), EDGE_WARPS))
    for normalise in (True, False):
        out.append((_normalise_propagate_kernel, {"parents_ptr": "*i32", "depth_ptr": "*i32", "seg_sum_ptr": "*i64"},
                    dict(NORMALISE=normalise, BLOCK=NORM_BLOCK), (), 4))
    return out


__all__ = ["score_edges_triton", "aot_configs"]
