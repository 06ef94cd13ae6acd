"""Batch-size sweeps (``taps bench --batch-size B`` / ``--batch-sizes 1,2,4,8,16``): every policy with B requests
at once.

Protocol per dataset and batch size ``B > 1``: each policy (AR first, the others in an order rotated by one
per batch size) gets its own :class:`taps.decode.BatchDecoder` with ``max_batch=B``, a short warm-up batch,
then ALL the prompts in order through continuous batching (a finished row is refilled from the queue between
rounds). A multi-turn item asks turn ``k`` in wave ``k``: the wave holds turn ``k`` of every item that has
one, each after its own earlier answers, so a request's later turn never waits on another request's answer
inside a wave. ``B = 1`` is the single-request protocol of ``taps bench`` (rotation across policies per
prompt); its summary becomes the B = 1 row.

Per (policy, B), the row of the summary's ``batch`` section:

* ``total_tokens_per_s``: all output tokens / wall time of the batch run (warm-up excluded; prefills,
  queueing and the drain at the end included). At B = 1: tokens / the policy's summed generation time.
* ``per_request_tokens_per_s_median``: median over requests of own tokens / own latency, a request's
  latency running from its admission (prefill) to its last token, summed over its turns (time queued
  before admission excluded).
* ``prefill_s``, ``decode_tokens_per_s``: the prefills' summed seconds (each prompt is prefilled alone while
  the other rows wait) and tokens / (wall - prefill_s), the rounds' own throughput.
* ``tau``: accepted tokens per round, root included, over every request's rounds.
* ``speedup``: total tokens/s / batched AR's total tokens/s at the same B (= AR time per token / policy
  time per token of the batch run).
* ``identical_to_ar``: requests whose tokens equal the B = 1 AR tokens (AR at the same B when B = 1 was
  not run); greedy runs only.
* ``latency_table``: for the throughput-rule policies (``taps``, ``ddtree-cost``), which table priced the
  batch's trees. The policy reads ``latency["batch_latency"][str(R)]`` for R running rows when ``taps
  calibrate`` measured it; otherwise (and for row counts not measured) it prices a verify by the total rows
  it runs, ``latency[R - 1 + n]`` of the one-row table, extended linearly past its end
  (:func:`taps.decode.policies.gate.batch_seconds`). ``$TAPS_LATENCY`` selects the table file.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

from taps.data import encode_prompt, stop_token_ids
from taps.decode.policies import policy_from_options

from . import BenchError
from .progress import Progress
from .suite import add_turn, prefix_reuse_asked


# --- one batch run --------------------------------------------------------------------------------------------------

def make_batch_decoder(model, tok, drafter, spec: str, batch_size: int, sampling, args=None):
    from taps.decode import BatchDecoder

    policy = policy_from_options(spec, args)
    try:
        return BatchDecoder(model, policy, drafter=drafter if policy.uses_drafter else None, sampling=sampling,
                            stop_token_ids=stop_token_ids(tok, model), max_batch=batch_size,
                            prefix_reuse=prefix_reuse_asked(args))
    except (FileNotFoundError, ValueError, KeyError, OSError) as e:
        raise BenchError(f"policy {spec}: {str(e).strip().splitlines()[0]}") from None


def latency_note(policy) -> Optional[str]:
    """Which latency table priced ``policy``'s batch trees (None: the policy reads none)."""
    from taps.decode.latency import LatencyTable

    lat = getattr(policy, "_latency", None)
    if not lat:
        return None
    lat = LatencyTable.of(lat)
    n = len(lat.latency) - 1
    rows = lat.measured_rows
    if rows:
        return f"one-row table to {n} nodes; batch tables measured for {rows} rows"
    return f"one-row table to {n} nodes, no batch tables: a verify priced by its total rows"


def _drive(dec, requests, on_tokens: Callable[[int], None]):
    """All ``requests`` through ``dec`` with continuous batching; results in request order."""
    dec.reset()
    ids = [dec.submit(r) for r in requests]
    while not dec.idle:
        dec.admit()
        if dec.running:
            on_tokens(sum(r.committed for r in dec.step().values()))
    results = dec.run()  # idle: returns the finished results at once
    return [results[i] for i in ids]


