"""Verify-latency tables for the throughput rule: ``latency[n]`` = seconds for one target forward over
root + ``n`` tree nodes on top of a cache, and ``t0`` = the fixed per-round time outside verification.

Measured on the current machine (``taps calibrate``), never assumed (METHOD.md section 6), and
cached as JSON per machine and model under ``$TAPS_CACHE/latency/`` (default ``~/.cache/taps``).

Procedure: prefill ``prefix_len`` random tokens; for each ``n`` of a grid (every ``n <= 16``, then every
4th up to 64, every 16th beyond) run the same verification the decode loop runs
(:class:`taps.decode.verifier.TargetVerifier`, hidden states requested when a drafter reads them) over a
random tree of ``n`` non-root nodes, crop the cache back; the grid is swept ``repeats`` times after one
warm-up sweep (so a machine whose speed drifts shifts every point alike), and each point keeps its median.
The table is interpolated linearly between grid points and made non-decreasing (isotonic fit,
pool-adjacent-violators), since noise on a shared machine can invert neighbours. ``t0`` is the median
time of a drafter pass plus the drafter's context update (0 without a drafter), each timed right after a
target step as decoding runs them (:func:`measure_draft_time`); each policy adds its own measured
pool/score/select overhead on top. ``t0`` belongs to one drafter shape (:func:`drafter_key`: layers, width,
body and head, block, draft vocabulary): :func:`get_table` re-measures it alone, in about a second, when a
cached table was made with another drafter, so a faster drafter is never costed as the old one (the verify
table, the slow part, depends on the target only). The whole table is measured again when the compiled kernels
changed (:func:`kernels_build`): a faster kernel is a new cost curve, which an old table would misprice.

Batch tables (``batch_sizes``, ``taps calibrate --batch-sizes``): for ``R`` rows, ``batch_latency[R][n]`` = seconds
of one verify of ``R`` rows (prefixes of ``prefix_len`` tokens) holding ``n`` non-root nodes in total, spread as
evenly as the rows allow and padded to the largest row, exactly as the batched loop runs it. Measured on a
coarser grid (multiples of ``R``) and interpolated like the one-row table.

This module sits below the decode loop (the throughput-rule policies read the table); the scorer's
training and evaluation code imports it from here.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from taps_kernels import Tree

from ..paths import cache_root


def cpu_name() -> str:
    """The CPU's model name, family / model numbers and widest int8 vector unit (``/proc/cpuinfo``), e.g.
    ``AMD EPYC (family 25, model 17; avx512_vnni)``: virtual machines report one model name for CPU
    generations as different as AVX2-only and AVX-512 parts. The platform's word where that file is missing."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    unit = next((u for u in ("amx_int8", "avx512_vnni", "avx_vnni", "avx2") if u in flags), "no avx2")
    return f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}; {unit})"


