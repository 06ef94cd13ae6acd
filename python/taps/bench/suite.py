"""Batch 1: each prompt (every turn, after the model's own earlier answers) through every policy, and HF
``generate`` (plain greedy, prompt-lookup decoding) on the same turns as baselines checked against AR."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from taps.data import encode_prompt, stop_token_ids
from taps.decode.policies import policy_from_options

from . import BenchError
from .summary import block_summary


def add_turn(rec: Dict, prompt_len: int, res, answer: str) -> None:
    """Add one turn's :class:`GenerationResult` to a benchmark record (its ``turns`` list and running totals;
    in a batch run the stage times are the batch rounds')."""
    st = res.stats
    rec["turns"].append({"prompt_len": prompt_len, "token_ids": res.token_ids, "text": answer,
                         "stop_reason": res.stop_reason, "seconds": st.total_s, "rounds": st.num_rounds,
                         "tau": st.tau, "prefix_reused": st.prefix_reused})
    rec["new_tokens"] += len(res.token_ids)
    rec["seconds"] += st.total_s
    rec["rounds"] += st.num_rounds
    rec["accept_lens"] += [r.accept_len for r in st.rounds]
    rec["nodes"] += sum(r.nodes for r in st.rounds)
    rec["drafted_rounds"] += sum(r.drafted for r in st.rounds)
    for key, v in st.stage_totals().items():
        rec["time_split"][key] = rec["time_split"].get(key, 0.0) + v


def run_item(decoder, tokenizer, item, max_new_tokens: int, seed: int = 0) -> Dict:
    """Run every turn of a :class:`taps.data.PromptItem` (turn k after the model's own earlier answers).

    Returns a dict: ``turns`` (token ids, text, stats per turn), ``new_tokens``, ``seconds``, ``rounds``,
    ``accept_lens``, ``nodes`` and summed ``time_split``.
    """
    history: List[dict] = []
    out = {"id": item.id, "source": item.source, "turns": [], "new_tokens": 0, "seconds": 0.0, "rounds": 0,
           "accept_lens": [], "nodes": 0, "drafted_rounds": 0, "time_split": {}}
    for k, text in enumerate(item.turns):
        ids = encode_prompt(tokenizer, text, raw=item.raw, history=history)
        res = decoder.generate(ids, max_new_tokens, seed=seed + k)
        answer = tokenizer.decode(res.token_ids, skip_special_tokens=True)
        add_turn(out, len(ids), res, answer)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    out["tau"] = sum(out["accept_lens"]) / len(out["accept_lens"]) if out["accept_lens"] else 0.0
    out["tokens_per_s"] = out["new_tokens"] / out["seconds"] if out["seconds"] > 0 else 0.0
    return out


