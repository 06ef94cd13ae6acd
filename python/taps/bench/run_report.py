"""``taps report``: markdown tables, the "must show" checks and plots from ``taps bench`` JSON.

Plots (PNG, matplotlib Agg): throughput against tau (the paper's first figure, one point per policy,
DDTree budgets joined), speedup and tau against the DDTree budget (other policies as horizontal
lines), and the acceptance-length histogram of DFlash / best DDTree / TAPS.

Projection mode (``projection``: a latency table JSON measured on a GPU with ``taps calibrate``):
projected tokens/s of a policy = ``tau / (t0 + latency[nodes per round - 1])`` with the measured tau
and nodes per round of this run; it is labelled as a projection everywhere it appears.
"""
from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

from taps.bench.summary import decode_speedup
from taps.decode.stats import SPLIT_HEADER, SPLIT_STAGES
from taps.paths import portable_command, portable_path

TARGETS = {"tau_vs_ddtree_same_budget": 1.07, "tps_vs_dflash": 1.3, "tps_vs_best_ddtree": 1.15, "ar_vs_hf": 1.0}
#: TAPS over plain decoding, per dataset (code accepts longer drafts than chat)
TAPS_VS_AR = {"humaneval": 1.4, "mtbench": 1.15}
#: The TAPS rows the targets are checked for, and their names in the report.
TAPS_ROWS = {"taps": "TAPS", "taps-lookup": "TAPS with prompt lookup (taps-lookup)"}
#: most milliseconds one draft pass may take on the benchmark machine (one thread)
DRAFT_MS_PER_DRAFTED_ROUND = 8.0



def _save_figure(fig, path: Path) -> Path:
    """Lay out, write (PNG, 110 dpi) and close ``fig``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def _lat(table, n: float) -> float:
    """One-row verify seconds at (fractional) ``n`` nodes: the table's one rule (:class:`LatencyTable`)."""
    from taps.decode.latency import LatencyTable

    return LatencyTable.of(table).seconds(1, n)


def projected_tps(summary: dict, table: dict) -> Optional[float]:
    tau, nodes = summary.get("tau"), summary.get("nodes_per_round")
    if not tau or not nodes:
        return None
    return tau / (float(table.get("t0", 0.0)) + _lat(table, nodes - 1))


def policy_table(run: dict, projection: Optional[dict] = None) -> List[str]:
    pol = run["policies"]
    best = run.get("best_ddtree")
    head = ("| policy | tau | nodes/round | rounds drafted % | tok/s (median) | speedup vs AR | "
            "speedup vs AR, decode only | selection overhead ms/round | "
            "draft ms/round (load probe) | "
            f"{SPLIT_HEADER} | identical to AR |")
    if projection:
        head += " PROJECTED tok/s (GPU latency table) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for spec, s in pol.items():
        frac = s.get("time_split_frac", {})
        split = "/".join(f"{100 * frac.get(k, 0.0):.0f}" for k in SPLIT_STAGES) if s.get("rounds") else "-"
        name = f"{spec} (oracle best DDTree)" if spec == best else spec
        # At temperature > 0 a different random stream gives different (equally valid) text.
        same = f"{s.get('identical_to_ar')}/{s.get('prompts')}" if run["temperature"] == 0 else "n/a (sampled)"
        drafted = s.get("drafted_frac")
        row = (f"| {name} | {_fmt(s.get('tau'))} | {_fmt(s.get('nodes_per_round'), '.1f')} | "
               f"{_fmt(None if drafted is None else 100 * drafted, '.0f')} | {_fmt(s.get('tokens_per_s_median'))} | {_fmt(s.get('speedup'), '.2f')}x | "
               f"{_fmt(decode_speedup(pol, spec), '.2f')}x | {_fmt(s.get('selection_overhead_ms_per_round'), '.2f')} | "
               f"{_fmt((s.get('stage_ms_per_round') or {}).get('draft'), '.0f')} | {split} | "
               f"{same} |")
        if projection:
            row += f" {_fmt(projected_tps(s, projection), '.1f')} |"
        lines.append(row)
    return lines


