"""Scorer training (METHOD.md section 4): KL over each parent's children plus "other", and 0.5 x BCE on reach.

Targets come from traces (:mod:`taps.scoring.traces`). For a parent ``u`` with pool children
``C(u)`` the target distribution is ``p(v | u)`` for ``v in C(u)`` plus ``p_other(u) = 1 - sum p(v | u)``:

* ``target="greedy"`` (default): ``p(v | u) = 1`` iff ``v``'s token is the target's argmax after ``u``;
  this is the real acceptance event of greedy decoding, so predicted reach is calibrated against it;
* ``target="soft"``: ``p(v | u)`` = the target's probability of ``v``'s token after ``u`` (acceptance
  probability when sampling at temperature 1).

``r*(v)`` is the product of ``p`` along the root-to-``v`` path. Loss per batch:
``mean_u KL(p(.|u) || q(.|u)) + 0.5 * mean_v BCE(r_hat(v), r*(v))`` over parents with at least one
pool child and over non-root nodes. AdamW (lr 3e-3, weight decay 0.01), cosine decay, fixed seed;
the epoch with the lowest validation loss is kept.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch

from .model import TapsScorer
from .traces import pool_from_traces

BCE_WEIGHT = 0.5
_EPS = 1e-6


def target_embeddings(target: str = "smollm2") -> torch.Tensor:
    """The target's input embedding table ``[V, E] f32`` (read from the cached safetensors when possible)."""
    from taps.models.target import resolve_target_dir

    try:
        from safetensors import safe_open

        d = resolve_target_dir(target)
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    if k.endswith("embed_tokens.weight"):
                        return h.get_tensor(k).float()
    except (FileNotFoundError, ValueError, OSError):
        pass
    from taps.models.target import load_target

    model, _ = load_target(target)
    return model.get_input_embeddings().weight.detach().float()


def edge_targets(traces: Dict[str, torch.Tensor], target: str = "greedy") -> Dict[str, torch.Tensor]:
    """Per-round training targets.

    Returns ``p_child [R,N] f32`` (``p(v | parent(v))``, 0 at root/padding), ``p_other [R,N] f32``,
    ``has_child [R,N] bool``, ``r_star [R,N] f32`` (product of ``p_child`` along the path, 1 at the root),
    ``edge_valid [R,N] bool``.
    """
    if target not in ("greedy", "soft"):
        raise ValueError(f"target: expected 'greedy' or 'soft', received {target!r}")
    parents = traces["parents"].long()
    depth = traces["depth"].long()
    tokens = traces["tokens"].long()
    R, N = tokens.shape
    edge_valid = parents >= 0
    par = parents.clamp(min=0)
    if target == "greedy":
        p = (traces["target_argmax"].long().gather(1, par) == tokens).float()
    else:
        p = traces["child_prob"].float()
    p = torch.where(edge_valid, p, torch.zeros_like(p))
    child_sum = torch.zeros(R, N).scatter_add(1, par, p)
    n_child = torch.zeros(R, N).scatter_add(1, par, edge_valid.float())
    p_other = (1 - child_sum).clamp(min=0.0)
    r = torch.ones(R, N)
    for d in range(1, int(depth.max()) + 1 if depth.numel() else 1):
        at = edge_valid & (depth == d)
        r = torch.where(at, r.gather(1, par) * p, r)
    r = torch.where(edge_valid | (torch.arange(N)[None] == 0), r, torch.zeros_like(r))
    return {"p_child": p, "p_other": p_other, "has_child": n_child > 0, "r_star": r, "edge_valid": edge_valid}


def _xlogx(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x * torch.log(x.clamp(min=1e-30)), torch.zeros_like(x))