def check_prompt_lookup(name: str, value: Optional[int]) -> Optional[int]:
    """``value`` if it is None or an int >= 1 (HF's ``prompt_lookup_num_tokens``), else a ValueError naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}: expected an integer >= 1 (or None), received {value!r}")
    return value


def hf_generate_item(model, tokenizer, item, max_new_tokens: int, stop_ids: List[int], answers: List[str],
                     prompt_lookup_num_tokens: Optional[int] = None) -> Dict:
    """Time HF ``generate(do_sample=False)`` on the same turns (turn k after ``answers[:k]``, the answers our
    decoder gave, so both see identical prompts). Returns token ids per turn, new tokens and seconds.

    ``prompt_lookup_num_tokens``: None for plain greedy ``generate``; an int >= 1 turns on HF's prompt-lookup
    decoding (n-gram matches in the context proposed as up to that many draft tokens, verified by the target:
    lossless under greedy decoding, no drafter needed)."""
    extra = {}
    if check_prompt_lookup("prompt_lookup_num_tokens", prompt_lookup_num_tokens) is not None:
        extra["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    history: List[dict] = []
    out = {"turns": [], "new_tokens": 0, "seconds": 0.0}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)
    for k, text in enumerate(item.turns):
        ids = encode_prompt(tokenizer, text, raw=item.raw, history=history)
        inp = torch.tensor([ids], device=next(model.parameters()).device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=stop_ids or None, pad_token_id=pad,
                                 temperature=None, top_p=None, top_k=None, **extra)
        dt = time.perf_counter() - t0
        toks = gen[0, len(ids):].tolist()
        out["turns"].append({"token_ids": toks, "seconds": dt})
        out["new_tokens"] += len(toks)
        out["seconds"] += dt
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": answers[k]}]
    return out


def prefix_reuse_asked(args) -> bool:
    """``taps bench`` runs prompts on the rows earlier ones left unless ``--no-prefix-reuse``."""
    return not getattr(args, "no_prefix_reuse", False)


def build_decoders(model, tok, drafter, specs: List[str], sampling, args=None):
    """One batch-1 decoder per policy spec; ``args`` carries the policies' options (``--scorer``, ``--pool-size``)."""
    from taps.decode import SpeculativeDecoder

    stops = stop_token_ids(tok, model)
    decoders = {}
    for s in specs:
        policy = policy_from_options(s, args)
        try:
            # bind() runs here: a policy whose learned parts (scorer, latency table) are missing fails now
            decoders[s] = SpeculativeDecoder(model, policy, drafter=drafter, sampling=sampling, stop_token_ids=stops,
                                             prefix_reuse=prefix_reuse_asked(args))
        except (FileNotFoundError, ValueError, KeyError, OSError) as e:
            raise BenchError(f"policy {s}: {str(e).strip().splitlines()[0]}") from None
    return decoders


def hf_pld_name(num_tokens: int) -> str:
    """The row name of HF prompt-lookup decoding with ``prompt_lookup_num_tokens=num_tokens``."""
    return f"hf-pld:{num_tokens}"


def hf_rows(hf_baseline: bool, hf_prompt_lookup: Optional[int]) -> Dict[str, Optional[int]]:
    """The HF baseline rows asked for, in run order: ``{row name: prompt_lookup_num_tokens}`` (None: plain
    greedy ``generate``). ``hf_prompt_lookup`` must be None or an int >= 1."""
    check_prompt_lookup("hf_prompt_lookup", hf_prompt_lookup)
    rows: Dict[str, Optional[int]] = {"hf": None} if hf_baseline else {}
    if hf_prompt_lookup is not None:
        rows[hf_pld_name(hf_prompt_lookup)] = hf_prompt_lookup
    return rows


def run_suite(model, tok, decoders: Dict, items, max_new_tokens: int, seed: int = 0, warmup: int = 1,
              hf_baseline: bool = False, on_record: Optional[Callable[[dict], None]] = None,
              hf_prompt_lookup: Optional[int] = None) -> Dict[str, List[dict]]:
    """Run every item with every decoder (items outer, policies inner). Returns ``{policy: [record, ...]}``;
    a record is :func:`run_item`'s dict plus ``identical_to_ar``; ``"hf"`` holds the HF baseline if asked,
    ``"hf-pld:N"`` HF prompt-lookup decoding with ``prompt_lookup_num_tokens = hf_prompt_lookup`` (>= 1) if
    asked. The HF rows run after the decoders on each prompt and carry no rounds or tau."""
    from taps.data import PromptItem

    hf = hf_rows(hf_baseline, hf_prompt_lookup)
    greedy = all(dec.sampling.greedy for dec in decoders.values())
    warm = PromptItem("warmup", "warmup", ["Say hello."])
    for dec in decoders.values():
        for _ in range(warmup):
            run_item(dec, tok, warm, 8, seed=seed)
    stops = stop_token_ids(tok, model)
    if warmup:
        for n in hf.values():
            hf_generate_item(model, tok, warm, 8, stops, ["hello"], prompt_lookup_num_tokens=n)
    results: Dict[str, List[dict]] = {s: [] for s in decoders}
    results.update({name: [] for name in hf})
    for item in items:
        ar_tokens = None
        for spec, dec in decoders.items():
            rec = run_item(dec, tok, item, max_new_tokens, seed=seed)
            rec["policy"] = spec
            toks = [t["token_ids"] for t in rec["turns"]]
            if spec == "ar":
                ar_tokens = toks
                ar_answers = [t["text"] for t in rec["turns"]]
            # sampled outputs differ from AR's by design (same distribution, other draws)
            rec["identical_to_ar"] = (toks == ar_tokens) if ar_tokens is not None and greedy else None
            results[spec].append(rec)
            if on_record:
                on_record(rec)
        for name, n in hf.items():
            rec = hf_generate_item(model, tok, item, max_new_tokens, stops, ar_answers, prompt_lookup_num_tokens=n)
            rec.update(id=item.id, source=item.source, policy=name)
            rec["tokens_per_s"] = rec["new_tokens"] / rec["seconds"] if rec["seconds"] > 0 else 0.0
            rec["identical_to_ar"] = [t["token_ids"] for t in rec["turns"]] == ar_tokens if greedy else None
            results[name].append(rec)
            if on_record:
                on_record(rec)
    return results


