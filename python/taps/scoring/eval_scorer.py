"""Held-out scorer validation: calibration of predicted reach against real acceptance, beside the marginal product.

Per non-root pool node ``v`` of a validation round: ``pred(v)`` = predicted reach (scorer, through
:func:`taps_kernels.score_edges`, the inference path) or the marginal product ``exp(pool.logq)``
(DDTree's surrogate); ``label(v) = 1`` iff ``v`` lies on the round's accepted greedy path.

* reliability curve: equal-width bins of ``pred`` on [0, 1]; per bin the count, mean ``pred`` and
  mean ``label``;
* expected calibration error ``ECE = sum_b (n_b / n) |mean pred_b - mean label_b|``;
* top-1 child accuracy: among parents with pool children, how often the child with the highest
  predicted edge probability carries the target's greedy token (scorer vs marginal rank-0 child),
  over all parents and over parents on the accepted path;
* offline tau at equal budget ``n``: keep the top-``n`` nodes by reach (prefix-closed), count the
  accepted ones (+1 for the bonus) -- exactly the tau a round would have had with that tree.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

import taps_kernels
from taps_kernels import ScorerWeights, Tree

from .traces import accepted_mask, pool_from_traces


def reliability(pred: torch.Tensor, label: torch.Tensor, bins: int = 10) -> Dict[str, object]:
    """Reliability curve and ECE of probabilities ``pred [M]`` against 0/1 (or fractional) ``label [M]``.

    Bin ``b`` holds ``b/bins <= pred < (b+1)/bins`` (the last bin includes 1). Returns ``{"ece",
    "bins": [{"lo", "hi", "count", "pred", "acc"}, ...]}`` (empty bins have count 0 and None means).
    """
    pred = pred.double().clamp(0.0, 1.0).flatten()
    label = label.double().flatten()
    if pred.shape != label.shape:
        raise ValueError(f"pred, label: expected equal shapes, received {tuple(pred.shape)} and {tuple(label.shape)}")
    idx = torch.clamp((pred * bins).floor().long(), max=bins - 1)
    total = pred.numel()
    ece = 0.0
    out = []
    for b in range(bins):
        m = idx == b
        c = int(m.sum())
        if c:
            p, a = float(pred[m].mean()), float(label[m].mean())
            ece += c / total * abs(p - a)
        else:
            p = a = None
        out.append({"lo": b / bins, "hi": (b + 1) / bins, "count": c, "pred": p, "acc": a})
    return {"ece": ece if total else None, "bins": out, "count": total}


def _child_top1(edge_logq, parents, tokens, target_argmax, on_path):
    """Among parents with children: fraction whose best child (max edge_logq, smallest index on ties)
    has the target's greedy token; returns (all_parents, on_path_parents)."""
    R, N = tokens.shape
    par = parents.long()
    valid = par >= 0
    score = torch.where(valid, edge_logq, torch.full_like(edge_logq, float("-inf")))
    best = torch.full((R, N), float("-inf")).scatter_reduce(1, par.clamp(min=0), score, reduce="amax", include_self=True)
    is_best = valid & (score == best.gather(1, par.clamp(min=0)))
    # smallest-index child among equal bests
    idx = torch.arange(N).expand(R, N)
    cand = torch.where(is_best, idx, torch.full_like(idx, N))
    first = torch.full((R, N), N, dtype=torch.long).scatter_reduce(1, par.clamp(min=0), cand, reduce="amin",
                                                                  include_self=True)
    has_child = first < N
    best_tok = tokens.gather(1, first.clamp(max=N - 1))
    hit = has_child & (best_tok == target_argmax.long())
    n_all = int(has_child.sum())
    n_path = int((has_child & on_path).sum())
    return (float(hit.sum()) / n_all if n_all else None,
            float((hit & on_path).sum()) / n_path if n_path else None, n_all, n_path)


def offline_tau(log_reach: torch.Tensor, tree, accepted: torch.Tensor, budgets: List[int]) -> Dict[int, float]:
    """Mean over rounds of ``1 + #accepted nodes among the top-n by reach`` for each budget ``n``."""
    out = {}
    for n in budgets:
        sel = taps_kernels.select_subtree(tree, log_reach, max_nodes=n)
        pi = sel.pool_index
        keep = pi > 0
        acc = accepted.gather(1, pi.clamp(min=0)) & keep
        out[n] = float((1 + acc.sum(1).float()).mean())
    return out


