"""taps.bench.peer_llamacpp without llama.cpp: its parsers on output captured from the real tools
(llama.cpp 0c1e570 from the llama-cpp-python 0.3.36 sdist, SmolLM2-135M-Instruct Q4_1, one thread),
the error when the tools are missing, and the subprocess handling through stand-in scripts."""
import json
import os
import stat
import textwrap

import pytest

from taps.bench import peer_llamacpp as P

# llama-completion -f PROMPT.txt --no-escape -n 32 -t 1 -tb 1 --temp 0 --seed 0 --no-repack -no-cnv
# --no-display-prompt, on "What is the capital of France?" (chat template, no system turn): stops at EOS.
COMPLETION_STDOUT = "The capital of France is Paris. [end of text]\n\n\n"
COMPLETION_STDERR = """\
0.00.623.958 I common_perf_print:    sampling time =       1.52 ms
0.00.623.974 I common_perf_print:    samplers time =       0.46 ms /    24 tokens
0.00.623.981 I common_perf_print:        load time =     239.38 ms
0.00.623.993 I common_perf_print: prompt eval time =     131.35 ms /    16 tokens (    8.21 ms per token,   121.81 tokens per second)
0.00.623.994 I common_perf_print:        eval time =     111.48 ms /     7 runs   (   15.93 ms per token,    62.79 tokens per second)
0.00.623.995 I common_perf_print:       total time =     245.56 ms /    23 tokens
0.00.623.996 I common_perf_print: unaccounted time =       1.20 ms /   0.5 %      (total - sampling - prompt eval - eval) / (total)
0.00.623.996 I common_perf_print:    graphs reused =          6
"""

# llama-lookup ... --spec-draft-n-max 8, -n 32, on the same question with the default system turn.
LOOKUP_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
LOOKUP_TEXT = "L'Étoile, la Marseillaise, la femme au roi, la femme au roi, la femme au roi, la femme au"
LOOKUP_STDOUT = "\n\n" + LOOKUP_PROMPT + LOOKUP_TEXT + "\n\n\n\n"
LOOKUP_STDERR = """\
0.01.090.265 I encoded   37 tokens in    0.278 seconds, speed:  265.735 t/s
0.01.090.285 I decoded   37 tokens in    0.396 seconds, speed:   93.461 t/s
0.01.090.298 I 
0.01.090.311 I n_draft      = 8
0.01.090.324 I n_predict    = 37
0.01.090.336 I n_drafted    = 16
0.01.090.349 I t_draft_flat = 0.04 ms
0.01.090.363 I t_draft      = 0.24 ms, 14.88 us per token, 67226.89 tokens per second
0.01.090.376 I n_accept     = 16
0.01.090.389 I accept       = 100.000%
0.01.090.402 I 
target:

0.01.090.420 I common_perf_print:    sampling time =       3.46 ms
0.01.090.433 I common_perf_print:    samplers time =       1.21 ms /    37 tokens
0.01.090.450 I common_perf_print:        load time =     267.72 ms
0.01.090.464 I common_perf_print: prompt eval time =     361.67 ms /    55 tokens (    6.58 ms per token,   152.07 tokens per second)
0.01.090.477 I common_perf_print:        eval time =     221.41 ms /    18 runs   (   12.30 ms per token,    81.30 tokens per second)
"""

# llama-bench -m <gguf> -t 1 -p 0 -n 64 -r 2 (-o json: a trimmed record; default: markdown).
BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "backends": "CPU",
    "model_type": "llama 256M Q4_1",
    "n_threads": 1,
    "repack": true,
    "n_prompt": 0,
    "n_gen": 64,
    "n_depth": 0,
    "avg_ns": 850926200,
    "stddev_ns": 47332663,
    "avg_ts": 80.975308,
    "stddev_ts": 4.198948,
    "samples_ts": [ 76.6335, 76.967 ]
  }
]"""
BENCH_MD = """\
| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| llama 256M Q4_1                |  92.10 MiB |   134.52 M | CPU        |       1 |            tg64 |         77.62 ± 8.82 |