@dataclass
class BlockPlan:
    """What one batch-1 block runs: the policy ``specs``, the ``sampling``, ``max_new_tokens`` per turn, the
    ``seed``, ``warmup`` untimed runs before the first prompt, and the HF rows: ``hf_baseline`` times HF
    ``generate`` on every prompt (policy ``"hf"``), ``hf_prompt_lookup`` HF prompt-lookup decoding (policy
    ``"hf-pld:N"``)."""

    specs: List[str]
    sampling: object
    max_new_tokens: int
    seed: int
    warmup: int
    hf_baseline: bool = False
    hf_prompt_lookup: Optional[int] = None


def run_block(model, tok, drafter, items, plan: BlockPlan, log, on_partial=None, on_record=None, args=None):
    """Run ``items`` x ``plan.specs``; after every prompt (all policies) ``on_partial(summary, prompts_done)`` is
    called, so a run cut short still leaves a valid JSON of the prompts completed. ``on_record(record)`` sees
    every record; ``args`` carries the policies' options (``--scorer``, ``--pool-size``)."""
    specs, hf_baseline, hf_prompt_lookup = plan.specs, plan.hf_baseline, plan.hf_prompt_lookup
    hf = hf_rows(hf_baseline, hf_prompt_lookup)
    decoders = build_decoders(model, tok, drafter, specs, plan.sampling, args)
    partial = {s: [] for s in specs + list(hf)}

    def show(rec):
        tau = f"tau {rec['tau']:.2f}" if "tau" in rec else "        "
        log(f"  {rec['id']:<22} {rec['policy']:<14} {rec['new_tokens']:>4} tok  {tau}  "
            f"{rec['tokens_per_s']:6.2f} tok/s  "
            f"{ {True: '=AR', False: 'DIFFERS', None: '(sampled)'}[rec['identical_to_ar']] }")
        partial[rec["policy"]].append(rec)
        if on_record is not None:
            on_record(rec)
        done = min(len(v) for v in partial.values())
        if on_partial is not None and all(len(v) == done for v in partial.values()):
            on_partial(block_summary(partial), done)

    # AR first (the lossless check compares against it), then the other policies in an order rotated by one
    # per prompt: on a shared machine the load drifts within a prompt, and a fixed order would always hand
    # the same policies the slow minutes.
    others = [s for s in specs if s != "ar"]
    results = {s: [] for s in partial}
    for i, item in enumerate(items):
        k = i % max(len(others), 1)
        order = (["ar"] if "ar" in decoders else []) + others[k:] + others[:k]
        res = run_suite(model, tok, {s: decoders[s] for s in order}, [item], plan.max_new_tokens, seed=plan.seed,
                        warmup=plan.warmup if i == 0 else 0, hf_baseline=hf_baseline, on_record=show,
                        hf_prompt_lookup=hf_prompt_lookup)
        for s, recs in res.items():
            results[s] += recs
    return block_summary(results)
