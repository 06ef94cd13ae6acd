"""Chat prompts written by the target itself (Magpie).

The instruct model is given its chat template up to the user header alone
(``<|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n`` for SmolLM2) and
samples the user turn at temperature ~1 until its end-of-turn token. The
sampled turns are cleaned, deduplicated (normalised text and leading words)
and dropped when they overlap HumanEval or MT-Bench (the shingle filter of
:mod:`taps.training.prompts`). The answers are generated later, greedily, by
``build-data`` like any other prompt.

Resumable: every accepted turn is appended to ``<out>/magpie.jsonl`` with the
batch that produced it; a restart reads the file and continues with the next
batch seed.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import List, Optional

import torch

_SENTINEL = "\x00MAGPIE\x00"


def user_header_ids(tokenizer) -> List[int]:
    """Token ids of the chat template up to (and including) the user header: everything the
    template puts before the content of a first user turn (the default system turn included)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("tokenizer: has no chat template; Magpie prompts need one")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("tokenizer: the chat template does not render the user content verbatim")
    return tokenizer(text.split(_SENTINEL)[0], add_special_tokens=False)["input_ids"]


def _norm_key(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def clean_turn(text: str, min_words: int = 4, max_chars: int = 900) -> Optional[str]:
    """A usable user turn or None (too short, too long, or template debris)."""
    t = text.strip()
    if "<|im_start|>" in t or "<|im_end|>" in t or "<|endoftext|>" in t:
        return None
    if len(t) > max_chars or len(_norm_key(t).split()) < min_words:
        return None
    return t


class MagpieWriter:
    """Samples, filters and stores user turns under ``out_dir/magpie.jsonl``."""

    def __init__(self, out_dir, generator, tokenizer, eval_filter=None, temperature: float = 1.0,
                 max_tokens: int = 96, batch_size: int = 64, seed: int = 0):
        from taps.training.prompts import EvalFilter

        self.path = Path(out_dir) / "magpie.jsonl"
        self.gen, self.tok = generator, tokenizer
        self.filter = eval_filter if eval_filter is not None else EvalFilter()
        self.temperature, self.max_tokens, self.batch_size, self.seed = temperature, max_tokens, batch_size, seed
        self.header = user_header_ids(tokenizer)
        self.turns: List[dict] = []
        self.keys = set()
        self.next_batch = 0
        self.stats = {"sampled": 0, "rejected_clean": 0, "rejected_dup": 0, "rejected_eval": 0}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                r = json.loads(line)
                if r.get("type") == "batch":
                    self.next_batch = max(self.next_batch, r["batch"] + 1)
                    for k in self.stats:
                        self.stats[k] += r.get(k, 0)
                else:
                    self.turns.append(r)
                    self.keys.update(self._dup_keys(r["text"]))

    @staticmethod
    def _dup_keys(text: str):
        w = _norm_key(text).split()
        return {"full:" + " ".join(w), "lead:" + " ".join(w[:10])}

    def exclude(self, texts) -> None:
        """Reject later turns that duplicate any of ``texts`` (prompts used elsewhere, e.g. for training)."""
        for t in texts:
            self.keys |= self._dup_keys(t)

    def ensure(self, n: int) -> List[dict]:
        """Sample until at least ``n`` accepted turns exist; returns all accepted turns (stable order)."""
        eos = self.tok.eos_token_id
        stop = [i for i in (self.tok.convert_tokens_to_ids("<|im_start|>"),
                            self.tok.convert_tokens_to_ids("<|endoftext|>")) if isinstance(i, int) and i >= 0]
        while len(self.turns) < n:
            b = self.next_batch
            g = torch.Generator(device=self.gen.device).manual_seed(self.seed * 1_000_003 + b)
            res = self.gen.generate([self.header] * self.batch_size, self.max_tokens, eos_id=eos,
                                    temperature=self.temperature, generator=g, capture=False, stop_ids=stop)
            st = {"sampled": 0, "rejected_clean": 0, "rejected_dup": 0, "rejected_eval": 0}
            new = []
            for r in res:
                st["sampled"] += 1
                resp = r.tokens[r.prompt_len:]
                if not resp or resp[-1] != eos:  # cut by max_tokens or ended by a foreign token
                    st["rejected_clean"] += 1
                    continue
                t = clean_turn(self.tok.decode(resp[:-1], skip_special_tokens=False))
                if t is None:
                    st["rejected_clean"] += 1
                    continue
                keys = self._dup_keys(t)
                if keys & self.keys:
                    st["rejected_dup"] += 1
                    continue
                if self.filter.overlaps(t):
                    st["rejected_eval"] += 1
                    continue
                self.keys |= keys
                rec = {"kind": "chat", "text": t, "id": hashlib.md5(t.encode()).hexdigest()[:16], "batch": b}
                new.append(rec)
            with open(self.path, "a") as f:
                for rec in new:
                    f.write(json.dumps(rec) + "\n")
                f.write(json.dumps({"type": "batch", "batch": b, **st}) + "\n")
            self.turns.extend(new)
            for k in st:
                self.stats[k] += st[k]
            self.next_batch = b + 1
        return self.turns