def scorer_loss(edge_logq, other_logq, log_reach, tgt: Dict[str, torch.Tensor], bce_weight: float = BCE_WEIGHT):
    """``(loss, parts)``: mean KL per parent with children + ``bce_weight`` x mean BCE per non-root node.

    All inputs ``[B,N]``; ``tgt`` holds the matching rows of :func:`edge_targets`.
    """
    ev, hc = tgt["edge_valid"], tgt["has_child"]
    pc, po = tgt["p_child"], tgt["p_other"]
    e = torch.where(ev, edge_logq, torch.zeros_like(edge_logq))
    o = torch.where(hc, other_logq, torch.zeros_like(other_logq))
    cross = -(pc * e).sum() - (po * o * hc).sum()
    neg_entropy = _xlogx(pc).sum() + (_xlogx(po) * hc).sum()
    n_par = hc.sum().clamp(min=1)
    kl = (cross + neg_entropy) / n_par
    lr = torch.where(ev, log_reach, torch.full_like(log_reach, -30.0)).clamp(max=-_EPS)
    log1m = torch.log(-torch.expm1(lr))
    rs = tgt["r_star"]
    bce = -(rs * lr + (1 - rs) * log1m)
    bce = (bce * ev).sum() / ev.sum().clamp(min=1)
    loss = kl + bce_weight * bce
    return loss, {"kl": float(kl.detach()), "bce": float(bce.detach()), "loss": float(loss.detach())}


def _batches(R: int, batch: int, gen: Optional[torch.Generator]):
    order = torch.randperm(R, generator=gen) if gen is not None else torch.arange(R)
    for i in range(0, R, batch):
        yield order[i:i + batch]


def evaluate_loss(model: TapsScorer, traces, tgt, emb, batch: int = 64) -> Dict[str, float]:
    """Mean loss parts over all rounds of ``traces`` (no gradient)."""
    R = traces["tokens"].shape[0]
    tot = {"kl": 0.0, "bce": 0.0, "loss": 0.0}
    with torch.no_grad():
        for rows in _batches(R, batch, None):
            pool = pool_from_traces(traces, rows)
            out = model(pool, emb, traces["hidden"][rows].float() if not model.tiny else None)
            _, parts = scorer_loss(*out, {k: v[rows] for k, v in tgt.items()})
            for k in tot:
                tot[k] += parts[k] * len(rows)
    return {k: v / max(R, 1) for k, v in tot.items()}


class InitShapeError(ValueError):
    """``train_scorer(init=...)`` got a scorer whose shapes differ from the ones the traces ask for."""


#: the depth embedding's state-dict key: an ``init`` scorer trained for a deeper block may have more rows
DEPTH_TABLE = "depth_embedding.weight"


@dataclass
class ScorerTrainOptions:
    """Options of :func:`train_scorer`: ``tiny`` (the variant without target inputs), ``epochs``, ``batch``
    (rounds per step), AdamW's ``lr`` and ``weight_decay``, the ``target`` distribution (``greedy`` or
    ``soft``, :func:`edge_targets`), ``seed``, the scorer's ``top_k`` and a ``progress`` bar."""

    tiny: bool = False
    epochs: int = 30
    batch: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    target: str = "greedy"
    seed: int = 0
    top_k: int = 64
    progress: bool = True