def machine_key(device: Optional[torch.device] = None) -> str:
    """CPU model, core count and torch threads (plus the GPU name on CUDA): what the latency depends on."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return f"cuda-{torch.cuda.get_device_name(dev)}"
    return f"cpu-{cpu_name()}-{os.cpu_count()}cores-{torch.get_num_threads()}threads"


def model_key(model) -> str:
    """Name (basename of ``name_or_path``), layers, width, dtype and linear kernel of the target (the GGUF
    target: its format, activation digits and KV cache dtype)."""
    from taps_kernels.integrations.rows_linear import RowsLinear

    cfg = model.config
    name = Path(str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "model"))).name or "model"
    if getattr(model, "format", None) == "gguf":  # the block forward: its own cost curve
        kv = str(model.kv_dtype).replace("torch.", "")
        digits = "-a16" if model.activation_digits == 2 else ""  # twice the integer work: another curve
        return f"{name}-L{cfg.num_hidden_layers}-H{cfg.hidden_size}-gguf{digits}-kv{kv}"
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    # the few-row kernel changes the verify cost per node count: its tables are kept apart
    linear = "-rowslinear" if any(isinstance(m, RowsLinear) for m in model.modules()) else ""
    return f"{name}-L{cfg.num_hidden_layers}-H{cfg.hidden_size}-{dtype}{linear}"


@functools.lru_cache(maxsize=None)
def kernels_build() -> str:
    """The compiled extension's fingerprint (its file's sha256, 16 hex digits; ``"none"`` without it): a rebuilt
    kernel may run at another speed, so a table keeps the build it was measured with."""
    try:
        from taps_kernels import _C
    except ImportError:
        return "none"
    return hashlib.sha256(Path(_C.__file__).read_bytes()).hexdigest()[:16]


def drafter_key(drafter) -> str:
    """What one draft pass's time depends on: layers, width, block, body (``blocks`` for the GGUF block body, else
    its dtype) and head format, draft vocabulary."""
    c = drafter.config
    block = getattr(drafter, "block_draft", None)
    if block is not None:  # its torch parameters' dtype says nothing of how it drafts
        body, head = "blocks", block.head_format
    else:
        body = str(next(drafter.parameters()).dtype).replace("torch.", "")
        head = str(getattr(drafter, "head_dtype", None) or body).replace("torch.", "")
    vocab = getattr(c, "draft_vocab_size", None) or c.vocab_size
    short = "-short" if getattr(drafter, "short_blocks", False) else ""
    return f"L{c.num_hidden_layers}-H{c.hidden_size}-B{c.block_size}-{body}-head{head}-V{vocab}{short}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:180]


def cache_path(machine: str, model: str, root: Optional[Path] = None) -> Path:
    return (root or cache_root()) / "latency" / f"{_slug(model)}__{_slug(machine)}.json"


def default_grid(n_max: int) -> List[int]:
    """``0..16``, every 4th to 64, every 16th beyond, and ``n_max`` itself (all ``<= n_max``)."""
    g = set(range(0, min(n_max, 16) + 1))
    g.update(range(20, min(n_max, 64) + 1, 4))
    g.update(range(80, n_max + 1, 16))
    g.add(n_max)
    return sorted(g)


def isotonic(values: List[float]) -> List[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    out = []
    for m, c in blocks:
        out += [m] * c
    return out


def interpolate(points: Dict[int, float], n_max: int) -> List[float]:
    """Linear interpolation of ``{n: seconds}`` onto ``n = 0..n_max`` (flat beyond the ends)."""
    xs = sorted(points)
    out = []
    for n in range(n_max + 1):
        if n <= xs[0]:
            out.append(points[xs[0]])
        elif n >= xs[-1]:
            out.append(points[xs[-1]])
        else:
            j = next(i for i, x in enumerate(xs) if x >= n)
            x0, x1 = xs[j - 1], xs[j]
            w = (n - x0) / (x1 - x0)
            out.append(points[x0] * (1 - w) + points[x1] * w)
    return out


def random_tree(n: int, vocab: int, gen: torch.Generator, device=None) -> Tree:
    """Batch-1 tree of root + ``n`` nodes: node ``i`` hangs under a random earlier node, depth <= 15."""
    parents, depth = [-1], [0]
    for i in range(1, n + 1):
        while True:
            p = int(torch.randint(0, i, (1,), generator=gen))
            if depth[p] < 15:
                break
        parents.append(p)
        depth.append(depth[p] + 1)
    tokens = torch.randint(0, vocab, (1, n + 1), generator=gen)
    return Tree(tokens.to(device), torch.tensor([parents], dtype=torch.int32, device=device),
                torch.tensor([depth], dtype=torch.int32, device=device),
                torch.tensor([n + 1], dtype=torch.int32, device=device))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_latency(model, n_max: int = 64, prefix_len: int = 256, repeats: int = 3, drafter=None,
                    grid: Optional[List[int]] = None, seed: int = 0, progress: bool = False,
                    batch_sizes: Optional[List[int]] = None) -> dict:
    """Measure the table on this machine (see the module docstring).

    Returns a dict: ``latency`` (``n_max + 1`` seconds, non-decreasing, index = non-root nodes),
    ``raw`` (``{n: median seconds}`` at the grid points), ``t0`` (seconds), ``t0_parts``, ``prefix_len``,
    ``repeats``, ``machine``, ``model``, ``kernels_build``, ``created``.
    """
    from .verifier import make_verifier

    if n_max < 0:
        raise ValueError(f"n_max: expected >= 0, received {n_max}")
    device = next(model.parameters()).device
    layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else None
    ver = make_verifier(model, layer_ids)
    gen = torch.Generator().manual_seed(seed)
    V = int(model.config.vocab_size)
    prompt = torch.randint(0, V, (1, prefix_len), generator=gen)
    _, feats = ver.prefill(prompt)
    grid = sorted(set(grid)) if grid is not None else default_grid(n_max)
    trees = {n: random_tree(n, V, gen, device) for n in grid}

    def verify_seconds(n: int) -> float:
        _sync(device)
        t = time.perf_counter()
        ver.verify(trees[n])
        _sync(device)
        dt = time.perf_counter() - t
        ver.crop(prefix_len)
        return dt

    raw = {n: statistics.median(ts) for n, ts in _interleaved(grid, repeats, verify_seconds, progress).items()}
    table = isotonic(interpolate(raw, n_max))
    t0_parts = measure_draft_time(model, drafter, ver, prompt, feats, repeats) if drafter is not None else {}
    batch = {}
    for rows in sorted(set(int(b) for b in (batch_sizes or []) if int(b) > 1)):
        batch[str(rows)] = measure_batch_latency(model, rows, n_max, prefix_len, repeats, layer_ids, seed)
    out_batch = {"batch_latency": batch} if batch else {}
    return {"latency": table, "raw": {str(k): v for k, v in raw.items()}, "t0": _full_round(t0_parts), **out_batch,
            "t0_parts": t0_parts, "drafter": drafter_key(drafter) if drafter is not None else None,
            "prefix_len": prefix_len, "repeats": repeats, "n_max": n_max,
            "machine": machine_key(device), "model": model_key(model), "device": str(device),
            "kernels_build": kernels_build(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


@torch.inference_mode()
def measure_batch_latency(model, rows: int, n_max: int, prefix_len: int = 256, repeats: int = 3,
                          feature_layer_ids=None, seed: int = 0) -> List[float]:
    """``[rows * n_max + 1]`` seconds: one verify of ``rows`` rows holding ``n`` non-root nodes in total
    (module docstring), non-decreasing."""
    from .tree_ops import pad_tree
    from .verifier import make_verifier

    if rows < 1:
        raise ValueError(f"rows: expected >= 1, received {rows}")
    device = next(model.parameters()).device
    ver = make_verifier(model, feature_layer_ids, max_batch=rows)
    ver.reset(rows, prefix_len + n_max + 2)
    gen = torch.Generator().manual_seed(seed)
    V = int(model.config.vocab_size)
    for r in range(rows):
        ver.prefill_row(r, torch.randint(0, V, (prefix_len,), generator=gen).tolist())
    total = rows * n_max
    grid = sorted(set(range(0, total + 1, rows)) | {total})
    batch_trees = {}
    for n in grid:
        per = [n // rows + (1 if r < n % rows else 0) for r in range(rows)]
        trees = [random_tree(k, V, gen, device) for k in per]
        width = max(per) + 1
        trees = [pad_tree(t, width) for t in trees]
        batch_trees[n] = Tree(*(torch.cat([getattr(t, f) for t in trees])
                                for f in ("tokens", "parents", "depth", "num_nodes")))

    def verify_seconds(n: int) -> float:
        _sync(device)
        t = time.perf_counter()
        ver.verify_batch(batch_trees[n], rows)
        _sync(device)
        return time.perf_counter() - t

    raw = {n: statistics.median(ts) for n, ts in _interleaved(grid, repeats, verify_seconds).items()}
    return isotonic(interpolate(raw, total))


def _interleaved(grid: List[int], repeats: int, seconds_of, progress: bool = False) -> Dict[int, List[float]]:
    """``{n: [repeats timings]}`` of ``seconds_of(n)`` for every grid point, the grid swept once per repeat after
    one warm-up sweep: a machine whose speed drifts during the calibration (shared cores) then shifts every point
    alike instead of bending the curve's shape (measured point by point, a table's small trees could come from a
    fast minute and its large ones from a slow one)."""
    sweeps = range(repeats + 1)
    if progress:
        from tqdm import tqdm
        sweeps = tqdm(sweeps, desc="calibrate", unit="sweep")
    times: Dict[int, List[float]] = {n: [] for n in grid}
    for r in sweeps:
        for n in grid:
            dt = seconds_of(n)
            if r:
                times[n].append(dt)
    return times


#: How :func:`measure_draft_time` times a draft (``t0_parts["timed"]``): a cached table timed otherwise gets its
#: ``t0`` measured again.
T0_TIMING = "after a target step"


@torch.inference_mode()
def measure_draft_time(model, drafter, ver=None, prompt=None, feats=None, repeats: int = 3,
                       prefix_len: int = 256, seed: int = 0) -> Dict[str, object]:
    """``{"draft", "context", "draft_by_positions"}``: median seconds of one draft pass projecting all block
    positions over a context of ``prefix_len`` tokens, of appending 4 accepted tokens' features to the drafter's
    context and projecting them (what a drafted round pays; the rounds between drafts only keep them), and ``[D]``
    seconds of a pass projecting only positions ``1..P`` (index ``P-1``, non-decreasing; what a policy with a depth
    cap pays). Prefills its own random prompt unless the caller's verifier (``ver``, ``prompt [1, S]``, ``feats``)
    is given.

    Each timed call follows a target step (a verify of the root), as in decoding, where a round's context update
    and draft come right after the previous round's verify: the target's weights have streamed through the
    caches since the drafter last ran. Timed back to back instead, the drafter's weights stay cached and the
    figure is what decoding never sees (the GGUF target on the AMX Xeon, one thread: 1.2 ms a draft back to back,
    2.4-2.6 ms per drafted round in the full sets)."""
    device = next(model.parameters()).device
    if ver is None:
        from .verifier import make_verifier

        ver = make_verifier(model, list(drafter.config.target_layer_ids))
        prompt = torch.randint(0, int(model.config.vocab_size), (1, prefix_len),
                               generator=torch.Generator().manual_seed(seed))
        _, feats = ver.prefill(prompt)
    prefix_len = prompt.shape[1]
    state = drafter.new_state(1)
    drafter.append_context(state, feats)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    bonus = prompt[:, -1].to(device)
    D = drafter.config.block_size - 1

    root = random_tree(0, int(model.config.vocab_size), torch.Generator().manual_seed(seed), device)

    def timed(fn):
        ver.verify(root)  # the target step before it, as in decoding (docstring)
        ver.crop(prefix_len)
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t

    dts, cts = {P: [] for P in range(1, D + 1)}, []
    for r in range(repeats + 1):  # positions interleaved within each repeat: drift and warm-up hit all alike
        for P in dts:
            dt = timed(lambda: drafter.draft(state, bonus, embed, head, num_positions=P, full_vocab_logits=False))
            if r:
                dts[P].append(dt)
        ct = timed(lambda: drafter.flush_context(drafter.append_context(state, feats[:, :4])))
        drafter.rollback(state, prefix_len)
        if r:
            cts.append(ct)
    by_positions = isotonic([statistics.median(dts[P]) for P in dts])
    return {"draft": by_positions[-1], "context": statistics.median(cts), "draft_by_positions": by_positions,
            "timed": T0_TIMING}


def _full_round(parts: dict) -> float:
    """``t0``: a draft projecting every block position plus the context update (0 without a drafter)."""
    return parts["draft"] + parts["context"] if parts else 0.0


class LatencyTable:
    """A measured verify-latency table: the JSON record ``taps calibrate`` writes (:func:`measure_latency`),
    with the ONE way to read a cost from it.

    Record fields read here: ``latency`` (``[L]`` seconds, ``latency[n]`` = one verify of one row's root + ``n``
    nodes), ``batch_latency`` (optional ``{str(R): [R*n_max + 1] seconds}``: R rows holding ``n`` nodes in
    total), ``t0`` (seconds of a drafted round outside the verify), ``t0_parts`` (``draft``, ``context``,
    ``draft_by_positions [D]``). Other fields ride along unchanged (:meth:`to_dict`).

    **Cost at (rows, nodes)** (:meth:`seconds`): from ``batch_latency[R]`` when measured for ``R = rows > 1``;
    otherwise the one-row table by total verified rows, ``latency[rows - 1 + nodes]`` (the CPU model: a
    verify's cost follows the rows it runs, whichever request they belong to). Fractional ``nodes`` (a mean
    per round) interpolate linearly; below 0 the cost at 0.

    **Past the table's end** (one rule for every reader): linear, with the mean slope over the measured range
    ``max((t[-1] - t[0]) / (L - 1), 0)``, not the last step: a table often ends flat (two equal timings at
    its largest sizes), and a zero slope would price every node past the end as free. This was the rule of
    the policies' batch tables; the projection report used to hold the last value and the GPU benchmark
    the last segment's slope, and both follow this rule now.
    """

    def __init__(self, record: dict):
        lat = record.get("latency") if isinstance(record, dict) else None
        if not isinstance(lat, list) or not lat or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x == x for x in lat):
            raise ValueError("latency table: expected a non-empty 'latency' list of seconds, received "
                             f"{type(lat).__name__ if not isinstance(lat, list) else lat[:4]}")
        self.record = dict(record)
        self.record.setdefault("t0", 0.0)
        self.latency: List[float] = [float(x) for x in lat]

    @classmethod
    def of(cls, table) -> "LatencyTable":
        """``table`` itself when it is a :class:`LatencyTable`, else the table of a record dict."""
        return table if isinstance(table, cls) else cls(table)

    @classmethod
    def from_points(cls, points: Dict[int, float], **fields) -> "LatencyTable":
        """A one-row table from sparse ``{n: seconds}`` measurements: made non-decreasing (:func:`isotonic`, noise
        can invert neighbours), then linear in between (:func:`interpolate`); ``fields`` join the record."""
        xs = sorted(points)
        if not xs or xs[0] < 0:
            raise ValueError(f"points: expected measurements at node counts >= 0, received {xs}")
        ys = isotonic([float(points[x]) for x in xs])
        return cls({"latency": interpolate(dict(zip(xs, ys)), xs[-1]), **fields})  # flat below the first point

    @classmethod
    def load(cls, path) -> "LatencyTable":
        """Read a table JSON (``latency`` must be a non-empty list of finite seconds)."""
        p = Path(path)
        try:
            return cls(json.loads(p.read_text(encoding="utf-8")))
        except ValueError as exc:
            raise ValueError(f"latency table {p}: {exc}") from None

    def save(self, path: Optional[Path] = None) -> Path:
        """Write the record as JSON (default: the cache path of its ``machine`` and ``model``), atomically."""
        p = Path(path) if path else cache_path(self.record["machine"], self.record["model"])
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")  # two processes may save the same table at once
        tmp.write_text(json.dumps(self.record, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, p)
        return p

    def to_dict(self) -> dict:
        return dict(self.record)

    @property
    def t0(self) -> float:
        return float(self.record.get("t0", 0.0))

    @property
    def measured_rows(self) -> List[int]:
        """Row counts ``R > 1`` with a measured ``batch_latency`` table, ascending."""
        return sorted(int(k) for k, v in (self.record.get("batch_latency") or {}).items() if v)

    def _base(self, rows: int):
        """``(seconds list, offset)``: the curve a ``rows``-row verify reads and where ``n = 0`` sits on it."""
        measured = (self.record.get("batch_latency") or {}).get(str(rows)) if rows > 1 else None
        if measured:
            return [float(x) for x in measured], 0
        return self.latency, rows - 1

    @staticmethod
    def _at(base: List[float], x: float) -> float:
        """``base`` at ``x >= 0``: linear between points, the mean-slope rule past the end."""
        last = len(base) - 1
        if x > last:
            slope = max((base[-1] - base[0]) / last, 0.0) if last > 0 else 0.0
            return base[-1] + slope * (x - last)
        lo = int(x)
        w = x - lo
        return base[lo] if w == 0 else base[lo] * (1 - w) + base[lo + 1] * w

    def seconds(self, rows: int, nodes: float) -> float:
        """Seconds of one verify of ``rows`` roots plus ``nodes`` tree nodes in total (class docstring)."""
        if rows < 1:
            raise ValueError(f"rows: expected >= 1, received {rows}")
        base, offset = self._base(int(rows))
        return self._at(base, max(float(nodes), 0.0) + offset)

    def batch_seconds(self, rows: int, n_total: int) -> List[float]:
        """``[n_total + 1]`` host floats: :meth:`seconds` at ``nodes = 0..n_total``."""
        if rows < 1:
            raise ValueError(f"rows: expected >= 1, received {rows}")
        base, offset = self._base(int(rows))
        return [self._at(base, n + offset) for n in range(int(n_total) + 1)]

    def round_seconds(self, positions: Optional[int] = None) -> float:
        """The fixed seconds of a drafted round: the draft pass (projecting ``positions`` block positions;
        default all) plus the context update, from ``t0_parts`` (``t0`` when they are absent)."""
        parts = self.record.get("t0_parts") or {}
        by_positions = parts.get("draft_by_positions")
        if positions is None or not by_positions:
            return self.t0
        i = min(max(int(positions), 1), len(by_positions)) - 1
        return float(by_positions[i]) + float(parts.get("context", 0.0))

    def plain_round_seconds(self, rows: int = 1) -> float:
        """Seconds of a plain (root-only, undrafted) round of ``rows`` rows: their verify. The drafter's context
        update is not in it: such a round keeps its features, and the next drafted round projects them
        (:meth:`round_seconds` counts it there)."""
        return self.seconds(rows, 0)


def round_seconds(latency, positions: Optional[int] = None) -> float:
    """:meth:`LatencyTable.round_seconds` of a table (or its record dict)."""
    return LatencyTable.of(latency).round_seconds(positions)


def save_table(table, path: Optional[Path] = None) -> Path:
    """:meth:`LatencyTable.save` of a table (or its record dict)."""
    return LatencyTable.of(table).save(path)


def load_table(path) -> dict:
    """The record dict of :meth:`LatencyTable.load` (``t0`` defaults to 0)."""
    return LatencyTable.load(path).to_dict()


def get_table(model, drafter=None, n_max: int = 64, path=None, recalibrate: bool = False,
              repeats: int = 2, batch_sizes: Optional[List[int]] = None) -> dict:
    """The cached table for this machine and model (``$TAPS_LATENCY`` or ``path`` overrides the cache
    location); measured now and cached when missing or shorter than ``n_max + 1``. A cached table whose
    ``t0`` was measured with another drafter (:func:`drafter_key`) or timed another way (:data:`T0_TIMING`) gets
    ``t0`` re-measured and saved, and one measured with other compiled kernels (:func:`kernels_build`) is measured
    again; an explicit table (``path``/``$TAPS_LATENCY``) is used as it is."""
    path = path or os.environ.get("TAPS_LATENCY")
    device = next(model.parameters()).device
    p = Path(path) if path else cache_path(machine_key(device), model_key(model))
    if p.is_file() and not recalibrate:
        t = load_table(p)
        if path:
            return t
        if len(t["latency"]) >= n_max + 1 and t.get("kernels_build") == kernels_build():
            if drafter is not None and (t.get("drafter") != drafter_key(drafter)
                                        or t.get("t0_parts", {}).get("timed") != T0_TIMING):
                t["t0_parts"] = measure_draft_time(model, drafter, repeats=max(repeats, 5))
                t["t0"], t["drafter"] = _full_round(t["t0_parts"]), drafter_key(drafter)
                save_table(t, p)
            return t
    t = measure_latency(model, n_max=n_max, drafter=drafter, repeats=repeats, batch_sizes=batch_sizes)
    save_table(t, p)
    return t
