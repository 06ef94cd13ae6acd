"""llama.cpp as a peer for ``taps bench``: the same GGUF file, prompts, token counts and thread count.

Optional: the tools come from ``scripts/build_llamacpp.sh`` (llama.cpp 0c1e570, vendored by the
llama-cpp-python 0.3.36 sdist) and nothing in the test suite or CI needs them. Three rows:

* ``llamacpp-decode`` -- ``llama-bench -p 0 -n N``: pure decode of N tokens from an empty context with
  llama.cpp's default buffers (on AMX CPUs its repacked AMX buffer: its fastest decode, but that buffer
  dies with SIGILL on any batch of 2+ tokens, so it cannot run a prompt there).
* ``llamacpp`` -- ``llama-completion --no-repack``: end to end on the caller's prompt text (already
  chat-templated; llama.cpp applies no template), greedy, at most N new tokens, stopping at EOS.
* ``llamacpp-lookup`` -- ``llama-lookup --no-repack --spec-draft-n-max 8``: the same with llama.cpp's
  n-gram prompt-lookup speculative decoding (greedy, so the text matches ``llamacpp``'s up to length).

and a check of the numbers themselves: ``taps-llamacpp-logits`` (``scripts/llamacpp_logits.cpp``, built beside
the tools against llama.cpp's library) runs llama.cpp's greedy path teacher-forced on given tokens and writes its
logits, which :func:`logit_check` compares with our target's on the same tokens (largest and mean logit
difference, top-1 agreement).

Tools are looked up in ``$TAPS_LLAMACPP_DIR`` and then ``$TAPS_CACHE/llamacpp/build/bin``
(``$TAPS_CACHE`` defaults to ``~/.cache/taps``). Every command has a timeout; a failing one raises
RuntimeError naming the tool, the command and the last lines of its stderr.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from taps.paths import cache_root, portable_command

from . import BenchError

TOOLS = ("llama-bench", "llama-completion", "llama-lookup")
LOGITS_TOOL = "taps-llamacpp-logits"
SDIST = "llama-cpp-python 0.3.36"
DRAFT_N_MAX = 8
TIMEOUT_S = 900

ROW_DECODE = "llamacpp-decode (llama-bench, its default buffers)"
ROW_COMPLETION = "llamacpp (llama-completion --no-repack)"
ROW_LOOKUP = "llamacpp-lookup (llama-lookup --no-repack)"


# ---------------------------------------------------------------------------------------------- tools

def tool_dirs() -> List[Path]:
    """Where :func:`find_llamacpp` looks, in order: ``$TAPS_LLAMACPP_DIR`` (and its ``bin/``), then the
    build directory of ``scripts/build_llamacpp.sh``."""
    out = []
    env = os.environ.get("TAPS_LLAMACPP_DIR")
    if env:
        d = Path(env).expanduser()
        out += [d, d / "bin", d / "build" / "bin"]
    out.append(cache_root() / "llamacpp" / "build" / "bin")
    return out


def find_llamacpp() -> Optional[Dict[str, Path]]:
    """``{"llama-bench": path, "llama-completion": path, "llama-lookup": path}`` from the first directory
    of :func:`tool_dirs` holding all three executables, or None."""
    for d in tool_dirs():
        paths = {t: d / t for t in TOOLS}
        if all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()):
            return paths
    return None


def find_logits_tool() -> Optional[Path]:
    """``taps-llamacpp-logits`` from the first directory of :func:`tool_dirs` holding it, or None."""
    for d in tool_dirs():
        p = d / LOGITS_TOOL
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def require_llamacpp() -> Dict[str, Path]:
    """:func:`find_llamacpp`, or RuntimeError saying where it looked and how to build the tools."""
    tools = find_llamacpp()
    if tools is None:
        looked = ", ".join(str(d) for d in tool_dirs())
        raise RuntimeError(f"llama.cpp tools {', '.join(TOOLS)} not found (looked in {looked}); build them "
                           "with `bash scripts/build_llamacpp.sh` or set $TAPS_LLAMACPP_DIR to their directory")
    return tools


def _run(tool: str, argv: Sequence[str], timeout: float, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``argv`` (stdin closed); RuntimeError on a timeout or a non-zero exit code."""
    cmd = portable_command(argv)

    def fail(why: str, stderr) -> RuntimeError:
        if isinstance(stderr, bytes):
            stderr = stderr.decode("utf-8", "replace")
        tail = "\n".join((stderr or "").strip().splitlines()[-15:])
        return RuntimeError(f"{tool} {why}: {cmd}\n--- last stderr lines ---\n{tail}")

    try:
        proc = subprocess.run([str(a) for a in argv], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout, cwd=cwd, errors="replace", text=True)
    except subprocess.TimeoutExpired as e:
        raise fail(f"timed out after {timeout:.0f} s", e.stderr) from None
    except OSError as e:
        raise fail(f"could not start ({e})", "") from None
    if proc.returncode != 0:
        raise fail(f"failed with exit code {proc.returncode}", proc.stderr)
    return proc