@torch.no_grad()
def evaluate_scorer(traces: Dict[str, torch.Tensor], weights: Optional[ScorerWeights],
                    token_embeddings: Optional[torch.Tensor], bins: int = 10, batch: int = 64,
                    budgets=(4, 8, 16, 32, 64), backend: Optional[str] = None) -> Dict[str, object]:
    """Calibration, top-1 child accuracy and offline tau of ``weights`` (and of the marginal product).

    ``traces``: held-out trace dict; ``weights``: ScorerWeights (None evaluates the marginal only).
    Scoring runs through :func:`taps_kernels.score_edges` (``backend`` as given, default choice otherwise).
    """
    R, N = traces["tokens"].shape
    accepted = accepted_mask(traces)
    preds = {"scorer": [], "marginal": []}
    labels = []
    top1 = {"scorer": [], "marginal": []}
    taus = {"scorer": [], "marginal": []}
    exp_tau = {"scorer": [], "marginal": []}
    nonroot_all = []
    for i in range(0, R, batch):
        rows = torch.arange(i, min(R, i + batch))
        pool = pool_from_traces(traces, rows)
        acc = accepted[rows]
        nonroot = pool.tree.parents >= 0
        labels.append(acc[nonroot].float())
        nonroot_all.append(nonroot)
        on_path = acc
        models = {"marginal": (pool.step_logq, pool.logq)}
        if weights is not None:
            hid = traces["hidden"][rows].float() if weights.full else None
            e, _, lr = taps_kernels.score_edges(pool, weights, token_embeddings if weights.full else None, hid,
                                                backend=backend)
            models["scorer"] = (e, lr)
        for name, (e, lr) in models.items():
            preds[name].append(lr.exp()[nonroot])
            top1[name].append(_child_top1(e, pool.tree.parents, pool.tree.tokens, traces["target_argmax"][rows], on_path))
            t = offline_tau(lr, pool.tree, acc, list(budgets))
            taus[name].append((len(rows), t))
            # predicted E[tau(n)] = 1 + sum of the top-n reaches
            srt = torch.sort(torch.where(nonroot, lr.exp(), torch.zeros_like(lr)), dim=1, descending=True).values
            cums = torch.cumsum(srt, 1)
            exp_tau[name].append((len(rows), {n: float((1 + cums[:, min(n, N - 1) - 1]).mean()) for n in budgets}))
    label = torch.cat(labels)
    out = {"rounds": R, "nodes": int(label.numel()), "accept_rate": float(label.mean()),
           "tau_pool": float(accepted.sum(1).float().mean()), "bins": bins}
    for name in preds:
        if not preds[name]:
            continue
        pred = torch.cat(preds[name])
        rel = reliability(pred, label, bins)
        a_all = [x for x in top1[name]]
        n_all = sum(x[2] for x in a_all)
        n_path = sum(x[3] for x in a_all)
        acc_all = sum((x[0] or 0) * x[2] for x in a_all) / n_all if n_all else None
        acc_path = sum((x[1] or 0) * x[3] for x in a_all) / n_path if n_path else None
        tau = {str(n): sum(c * t[n] for c, t in taus[name]) / R for n in budgets}
        etau = {str(n): sum(c * t[n] for c, t in exp_tau[name]) / R for n in budgets}
        corr = float(torch.corrcoef(torch.stack([pred.double(), label.double()]))[0, 1]) if pred.numel() > 1 else None
        out[name] = {"ece": rel["ece"], "reliability": rel["bins"], "mean_pred": float(pred.mean()),
                     "corr": corr, "top1_child_acc": acc_all, "top1_child_acc_on_path": acc_path,
                     "parents": n_all, "parents_on_path": n_path, "offline_tau": tau, "predicted_tau": etau}
    return out


def format_eval(res: Dict[str, object]) -> str:
    """Human-readable summary of :func:`evaluate_scorer` output."""
    lines = [f"{res['rounds']} held-out rounds, {res['nodes']} pool nodes, accept rate {res['accept_rate']:.4f}, "
             f"greedy tau over the full pool {res['tau_pool']:.2f}"]
    names = [n for n in ("scorer", "marginal") if n in res]
    for n in names:
        r = res[n]
        lines.append(f"{n:<9} ECE {r['ece']:.4f}  corr {r['corr']:.3f}  mean pred {r['mean_pred']:.4f}  "
                     f"top-1 child acc {r['top1_child_acc']:.3f} (on path {r['top1_child_acc_on_path']:.3f})")
        lines.append(f"{'':<9} offline tau by budget {r['offline_tau']}  (predicted {r['predicted_tau']})")
    lines.append("reliability (bin: count, pred -> acc) " + ", ".join(names))
    for b in range(res["bins"]):
        parts = []
        for n in names:
            x = res[n]["reliability"][b]
            parts.append(f"{x['count']:>7} {x['pred'] if x['pred'] is not None else float('nan'):.3f}->"
                         f"{x['acc'] if x['acc'] is not None else float('nan'):.3f}")
        lo, hi = res[names[0]]["reliability"][b]["lo"], res[names[0]]["reliability"][b]["hi"]
        lines.append(f"  [{lo:.1f},{hi:.1f})  " + "   ".join(parts))
    return "\n".join(lines)


