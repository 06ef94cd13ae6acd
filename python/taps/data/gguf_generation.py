"""Batched generation over the shipped target format (:class:`taps.models.gguf_target.GGUFTarget`) for
training data.

:class:`GGUFGenerator` answers many prompts with up to ``batch_size`` rows live at once in one preallocated
KV cache (``[batch_size, kv_heads, capacity, head_dim]`` of ``target.kv_dtype`` per layer). Each decode step is
ONE call of the C++ forward (``csrc/gguf_forward.h``) over every live row (one new token per row), so the rows
share the stream of the weight blocks. A row that ends (a stop token or ``max_new_tokens``) leaves at once and the next
prompt is prefilled into its cache row before the next step (continuous batching), so the batch stays full
while prompts remain. The same call returns the hidden states of the drafter's ``layer_ids`` (the drafter's
target features, read straight from the forward's feature output) and the logits of every row, from which
the top-k log-probabilities are taken.

Exactness: the C++ forward computes each row with arithmetic that does not depend on the other rows (see
``csrc/gguf_forward.h``), and a prefill equals decoding the prompt token by token. Greedy tokens and features
of a row are therefore the same bits whatever batch it ran in, when it was admitted and which cache row it
used; ``tests/test_gguf_generation.py`` checks this exactly, and the tokens against the independent oracle
:func:`taps_kernels.reference.gguf_forward.greedy_reference`.

Prefill: a prefix common to all prompts (the chat template's system turn; the whole prompt of Magpie sampling)
is prefilled once and its keys, values and features copied into each row (a prefill in chunks gives the bits of
a whole one). The rest of the prompts admitted in the same step are prefilled together, right padded to the
longest, in groups of at most ``prefill_tokens`` padded tokens with at most 1/9 padding. A padding node sees
only itself; its keys land beyond the row's prompt and are overwritten by the row's own decode steps before
any query can see them.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch

import taps_kernels
from taps.decode.gguf_verifier import chain_bits

from .generation import GenResult

__all__ = ["GGUFGenerator"]


class _Row:
    """A live row: its prompt, committed length, next token to feed and what it produced so far."""

    __slots__ = ("index", "prompt", "length", "next_token", "tokens", "topk_ids", "topk_logp", "feats")

    def __init__(self, index: int, prompt: List[int], feats: Optional[torch.Tensor]):
        self.index, self.prompt = index, prompt
        self.length = 0
        self.next_token = -1
        self.tokens: List[int] = []
        self.topk_ids: List[torch.Tensor] = []
        self.topk_logp: List[torch.Tensor] = []
        self.feats = feats


class GGUFGenerator:
    """Batched greedy (or sampled) generation over a :class:`~taps.models.gguf_target.GGUFTarget`.

    ``target``: a ``GGUFTarget`` (``load_target(..., target_format="gguf")``). ``layer_ids``: decoder layers
    whose outputs are captured (the drafter's ``target_layer_ids``; a feature of layer ``i`` is transformers'
    ``hidden_states[i + 1]``, the last layer's being the final-normed state). ``batch_size``: rows live at once
    (the cache holds that many rows). ``prefill_tokens``: padded tokens per prefill call at most (bounds the
    float32 feature output of a prefill: ``prefill_tokens * len(layer_ids) * hidden * 4`` bytes).
    ``min_shared_prefix``: a common prefix of all prompts at least this long is prefilled once and copied into
    each row (0: never).
    """

    def __init__(self, target, layer_ids: Sequence[int] = (), batch_size: int = 64, prefill_tokens: int = 4096,
                 min_shared_prefix: int = 8):
        if getattr(target, "format", None) != "gguf" or not hasattr(target, "forward_rows"):
            raise TypeError(f"target: expected a GGUFTarget (target_format='gguf'), received {type(target).__name__}")
        cfg = target.config
        n = int(cfg.num_hidden_layers)
        bad = [int(i) for i in layer_ids if not 0 <= int(i) < n]
        if bad:
            raise ValueError(f"layer_ids: {bad} outside [0, {n})")
        for name, v, lo in (("batch_size", batch_size, 1), ("prefill_tokens", prefill_tokens, 1),
                            ("min_shared_prefix", min_shared_prefix, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: expected an integer >= {lo}, received {v!r}")
        self.target = target
        self.cfg = cfg
        self.layer_ids = [int(i) for i in layer_ids]
        self.batch_size = batch_size
        self.prefill_tokens = prefill_tokens
        self.min_shared_prefix = min_shared_prefix
        self.device = torch.device("cpu")
        self._layers = torch.tensor(self.layer_ids, dtype=torch.int64)
        self._none = torch.zeros(0, dtype=torch.int64)
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        self._shared = None
        #: counters of the last :meth:`generate` call: forward calls, query rows and seconds of the prefills and
        #: decode steps (the C++ forward and the feature copies), seconds choosing tokens (top-k, argmax)
        self.last_stats: dict = {}

    # ------------------------------------------------------------------------------------------------ cache
    def _ensure_cache(self, rows: int, capacity: int) -> None:
        if self.keys and self.keys[0].shape[0] >= rows and self.keys[0].shape[2] >= capacity:
            return  # the buffers of an earlier call serve: lengths say what is valid
        self.keys, self.values = self.target.new_cache(rows, capacity)

    # ------------------------------------------------------------------------------------------------ steps
    def _prefill_shared(self, slot: int, prefix: List[int], capture: bool) -> None:
        """Prefill the prompts' common ``prefix`` once into cache row ``slot`` and keep a copy of its keys,
        values and features for the other rows (a chunked prefill gives the bits of a whole one)."""
        T = len(prefix)
        t0 = time.perf_counter()
        _, feats = self.target.forward_rows(torch.tensor([prefix], dtype=torch.int64),
                                            torch.arange(T, dtype=torch.int64)[None], torch.zeros(1, dtype=torch.int64),
                                            torch.tensor([slot], dtype=torch.int64), chain_bits(T), self.keys,
                                            self.values, self._layers if capture else self._none, self._none)
        self._shared = ([k[slot, :, :T].clone() for k in self.keys], [v[slot, :, :T].clone() for v in self.values],
                        feats[0].to(torch.float16))
        self.last_stats["prefill_calls"] += 1
        self.last_stats["prefill_rows"] += T
        self.last_stats["prefill_seconds"] += time.perf_counter() - t0

    def _prefill(self, slots: List[int], rows: List[_Row], start: int, capture: bool):
        """Prefill ``rows`` into cache rows ``slots``, their first ``start`` tokens (the shared prefix) copied
        from :meth:`_prefill_shared`, the rest in padded groups; returns the last-token logits
        ``[len(rows), vocab]``."""
        out = []
        k = 0
        t0 = time.perf_counter()
        if start:
            sk, sv, sf = self._shared
            for slot, r in zip(slots, rows):
                for dst, src in zip(self.keys + self.values, sk + sv):
                    dst[slot, :, :start] = src
                if r.feats is not None:
                    r.feats[:start] = sf
        while k < len(rows):  # groups of at most prefill_tokens padded tokens, padding at most 1/8 of them
            group = [k]
            longest = real = len(rows[k].prompt) - start
            while k + len(group) < len(rows):
                n = len(rows[k + len(group)].prompt) - start
                nxt = max(longest, n)
                if nxt * (len(group) + 1) > self.prefill_tokens or 8 * nxt * (len(group) + 1) > 9 * (real + n):
                    break
                group.append(k + len(group))
                longest, real = nxt, real + n
            B, N = len(group), longest
            tokens = torch.zeros(B, N, dtype=torch.int64)
            for g, j in enumerate(group):
                p = rows[j].prompt[start:]
                tokens[g, :len(p)] = torch.as_tensor(p, dtype=torch.int64)
            positions = (start + torch.arange(N, dtype=torch.int64)).expand(B, N).contiguous()
            bits = chain_bits(N, torch.tensor([len(rows[j].prompt) - start for j in group]))  # padding: own bit
            last = torch.tensor([g * N + len(rows[j].prompt) - start - 1 for g, j in enumerate(group)],
                                dtype=torch.int64)
            cache_rows = torch.tensor([slots[j] for j in group], dtype=torch.int64)
            logits, feats = self.target.forward_rows(tokens, positions, torch.full((B,), start, dtype=torch.int64),
                                                     cache_rows, bits, self.keys, self.values,
                                                     self._layers if capture else self._none, last)
            self.last_stats["prefill_calls"] += 1
            self.last_stats["prefill_rows"] += B * N
            for g, j in enumerate(group):
                r = rows[j]
                P = len(r.prompt)
                if r.feats is not None:
                    r.feats[start:P] = feats[g, :P - start]
                r.length = P
            out.append(logits)
            k += len(group)
        self.last_stats["prefill_seconds"] += time.perf_counter() - t0
        return torch.cat(out, 0)

    def _decode(self, slots: List[int], rows: List[_Row], capture: bool):
        """One token per live row at its committed length; returns ``[len(rows), vocab]`` logits."""
        B = len(rows)
        t0 = time.perf_counter()
        tokens = torch.tensor([[r.next_token] for r in rows], dtype=torch.int64)
        lens = torch.tensor([r.length for r in rows], dtype=torch.int64)
        logits, feats = self.target.forward_rows(tokens, lens[:, None].contiguous(), lens,
                                                 torch.tensor(slots, dtype=torch.int64),
                                                 torch.ones(B, 1, 1, dtype=torch.int32), self.keys, self.values,
                                                 self._layers if capture else self._none,
                                                 torch.arange(B, dtype=torch.int64))
        self.last_stats["decode_calls"] += 1
        self.last_stats["decode_rows"] += B
        for i, r in enumerate(rows):
            if r.feats is not None:
                r.feats[r.length] = feats[i, 0]
            r.length += 1
        self.last_stats["decode_seconds"] += time.perf_counter() - t0
        return logits

    # ----------------------------------------------------------------------------------------------- generate
    @torch.no_grad()  # results are ordinary tensors (inference tensors refuse in-place writes later)
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int, topk: int = 0,
                 temperature: float = 0.0, generator: Optional[torch.Generator] = None, capture: bool = True,
                 stop_ids: Sequence[int] = ()) -> List[GenResult]:
        """Generate a continuation of every prompt; results in prompt order (:class:`GenResult`).

        ``prompts``: token id lists (any lengths, admitted in the order given, ``batch_size`` rows at a time).
        ``max_new_tokens``: response tokens per row at most; a row also ends with ``eos_id`` or one of
        ``stop_ids`` (kept as its last token). ``temperature == 0``: greedy (``argmax``, the smallest id on
        ties); else softmax sampling at that temperature with ``generator`` (then a row's draws depend on
        the batch it ran in). ``topk > 0``: each response token's top-k log-probabilities at temperature 1
        (``topk_ids [R, k] int64``, ``topk_logp [R, k] float32``). ``capture``: features of ``layer_ids``
        (``feats [len(tokens), len(layer_ids) * hidden] float16``, the last token's row zeros: it is never
        fed).
        """
        prompts = [list(map(int, p)) for p in prompts]
        capacity = self._check_generate(prompts, max_new_tokens, temperature, topk)
        capture = bool(capture) and bool(self.layer_ids)
        nf = len(self.layer_ids) * int(self.cfg.hidden_size) if capture else 0
        stops = {int(eos_id), *map(int, stop_ids)}
        R = min(self.batch_size, len(prompts))
        self._ensure_cache(R, capacity)
        self.last_stats = {"prefill_calls": 0, "prefill_rows": 0, "prefill_seconds": 0.0, "decode_calls": 0,
                           "decode_rows": 0, "decode_seconds": 0.0, "pick_seconds": 0.0}
        results: List[Optional[GenResult]] = [None] * len(prompts)
        free = list(range(R - 1, -1, -1))  # cache rows, popped from the end (row 0 first)
        live: dict = {}  # cache row -> _Row
        queue = list(range(len(prompts)))[::-1]
        start = self._shared_prefix_len(prompts)
        self._shared = None
        while queue or live:
            if queue and free:  # admit as many prompts as there are free cache rows
                slots, rows = [], []
                while queue and free:
                    b = queue.pop()
                    feats = torch.zeros(len(prompts[b]) + max_new_tokens, nf, dtype=torch.float16) if nf else None
                    slots.append(free.pop())
                    rows.append(_Row(b, prompts[b], feats))
                    live[slots[-1]] = rows[-1]
                if start and self._shared is None:
                    self._prefill_shared(slots[0], prompts[0][:start], capture)
                logits = self._prefill(slots, rows, start, capture)
            else:  # freed rows are refilled before the next decode step
                slots = sorted(live)
                rows = [live[s] for s in slots]
                logits = self._decode(slots, rows, capture)
            self._pick(logits, rows, topk, temperature, generator)
            for s, r in zip(slots, rows):
                if r.tokens[-1] in stops or len(r.tokens) >= max_new_tokens:
                    del live[s]
                    results[r.index] = _result(r, topk)
                    free.append(s)
        return results  # type: ignore[return-value]

    def _check_generate(self, prompts: List[List[int]], max_new_tokens, temperature, topk) -> int:
        """Refuses bad :meth:`generate` arguments naming the one at fault; returns the cache capacity needed
        (the longest prompt plus ``max_new_tokens``)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: expected a non-empty list of non-empty token id lists")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an integer >= 1, received {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature: expected >= 0, received {temperature}")
        V = int(self.cfg.vocab_size)
        if isinstance(topk, bool) or not isinstance(topk, int) or not 0 <= topk <= V:
            raise ValueError(f"topk: expected an integer in [0, {V}], received {topk!r}")
        bad = [t for p in prompts for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompts: token id {bad[0]} outside the vocabulary [0, {V})")
        ctx = int(getattr(self.cfg, "max_position_embeddings", 0) or 0)
        longest = max(len(p) for p in prompts)
        capacity = longest + max_new_tokens
        if ctx and capacity > ctx:
            raise ValueError(f"prompts: the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} "
                             f"exceeds the target's context of {ctx} positions")
        return capacity

    def _shared_prefix_len(self, prompts: List[List[int]]) -> int:
        """Tokens of the prompts' common prefix (a chat template's system turn; a Magpie header entirely) to
        prefill once; each row keeps at least its last token to prefill, which gives its first logits. 0 when
        shorter than ``min_shared_prefix`` (or that is 0)."""
        start = min(len(p) for p in prompts) - 1
        for p in prompts[1:]:
            start = next((i for i in range(start) if p[i] != prompts[0][i]), start)
        if not self.min_shared_prefix or start < self.min_shared_prefix:
            start = 0
        return start

    def _pick(self, logits: torch.Tensor, rows: List[_Row], topk: int, temperature: float, generator) -> None:
        """Choose each row's next token from its logits and record it (with its top-k when ``topk``)."""
        t0 = time.perf_counter()
        if topk:  # one pass per row (log-sum-exp and a threshold filter); torch's log_softmax + topk took 1.7x
            stats = taps_kernels.topk_stats(logits[:, None], topk, validate="none")
            tv, ti = stats.topk_logp[:, 0], stats.topk_ids[:, 0]
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        else:
            nxt = taps_kernels.greedy_tokens(logits)
        for i, (r, t) in enumerate(zip(rows, nxt.tolist())):
            r.tokens.append(t)
            if topk:
                r.topk_ids.append(ti[i])
                r.topk_logp.append(tv[i])
            r.next_token = t
        self.last_stats["pick_seconds"] += time.perf_counter() - t0


def _result(r: _Row, topk: int) -> GenResult:
    """The :class:`GenResult` of a finished row."""
    res = GenResult(r.prompt + r.tokens, len(r.prompt))
    if r.feats is not None:
        res.feats = r.feats[:len(res.tokens)].clone()  # the last row stays zeros: never fed
    if topk:
        res.topk_ids = torch.stack(r.topk_ids).long()
        res.topk_logp = torch.stack(r.topk_logp).float()
    return res