build: 0c1e570 (1)
"""
VERSION = "version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0 for Linux x86_64\n"


def test_parse_perf():
    assert P.parse_perf(COMPLETION_STDERR) == {"prompt_ms": 131.35, "prompt_tokens": 16,
                                               "eval_ms": 111.48, "eval_runs": 7}
    with pytest.raises(ValueError):
        P.parse_perf("no timings here")


def test_parse_generate_completion():
    rec = P.parse_generate(COMPLETION_STDOUT, COMPLETION_STDERR, "unused", lookup=False)
    assert rec["text"] == "The capital of France is Paris."
    assert rec["n_generated"] == 8 and rec["decode_tokens"] == 7 and rec["prompt_tokens"] == 16
    assert rec["decode_s"] == pytest.approx(0.11148)
    assert rec["decode_tok_s"] == pytest.approx(62.79, abs=0.01)
    assert rec["prompt_tok_s"] == pytest.approx(121.81, abs=0.01)
    # no EOS: only the final blank line goes
    assert P.completion_text("```python\ndef f():\n    return 1\n```\n\n") == "```python\ndef f():\n    return 1\n```"


def test_parse_lookup_and_generate():
    assert P.parse_lookup(LOOKUP_STDERR) == {"prompt_tokens": 37, "prompt_s": 0.278, "n_predict": 37,
                                             "decode_s": 0.396, "n_drafted": 16, "n_accept": 16}
    rec = P.parse_generate(LOOKUP_STDOUT, LOOKUP_STDERR, LOOKUP_PROMPT, lookup=True)
    assert rec["text"] == LOOKUP_TEXT
    assert rec["n_generated"] == 37 and rec["decode_tokens"] == 36
    assert rec["decode_tok_s"] == pytest.approx(36 / 0.396)
    assert rec["prompt_tok_s"] == pytest.approx(37 / 0.278)
    assert (rec["n_drafted"], rec["n_accept"]) == (16, 16)
    # a final EOS is printed as its special text by llama-lookup
    eos_out = "\n\n" + LOOKUP_PROMPT + "The capital of France is Paris.<|im_end|>\n\n\n\n"
    assert P.lookup_text(eos_out, LOOKUP_PROMPT) == "The capital of France is Paris."
    with pytest.raises(ValueError):
        P.parse_lookup(COMPLETION_STDERR)


def test_parse_bench():
    assert P.parse_bench_json(BENCH_JSON) == 80.975308
    both = json.loads(BENCH_JSON)
    both.insert(0, {**both[0], "n_prompt": 512, "n_gen": 0, "avg_ts": 900.0})
    assert P.parse_bench_json(json.dumps(both)) == 80.975308
    assert P.parse_bench_markdown(BENCH_MD) == 77.62
    with pytest.raises(ValueError):
        P.parse_bench_json("[]")


def test_parse_version():
    assert P.parse_version(VERSION) == "0c1e570"
    assert P.parse_version(BENCH_MD) == "0c1e570"
    assert P.parse_version("version: 4567 (abcdef12)") == "abcdef12"
    assert P.parse_version("nothing") is None


@pytest.fixture
def no_tools(tmp_path, monkeypatch):
    empty = tmp_path / "llamacpp"
    empty.mkdir()
    monkeypatch.setenv("TAPS_LLAMACPP_DIR", str(empty))
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path / "cache"))
    return empty


def test_missing_tools(no_tools):
    assert P.find_llamacpp() is None
    for call in (lambda: P.bench_decode("m.gguf", 1, 8), lambda: P.generate("m.gguf", "hi", 8, 1),
                 lambda: P.generate("m.gguf", "hi", 8, 1, lookup=True), lambda: P.peer_rows("m.gguf", ["hi"], 8, 1)):
        with pytest.raises(RuntimeError, match="llama.cpp tools .* not found") as e:
            call()
        assert str(no_tools) in str(e.value) and "scripts/build_llamacpp.sh" in str(e.value)


def _fake_tools(d, script: str):
    """Stand-ins for the three tools: shell scripts running ``script`` (``$0`` is the tool path)."""
    for t in P.TOOLS:
        p = d / t
        p.write_text("#!/bin/sh\n" + textwrap.dedent(script))
        p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_found_and_failure_message(no_tools, tmp_path):
    _fake_tools(no_tools, """\
        echo "loading model" >&2
        echo "error: bad things happened" >&2
        exit 3
        """)
    tools = P.find_llamacpp()
    assert tools == {t: no_tools / t for t in P.TOOLS}
    with pytest.raises(RuntimeError) as e:
        P.bench_decode(tmp_path / "m.gguf", 1, 64)
    msg = str(e.value)
    assert msg.startswith("llama-bench failed with exit code 3: ")
    assert "-t 1 -p 0 -n 64 -o json" in msg and "error: bad things happened" in msg
    with pytest.raises(RuntimeError, match="llama-completion failed with exit code 3"):
        P.generate(tmp_path / "m.gguf", "hi", 8, 1)


def test_timeout_message(no_tools, tmp_path):
    _fake_tools(no_tools, """\
        echo "still loading" >&2
        exec sleep 30
        """)
    with pytest.raises(RuntimeError, match="llama-lookup timed out after 1 s") as e:
        P.generate(tmp_path / "m.gguf", "hi", 8, 1, lookup=True, timeout=1)
    assert "still loading" in str(e.value)


def test_generate_through_stand_in(no_tools, tmp_path):
    """generate() writes the prompt with one extra newline (`-f` drops one), passes the flags, and
    parses the tool's output; the recorded command names no absolute path."""
    (tmp_path / "out.txt").write_text(COMPLETION_STDOUT)
    (tmp_path / "err.txt").write_text(COMPLETION_STDERR)
    _fake_tools(no_tools, f"""\
        printf "%s\\n" "$@" > {tmp_path}/argv.txt
        while [ "$1" != "-f" ]; do shift; done
        cp "$2" {tmp_path}/prompt_seen.txt
        cat {tmp_path}/out.txt
        cat {tmp_path}/err.txt >&2
        """)
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    rec = P.generate(tmp_path / "m.gguf", prompt, 32, 1)
    assert (tmp_path / "prompt_seen.txt").read_text() == prompt + "\n"
    argv = (tmp_path / "argv.txt").read_text().split("\n")
    for flag in ("--temp", "--no-repack", "-no-cnv", "--no-display-prompt", "--no-escape"):
        assert flag in argv
    assert argv[argv.index("-n") + 1] == "32" and argv[argv.index("-t") + 1] == "1"
    assert rec["text"] == "The capital of France is Paris." and rec["n_generated"] == 8
    assert "PROMPT.txt" in rec["command"] and not any(a.startswith("/") for a in rec["command"].split())
    assert rec["command"].split()[0].rstrip("'").endswith("/llama-completion")