def _chain_nodes(tree, rank) -> torch.Tensor:
    """``[B,N] bool``: pool nodes on the rank-0 (argmax) chain from the root, i.e. DFlash's proposal."""
    B, N = rank.shape
    on = torch.zeros(B, N, dtype=torch.bool)
    on[:, 0] = True
    par = tree.parents.long()
    for d in range(1, int(tree.depth.max()) + 1):
        at = (tree.depth == d) & (par >= 0)
        on = torch.where(at, on.gather(1, par.clamp(min=0)) & (rank == 0), on)
    return on


def _best_mix(tok_a, t_a, tok_b, t_b, iters: int = 50) -> torch.Tensor:
    """Per item, option a or b (``[R]`` tokens and seconds each), chosen to maximise total tokens / total
    seconds; returns ``[R] bool`` (True = a). Dinkelbach's iteration: at the current rate ``rho`` each item
    independently takes the option with the larger ``tokens - rho * seconds``; the rate never decreases and
    the choice is optimal once it stops changing."""
    pick = torch.ones_like(tok_a, dtype=torch.bool)
    for _ in range(iters):
        rho = (torch.where(pick, tok_a, tok_b).sum() / torch.where(pick, t_a, t_b).sum())
        new = tok_a - rho * t_a >= tok_b - rho * t_b
        if torch.equal(new, pick):
            break
        pick = new
    return pick


@torch.no_grad()
def _selected_rounds(tree: Tree, log_reach: torch.Tensor, accepted: torch.Tensor, one_row: bool = False, **select):
    """``(tau [B] float32, n [B] int64)`` of :func:`taps_kernels.select_subtree`'s trees (``select``: its
    arguments) on recorded rounds: ``1 +`` the accepted pool nodes they keep, and their size. ``one_row``: each
    row selected on its own (a batch rule would decide the rows jointly)."""
    rows = [slice(b, b + 1) for b in range(tree.batch_size)] if one_row else [slice(None)]
    taus, sizes = [], []
    for r in rows:
        sub = Tree(tree.tokens[r], tree.parents[r], tree.depth[r], tree.num_nodes[r])
        sel = taps_kernels.select_subtree(sub, log_reach[r], **select)
        pi = sel.pool_index
        taus.append(1 + (accepted[r].gather(1, pi.clamp(min=0)) & (pi > 0)).sum(1).float())
        sizes.append(sel.num_selected.long())
    return torch.cat(taus), torch.cat(sizes)