def check_targets(run: dict) -> List[dict]:
    """The benchmark's "must show" checks on one greedy run: each ``{name, value, target, met, detail}``."""
    pol = run["policies"]
    out = []
    fixed = {k: v for k, v in pol.items() if k.startswith("taps-fixed:")}
    for k, v in fixed.items():
        b = k.split(":", 1)[1]
        dd = pol.get(f"ddtree:{b}")
        if dd and v.get("tau") and dd.get("tau"):
            r = v["tau"] / dd["tau"]
            out.append({"name": f"TAPS tau / DDTree tau at {b} nodes ({k} vs ddtree:{b})", "value": r,
                        "target": TARGETS["tau_vs_ddtree_same_budget"], "met": r >= TARGETS["tau_vs_ddtree_same_budget"]})
    for spec, name in TAPS_ROWS.items():
        taps = pol.get(spec)
        if not taps:
            continue
        best = run.get("best_ddtree")
        rivals = [("AR", pol.get("ar"), TAPS_VS_AR.get(run.get("dataset"))),
                  ("DFlash", pol.get("dflash"), TARGETS["tps_vs_dflash"]),
                  (f"best fixed-budget DDTree ({best})", pol.get(best) if best else None, TARGETS["tps_vs_best_ddtree"])]
        for label, rival, want in rivals:
            if not rival or want is None:
                continue
            # per-prompt median tok/s, the aggregate (total time per token, the protocol's speedup), and the
            # aggregate without the prefills (the same work for every policy: what speculation can speed up)
            for stat, key in (("median tok/s", "tokens_per_s_median"), ("aggregate tok/s", "speedup"),
                              ("decode-only tok/s", "decode_tokens_per_s")):
                if taps.get(key) and rival.get(key):
                    r = taps[key] / rival[key]
                    out.append({"name": f"{name} / {label}, {stat}", "value": r, "target": want, "met": r >= want})
        draft_ms, drafted = (taps.get("stage_ms_per_round") or {}).get("draft"), taps.get("drafted_frac")
        if draft_ms and drafted:
            per = draft_ms / drafted  # rounds that skip the drafter would flatter a per-round mean
            out.append({"name": f"{name} draft ms per drafted round (one thread)", "value": per,
                        "target": DRAFT_MS_PER_DRAFTED_ROUND, "cmp": "<=", "met": per <= DRAFT_MS_PER_DRAFTED_ROUND})
    hf, ar = pol.get("hf"), pol.get("ar")
    if hf and ar and hf.get("speedup"):
        # hf's speedup is AR time per token / HF time per token: its inverse is how much faster our AR is.
        r = 1.0 / hf["speedup"]
        out.append({"name": "AR policy speed / HF generate speed (time per token, same prompts)", "value": r,
                    "target": TARGETS["ar_vs_hf"], "met": r >= TARGETS["ar_vs_hf"]})
    same = all(s.get("identical_to_ar") == s.get("prompts") for s in pol.values())
    # the HF rows (plain greedy generate, prompt-lookup decoding "hf-pld:N") are checked against AR like any policy
    with_hf = any(_is_hf_row(k) for k in pol)
    out.append({"name": "lossless: every output identical to AR (temperature 0)" + (", HF generate included" if with_hf else ""),
                "value": None, "target": None,
                "met": same})
    return out


def _is_hf_row(policy: str) -> bool:
    """The HF baseline rows: plain greedy ``generate`` (``"hf"``) and prompt-lookup decoding (``"hf-pld:N"``)."""
    return policy == "hf" or policy.startswith("hf-pld:")


def _drafted(run: dict) -> bool:
    """Whether a run holds a drafted policy (not only AR and HF baselines): only those are plotted."""
    return any(p != "ar" and not _is_hf_row(p) for p in run["policies"])


