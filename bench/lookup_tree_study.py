"""Prompt-lookup tree shapes replayed on recorded greedy outputs, without the target.

    python bench/lookup_tree_study.py --jsonl <a `taps bench --jsonl` file> --dataset humaneval [--out FILE]

A ``taps bench --jsonl`` file holds AR's tokens for every prompt: the target's greedy continuation. A round of
prompt lookup can therefore be replayed offline: it proposes nodes from the history (prompt + committed tokens),
accepts the longest path whose tokens equal the recorded continuation, and commits it plus the bonus token.
Shapes, in non-root nodes per round (first turns only: a later turn's history holds the earlier answer):

* ``chain:K``: the up to K tokens after the latest occurrence of the longest matching suffix (3, else 2, else 1
  tokens), as :func:`taps_kernels.lookup_chain` picks them (checked against it every round).
* ``sibling``: 2 nodes, both children of the root: the next tokens of the latest two occurrences that differ
  (``chain:2`` when every occurrence continues alike); the second is :func:`taps_kernels.lookup_chain`'s sibling
  (checked every round), which ``lookup-cost`` and ``taps-lookup`` graft beside the chain.
* ``chain:2+sibling``: 3 nodes: ``chain:2`` and the sibling of its first node.

Shapes with the same node count cost the same verify, so their tau (tokens per round, the bonus included) compares
them directly (on the Zen 3 of the README the root and 1 node cost one decode step, a second node ~27% more:
``bench/results/lookup_sibling_ab_zen3_*`` measures the sibling in the policies). Prints the table and writes JSON.
"""
import argparse
import json
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

MAX_NGRAM = 3


def occurrences(history: List[int]) -> List[int]:
    """Positions right after each earlier occurrence of the longest matching suffix (latest first), or []."""
    for n in range(min(MAX_NGRAM, len(history) - 1), 0, -1):
        suffix = history[-n:]
        found = [s + n for s in range(len(history) - n - 1, -1, -1) if history[s:s + n] == suffix]
        if found:
            return found
    return []


def chain(history: List[int], found: List[int], k: int) -> List[int]:
    return history[found[0]:found[0] + k] if found else []


def sibling(history: List[int], found: List[int]) -> List[int]:
    """The next tokens of the latest two occurrences that continue differently ([] or one token otherwise)."""
    firsts: List[int] = []
    for pos in found:
        if history[pos] not in firsts:
            firsts.append(history[pos])
            if len(firsts) == 2:
                break
    return firsts


def matched(proposal: List[int], truth: List[int]) -> int:
    n = 0
    while n < len(proposal) and n < len(truth) and proposal[n] == truth[n]:
        n += 1
    return n


def shapes(k_max: int) -> Dict[str, Tuple[int, Callable[[List[int], List[int], List[int]], int]]]:
    """``{name: (non-root nodes, accepted(history, found, truth))}``: the tokens a round of the shape accepts (bonus
    excluded)."""
    out = {f"chain:{k}": (k, lambda h, f, t, k=k: matched(chain(h, f, k), t)) for k in range(1, k_max + 1)}

    def two_children(h, f, t):
        first = sibling(h, f)
        return (1 if t and t[0] in first else 0) if len(first) == 2 else matched(chain(h, f, 2), t)

    def chain_and_sibling(h, f, t):
        first = sibling(h, f)
        return max(matched(chain(h, f, 2), t), 1 if len(first) == 2 and t and t[0] == first[1] else 0)

    out["sibling"] = (2, two_children)
    out["chain:2+sibling"] = (3, chain_and_sibling)
    return out


def replay(prompt: List[int], answer: List[int], accepted: Callable, check_chain: int = 0) -> Dict[str, int]:
    """Rounds to commit ``answer`` after ``prompt``; ``check_chain`` > 0: compare every round's ``chain:K`` and
    sibling with :func:`taps_kernels.lookup_chain`'s."""
    seq = prompt + answer
    p, rounds = len(prompt), 0
    while p < len(seq):
        history = seq[:p]
        found = occurrences(history)
        if check_chain:
            import taps_kernels

            ids = torch.tensor([history], dtype=torch.int64)
            op_chain, op_len, _, op_sibling = taps_kernels.lookup_chain(ids, torch.tensor([p]), check_chain, MAX_NGRAM)
            assert op_chain[0, :int(op_len[0])].tolist() == chain(history, found, check_chain), p
            assert int(op_sibling[0]) == (sibling(history, found) + [-1, -1])[1], p
        # the last recorded token can only be a bonus: a round never accepts past it
        p += min(accepted(history, found, seq[p:]), len(seq) - p - 1) + 1
        rounds += 1
    return {"rounds": rounds, "tokens": len(answer)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jsonl", required=True, help="a `taps bench --jsonl` file with the dataset's AR records")
    ap.add_argument("--dataset", required=True, choices=["humaneval", "mtbench"])
    ap.add_argument("--chain-max", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from taps.data.loaders import encode_prompt, load_dataset
    from taps.models.target import smollm2_cache_dir

    tok = AutoTokenizer.from_pretrained(str(smollm2_cache_dir()))
    items = {it.id: it for it in load_dataset(args.dataset)}
    ar = {}
    for line in Path(args.jsonl).read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("policy") == "ar" and rec.get("source") == args.dataset:
            ar.setdefault(rec["id"], rec)
    runs = shapes(args.chain_max)
    totals = {name: {"rounds": 0, "tokens": 0} for name in runs}
    prompts = 0
    for rid, rec in ar.items():
        item, turn = items[rid], rec["turns"][0]
        prompt = encode_prompt(tok, item.turns[0], raw=item.raw)
        if len(prompt) != turn["prompt_len"]:
            raise SystemExit(f"{rid}: the prompt encodes to {len(prompt)} tokens, the record says "
                             f"{turn['prompt_len']} (another tokenizer or template?)")
        prompts += 1
        for name, (_, accepted) in runs.items():
            r = replay(prompt, turn["token_ids"], accepted,
                       args.chain_max if name == f"chain:{args.chain_max}" else 0)
            for key in r:
                totals[name][key] += r[key]
    table = {name: {**t, "tau": round(t["tokens"] / t["rounds"], 3)} for name, t in totals.items()}
    print(f"{args.dataset}: {prompts} first turns, {sum(len(r['turns'][0]['token_ids']) for r in ar.values())} "
          f"recorded tokens")
    print(f"{'shape':<18} {'non-root nodes':>14} {'rounds':>7} {'tau':>6}")
    for name, t in table.items():
        print(f"{name:<18} {runs[name][0]:>14} {t['rounds']:>7} {t['tau']:>6.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"dataset": args.dataset, "records": Path(args.jsonl).name,
                                              "prompts": prompts, "max_ngram": MAX_NGRAM, "shapes": table},
                                             indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