def replay_throughput(traces: Dict[str, torch.Tensor], weights: Optional[ScorerWeights],
                      token_embeddings: Optional[torch.Tensor], table: dict, overhead_s: Dict[str, float],
                      budgets=(4, 8, 16, 32, 64, 128), cap: int = 64, min_utility: float = 0.01,
                      fixed_budgets=(16,), batch: int = 64) -> Dict[str, dict]:
    """Trace replay: each policy's tree on held-out rounds, scored with the real acceptance, timed with a
    measured latency table instead of a wall clock (no machine noise).

    A round of policy ``P`` commits ``1 + #accepted selected nodes`` tokens (exact for greedy decoding: the
    accepted nodes of the pool form one root path and every selection is prefix-closed) and costs
    ``t0 + overhead_s[P] + latency[n]`` (``n`` selected non-root nodes; AR: ``latency[0]``, no draft); past
    the table's last measured node count ``latency`` follows :class:`taps.decode.latency.LatencyTable`'s one
    rule, as the policies do. DFlash verifies its 15-node argmax chain; nodes of the chain missing from the pool count as rejected,
    so its tau here is a lower bound. ``taps`` and ``ddtree-cost`` size their trees with the policies'
    throughput rule (:class:`taps_kernels.ThroughputRule`, each trace row on its own) and draft every round (no
    gate replayed); ``taps-ratio``: the scorer's trees by METHOD.md's per-round ratio (``latency=, t0=``).

    Two oracle rows bound what any tree policy over this drafter's pool could reach on these rounds:
    ``oracle-path`` verifies exactly the accepted pool path (``a`` nodes) at ``t0 + latency[a]``, with no
    selection overhead; ``oracle-path+skip`` also chooses, per round, between that and a plain round
    (one token at ``latency[0]``, no draft) so as to maximise the aggregate rate (:func:`_best_mix`).
    Returns ``{policy: {"tau", "nodes", "tokens_per_s", "speedup"}}``.
    """
    import taps_kernels as tk
    from taps.decode.latency import LatencyTable
    from taps.decode.policies.gate import plain_round_seconds

    R, N = traces["tokens"].shape
    tbl = LatencyTable.of(table)
    # every node count a pool of N rows can verify, past the table's end by its one rule (decode.latency)
    lat = torch.tensor(tbl.batch_seconds(1, max(N, int(cap) + 1)), dtype=torch.float64)
    t0 = tbl.t0
    L = lat.numel()

    def cost(n, key):
        return t0 + overhead_s.get(key, 0.0) + lat[n.clamp(max=L - 1)]

    D = traces["entropy"].shape[1]
    acc_all = accepted_mask(traces)
    agg = {}

    def add(name, tau, n, secs):
        a = agg.setdefault(name, [0.0, 0.0, 0.0, 0])
        a[0] += float(tau.sum())
        a[1] += float(n.sum())
        a[2] += float(secs.sum())
        a[3] += int(tau.numel())

    lat_t = lat[:cap + 1].clone()
    plain_s = plain_round_seconds(table)
    accepted = []
    for i in range(0, R, batch):
        rows = torch.arange(i, min(R, i + batch))
        pool = pool_from_traces(traces, rows)
        acc = acc_all[rows]
        B = len(rows)
        add("ar", torch.ones(B), torch.ones(B), lat[0].expand(B))
        chain = _chain_nodes(pool.tree, pool.rank) & (pool.tree.parents >= 0)
        n_chain = torch.full((B,), D, dtype=torch.long)
        add("dflash", 1 + (acc & chain).sum(1).float(), n_chain + 1, cost(n_chain, "dflash"))
        n_acc = (acc & (pool.tree.parents >= 0)).sum(1)
        accepted.append(n_acc)
        add("oracle-path", 1 + n_acc.float(), n_acc + 1, t0 + lat[n_acc.clamp(max=L - 1)])
        reaches = {"marginal": pool.logq}
        if weights is not None:
            hid = traces["hidden"][rows].float() if weights.full else None
            reaches["scorer"] = tk.score_edges(pool, weights, token_embeddings if weights.full else None, hid)[2]

        def run(name, lr, key, **kw):
            tau, n = _selected_rounds(pool.tree, lr, acc, **kw)
            add(name, tau, n + 1, cost(n, key))

        def run_throughput(name, lr, key):
            # the policies' rule, one row at a time (each trace row is a one-row decode)
            tau, n = _selected_rounds(pool.tree, lr, acc, one_row=True, max_nodes=cap,
                                      rule=tk.ThroughputRule(lat_t, plain_s, rows=1))
            add(name, tau, n + 1, cost(n, key))

        for b in budgets:
            run(f"ddtree:{b}", reaches["marginal"], "ddtree", max_nodes=min(b, N - 1))
        run_throughput("ddtree-cost", reaches["marginal"], "ddtree")
        if "scorer" in reaches:
            r = reaches["scorer"]
            run_throughput("taps", r, "taps")
            run("taps-ratio", r, "taps", max_nodes=cap,
                rule=tk.ReachRule(lat_t, t0=t0 + overhead_s.get("taps", 0.0)))
            run("taps-paper", r, "taps", max_nodes=cap, rule=tk.UtilityRule(min_utility=min_utility))
            for b in fixed_budgets:
                run(f"taps-fixed:{b}", r, "taps", max_nodes=b)
    n_acc = torch.cat(accepted)
    t_path = t0 + lat[n_acc.clamp(max=L - 1)]
    draft = _best_mix(1 + n_acc.double(), t_path, torch.ones_like(t_path), lat[0].expand_as(t_path))
    add("oracle-path+skip", torch.where(draft, 1 + n_acc.double(), 1.0), torch.where(draft, n_acc + 1, 1),
        torch.where(draft, t_path, lat[0]))
    out = {}
    ar_tps = agg["ar"][0] / agg["ar"][2]
    for k, (tau, nodes, secs, rounds) in agg.items():
        tps = tau / secs
        out[k] = {"tau": tau / rounds, "nodes_per_round": nodes / rounds, "tokens_per_s": tps,
                  "speedup": tps / ar_tps, "rounds": rounds}
    return out