class _CharTokenizer:
    """One character per token id (``ord``); id 0 is EOS."""

    eos_token_id = 0

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_agreement_counts_identical_texts_and_where_they_part():
    ours = [[ord(c) for c in "abc"] + [0], [ord(c) for c in "abd"], [ord(c) for c in "xyz"], []]
    a = P.agreement(_CharTokenizer(), ours, ["abc", "abcz", "q", ""])
    # EOS dropped before comparing; "abd" parts from "abcz" after two tokens; an empty output equals an empty text
    assert a == {"identical": 2, "prompts": 4, "agree_tokens": [3, 2, 0, 0]}


def test_logit_gap_measures_both_engines_at_the_same_positions():
    import torch

    ours = torch.tensor([[1.0, 2.0, 3.0], [0.0, 5.0, 1.0]])
    theirs = torch.tensor([[1.0, 2.5, 3.0], [0.0, 4.0, 6.0]])
    g = P.logit_gap(ours, theirs)
    assert g["positions"] == 2 and g["top1_agree"] == 1  # row 1: token 1 vs token 2
    assert g["max_abs_logit_diff"] == pytest.approx(5.0)
    assert g["mean_abs_logit_diff"] == pytest.approx(6.5 / 6)
    want = (torch.log_softmax(ours.double(), -1) - torch.log_softmax(theirs.double(), -1)).abs().max()
    assert g["max_abs_logprob_diff"] == pytest.approx(float(want))
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(2, 2\)"):
        P.logit_gap(ours, theirs[:, :2])