# -------------------------------------------------------------------------------------------- parsers

def parse_bench_json(text: str) -> float:
    """Decode tokens/s (``avg_ts``, mean over llama-bench's repetitions) of the ``-p 0 -n N`` test in
    ``llama-bench -o json`` output."""
    tests = [t for t in json.loads(text) if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if not tests:
        raise ValueError("llama-bench JSON has no decode-only (n_prompt 0, n_gen > 0) test")
    return float(tests[0]["avg_ts"])


def parse_bench_markdown(text: str) -> float:
    """Decode tokens/s from llama-bench's markdown table (the ``tgN`` row's ``t/s`` column, mean part)."""
    m = re.search(r"\|\s*tg\d+\s*\|\s*([0-9.]+)\s*±", text)
    if not m:
        raise ValueError("no tgN row in llama-bench's table")
    return float(m.group(1))


_NUM = r"([0-9]+(?:\.[0-9]+)?)"


def parse_perf(stderr: str) -> Dict[str, float]:
    """The ``*_perf_*print`` timing lines: ``prompt_ms``/``prompt_tokens`` (the prompt batch; in
    llama.cpp every batch of 2+ tokens counts here) and ``eval_ms``/``eval_runs`` (single-token decode
    calls). Missing lines raise ValueError."""
    p = re.search(rf"prompt eval time =\s*{_NUM} ms /\s*(\d+) tokens", stderr)
    e = re.search(rf"\s eval time =\s*{_NUM} ms /\s*(\d+) runs", stderr)
    if not p or not e:
        raise ValueError("no 'prompt eval time' / 'eval time' lines in the output")
    return {"prompt_ms": float(p.group(1)), "prompt_tokens": int(p.group(2)),
            "eval_ms": float(e.group(1)), "eval_runs": int(e.group(2))}


def parse_lookup(stderr: str) -> Dict[str, float]:
    """llama-lookup's summary: ``prompt_tokens``/``prompt_s`` (the ``encoded`` line; its printed speed is
    not used, it divides by the final context length), ``n_predict``/``decode_s`` (the ``decoded`` line:
    every generated token and the wall time of the whole draft-and-verify loop), ``n_drafted``,
    ``n_accept``."""
    enc = re.search(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds", stderr)
    dec = re.search(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds", stderr)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", stderr)
    accept = re.search(r"n_accept\s*=\s*(\d+)", stderr)
    if not (enc and dec and drafted and accept):
        raise ValueError("no 'encoded'/'decoded'/'n_drafted'/'n_accept' lines in llama-lookup's output")
    return {"prompt_tokens": int(enc.group(1)), "prompt_s": float(enc.group(2)),
            "n_predict": int(dec.group(1)), "decode_s": float(dec.group(2)),
            "n_drafted": int(drafted.group(1)), "n_accept": int(accept.group(1))}


def parse_version(text: str) -> Optional[str]:
    """The commit in ``version: <n> (<commit>)`` / ``build: <commit> (<n>)`` / ``commit <commit>`` lines."""
    for pat in (r"version:\s*\d+\s*\(([0-9a-f]{6,40})\)", r"commit\s+([0-9a-f]{6,40})", r"build:\s*([0-9a-f]{6,40})"):
        m = re.search(pat, text)
        if m:
            return m.group(1)
    return None


# -------------------------------------------------------------------------------------------- runners

def version() -> Dict[str, Optional[str]]:
    """``{"commit": ..., "source": ...}`` from ``llama-bench --version`` (commit None if it says none)."""
    tools = require_llamacpp()
    proc = _run("llama-bench", [tools["llama-bench"], "--version"], timeout=60)
    return {"commit": parse_version(proc.stdout + proc.stderr), "source": f"{SDIST} sdist (vendor/llama.cpp)"}


def bench_decode(gguf, threads: int, n_tokens: int, timeout: float = TIMEOUT_S) -> Dict:
    """Pure decode: ``llama-bench -m gguf -t threads -p 0 -n n_tokens -o json`` with its default buffers.

    Returns ``decode_tok_s`` (llama-bench's mean over its 5 repetitions of n_tokens decoded tokens,
    one at a time, from an empty context) and ``command``."""
    tools = require_llamacpp()
    argv = [tools["llama-bench"], "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n_tokens), "-o", "json"]
    proc = _run("llama-bench", argv, timeout)
    try:
        tok_s = parse_bench_json(proc.stdout)
    except (ValueError, KeyError, TypeError):
        tok_s = parse_bench_markdown(proc.stdout)
    return {"decode_tok_s": tok_s, "n_tokens": n_tokens, "command": portable_command(argv)}


def _strip(text: str, suffix: str) -> str:
    return text[: -len(suffix)] if suffix and text.endswith(suffix) else text


def completion_text(stdout: str) -> str:
    """The generated text in llama-completion's stdout (``--no-display-prompt``): the tokens, then
    `` [end of text]\\n`` if it stopped at EOS, then a blank line."""
    return _strip(_strip(stdout, "\n\n"), " [end of text]\n")


def lookup_text(stdout: str, prompt_text: str) -> str:
    """The generated text in llama-lookup's stdout: a blank line, the prompt, the tokens (a final EOS is
    printed as its special text, e.g. ``<|im_end|>``, and dropped here), two blank lines."""
    out = _strip(_strip(stdout, "\n\n"), "\n\n")
    out = out[2:] if out.startswith("\n\n") else out
    out = out[len(prompt_text):] if out.startswith(prompt_text) else out
    return re.sub(r"<\|[^|<>\s]+\|>$", "", out)


def parse_generate(stdout: str, stderr: str, prompt_text: str, lookup: bool) -> Dict:
    """The record of one :func:`generate` run from the tool's stdout and stderr (ValueError if the timing
    lines are missing). See :func:`generate` for the fields."""
    if lookup:
        s = parse_lookup(stderr)
        return {"text": lookup_text(stdout, prompt_text), "n_generated": s["n_predict"],
                "prompt_tokens": s["prompt_tokens"], "prompt_s": s["prompt_s"],
                "prompt_tok_s": s["prompt_tokens"] / s["prompt_s"],
                "decode_tokens": s["n_predict"] - 1, "decode_s": s["decode_s"],
                "decode_tok_s": (s["n_predict"] - 1) / s["decode_s"],
                "n_drafted": s["n_drafted"], "n_accept": s["n_accept"]}
    p = parse_perf(stderr)
    return {"text": completion_text(stdout), "n_generated": p["eval_runs"] + 1,
            "prompt_tokens": p["prompt_tokens"], "prompt_s": p["prompt_ms"] / 1e3,
            "prompt_tok_s": 1e3 * p["prompt_tokens"] / p["prompt_ms"],
            "decode_tokens": p["eval_runs"], "decode_s": p["eval_ms"] / 1e3,
            "decode_tok_s": 1e3 * p["eval_runs"] / p["eval_ms"]}


def generate(gguf, prompt_text: str, n_tokens: int, threads: int, lookup: bool = False,
             timeout: float = TIMEOUT_S) -> Dict:
    """Greedy end-to-end generation of at most ``n_tokens`` new tokens (EOS stops it) on ``prompt_text``
    (already chat-templated: no template is applied here), with ``--no-repack``.

    ``lookup=False``: llama-completion. ``lookup=True``: llama-lookup with ``--spec-draft-n-max 8`` (it
    finishes the accepted draft it is in, so it may return up to 8 tokens more than ``n_tokens``).

    Returns ``text`` (the new text, without EOS); ``n_generated`` (sampled new tokens, EOS included);
    ``prompt_tokens``, ``prompt_s``, ``prompt_tok_s`` (the prefill); ``decode_tokens`` (n_generated - 1:
    the first new token comes out of the prefill's logits), ``decode_s`` and ``decode_tok_s`` (the
    decode phase): for llama-completion the ``eval time`` line (its single-token decode calls), for
    llama-lookup the wall time of the ``decoded`` line (the whole draft-and-verify loop; its ``eval
    time`` line leaves out the verify batches, which llama.cpp books as prompt eval);
    ``n_drafted``/``n_accept`` (lookup only); ``command`` (the prompt file written as PROMPT.txt)."""
    tools = require_llamacpp()
    tool = "llama-lookup" if lookup else "llama-completion"
    with tempfile.TemporaryDirectory(prefix="taps-llamacpp-") as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        # `-f` drops one trailing newline (chat templates end in one): write one more. `--no-escape`: the
        # text is taken as is (by default llama.cpp turns a literal backslash-n into a newline).
        prompt_file.write_text(prompt_text + "\n", encoding="utf-8")
        argv = [tools[tool], "-m", str(gguf), "-f", str(prompt_file), "--no-escape", "-n", str(n_tokens),
                "-t", str(threads), "-tb", str(threads), "--temp", "0", "--seed", "0", "--no-repack"]
        argv += ["--spec-draft-n-max", str(DRAFT_N_MAX)] if lookup else ["-no-cnv", "--no-display-prompt"]
        proc = _run(tool, argv, timeout, cwd=tmp)
    command = portable_command([a if a != str(prompt_file) else "PROMPT.txt" for a in argv])
    try:
        rec = parse_generate(proc.stdout, proc.stderr, prompt_text, lookup)
    except ValueError as e:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{tool}: {e}: {command}\n--- last stderr lines ---\n{tail}") from None
    rec["command"] = command
    return rec


def peer_rows(gguf, prompts_text: Sequence[str], n_tokens: int, threads: int,
              timeout: float = TIMEOUT_S) -> List[Dict]:
    """The three llama.cpp rows for ``taps bench`` on the same GGUF, prompts, token count and threads.

    Each row: ``name``; ``tok_s``, decode tokens/s: for ``llamacpp-decode`` llama-bench's own mean (no
    prompt), for the end-to-end rows the sum over prompts of ``decode_tokens`` over the sum of
    ``decode_s`` (the prefill and its first token excluded); ``prompt_tok_s`` (sum of prompt tokens over
    sum of prefill seconds); ``n_generated`` (sum over prompts); ``per_prompt`` (each :func:`generate`
    record, ``text`` included); ``llamacpp_commit``, ``source``, ``cpu``, ``threads``, ``n_tokens``,
    ``gguf`` (a portable path) and the exact ``commands``."""
    from taps.decode.latency import cpu_name

    require_llamacpp()
    ver = version()
    common = {"llamacpp_commit": ver["commit"], "source": ver["source"], "cpu": cpu_name(),
              "threads": threads, "n_tokens": n_tokens, "gguf": portable_command([gguf])}
    dec = bench_decode(gguf, threads, n_tokens, timeout)
    rows = [{"name": ROW_DECODE, "tok_s": dec["decode_tok_s"], "prompt_tok_s": None, "n_generated": None,
             "per_prompt": [], **common, "commands": [dec["command"]]}]
    for name, lookup in ((ROW_COMPLETION, False), (ROW_LOOKUP, True)):
        recs = [generate(gguf, p, n_tokens, threads, lookup=lookup, timeout=timeout) for p in prompts_text]
        dec_s = sum(r["decode_s"] for r in recs)
        pre_s = sum(r["prompt_s"] for r in recs)
        rows.append({"name": name,
                     "tok_s": sum(r["decode_tokens"] for r in recs) / dec_s if dec_s > 0 else None,
                     "prompt_tok_s": sum(r["prompt_tokens"] for r in recs) / pre_s if pre_s > 0 else None,
                     "n_generated": sum(r["n_generated"] for r in recs),
                     "per_prompt": recs, **common, "commands": [r["command"] for r in recs]})
    return rows


def agreement(tok, ours: Sequence[Sequence[int]], theirs: Sequence[str]) -> Dict:
    """llama.cpp's greedy texts ``theirs`` against our greedy tokens ``ours`` on the same prompts (an external
    check of the target's numerics: llama.cpp's own int8 and batch paths round differently, so it need not be
    all). Ours drop a final EOS (llama.cpp prints none). Returns ``identical`` (prompts whose texts are equal),
    ``prompts``, and ``agree_tokens``: per prompt, the longest prefix of our tokens whose text starts
    llama.cpp's (all of ours when identical)."""
    eos = tok.eos_token_id
    agree, same = [], 0
    for ids, text in zip(ours, theirs):
        ids = list(ids[:-1]) if ids and ids[-1] == eos else list(ids)
        same += int(tok.decode(ids) == text)
        n = 0
        while n < len(ids) and text.startswith(tok.decode(ids[:n + 1])):
            n += 1
        agree.append(n)
    return {"identical": same, "prompts": len(agree), "agree_tokens": agree}


# ------------------------------------------------------------------------------------------- logits

def llamacpp_logits(gguf, ids: Sequence[int], prompt_len: int, threads: int, timeout: float = TIMEOUT_S):
    """llama.cpp's logits ``[len(ids) - prompt_len + 1, vocab] float32`` after each of ``ids[prompt_len - 1:]``:
    the prompt ``ids[:prompt_len]`` as one batch, then each further token alone (llama-completion's greedy path,
    ``--no-repack``), through ``taps-llamacpp-logits``."""
    import numpy as np
    import torch

    tool = find_logits_tool()
    if tool is None:
        raise RuntimeError(f"{LOGITS_TOOL} not found (looked in {', '.join(str(d) for d in tool_dirs())}); build it "
                           "with `bash scripts/build_llamacpp.sh`")
    if not 1 <= prompt_len <= len(ids):
        raise ValueError(f"prompt_len: expected 1 .. {len(ids)}, received {prompt_len}")
    with tempfile.TemporaryDirectory(prefix="taps-llamacpp-") as tmp:
        tokens, out = Path(tmp) / "tokens.txt", Path(tmp) / "logits.f32"
        tokens.write_text(f"{prompt_len}\n" + " ".join(str(int(t)) for t in ids) + "\n", encoding="utf-8")
        _run(LOGITS_TOOL, [tool, gguf, threads, tokens, out, "--no-repack"], timeout)
        flat = torch.from_numpy(np.fromfile(out, dtype=np.float32))
    rows = len(ids) - prompt_len + 1
    if flat.numel() % rows:
        raise RuntimeError(f"{LOGITS_TOOL} wrote {flat.numel()} floats, not a multiple of {rows} rows")
    return flat.view(rows, -1)


def teacher_forced_logits(target, ids: Sequence[int], first: int = 0):
    """``target``'s logits ``[len(ids) - first, vocab] float32`` after each of ``ids[first:]``, from one forward over
    the whole sequence in a fresh cache: for a GGUF target each row is the one decoding token by token gives, bit
    for bit (``tests/test_gguf_forward.py``); a transformers model runs its own forward."""
    import torch

    from taps.decode.gguf_verifier import chain_bits
    from taps.models.gguf_target import GGUFTarget

    T = len(ids)
    x = torch.tensor([list(ids)], dtype=torch.int64)
    with torch.no_grad():
        if not isinstance(target, GGUFTarget):
            return target(x).logits[0, first:].float()
        keys, values = target.new_cache(1, T)
        zero = torch.zeros(1, dtype=torch.int64)
        return target.forward_rows(x, torch.arange(T)[None], zero, zero, chain_bits(T), keys, values,
                                   torch.zeros(0, dtype=torch.int64), torch.arange(first, T))[0]


def logit_gap(ours, theirs) -> Dict:
    """Two engines' logits ``[N, vocab]`` at the same N positions: ``positions``, ``max_abs_logit_diff``,
    ``mean_abs_logit_diff``, ``max_abs_logprob_diff`` (after each row's log-softmax) and ``top1_agree`` (positions
    whose argmax is the same token)."""
    import torch

    if ours.shape != theirs.shape:
        raise ValueError(f"logits: expected two tensors of one shape, received {tuple(ours.shape)} and "
                         f"{tuple(theirs.shape)}")
    a, b = ours.double(), theirs.double()
    diff = (a - b).abs()
    lp = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs()
    return {"positions": int(a.shape[0]), "max_abs_logit_diff": float(diff.max()),
            "mean_abs_logit_diff": float(diff.mean()), "max_abs_logprob_diff": float(lp.max()),
            "top1_agree": int((a.argmax(-1) == b.argmax(-1)).sum())}


def combine_gaps(gaps: Sequence[Dict]) -> Dict:
    """The totals of several :func:`logit_gap` results: ``positions``, the largest ``max_abs_logit_diff`` and
    ``max_abs_logprob_diff``, the position-weighted ``mean_abs_logit_diff`` and ``top1_agreement`` (a share)."""
    n = sum(g["positions"] for g in gaps)
    return {"positions": n, "max_abs_logit_diff": max(g["max_abs_logit_diff"] for g in gaps),
            "mean_abs_logit_diff": sum(g["mean_abs_logit_diff"] * g["positions"] for g in gaps) / n,
            "max_abs_logprob_diff": max(g["max_abs_logprob_diff"] for g in gaps),
            "top1_agreement": sum(g["top1_agree"] for g in gaps) / n}


def logit_check(target, gguf, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], threads: int) -> Dict:
    """llama.cpp's logits against ``target``'s, teacher-forced on each of ``sequences`` (a prompt of
    ``prompt_lens[i]`` tokens and a continuation) at the positions that predict the continuation and the token
    after it. Returns :func:`combine_gaps` over all positions, ``per_prompt`` (each prompt's gap) and the
    ``command`` (the token and output files as TOKENS.txt / OUT.f32)."""
    per = [logit_gap(teacher_forced_logits(target, ids, p - 1), llamacpp_logits(gguf, ids, p, threads))
           for ids, p in zip(sequences, prompt_lens)]
    return {"prompts": len(per), **combine_gaps(per), "per_prompt": per,
            "command": portable_command([LOGITS_TOOL, gguf, threads, "TOKENS.txt", "OUT.f32", "--no-repack"])}


def rows_beside_ours(args, tok, items, summary: Dict[str, dict], log,
                     ours: Optional[Sequence[Sequence[int]]] = None, target=None) -> List[dict]:
    """llama.cpp's rows on the first turns of ``items`` (same GGUF, token count and threads), printed beside
    our decode-only tokens/s; ``args`` holds ``target`` and ``max_new_tokens``, ``log`` prints a line. ``ours``:
    our AR's first-turn tokens per item; the completion row then records :func:`agreement` with them, and with
    ``target`` (our model) and ``taps-llamacpp-logits`` built, :func:`logit_check` on those tokens."""
    import torch

    from taps.data import encode_prompt
    from taps.models.target import SMOLLM2_NAMES, find_smollm2_gguf

    gguf = find_smollm2_gguf() if args.target in SMOLLM2_NAMES else Path(args.target)
    prompts = [encode_prompt(tok, it.turns[0], raw=it.raw) for it in items]
    texts = [tok.decode(p) for p in prompts]
    try:
        rows = peer_rows(gguf, texts, args.max_new_tokens, torch.get_num_threads())
    except RuntimeError as e:
        raise BenchError(f"--peer llamacpp: {e}") from None
    log(f"llama.cpp {rows[0]['llamacpp_commit']} on {rows[0]['cpu']}, {rows[0]['threads']} thread(s), first turns "
        f"of {len(texts)} prompts, {args.max_new_tokens} tokens: decode tokens/s (prefill and its token excluded)")
    for r in rows:
        log(f"  {r['name']:<48} {r['tok_s']:8.2f}")
    for spec, s in summary.items():
        if s.get("decode_tokens_per_s"):
            log(f"  ours: {spec:<42} {s['decode_tokens_per_s']:8.2f}  (all turns)")
    if ours:
        done = next(r for r in rows if r["name"] == ROW_COMPLETION)
        a = done["agreement_with_our_ar"] = agreement(tok, ours, [r["text"] for r in done["per_prompt"]])
        log(f"  llama-completion's greedy text = our AR's on {a['identical']} of {a['prompts']} first turns; "
            f"tokens before they part: median {sorted(a['agree_tokens'])[len(a['agree_tokens']) // 2]}")
        if target is not None and find_logits_tool() is not None:
            try:
                c = logit_check(target, gguf, [list(p) + list(o) for p, o in zip(prompts, ours)],
                                [len(p) for p in prompts], torch.get_num_threads())
            except RuntimeError as e:
                raise BenchError(f"--peer llamacpp: {e}") from None
            done["logits_vs_ours"] = c
            log(f"  llama.cpp's logits on our AR's tokens ({c['positions']} positions): largest difference "
                f"{c['max_abs_logit_diff']:.3f}, mean {c['mean_abs_logit_diff']:.3f}, same top-1 at "
                f"{100 * c['top1_agreement']:.1f}%")
    return rows