def _plots(runs: List[dict], prefix: str) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    greedy = [r for r in runs if r["temperature"] == 0.0]
    paths = []
    if not greedy:
        return paths
    # 1. throughput against tau
    fig, axes = plt.subplots(1, len(greedy), figsize=(6 * len(greedy), 4.5), squeeze=False)
    for ax, run in zip(axes[0], greedy):
        pol = run["policies"]
        dd = sorted((int(k.split(":")[1]), v) for k, v in pol.items() if k.startswith("ddtree:"))
        if dd:
            ax.plot([v["tau"] for _, v in dd], [v["tokens_per_s_median"] for _, v in dd], "o-", color="tab:blue",
                    label="DDTree (budgets)")
            for b, v in dd:
                ax.annotate(str(b), (v["tau"], v["tokens_per_s_median"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        for spec, v in pol.items():
            if spec.startswith("ddtree:") or v.get("tau") is None:
                continue
            ax.plot([v["tau"]], [v["tokens_per_s_median"]], "*" if spec.startswith("taps") else "s", markersize=10,
                    label=spec)
        ax.set_xlabel("tau (tokens per round)")
        ax.set_ylabel("tokens/s (median)")
        ax.set_title(f"{run['dataset']} (T=0, {run['prompts']} prompts)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(_save_figure(fig, Path(f"{prefix}_throughput_vs_tau.png")))
    # 2. speedup and tau against budget
    fig, axes = plt.subplots(2, len(greedy), figsize=(6 * len(greedy), 7), squeeze=False)
    for j, run in enumerate(greedy):
        pol = run["policies"]
        dd = sorted((int(k.split(":")[1]), v) for k, v in pol.items() if k.startswith("ddtree:"))
        for i, key in enumerate(("speedup", "tau")):
            ax = axes[i][j]
            if dd:
                ax.plot([b for b, _ in dd], [v[key] for _, v in dd], "o-", label="DDTree(budget)")
            others = [s for s, v in pol.items() if not s.startswith("ddtree:") and s != "ar" and v.get(key) is not None]
            for c, spec in enumerate(others):
                ax.axhline(pol[spec][key], linestyle="--", linewidth=1.2, label=spec, color=f"C{c + 1}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("node budget")
            ax.set_ylabel(key)
            ax.set_title(f"{run['dataset']}: {key} vs budget")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    paths.append(_save_figure(fig, Path(f"{prefix}_budget.png")))
    # 3. acceptance-length histogram
    fig, axes = plt.subplots(1, len(greedy), figsize=(6 * len(greedy), 4), squeeze=False)
    for ax, run in zip(axes[0], greedy):
        pol = run["policies"]
        show = [s for s in ("dflash", run.get("best_ddtree"), "ddtree-cost", "lookup", *TAPS_ROWS) if s and s in pol]
        width = 0.8 / max(len(show), 1)
        for i, spec in enumerate(show):
            h = pol[spec].get("accept_len_hist", {})
            tot = sum(h.values()) or 1
            xs = [int(k) for k in h]
            ax.bar([x + i * width for x in xs], [h[k] / tot for k in h], width=width, label=spec)
        top = max([int(k) for s in show for k in pol[s].get("accept_len_hist", {})] or [1])
        ax.set_xticks([x + width * (len(show) - 1) / 2 for x in range(1, top + 1)], [str(x) for x in range(1, top + 1)])
        ax.set_xlabel("acceptance length per round (tau, bonus included)")
        ax.set_ylabel("fraction of rounds")
        ax.set_title(f"{run['dataset']} (T=0)")
        ax.legend(fontsize=7)
    paths.append(_save_figure(fig, Path(f"{prefix}_accept_hist.png")))
    return paths


#: Prompts in each evaluation set, to label a run as the full set or a subset.
FULL_SIZES = {"humaneval": 164, "mtbench": 80}


def coverage(runs: List[dict]) -> str:
    """``"humaneval: FULL SET, 164 of 164 prompts; ..."`` over the greedy runs."""
    parts = []
    for run in runs:
        if run["temperature"] == 0.0:
            full = FULL_SIZES.get(run["dataset"])
            kind = "FULL SET" if full is not None and run["prompts"] >= full else "SUBSET"
            part = f"{run['dataset']}: {kind}, {run['prompts']} of {full or '?'} prompts"
            if part not in parts:  # merged files may run one set twice (e.g. a baseline-only run)
                parts.append(part)
    return "; ".join(parts)


def merge_bench(paths) -> dict:
    """One bench dict from several ``taps bench`` JSONs (e.g. one per dataset, run side by side): runs are
    concatenated, each tagged with ``"source"`` (its file's index, the line of its command), the config is the
    first file's with every command kept."""
    datas = [json.loads(Path(p).read_text()) for p in paths]
    vllm = [d for d in datas if is_vllm_peer(d)]  # scripts/vllm_cpu.sh records: peer rows, not our runs
    datas = [d for d in datas if not is_vllm_peer(d)]
    if not datas:
        raise ValueError("bench JSON: expected at least one `taps bench --out` file beside the vLLM peer file(s)")
    for d in datas:
        if "runs" not in d and "policies" in d:  # a summary from before bench and bench-suite merged: one run
            c = d.get("config", {})
            d["runs"] = [{"dataset": c.get("dataset", "?"), "temperature": c.get("temperature", 0.0),
                          "prompts": max((s.get("prompts", 0) for s in d["policies"].values()), default=0),
                          "policies": d["policies"], "best_ddtree": None, "partial": False}]
    cfg = dict(datas[0]["config"])
    if len(datas) > 1:
        cfg["command"] = "\n".join(d["config"].get("command", "") for d in datas)
        cfg["wall_s"] = " + ".join(str(d["config"].get("wall_s")) for d in datas)
        # the MT-Bench turn count is that of the file that ran MT-Bench, not of the first file
        turns = [d["config"].get("mtbench_turns") for d in datas if "mtbench" in (d["config"].get("datasets") or ())]
        if turns:
            cfg["mtbench_turns"] = turns[0]
    runs = [dict(r, source=i) for i, d in enumerate(datas) for r in d["runs"]]
    peers = {ds: rows for d in datas for ds, rows in (d.get("peers") or {}).items()}
    return {"config": cfg, "runs": runs, "peers": peers, "vllm_peers": vllm,
            "source_configs": [d["config"] for d in datas]}


def is_vllm_peer(d: dict) -> bool:
    """A ``scripts/vllm_cpu.sh`` record (``bench/results/vllm_cpu_smoke.json``): vLLM-CPU rows."""
    return isinstance(d.get("rows"), dict) and "vllm-cpu-ar" in d["rows"] and "records" in d


def _vllm_by_dataset(peer: dict) -> Dict[str, dict]:
    """Per dataset: vLLM-CPU AR / DFlash tokens/s (new tokens / generate wall time, prefill included), the
    DFlash tau (1 + accepted / drafts), and how many DFlash outputs equal AR's."""
    out: Dict[str, dict] = {}
    ar, df = peer["records"]["ar"], peer["records"]["dflash"]
    for a, d in zip(ar, df):
        o = out.setdefault(a["dataset"], {"prompts": 0, "same": 0, "ar_tok": 0, "ar_s": 0.0, "df_tok": 0,
                                          "df_s": 0.0, "drafts": 0, "accepted": 0})
        o["prompts"] += 1
        o["same"] += int(a["token_ids"] == d["token_ids"])
        o["ar_tok"] += a["new_tokens"]
        o["ar_s"] += a["seconds"]
        o["df_tok"] += d["new_tokens"]
        o["df_s"] += d["seconds"]
        o["drafts"] += d.get("drafts", 0)
        o["accepted"] += d.get("accepted_tokens", 0)
    return out


#: our rows shown beside vLLM's
VLLM_PEER_POLICIES = ("ar", "dflash", "taps", "taps-lookup")


def vllm_peer_table(data: dict) -> List[str]:
    """vLLM-CPU AR and vLLM-CPU DFlash (our drafter) beside our rows on the same prompts, per dataset, with
    the DFlash tau of both harnesses."""
    if not data.get("vllm_peers"):
        return []
    L = []
    srcs = data.get("source_configs") or [data["config"]]
    for peer in data["vllm_peers"]:
        c = peer["config"]
        L += [f"## vLLM-CPU on the same prompts (first turns), token count and threads", "",
              f"vLLM: `{c.get('package')}`, torch {c.get('torch')}, {c.get('threads')} thread(s), {c.get('cpu')}; "
              f"{c.get('dtype')}, eager; DFlash: `{json.dumps(c.get('speculative_config'))}` with "
              f"{c.get('drafter')}. tokens/s: new tokens / generate() wall time, prefill included, both harnesses. "
              "tau: tokens per drafted round, bonus included (vLLM: 1 + accepted / drafts).", "",
              "Commands: " + "; ".join(f"`{x}`" for x in c.get("commands", [])), "",
              "| dataset | row | tau | tok/s | same as AR | tau vs ours (same arithmetic) |", "|---|---|---|---|---|---|"]
        for ds, o in _vllm_by_dataset(peer).items():
            tau = 1 + o["accepted"] / o["drafts"] if o["drafts"] else None
            ref = None
            for run in data["runs"]:
                sc = srcs[run.get("source", 0)] if run.get("source", 0) < len(srcs) else data["config"]
                if run["dataset"] == ds and run["temperature"] == 0.0 and sc.get("target_format") == "fp32" \
                        and (run["policies"].get("dflash") or {}).get("tau"):
                    ref = run["policies"]["dflash"]["tau"]
            diff = f"{100 * (tau - ref) / ref:+.1f}% (ours fp32 {ref:.3f})" if tau and ref else "-"
            L.append(f"| {ds} | vLLM-CPU AR ({c.get('vllm')}) | - | {_fmt(o['ar_tok'] / o['ar_s'])} | - | - |")
            L.append(f"| {ds} | vLLM-CPU DFlash, our drafter ({c.get('vllm')}) | {_fmt(tau, '.3f')} | "
                     f"{_fmt(o['df_tok'] / o['df_s'])} | {o['same']}/{o['prompts']} | {diff} |")
            for run in data["runs"]:
                if run["dataset"] != ds or run["temperature"] != 0.0:
                    continue
                sc = srcs[run.get("source", 0)] if run.get("source", 0) < len(srcs) else data["config"]
                label = f"{sc.get('target_format')} target, {sc.get('threads')} thread(s)"
                for spec in VLLM_PEER_POLICIES:
                    s = run["policies"].get(spec)
                    if s:
                        L.append(f"| {ds} | ours: {spec} ({label}) | {_fmt(s.get('tau'), '.3f')} | "
                                 f"{_fmt(s['new_tokens'] / s['seconds'] if s.get('seconds') else None)} | {s.get('identical_to_ar')}/{s.get('prompts')} "
                                 f"| - |")
        L.append("")
    return L


def peer_table(data: dict) -> List[str]:
    """llama.cpp's rows (``taps bench --peer llamacpp``) beside our decode-only tokens/s, per dataset."""
    if not data.get("peers"):
        return []
    L = ["## llama.cpp on the same GGUF, prompts (first turns), token count and threads", "",
         "Decode-only tokens/s: the prefill and the token it gives excluded, on both sides (ours over all turns).", "",
         "| dataset | row | decode tok/s | prompt tok/s | our AR / this row |", "|---|---|---|---|---|"]
    ours = {r["dataset"]: r["policies"] for r in data["runs"] if r["temperature"] == 0.0}
    for ds, rows in data["peers"].items():
        ar = (ours.get(ds, {}).get("ar") or {}).get("decode_tokens_per_s")
        for r in rows:
            ratio = f"{ar / r['tok_s']:.2f}x" if ar and r.get("tok_s") else "-"
            L.append(f"| {ds} | {r['name']} (llama.cpp {r.get('llamacpp_commit')}, {r.get('cpu')}) | "
                     f"{_fmt(r.get('tok_s'))} | {_fmt(r.get('prompt_tok_s'))} | {ratio} |")
        for spec, s in ours.get(ds, {}).items():
            if s.get("decode_tokens_per_s"):
                L.append(f"| {ds} | ours: {spec} | {_fmt(s['decode_tokens_per_s'])} | - | - |")
    return L + [""]


def prefix_reuse_note(cfg: dict, runs: List[dict]) -> str:
    """What the runs' prefills skipped: AR's prompt tokens that ran on cache rows an earlier prompt left."""
    if not cfg.get("prefix_reuse"):
        return "Prefix reuse: off (every prompt prefilled whole)."
    per = [p for run in runs for p in run["policies"].get("ar", {}).get("per_prompt", []) if "prefix_reused" in p]
    counts = (f": {sum(p['prefix_reused'] for p in per):,} of AR's {sum(p['prompt_tokens'] for p in per):,} prompt "
              f"tokens ran on cache rows an earlier prompt left") if per else ""
    return f"Prefix reuse: on{counts} (`--no-prefix-reuse` prefills every prompt whole)."


def write_report(bench_json, out_md, plot_prefix: Optional[str] = "bench/results/taps_cpu",
                 scorer_metrics: Optional[str] = None, projection: Optional[str] = None,
                 notes: Optional[str] = None, replay: Optional[str] = None) -> List[Path]:
    """Write the markdown report (and plots); returns the written paths."""
    data = merge_bench(bench_json if isinstance(bench_json, (list, tuple)) else [bench_json])
    cfg = data["config"]
    proj = json.loads(Path(projection).read_text()) if projection else None
    drafter = cfg.get("drafter") if isinstance(cfg.get("drafter"), dict) else {"path": cfg.get("drafter")}
    # Records from other machines may hold absolute paths: the report shows them portably.
    drafter_path = portable_path(drafter["path"]) if drafter.get("path") else None
    scorer = portable_path(cfg["scorer"]) if cfg.get("scorer") else None
    command = "\n".join(portable_command(shlex.split(c)) for c in str(cfg.get("command", "")).splitlines())
    cpu = f"{cfg['cpu']}, " if cfg.get("cpu") else ""
    L = [f"# TAPS benchmark: {cfg.get('target')} on {cfg.get('device')} ({cpu}{cfg.get('threads')} threads)", "",
         f"**{coverage(data['runs'])}; {cfg.get('max_new_tokens')} new tokens per turn**", "",
         "Commands:", "", "```", command,
         "```", "",
         f"Drafter: `{drafter_path}` (sha256 `{drafter.get('sha256')}`); "
         f"scorer: `{scorer}`; max new tokens per turn {cfg.get('max_new_tokens')}; MT-Bench turns "
         f"{cfg.get('mtbench_turns')}; wall {cfg.get('wall_s')} s. Speedup = AR time per token / policy time per "
         "token, same harness, prompts interleaved across policies. tau counts the bonus token. "
         f"{prefix_reuse_note(cfg, data['runs'])}", ""]
    checks_all = []
    seen = Counter((r["dataset"], r["temperature"]) for r in data["runs"])
    for run in data["runs"]:
        part = " (PARTIAL: run cut short, prompts completed so far)" if run.get("partial") else ""
        if seen[(run["dataset"], run["temperature"])] > 1:  # the same set in several runs: say which one
            part += f" (command {run['source'] + 1} above)"
        L += [f"## {run['dataset']}, temperature {run['temperature']:g}, {run['prompts']} prompts{part}", ""]
        L += policy_table(run, proj)
        L.append("")
        if run["temperature"] == 0.0:
            checks = check_targets(run)
            checks_all.append((run["dataset"], checks))
    L += peer_table(data)
    L += vllm_peer_table(data)
    L += ["## Targets (\"must show\")", "", "| dataset | check | value | target | met? |", "|---|---|---|---|---|"]
    for ds, checks in checks_all:
        for c in checks:
            val = _fmt(c["value"], ".3f") if c["value"] is not None else "-"
            cmp = c.get("cmp", ">=")
            tgt = f"{cmp} {c['target']}" if c["target"] is not None else "-"
            miss = ""
            if c["target"] is not None and not c["met"]:
                miss = f" (missed by {100 * abs(c['target'] - c['value']) / c['target']:.1f}%)"
            L.append(f"| {ds} | {c['name']} | {val} | {tgt} | {'yes' if c['met'] else 'NO' + miss} |")
    if scorer_metrics:
        m = json.loads(Path(scorer_metrics).read_text())
        ev = m.get("eval", m)
        s, mg = ev["scorer"], ev["marginal"]
        met = s["ece"] < mg["ece"]
        L.append(f"| held-out traces | scorer ECE < marginal-product ECE | {s['ece']:.4f} vs {mg['ece']:.4f} | lower | "
                 f"{'yes' if met else 'NO'} |")
    L.append("")
    if replay:
        rp = json.loads(Path(replay).read_text())
        rp = rp.get("replay", rp)
        pols = rp["policies"]
        L += ["## Trace replay (held-out traces x measured latency table; no wall-clock noise)", "",
              f"Each policy's tree on {rp.get('rounds')} held-out trace rounds, tau from the real (greedy) acceptance, "
              f"time = t0 ({1000 * float(rp.get('t0') or 0):.0f} ms) + selection overhead + latency[n] from the table "
              f"measured on `{rp.get('table_machine')}`. Same machine and pair as above, but every policy sees the same "
              "rounds and the same costs, so the comparison between policies is not disturbed by load drift.", "",
              "| policy | tau | nodes/round | tok/s | speedup vs AR |", "|---|---|---|---|---|"]
        for k, v in pols.items():
            L.append(f"| {k} | {v['tau']:.3f} | {v['nodes_per_round']:.1f} | {v['tokens_per_s']:.2f} | {v['speedup']:.3f}x |")
        L.append("")
    if proj:
        L += ["## Projection (NOT a measurement)", "",
              f"The PROJECTED column combines the tau and nodes/round measured above with a verify-latency table "
              f"measured on `{proj.get('machine')}` (model `{proj.get('model')}`, t0 {1000 * proj.get('t0', 0):.2f} ms): "
              "tokens/s = tau / (t0 + latency[nodes - 1]). It ignores that a policy tuned on that machine would pick "
              "other tree sizes.", ""]
    paths = []
    if plot_prefix:
        Path(plot_prefix).parent.mkdir(parents=True, exist_ok=True)
        paths = _plots([r for r in data["runs"] if _drafted(r)], plot_prefix)
        L += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in paths] + [""]
    if notes:
        L += [Path(notes).read_text()]
    out = Path(out_md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(L) + "\n")
    return [out] + paths