def test_combine_gaps_equals_one_gap_over_all_rows():
    import torch

    g = torch.Generator().manual_seed(3)
    ours, theirs = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    whole = P.logit_gap(ours, theirs)
    parts = P.combine_gaps([P.logit_gap(ours[:2], theirs[:2]), P.logit_gap(ours[2:], theirs[2:])])
    assert parts["positions"] == 7 and parts["top1_agreement"] == whole["top1_agree"] / 7
    for key in ("max_abs_logit_diff", "mean_abs_logit_diff", "max_abs_logprob_diff"):
        assert parts[key] == pytest.approx(whole[key], rel=1e-12)


def _fake_logits_tool(d, rows_written=None):
    """A stand-in ``taps-llamacpp-logits``: logits ``[L - P + 1, 4]`` with row j = (token P - 1 + j) * [1, 2, 3, 4];
    it records its argv. ``rows_written``: write this many floats instead (a broken tool)."""
    import sys

    p = d / P.LOGITS_TOOL
    p.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import sys, struct
        open(sys.argv[4] + ".argv", "w").write(" ".join(sys.argv[1:]))
        lines = open(sys.argv[3]).read().split()
        n, ids = int(lines[0]), [int(t) for t in lines[1:]]
        vals = [t * k for t in ids[n - 1:] for k in (1, 2, 3, 4)]
        if {rows_written!r} is not None:
            vals = vals[:{rows_written!r}]
        open(sys.argv[4], "wb").write(struct.pack(f"<{{len(vals)}}f", *vals))
        """))
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_llamacpp_logits_through_stand_in(no_tools, tmp_path, monkeypatch):
    import torch

    with pytest.raises(RuntimeError, match="taps-llamacpp-logits not found") as e:
        P.llamacpp_logits(tmp_path / "m.gguf", [1, 2, 3], 2, 1)
    assert "scripts/build_llamacpp.sh" in str(e.value)
    _fake_logits_tool(no_tools)
    assert P.find_logits_tool() == no_tools / P.LOGITS_TOOL
    seen = []
    real_run = P._run
    monkeypatch.setattr(P, "_run", lambda tool, argv, timeout: seen.append([str(a) for a in argv]) or
                        real_run(tool, argv, timeout))
    got = P.llamacpp_logits(tmp_path / "m.gguf", [5, 6, 7, 8], 2, 1)
    assert torch.equal(got, torch.tensor([[t * k for k in (1.0, 2.0, 3.0, 4.0)] for t in (6, 7, 8)]))
    argv = seen[0]
    assert argv[1:3] == [str(tmp_path / "m.gguf"), "1"] and argv[-1] == "--no-repack"
    with pytest.raises(ValueError, match="prompt_len: expected 1 .. 4, received 0"):
        P.llamacpp_logits(tmp_path / "m.gguf", [5, 6, 7, 8], 0, 1)
    _fake_logits_tool(no_tools, rows_written=5)
    with pytest.raises(RuntimeError, match="wrote 5 floats, not a multiple of 3 rows"):
        P.llamacpp_logits(tmp_path / "m.gguf", [5, 6, 7, 8], 2, 1)


def test_teacher_forced_logits_are_the_token_by_token_rows(tmp_path):
    """The check's side of ours: one forward over the sequence gives, row for row, the logits of decoding it one
    token at a time (bit for bit), from the row after ``first - 1`` on."""
    import torch

    _C = pytest.importorskip("taps_kernels._C")
    if not _C.gguf_forward_available():
        pytest.skip("the GGUF forward needs AVX-512 or AVX2")
    from gguf_models import write_tiny_gguf

    from taps.decode.gguf_verifier import chain_bits
    from taps.models.gguf_target import load_gguf_target

    target = load_gguf_target(write_tiny_gguf(tmp_path / "tiny.gguf", vocab=80, layers=2))
    ids = [3, 9, 27, 14, 42, 5, 77, 1, 60]
    keys, values = target.new_cache(1, len(ids))
    zero, none = torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    alone = [target.forward_rows(torch.tensor([[t]]), torch.tensor([[i]]), torch.tensor([i]), zero, chain_bits(1),
                                 keys, values, none, zero)[0][0] for i, t in enumerate(ids)]
    got = P.teacher_forced_logits(target, ids, 3)
    assert got.shape == (len(ids) - 3, 80)
    assert torch.equal(got, torch.stack(alone[3:]))
