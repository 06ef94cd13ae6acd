"""Reference subtree selection: top nodes by (prefix-closed) reach, the throughput rule (one tree, and the
batch-joint rule of the shipped policies), and the published utility rule."""
from __future__ import annotations

import itertools
import math
from typing import Optional

import torch


def effective_reach(parents: torch.Tensor, log_reach: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """``e(v) = min(log_reach(v), e(parent(v)))``, root 0, padding -inf: monotone along paths, so top-n is prefix-closed."""
    B, N = parents.shape
    e = torch.full((B, N), float("-inf"), dtype=torch.float32)
    lr = log_reach.detach().cpu().float()
    par = parents.detach().cpu().long()
    nn_ = num_nodes.detach().cpu().long()
    for b in range(B):
        e[b, 0] = 0.0
        for i in range(1, int(nn_[b])):
            e[b, i] = min(float(lr[b, i]), float(e[b, par[b, i]]))
    return e


def _throughput_size(sorted_e, n_max: int, latency: torch.Tensor, t0: float) -> int:
    best_n, best_val, tau = 0, -math.inf, 1.0
    for n in range(0, n_max + 1):
        if n > 0:
            tau += math.exp(float(sorted_e[n - 1]))
        val = tau / (t0 + float(latency[n]))
        if val > best_val:
            best_n, best_val = n, val
    return best_n


UTILITY_OPTION_DEFAULTS = {"max_leaves": None, "fill_below_threshold": False, "max_children": None, "min_nodes": 0}
"""The utility rule's options at the values that give the rule as described (METHOD.md section 4)."""


def default_utility_options_only(**call) -> str:
    """``supports`` of a ``select_subtree`` backend that implements the utility rule's default options only:
    empty when every option in ``call`` is at its default, else which are not (read by the backend table)."""
    changed = [f"{k}={call[k]!r}" for k, v in UTILITY_OPTION_DEFAULTS.items() if k in call and call[k] != v]
    if not changed:
        return ""
    return ("this backend implements the utility rule's default options only (max_leaves=None, "
            "fill_below_threshold=False, max_children=None, min_nodes=0), received " + ", ".join(changed)
            + "; the reference implements them")


def utility_greedy(util, parents, max_nodes: int, min_utility: float, max_leaves: Optional[int] = None,
                   fill_below_threshold: bool = False, max_children: Optional[int] = None, min_nodes: int = 0):
    """The utility rule's greedy choice for one tree; returns the kept non-root nodes ascending.

    ``util``: ``{node: utility}`` of the real non-root nodes; ``parents``: parent of every real node (root -1).
    Candidates are visited by ``(-u, index)``; taking one adds it with its not-yet-kept ancestors when they fit
    in ``max_nodes``, else it is skipped.

    * ``max_children``: a node is a candidate only if it is among the first ``max_children`` children of its
      parent in pool order (in a best-first pool: draft rank ``< max_children``). It filters candidates in
      every pass; a node past the cap still enters as the missing ancestor of a candidate.
    * main pass: candidates up to the first with ``u < min_utility``; with ``fill_below_threshold``, when no
      candidate reaches ``min_utility`` the pass takes all of them. It ends once ``max_nodes`` nodes are kept
      or ``max_leaves`` candidates were taken (a taken candidate is one that added at least one node; it is a
      leaf when taken, an ancestor of a later one stays counted).
    * ``min_nodes``: while fewer than ``min(min_nodes, max_nodes)`` nodes are kept, a second pass visits every
      candidate again from the top, threshold and ``max_leaves`` ignored, with the same fit rule.
    """
    order = sorted(util, key=lambda i: (-util[i], i))
    if max_children is not None:
        rank, seen = {}, {}
        for i in sorted(util):
            rank[i] = seen.get(parents[i], 0)
            seen[parents[i]] = rank[i] + 1
        order = [i for i in order if rank[i] < max_children]
    main = list(itertools.takewhile(lambda i: not util[i] < min_utility, order))
    if fill_below_threshold and not main:
        main = order
    chosen = set()

    def take(i) -> int:
        missing = []
        j = i
        while j > 0 and j not in chosen:
            missing.append(j)
            j = parents[j]
        if len(chosen) + len(missing) > max_nodes:
            return 0
        chosen.update(missing)
        return len(missing)

    taken = 0
    for i in main:
        taken += take(i) > 0
        if len(chosen) == max_nodes or (max_leaves is not None and taken >= max_leaves):
            break
    floor = min(min_nodes, max_nodes)
    if len(chosen) < floor:
        for i in order:
            take(i)
            if len(chosen) >= floor:
                break
    return sorted(chosen)


def select_subtree_reference(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor,
                             log_reach: torch.Tensor, max_nodes: int, latency: Optional[torch.Tensor] = None,
                             t0: float = 0.0, rule: str = "reach", lambda_node: float = 1.0,
                             lambda_depth: float = 0.002, min_utility: float = 0.0, max_leaves: Optional[int] = None,
                             fill_below_threshold: bool = False, max_children: Optional[int] = None,
                             min_nodes: int = 0):
    """Return ``(pool_index [B, max_nodes+1] int64, num_selected [B] int32)``: kept pool nodes ascending, -1 padded.

    ``max_leaves``, ``fill_below_threshold``, ``max_children``, ``min_nodes``: the utility rule's options
    (:func:`utility_greedy`); their defaults give the rule as described."""
    B, N = parents.shape
    par = parents.detach().cpu().long()
    dep = depth.detach().cpu().long()
    nn_ = num_nodes.detach().cpu().long()
    lr = log_reach.detach().cpu().float()
    lat = latency.detach().cpu().double() if latency is not None else None
    pool_index = torch.full((B, max_nodes + 1), -1, dtype=torch.int64)
    num_selected = torch.zeros(B, dtype=torch.int32)
    eff = effective_reach(par, lr, nn_) if rule == "reach" else None
    for b in range(B):
        real = int(nn_[b])
        if rule == "reach":
            cand = list(range(1, real))
            cand.sort(key=lambda i: (-float(eff[b, i]), i))
            n = min(max_nodes, real - 1)
            if lat is not None:
                n = _throughput_size([eff[b, i] for i in cand], min(n, lat.shape[0] - 1), lat, t0)
            kept = sorted(cand[:n])
        elif rule == "utility":
            util = {i: math.exp(float(lr[b, i])) / (lambda_node + lambda_depth * int(dep[b, i])) for i in range(1, real)}
            kept = utility_greedy(util, [int(p) for p in par[b, :real]], max_nodes, min_utility, max_leaves,
                                  fill_below_threshold, max_children, min_nodes)
        else:
            raise ValueError(f"rule: expected 'reach' or 'utility', received {rule!r}")
        pool_index[b, 0] = 0
        pool_index[b, 1:1 + len(kept)] = torch.tensor(kept, dtype=torch.int64)
        num_selected[b] = len(kept)
    dev = parents.device
    return pool_index.to(dev), num_selected.to(dev)


def select_throughput_reference(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor,
                                log_reach: torch.Tensor, max_nodes: int, table: torch.Tensor, plain_seconds: float,
                                rows: int):
    """The batch throughput rule of :class:`taps.decode.policies.sizing.ThroughputSize`: tree sizes chosen jointly for
    the whole batch, each row's tree its best nodes by reach.

    Args:
        parents, depth: ``[B, N] int32`` pool trees (read for their shape only: the rule ranks by reach alone).
        num_nodes: ``[B] int32`` real nodes per row; nodes at index ``>= num_nodes[b]`` count as log reach -inf.
        log_reach: ``[B, N] float32`` log reach, **non-increasing along every path** (pool log-masses and scorer
            reach are: each edge adds a log-probability ``<= 0``), so a row's top-``n`` nodes are prefix-closed;
            the root column is not read; -inf where a node must not be kept (e.g. below a depth cap).
        max_nodes: per-row cap (``>= 0``); each row offers its best ``cap = min(max_nodes, N - 1)`` nodes.
        table: ``[L] float64`` seconds to verify the batch's roots plus ``k`` nodes in total (``L >= 1``;
            :func:`taps.decode.policies.gate.batch_table`), read as float64.
        plain_seconds: seconds of a plain (root-only) round of the batch (``> 0``).
        rows: running rows (the plain round makes ``rows`` tokens, so its rate is ``rows / plain_seconds``).
    Returns:
        ``(pool_index [B, max_nodes+1] int64, num_selected [B] int32, expected [B] float32)``: per row 0 then its
        kept pool nodes ascending, -1 padded; how many; ``1 +`` the sum of their reach.

    The rule (bit for bit the policies' former host implementation, kept as the oracle of
    tests/test_select_throughput.py): row b ranks its non-root nodes by ``(-log_reach, index)`` (float32 keys, a stable sort); its first
    ``cap`` are its candidates, reach ``exp`` of the key in float64 (torch's ``exp``: not always libm's
    last bit). Candidates of all rows are merged by ``(-reach, b * cap + rank)`` (ties: lower row, then lower
    rank), the batch keeps the first ``k*`` of ``K = min(B * cap, L - 1)``, ``k* = argmax_k S_k - cost_k`` with
    ``S_k`` the running float64 sum of the merged reaches, ``cost_k = (table[k] - table[0]) * (rows /
    plain_seconds)``, first maximum (the smaller batch tree on ties). For B = 1 the row's own rank order is the
    merged order (the host rule's one-row branch; the same list whenever ``exp`` is monotone). Row b keeps its
    first ``n_b`` candidates (``n_b`` = its entries among the first ``k*``); ``expected[b]`` rounds to float32
    ``1 +`` their reach summed in float64 in merged order.

    A candidate of log reach -inf is never written to ``pool_index`` (the policies dropped depth-capped nodes the
    same way, and padding is never a node): with a non-decreasing table (LatencyTable's always are) a reach-0
    node never raises the gain, so it is never among the first ``k*`` and ``num_selected`` is the host rule's
    size; a table that gets cheaper with more nodes can make the host rule count such nodes, and
    ``num_selected`` then counts only the written ones.
    """
    B, N = parents.shape
    if max_nodes < 0:
        raise ValueError(f"max_nodes: expected an int >= 0, received {max_nodes}")
    T = table.detach().cpu().to(torch.float64)
    if T.dim() != 1 or T.numel() < 1:
        raise ValueError(f"table: expected a non-empty 1-D tensor, received shape {tuple(T.shape)}")
    real = torch.arange(N)[None, :] < num_nodes.detach().cpu().long()[:, None]
    e = torch.where(real, log_reach.detach().cpu().float(), torch.tensor(float("-inf")))
    cap = max(0, min(max_nodes, N - 1))
    # one stable sort per row: rank order by (-reach, node index), as select_subtree's reach rule
    neg, order = torch.sort(-e[:, 1:], dim=1, stable=True)
    order = order[:, :cap] + 1  # [B, cap] candidate nodes in rank order
    reach = (-neg[:, :cap]).double().exp()  # [B, cap], non-increasing; -inf -> 0
    flat = reach.reshape(-1).tolist()
    if B == 1:
        merged = list(range(cap))
    else:
        merged = torch.sort(-reach.reshape(-1), stable=True).indices.tolist()  # ties: lower row, then lower rank
    K = min(B * cap, T.numel() - 1)
    cost = ((T - T[0]) * (rows / plain_seconds)).tolist()
    best_k, best, total = 0, 0.0 - cost[0], 0.0
    for j in range(1, K + 1):
        total += flat[merged[j - 1]]
        gain = total - cost[j]
        if gain > best:  # first maximum
            best_k, best = j, gain
    sizes = [0] * B
    mass = [0.0] * B
    for j in merged[:best_k]:
        sizes[j // cap] += 1
        mass[j // cap] += flat[j]
    pool_index = torch.full((B, max_nodes + 1), -1, dtype=torch.int64)
    num_selected = torch.zeros(B, dtype=torch.int32)
    pool_index[:, 0] = 0
    for b in range(B):
        kept = sorted(int(i) for i in order[b, :sizes[b]] if e[b, i] > float("-inf"))
        pool_index[b, 1:1 + len(kept)] = torch.tensor(kept, dtype=torch.int64)
        num_selected[b] = len(kept)
    expected = torch.tensor([1.0 + m for m in mass], dtype=torch.float64).float()
    dev = parents.device
    return pool_index.to(dev), num_selected.to(dev), expected.to(dev)


def reindex_subtree_reference(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                              num_nodes: torch.Tensor, pool_index: torch.Tensor, num_selected: torch.Tensor):
    """Gather the kept rows (``pool_index [B,M]`` ascending, -1 padded) into a re-indexed tree.

    Returns ``(tokens [B,M] int64, parents [B,M] int32, depth [B,M] int32, num_nodes [B] int32)``; torch ops
    only, so it runs on any device.
    """
    B, N = tokens.shape
    M = pool_index.shape[1]
    keep = pool_index >= 0
    src = pool_index.clamp(min=0)
    # Padding rows scatter into a spare column N that is dropped afterwards.
    slot = torch.where(keep, src, torch.full_like(src, N))
    new_of_old = torch.full((B, N + 1), -1, dtype=torch.int64, device=tokens.device)
    new_of_old.scatter_(1, slot, torch.arange(M, device=tokens.device).expand(B, M).contiguous())
    new_of_old = new_of_old[:, :N]
    old_parent = parents.long().gather(1, src)
    new_parent = torch.where(old_parent >= 0, new_of_old.gather(1, old_parent.clamp(min=0)), old_parent)
    out_tokens = torch.where(keep, tokens.gather(1, src), torch.zeros_like(src))
    out_parents = torch.where(keep, new_parent, torch.full_like(new_parent, -1)).to(torch.int32)
    kept_depth = depth.gather(1, src)
    out_depth = torch.where(keep, kept_depth, torch.zeros_like(kept_depth))
    return out_tokens, out_parents, out_depth, (num_selected + 1).to(torch.int32)
