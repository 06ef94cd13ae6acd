"""Worker pool of the fuzz suite: subprocesses each run a batch of cases; crashes and hangs are pinned to a case.

A worker reports every case as it starts and as it ends (``worker.py``). When a worker dies (a signal: segfault,
abort) or stops making progress (no report for ``case_timeout`` seconds), the case it had started reruns alone in
a fresh process: if it kills that one too it is a ``CRASH``, if it times out again a ``HANG`` (a case that passes
alone keeps its own outcome). The batch's cases that had not started yet go back to the queue as a new batch.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
OUTCOMES = ("error", "agree", "unchecked", "DISAGREE", "UNCLEAN", "CRASH", "HANG")
FAILURES = ("DISAGREE", "UNCLEAN", "CRASH", "HANG")
STARTUP_S = 120.0  # importing torch + triton on a loaded 2-core machine


def _run_batch(ids: Sequence[str], case_timeout: float, env: Dict[str, str]):
    """-> ``(results {id: record}, ops {id: op}, failure or None, last started id)``."""
    results: Dict[str, dict] = {}
    ops: Dict[str, str] = {}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                env=env)
        proc.stdin.write(json.dumps(list(ids)).encode())
        proc.stdin.close()
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf, current = b"", None
        deadline = time.monotonic() + STARTUP_S
        failure = None
        fd = proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                proc.kill()
                failure = "HANG"
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # stray output of a library: not part of the protocol
                if "start" in rec:
                    current = rec["start"]
                    ops[current] = rec.get("op", "?")
                    deadline = time.monotonic() + case_timeout
                elif "id" in rec:
                    results[rec["id"]] = rec
                    current = None
        rc = proc.wait()
        sel.close()
        proc.stdout.close()
        if failure is None and (rc != 0 or len(results) < len(ids)):
            failure = "CRASH"
        err.seek(0)
        tail = err.read()[-600:].decode(errors="replace")
    if failure is not None:
        why = f"exit status {rc}" if failure == "CRASH" else f"no progress for {case_timeout:.0f} s"
        return results, ops, (failure, f"{why}; stderr: {tail.strip()[-400:]}"), current
    return results, ops, None, current


def run_cases(ids: Sequence[str], workers: int = 2, batches_per_worker: int = 3, case_timeout: float = 60.0,
              env_extra: Optional[Dict[str, str]] = None) -> Dict[str, dict]:
    """Run every case id; -> ``{id: {"op", "outcome", "detail"}}`` with CRASH / HANG pinned to single cases."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONHASHSEED="0", **(env_extra or {}))
    env.pop("TAPS_BACKEND", None)
    env.pop("TAPS_VALIDATE", None)
    n_batches = max(1, min(len(ids), workers * batches_per_worker))
    # Interleave so each batch gets a share of the slow (Triton, hypothesis) cases.
    batches: List[List[str]] = [list(ids[i::n_batches]) for i in range(n_batches)]
    queue = list(batches)
    lock = threading.Lock()
    out: Dict[str, dict] = {}

    def settle(batch: List[str], single: bool) -> None:
        results, ops, failure, current = _run_batch(batch, case_timeout, env)
        with lock:
            out.update(results)
        if failure is None:
            return
        missing = [i for i in batch if i not in results]
        if single or len(missing) == 1:
            case = missing[0]
            with lock:
                out[case] = {"id": case, "op": ops.get(case, case.split("|")[1]), "outcome": failure[0],
                             "detail": failure[1]}
            return
        # The case the worker had started is the suspect: it runs alone, so that a CRASH or HANG is pinned to it
        # (a case that passes alone is recorded with its own outcome); the cases not yet started run as a new batch.
        suspect = current if current in missing else missing[0]
        settle([suspect], single=True)
        rest = [i for i in missing if i != suspect]
        if rest:
            with lock:
                queue.append(rest)

    def work():
        while True:
            with lock:
                if not queue:
                    return
                batch = queue.pop(0)
            settle(batch, single=False)

    threads = [threading.Thread(target=work) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def counts_by_op(results: Dict[str, dict]) -> Dict[str, Dict[str, int]]:
    table: Dict[str, Counter] = defaultdict(Counter)
    for rec in results.values():
        table[rec["op"]][rec["outcome"]] += 1
    return {op: {o: table[op].get(o, 0) for o in OUTCOMES} for op in sorted(table)}


def format_counts(counts: Dict[str, Dict[str, int]]) -> str:
    head = f"{'op':<26}" + "".join(f"{o:>10}" for o in OUTCOMES)
    rows = [head, "-" * len(head)]
    total = Counter()
    for op, c in counts.items():
        rows.append(f"{op:<26}" + "".join(f"{c[o]:>10}" for o in OUTCOMES))
        total.update(c)
    rows.append("-" * len(head))
    rows.append(f"{'total':<26}" + "".join(f"{total.get(o, 0):>10}" for o in OUTCOMES))
    return "\n".join(rows)


def failures(results: Dict[str, dict]) -> List[Tuple[str, str, str]]:
    return sorted((r["outcome"], cid, r["detail"]) for cid, r in results.items() if r["outcome"] in FAILURES)