def run_batch(dec, tok, items, max_new_tokens: int, seed: int = 0, warmup: int = 1,
              progress: Optional[Progress] = None) -> List[dict]:
    """Every item through one :class:`BatchDecoder` (module docstring). Returns one record per item, in item
    order: :func:`taps.bench.suite.run_item`'s fields (per-turn ``seconds`` is the request's own latency) plus
    ``batch_size`` and ``batch_wall_s`` (the whole run's wall time)."""
    from taps.decode import Request

    warm = encode_prompt(tok, "Say hello.")
    for _ in range(warmup):
        dec.generate_batch([warm] * dec.max_batch, 8, seed=seed)
    recs = [{"id": it.id, "source": it.source, "turns": [], "new_tokens": 0, "seconds": 0.0, "rounds": 0,
             "accept_lens": [], "nodes": 0, "drafted_rounds": 0, "time_split": {}} for it in items]
    histories: List[List[dict]] = [[] for _ in items]
    tick = progress.update if progress is not None else (lambda n: None)
    t0 = time.perf_counter()
    for k in range(max((len(it.turns) for it in items), default=0)):
        wave = [i for i, it in enumerate(items) if len(it.turns) > k]
        reqs = [Request(encode_prompt(tok, items[i].turns[k], raw=items[i].raw, history=histories[i]),
                        max_new_tokens, None, seed + k) for i in wave]
        for i, req, res in zip(wave, reqs, _drive(dec, reqs, tick)):
            answer = tok.decode(res.token_ids, skip_special_tokens=True)
            add_turn(recs[i], len(req.prompt_ids), res, answer)
            histories[i] += [{"role": "user", "content": items[i].turns[k]}, {"role": "assistant", "content": answer}]
    wall = time.perf_counter() - t0
    for rec in recs:
        rec["tau"] = sum(rec["accept_lens"]) / len(rec["accept_lens"]) if rec["accept_lens"] else 0.0
        rec["tokens_per_s"] = rec["new_tokens"] / rec["seconds"] if rec["seconds"] > 0 else 0.0
        rec["batch_size"] = dec.max_batch
        rec["batch_wall_s"] = wall
    return recs


# --- summary --------------------------------------------------------------------------------------------------------

def batch_row(spec: str, batch_size: int, recs: List[dict], wall_s: float) -> dict:
    """The summary row of one (policy, B) run from its records (module docstring; ``speedup`` filled by
    :func:`add_speedups`)."""
    tokens = sum(r["new_tokens"] for r in recs)
    rounds = sum(r["rounds"] for r in recs)
    # prefills run alone between rounds (every other row waits), so the decode-only wall is the rest
    prefill = sum(r.get("time_split", {}).get("prefill", 0.0) for r in recs)
    accepted = sum(sum(r["accept_lens"]) for r in recs)
    flags = [r.get("identical_to_ar") for r in recs]
    return {"policy": spec, "batch_size": batch_size, "requests": len(recs), "new_tokens": tokens, "wall_s": wall_s,
            "total_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "prefill_s": prefill,
            "decode_tokens_per_s": tokens / (wall_s - prefill) if wall_s > prefill else None,
            "per_request_tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in recs) if recs else 0.0,
            "tau": accepted / rounds if rounds else None,
            "nodes_per_round": sum(r["nodes"] for r in recs) / rounds if rounds else None,
            "drafted_frac": sum(r["drafted_rounds"] for r in recs) / rounds if rounds else None,
            "identical_to_ar": None if None in flags else sum(bool(f) for f in flags),
            # mean over (request, round) of the batch round's stage times (prefill: per request, not a round)
            "stage_ms_per_round": {k: 1000 * sum(r.get("time_split", {}).get(k, 0.0) for r in recs) / rounds
                                   for k in sorted({k for r in recs for k in r.get("time_split", {})})
                                   if k != "prefill"} if rounds else {},
            "speedup": None}


def row_from_single(spec: str, recs: List[dict]) -> dict:
    """The B = 1 row from the single-request protocol's records (its wall time: the policy's summed time)."""
    return batch_row(spec, 1, recs, sum(r["seconds"] for r in recs))


def add_speedups(rows: List[dict]) -> None:
    """``speedup`` of every row: its total tokens/s over AR's at the same batch size (None without AR)."""
    ar = {r["batch_size"]: r["total_tokens_per_s"] for r in rows if r["policy"] == "ar"}
    for r in rows:
        base = ar.get(r["batch_size"])
        r["speedup"] = r["total_tokens_per_s"] / base if base else None


def mark_identical(recs: List[dict], reference: Optional[Dict[str, list]], greedy: bool) -> None:
    """``identical_to_ar`` of each record against ``{item id: [token ids per turn]}`` (None when sampled)."""
    for r in recs:
        toks = [t["token_ids"] for t in r["turns"]]
        r["identical_to_ar"] = (reference is not None and reference.get(r["id"]) == toks) if greedy else None


def format_batch_table(rows: List[dict]) -> str:
    head = (f"{'B':>3}  {'policy':<14}{'total tok/s':>12}{'req tok/s':>11}{'tau':>6}{'speedup':>9}{'nodes/rd':>9}"
            f"{'same as AR':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        nodes = f"{r['nodes_per_round']:.1f}" if r["nodes_per_round"] is not None else "-"
        same = f"{r['identical_to_ar']}/{r['requests']}" if r["identical_to_ar"] is not None else "(sampled)"
        lines.append(f"{r['batch_size']:>3}  {r['policy']:<14}{r['total_tokens_per_s']:>12.2f}"
                     f"{r['per_request_tokens_per_s_median']:>11.2f}{tau:>6}{sp:>9}{nodes:>9}{same:>12}")
    return "\n".join(lines)


def rotated(specs: List[str], k: int) -> List[str]:
    """AR first, then the other policies rotated by ``k``."""
    others = [s for s in specs if s != "ar"]
    k = k % max(len(others), 1)
    return (["ar"] if "ar" in specs else []) + others[k:] + others[:k]