def train_scorer(train: Dict[str, torch.Tensor], val: Optional[Dict[str, torch.Tensor]], emb: Optional[torch.Tensor],
                 options: Optional[ScorerTrainOptions] = None, *, log=print, init: Optional[TapsScorer] = None,
                 **overrides) -> (TapsScorer, dict):
    """Train a scorer on trace dicts (:func:`taps.scoring.traces.load_traces`).

    Args:
        train, val: trace dicts (``val`` may be None: then the last epoch is kept).
        emb: ``[V, E]`` target input embeddings (full variant; ignored when ``tiny``).
        options: :class:`ScorerTrainOptions` (default: its defaults), any field overridden by keyword
            (``train_scorer(train, val, emb, tiny=True, epochs=5)``).
        init: a trained scorer of the same shape to start from (e.g. the one of the previous drafter: a
            new drafter shifts the inputs, so little new data goes a long way from there); a depth embedding
            with more rows (a drafter with a longer block) gives its first ``D + 1`` rows.
    Returns:
        ``(model, history)``: the best-validation model (eval mode) and per-epoch losses, seconds, best epoch.
    """
    from tqdm import tqdm

    opts = replace(options or ScorerTrainOptions(), **overrides)
    tiny, target = opts.tiny, opts.target
    torch.manual_seed(opts.seed)
    gen = torch.Generator().manual_seed(opts.seed)
    D = int(train["entropy"].shape[1])
    H = int(train["hidden"].shape[2])
    model = TapsScorer(embed_dim=0 if tiny else emb.shape[1], hidden_dim=0 if tiny else H, max_depth=D, tiny=tiny,
                       top_k=opts.top_k)
    if init is not None:
        _load_init(model, init, f"tiny={tiny}, hidden {H}, depth {D}")
    emb_used = None if tiny else emb
    tgt_tr = edge_targets(train, target)
    tgt_va = edge_targets(val, target) if val is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    R = train["tokens"].shape[0]
    steps = opts.epochs * math.ceil(R / opts.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    hist = {"epochs": [], "best_epoch": None, "target": target, "train_rounds": R,
            "val_rounds": val["tokens"].shape[0] if val is not None else 0}
    best, best_state = float("inf"), None
    t_start = time.time()
    bar = tqdm(range(opts.epochs), desc="train-scorer" + (" (tiny)" if tiny else ""), unit="epoch",
               disable=not opts.progress)
    for ep in bar:
        model.train()
        run = _train_epoch(model, opt, sched, train, tgt_tr, emb_used, opts.batch, gen)
        model.eval()
        rec = {"epoch": ep + 1, "train": run, "seconds": round(time.time() - t_start, 1)}
        if val is not None:
            rec["val"] = evaluate_loss(model, val, tgt_va, emb_used)
            score = rec["val"]["loss"]
        else:
            score = -ep
        if score < best:
            best, best_state = score, {k: v.detach().clone() for k, v in model.state_dict().items()}
            hist["best_epoch"] = ep + 1
        hist["epochs"].append(rec)
        bar.set_postfix(train=f"{run['loss']:.4f}", val=f"{rec.get('val', {}).get('loss', float('nan')):.4f}")
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    hist["seconds"] = round(time.time() - t_start, 1)
    return model, hist


def _load_init(model: TapsScorer, init: TapsScorer, shapes: str) -> None:
    """Loads ``init``'s weights into ``model`` (a deeper depth table cut to ``model``'s rows); raises
    :class:`InitShapeError` naming ``shapes`` when any other shape differs."""
    state = dict(init.state_dict())
    if DEPTH_TABLE in state and DEPTH_TABLE in model.state_dict():
        # a drafter with a shorter block: depths 0..D mean the same, so the first D + 1 rows carry over
        have, need = state[DEPTH_TABLE].shape, model.state_dict()[DEPTH_TABLE].shape
        if have[0] > need[0] and have[1:] == need[1:]:
            state[DEPTH_TABLE] = state[DEPTH_TABLE][:need[0]]
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        raise InitShapeError(f"init: scorer shapes differ from the traces' ({shapes}); "
                             f"first mismatches {[(k, got.get(k), want.get(k)) for k in diff[:3]]} (init, expected)")
    model.load_state_dict(state)


def _train_epoch(model: TapsScorer, opt, sched, train, tgt, emb, batch: int, gen: torch.Generator) -> Dict[str, float]:
    """One pass over ``train`` in random batches of ``batch`` rounds; returns the mean loss parts."""
    R = train["tokens"].shape[0]
    run = {"kl": 0.0, "bce": 0.0, "loss": 0.0}
    for rows in _batches(R, batch, gen):
        pool = pool_from_traces(train, rows)
        out = model(pool, emb, None if model.tiny else train["hidden"][rows].float())
        loss, parts = scorer_loss(*out, {k: v[rows] for k, v in tgt.items()})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        for k in run:
            run[k] += parts[k] * len(rows)
    return {k: v / R for k, v in run.items()}
