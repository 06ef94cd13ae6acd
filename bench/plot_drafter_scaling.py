"""The drafter's scaling curve: held-out tau (code and chat prompts separately) against training compute, from the
evaluations committed beside the weights (``checkpoints/smollm2-dflash/eval_heldout_v2.json``: shard 0 of the
training data, never trained on), with a least-squares line in log2(minutes) per prompt kind and what that line
predicts it would take to reach the goals (code 2.6, chat 2.0).

Compute is minutes of one CPU thread (bf16 autocast) and data grew with it (the recipe in the checkpoint README),
so one doubling on this axis is a doubling of both. Writes ``scaling.png`` and ``scaling.json`` beside the weights.
"""
import argparse
import json
import math
from pathlib import Path

#: (run in eval_heldout_v2.json, training minutes of one thread, response tokens in the data at the end, label):
#: the 2-layer lineage of the shipped drafter (checkpoint README, "Held-out metrics" and the recipe)
RUNS = (("shape_2layer_20min", 20, 143_000, "block 16, 20 min"),
        ("shape_2layer_60min", 60, 271_000, "block 16, 60 min"),
        ("final_2layer_115min", 115, 494_000, "block 16, 115 min"),
        ("block16_2layer_212min", 212, 602_000, "block 16, 212 min"),
        ("final_block8_2layer_115+70min", 185, 602_000, "block 8, 115 + 70 min"),
        ("final_block8_2layer_115+110min", 225, 602_000, "block 8, 115 + 110 min (shipped)"))
GOALS = {"code": 2.6, "chat": 2.0}


def fit(xs, ys):
    """Least squares ``y = a + b * log2(x)``: ``(a, b)``."""
    lx = [math.log2(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    b = sum((u - mx) * (v - my) for u, v in zip(lx, ys)) / sum((u - mx) ** 2 for u in lx)
    return my - b * mx, b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--drafter", default="checkpoints/smollm2-dflash")
    args = ap.parse_args(argv)
    d = Path(args.drafter)
    runs = json.loads((d / "eval_heldout_v2.json").read_text())["runs"]
    points = [{"run": r, "minutes": m, "response_tokens": n, "label": label,
               **{k: runs[r]["family_tau"][k]["tau"] for k in GOALS}} for r, m, n, label in RUNS]
    minutes = [p["minutes"] for p in points]
    out = {"points": points, "heldout": "shard 0 of the training data (32 code + 32 chat sequences), as the "
           "checkpoint README's held-out table", "fits": {}}
    for kind, goal in GOALS.items():
        a, b = fit(minutes, [p[kind] for p in points])
        best = max(p[kind] for p in points)
        need = 2 ** ((goal - a) / b) if b > 0 else math.inf
        out["fits"][kind] = {"tau_at_1_min": a, "tau_per_doubling": b, "goal": goal, "best": best,
                             "missed_by": goal - best, "predicted_minutes_for_goal": need,
                             "doublings_past_225_min": math.log2(need / 225) if b > 0 else math.inf}
        print(f"{kind}: tau {best:.3f} at best, goal {goal} (missed by {goal - best:.3f}); fit {a:.3f} + {b:.4f} "
              f"x log2(minutes): the goal at {need:,.0f} minutes, {math.log2(need / 225):.1f} more doublings of "
              f"compute and data")
    (d / "scaling.json").write_text(json.dumps(out, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for kind, color in (("code", "tab:blue"), ("chat", "tab:orange")):
        f = out["fits"][kind]
        ax.scatter(minutes, [p[kind] for p in points], color=color, label=f"{kind} (held out)")
        xs = [10 * 2 ** (i / 4) for i in range(4 * 8)]
        ax.plot(xs, [f["tau_at_1_min"] + f["tau_per_doubling"] * math.log2(x) for x in xs], color=color, lw=1,
                ls="--", label=f"{kind} fit: +{f['tau_per_doubling']:.3f} per doubling")
        ax.axhline(f["goal"], color=color, lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training minutes, one CPU thread (data grew with it)")
    ax.set_ylabel("held-out tau (decoding drafts, bonus counted)")
    ax.set_title("smollm2-dflash: held-out tau against training compute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(d / "scaling.png", dpi=110)
    print(f"wrote {d / 'scaling.png'} and {d / 'scaling.json'}")


if __name__ == "__main__":
    main()
