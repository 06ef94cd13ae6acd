"""The speculative decoding loop, batched: prefill each request alone into its row, then rounds of
verify -> commit -> context -> draft -> tree over every running row, with ONE host read per round.

Exactness: every emitted token is the target's own choice (argmax, or a target sample) given its real
prefix, so greedy output equals plain autoregressive decoding token for token (for every request, whatever
else shares the batch), and sampled output has the target's distribution. Stop tokens and
``max_new_tokens`` truncate the last round's committed tokens.

Round structure. A round verifies the trees built at the end of the previous round (or when the request
joined), then builds the next ones::

    verify (tree_attention) -> ONE commit_round call (the target's tokens, the walk, committed tokens, history,
    KV compaction, lengths) -> drafter context update -> [draft -> policy tree]  -> ONE packed read to the host

The drafter's context update keeps the features; a round that drafts projects those of every round since the
last draft in one call, so a round that does not draft never pays for the projection.

Everything before the read stays on the device: position ids, masks, selection, acceptance, compaction,
the drafter's context update and the next trees. The packed read carries, per row, the committed tokens,
the accept length, the next tree's node count and the policy's statistics (expected tokens, chosen size);
stop tokens, length limits, the draft gate (:meth:`TreePolicy.observe`) and the next verify's width (the
batch's largest tree, so that padding costs nothing on a CPU) are decided from it. Building the next tree
before the read is what makes one read enough; the price is a discarded draft in the round that ends a
request early (a stop token, or a long acceptance reaching ``max_new_tokens``).

Batching. ``max_batch`` rows (request slots) share one preallocated target cache and one drafter state
(:mod:`.verifier`, :class:`taps.models.drafter.DFlashState`: right-padded, per-row lengths). A finished
request leaves its row between rounds; a queued request joins a free row between rounds and is prefilled
alone into it (no other row is recomputed). Rounds run the rows ``[0, B)`` with ``B`` = highest busy row + 1;
idle rows inside that range verify a root-only tree and keep nothing.

Prefix reuse. Where the verifier's cache rows are the bits a prefill would write (``exact_prefix_reuse``: the
GGUF forward), a finished request leaves its tokens' cache rows and drafter context in its row, and the next
prompt admitted there runs only what follows the longest common prefix with them (the chat template's system
turn of every prompt; a conversation's earlier turns and answers). What a row holds is forgotten when a round
runs with the row idle (its cache rows past length 0 are written then) or the buffers are made anew. The output
is unchanged by construction: the kept rows are those a prefill of the same tokens leaves.

A round that raises restores every row's target cache length, drafter state and pending tree before the
exception propagates (rows below a length are never written by a round, so restoring the lengths restores
the caches).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

import taps_kernels
from taps_kernels import Tree

from .token_history import TokenHistory
from .policies.base import BuiltTree, TreePolicy
from .readout import HostReadout, RoundReadout
from .sampling import SamplingConfig, choose_tokens, processed_probs
from .stats import BUILD_STAGES, GenerationStats, RoundStats
from .timing import RoundClock, StageTimer
from .tree_ops import pad_tree, root_only_tree, slice_tree, truncate_depth  # noqa: F401  (truncate_depth: API)
from .verifier import make_verifier

#: Largest batch a decoder accepts by default (rows preallocated in the caches).
DEFAULT_MAX_BATCH = 8


class GenerationError(ValueError):
    """Bad generation request (empty prompt, prompt too long, bad limits, too many rows, wrong device): the
    message names the argument and, in a batch, the request index."""


@dataclass
class GenerationResult:
    """``token_ids``: generated tokens only (stop token included when one ended the generation);
    ``stop_reason``: ``"stop_token"``, ``"max_new_tokens"`` or ``"context"``."""

    token_ids: List[int]
    stop_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class Request:
    """One generation request. ``stop_token_ids`` None: the decoder's; ``seed`` seeds this request's own
    sampling generator (None: a random seed), so a request's samples depend only on its seed and the batch."""

    prompt_ids: Union[Sequence[int], torch.Tensor]
    max_new_tokens: int = 64
    stop_token_ids: Optional[Iterable[int]] = None
    seed: Optional[int] = None


class _Row:
    """Host-side state of a running request."""

    def __init__(self, rid: int, prompt: List[int], max_new: int, clipped: bool, stops: frozenset,
                 generator: Optional[torch.Generator]):
        self.rid, self.prompt, self.max_new, self.clipped, self.stops = rid, prompt, max_new, clipped, stops
        self.generator = generator
        self.generated: List[int] = []
        self.stop_reason: Optional[str] = None
        self.stats = GenerationStats(prompt_len=len(prompt))
        self.t_start = time.perf_counter()
        # the tree this row verifies next: real node count (host), whether it was drafted, its build times
        self.next_nodes = 1
        self.next_drafted = False
        self.next_times: Dict[str, float] = {}

    def extend(self, tokens: List[int]) -> int:
        """Commit tokens up to (and including) the first stop token, never past max_new; returns how many."""
        kept = 0
        for t in tokens:
            if len(self.generated) >= self.max_new:
                break
            self.generated.append(t)
            kept += 1
            if t in self.stops:
                self.stop_reason = "stop_token"
                return kept
        if len(self.generated) >= self.max_new:
            self.stop_reason = "context" if self.clipped else "max_new_tokens"
        return kept

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.generated)


class BatchDecoder:
    """Batched lossless speculative decoding for one target, one policy and (when the policy needs one) one
    drafter.

    Args:
        target: HF causal LM (eval mode, full attention).
        policy: a :class:`TreePolicy` (``make_policy("ddtree:8")``).
        drafter: a ``DFlashDrafter``; required iff ``policy.uses_drafter``.
        sampling: :class:`SamplingConfig` (greedy by default); sampled requests draw from their own generator.
        stop_token_ids: default stop tokens of every request (kept in the output, like HF ``generate``).
        max_context: the target's context length (default ``config.max_position_embeddings``).
        max_batch: rows run together (more requests queue and join as rows free up).
        attention: ``"auto"``, ``"taps_tree"`` (tree attention kernel) or ``"sdpa"`` (dense-mask fallback).
        profile: synchronise at every stage boundary on a GPU (exact per-stage times, no overlap).
        static_shapes: verify every round at the policy's full tree width (fixed shapes for CUDA graphs)
            instead of the batch's largest real tree; default: False.
        max_requests: most requests one :meth:`generate_batch` call (or the queue) takes (None: no limit).
        prefix_reuse: run a prompt on top of the cache rows an earlier request left in the row where they
            start it (module docstring; only where the verifier's ``exact_prefix_reuse``); default: True.
    """

    def __init__(self, target, policy: TreePolicy, drafter=None, sampling: Optional[SamplingConfig] = None,
                 stop_token_ids: Iterable[int] = (), max_context: Optional[int] = None,
                 max_batch: int = DEFAULT_MAX_BATCH, attention: str = "auto", profile: bool = False,
                 static_shapes: bool = False, max_requests: Optional[int] = None, prefix_reuse: bool = True):
        if policy.uses_drafter and drafter is None:
            raise GenerationError(f"drafter: policy {policy.name!r} needs a drafter, received None")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise GenerationError(f"max_batch: expected an int >= 1, received {max_batch!r}")
        self.target = target
        self.policy = policy
        self.drafter = drafter if policy.uses_drafter else None
        self.sampling = sampling or SamplingConfig()
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_context = int(max_context or getattr(target.config, "max_position_embeddings", 1 << 30))
        self.max_batch = max_batch
        self.max_requests = max_requests
        self.profile = bool(profile)
        self.static_shapes = bool(static_shapes)
        layer_ids = list(self.drafter.config.target_layer_ids) if self.drafter is not None else None
        try:
            self.verifier = make_verifier(target, layer_ids, attention=attention, max_batch=max_batch)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        self.device = self.verifier.device
        if self.drafter is not None:
            self._embed = target.get_input_embeddings()
            self._head = target.get_output_embeddings()
            self._draft_positions = self.drafter.config.block_size - 1
        else:
            self._draft_positions = 0
        self._max_depth = policy.max_tree_depth(self._draft_positions)
        # committed tokens on the device for policies that look back at them (prompt lookup)
        self._history = TokenHistory(max_batch, self.device) if policy.wants_history else None
        policy.bind(target, self.drafter, self.device)
        # reduced-vocabulary logits for policies that map the columns back: the pool scans a third of the columns
        self._sub_vocab_logits = policy.vocab_ids is not None
        self._rows: List[Optional[_Row]] = [None] * max_batch
        self._queue: List[tuple] = []
        self._results: Dict[int, GenerationResult] = {}
        self._next_id = 0
        self._state = None
        self._pending: Optional[Tree] = None  # [max_batch, N] trees to verify next
        self._pending_stats = None
        self._bonus = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self._remaining = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        # which rows run, on the device: set between rounds, so a round copies nothing from the host
        self._active = torch.zeros(max_batch, dtype=torch.bool, device=self.device)
        self.round_hook = None  # test seam: called inside every round after verify
        self.prefix_reuse = bool(prefix_reuse) and self.verifier.exact_prefix_reuse
        # per free row: (tokens whose cache rows and drafter context it still holds, verifier.buffers_made then)
        self._kept: List[Optional[tuple]] = [None] * max_batch
        self.reset()

    # --- requests ------------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every request and empty the caches (a new batch starts; the policy's gate restarts; what free rows
        still hold stays for prefix reuse)."""
        self.verifier.reset(self.max_batch, 1)
        if self.drafter is not None:
            if self._state is None or self._state.batch_size != self.max_batch:
                self._state = self.drafter.new_state(self.max_batch)
                self._kept = [None] * self.max_batch
            else:  # keep the buffers: the lengths say what is valid
                self._state.lengths.zero_()
                self._state.set_host_lengths([0] * self.max_batch)
        self._rows = [None] * self.max_batch
        self._queue, self._results = [], {}
        self._pending = root_only_tree(torch.zeros(self.max_batch, dtype=torch.int64, device=self.device))
        self._pending_nodes = [1] * self.max_batch  # host: real nodes of each row's pending tree
        self._remaining.zero_()
        self._active.zero_()
        self.policy.reset()

    def _validate(self, index: int, req: Request):
        ids = req.prompt_ids
        if isinstance(ids, torch.Tensor):
            if ids.device != self.device and ids.device.type != "cpu":
                raise GenerationError(f"request {index}: prompt_ids on {ids.device}, the target runs on {self.device}")
            if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
                raise GenerationError(f"request {index}: prompt_ids: expected a 1-D integer tensor, received "
                                      f"{ids.dtype} of shape {tuple(ids.shape)}")
            ids = ids.tolist()
        try:
            prompt = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise GenerationError(f"request {index}: prompt_ids: expected token ids, received {ids!r}") from None
        if not prompt:
            raise GenerationError(f"request {index}: prompt: expected at least one token, received an empty prompt")
        V = int(self.target.config.vocab_size)
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise GenerationError(f"request {index}: prompt: token {bad[0]} is outside the vocabulary [0, {V})")
        m = req.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise GenerationError(f"request {index}: max_new_tokens: expected an int >= 1, received {m!r}")
        if len(prompt) >= self.max_context:
            raise GenerationError(f"request {index}: prompt: {len(prompt)} tokens do not fit the target's context of "
                                  f"{self.max_context} tokens (at least one position must stay free)")
        return prompt

    def submit(self, request: Union[Request, Sequence[int]], max_new_tokens: Optional[int] = None,
               seed: Optional[int] = None) -> int:
        """Queue a request (validated now); returns its id. It joins at the next :meth:`admit`."""
        if not isinstance(request, Request):
            request = Request(request, max_new_tokens if max_new_tokens is not None else 64, None, seed)
        rid = self._next_id
        if self.max_requests is not None and len(self._queue) + len(self.running) >= self.max_requests:
            raise GenerationError(f"request {rid}: the decoder takes at most {self.max_requests} requests at a time")
        prompt = self._validate(rid, request)
        self._next_id += 1
        self._queue.append((rid, prompt, request))
        return rid

    @property
    def running(self) -> List[int]:
        """Busy rows."""
        return [b for b, r in enumerate(self._rows) if r is not None]

    @property
    def idle(self) -> bool:
        return not self._queue and not self.running

    def admit(self) -> List[int]:
        """Move queued requests into free rows (between rounds): each prompt is prefilled alone into its row,
        its first token chosen and its first tree built. Returns the ids admitted."""
        done = []
        while self._queue and None in self._rows:
            rid, prompt, req = self._queue.pop(0)
            free = [b for b, r in enumerate(self._rows) if r is None]
            self._start_row(max(free, key=lambda b: (self._reusable(b, prompt), -b)), rid, prompt, req)
            done.append(rid)
        return done

    def _reusable(self, b: int, prompt: List[int]) -> int:
        """Leading tokens of ``prompt`` whose cache rows free row ``b`` still holds (at most all but the last: its
        logits choose the first token)."""
        kept = self._kept[b]
        if kept is None or kept[1] != self.verifier.buffers_made:
            return 0
        tokens, n = kept[0], min(len(kept[0]), len(prompt) - 1)
        i = 0
        while i < n and tokens[i] == prompt[i]:
            i += 1
        return i

    @torch.inference_mode()
    def _start_row(self, b: int, rid: int, prompt: List[int], req: Request) -> None:
        max_new = min(req.max_new_tokens, self.max_context - len(prompt))
        stops = self.stop_token_ids if req.stop_token_ids is None else frozenset(int(t) for t in req.stop_token_ids)
        gen = None
        if not self.sampling.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(req.seed) if req.seed is not None else torch.seed())
        row = _Row(rid, prompt, max_new, max_new < req.max_new_tokens, stops, gen)
        t0 = time.perf_counter()
        # room for the prompt, the output and one tree past it (the verify writes the whole padded tree)
        self.verifier.reserve(len(prompt) + max_new + self._tree_width() + 1)
        if self._history is not None:
            self._history.reserve(len(prompt) + max_new + self._max_depth + 2)
        keep = self._reusable(b, prompt)
        self._kept[b] = None  # from here on the row is this request's
        logits, feats = self.verifier.prefill_row(b, prompt, start=keep)
        if self.drafter is not None:
            self.drafter.reset_row(self._state, b, keep)
            self.drafter.append_context(self._state, feats, rows=slice(b, b + 1))
        first = int(choose_tokens(logits.view(1, -1), self.sampling, gen)[0])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        row.stats.prefill_s = time.perf_counter() - t0
        row.stats.prefix_reused = keep
        row.extend([first])
        if self._history is not None:
            self._history.set_row(b, prompt + [first])
        self._rows[b] = row
        self._active[b] = True
        self._bonus[b] = first
        self._remaining[b] = row.remaining
        if row.stop_reason is not None:
            self._finish(b)
            return
        # the first tree of this row, built alone (other rows keep theirs)
        timer = StageTimer(self.device, self.profile)
        bonus = self._bonus[b:b + 1]
        drafted = self.drafter is not None and row.remaining > 1 and self.policy.wants_draft()
        built = self._build(bonus, drafted, (self._remaining[b:b + 1] - 1).clamp(min=0), 1, timer, slice(b, b + 1))
        n = int(built.tree.num_nodes[0])  # admission reads freely: it is not a round
        if built.aux is not None:
            self.policy.observe_rows({b: None}, {b: built.aux[0].tolist()})
        self._set_pending_row(b, built.tree)
        row.next_nodes, row.next_drafted, row.next_times = n, drafted, timer.seconds()
        self._pending_nodes[b] = n
        if drafted and built.expected is not None:
            self.policy.observe(built.expected.tolist(), built.sizes.tolist(), row.next_times)

    def _tree_width(self) -> int:
        """Widest tree the policy can build (upper bound for cache room)."""
        return self.policy.tree_width(self._draft_positions)

    def _set_pending_row(self, b: int, tree: Tree) -> None:
        width = max(self._pending.tokens.shape[1], tree.tokens.shape[1])
        pend, tree = pad_tree(self._pending, width), pad_tree(tree, width)
        for f in ("tokens", "parents", "depth", "num_nodes"):
            getattr(pend, f)[b:b + 1] = getattr(tree, f)
        self._pending = pend

    def _finish(self, b: int) -> None:
        row = self._rows[b]
        row.stats.total_s = time.perf_counter() - row.t_start
        self._results[row.rid] = GenerationResult(list(row.generated), row.stop_reason, row.stats)
        self._rows[b] = None
        self._active[b] = False
        if self.prefix_reuse:  # its committed tokens' rows: the prompt and every generated token but the last
            n = self.verifier.host_lengths[b]
            if self._state is not None and self._state.host_lengths is not None:
                n = min(n, self._state.host_lengths[b])
            self._kept[b] = ((row.prompt + row.generated)[:n], self.verifier.buffers_made)
        self.verifier.reset_row(b)
        if self.drafter is not None:
            self.drafter.reset_row(self._state, b)
        self._remaining[b] = 0
        # an idle row inside a later round's range verifies a root alone (never a stale, wider tree)
        pend = self._pending
        pend.tokens[b] = 0
        pend.parents[b] = -1
        pend.depth[b] = 0
        pend.num_nodes[b] = 1
        self._pending_nodes[b] = 1

    # --- one round ---------------------------------------------------------------------------------------------

    def _build(self, bonus: torch.Tensor, drafted: bool, depth_cap: torch.Tensor, rows: int,
               timer: StageTimer, state_rows: Optional[slice] = None) -> BuiltTree:
        """Trees for ``bonus [R]`` (the drafter and the history read rows ``state_rows``, default ``0 .. R-1``)."""
        extra = {}
        if self._history is not None:
            extra["history"] = self._history.rows(state_rows or slice(0, bonus.numel()))
        if self.drafter is None or (not drafted and extra):  # policies that build trees without a draft
            return self.policy.build(None, None, bonus, depth_cap, timer, rows, **extra)
        if not drafted:
            return BuiltTree(root_only_tree(bonus))
        with timer("context"):  # the context rows of the rounds since the last draft, in one call
            self.drafter.flush_context(self._state)
        with timer("draft"):
            logits, hidden = self.drafter.draft(self._state, bonus, self._embed, self._head, rows=state_rows,
                                                num_positions=self.policy.draft_positions(self._draft_positions),
                                                full_vocab_logits=not self._sub_vocab_logits)
        return self.policy.build(logits, hidden, bonus, depth_cap, timer, rows, **extra)

    def _choice(self, logits: torch.Tensor, rows: List[Optional[_Row]]) -> Dict[str, torch.Tensor]:
        """How the commit chooses the target's tokens: ``{"logits": ...}`` (their argmax) when greedy, else
        ``{"target_tokens": [B, N]}``: per running row one sample per node from its own generator."""
        if self.sampling.greedy:
            return {"logits": logits}
        out = taps_kernels.greedy_tokens(logits)
        for b, row in enumerate(rows):
            if row is not None:
                probs = processed_probs(logits[b], self.sampling)
                out[b] = torch.multinomial(probs, 1, generator=row.generator).view(-1)
        return {"target_tokens": out}

    def step(self) -> Dict[int, RoundStats]:
        """Run one round over the running rows; returns ``{request id: RoundStats}``. On an exception every
        row's target cache length, drafter state and pending tree are restored before it propagates."""
        busy = self.running
        if not busy:
            raise RuntimeError("step: no request is running; submit() and admit() first")
        B = busy[-1] + 1
        rows = self._rows[:B]
        for b in range(B):  # an idle row verifies a root in this round, over what it held
            if rows[b] is None:
                self._kept[b] = None
        # the batch's largest pending tree, idle rows included (the read reported every row's node count)
        width = self._pending.tokens.shape[1] if self.static_shapes else max(self._pending_nodes[:B])
        # between rounds, host side: room for this round's tree in every running row (never inside a round)
        self.verifier.reserve(max(self.verifier.host_lengths[:B]) + width + 1)
        snap = (self.verifier.lengths.clone(), self._remaining.clone(), self._bonus.clone(), self._pending,
                None if self._state is None else self._state.snapshot(),
                None if self._history is None else self._history.lengths.clone())
        try:
            return self._round(B, rows, width)
        except BaseException:
            lengths, remaining, bonus, pending, state, history = snap
            self.verifier.lengths.copy_(lengths)
            self._remaining.copy_(remaining)
            self._bonus.copy_(bonus)
            self._pending = pending
            if state is not None:
                self._state.restore(state)
            if history is not None:
                self._history.lengths.copy_(history)
            raise

    @torch.inference_mode()
    def _round(self, B: int, rows: List[Optional[_Row]], width: int) -> Dict[int, RoundStats]:
        """verify -> commit -> build the next trees -> THE host read -> host bookkeeping."""
        dev = self.device
        timer = StageTimer(dev, self.profile)
        clock = RoundClock(dev)
        clock.start()
        active = self._active[:B]
        tree = slice_tree(Tree(*(t[:B] for t in (self._pending.tokens, self._pending.parents, self._pending.depth,
                                                   self._pending.num_nodes))), width)
        # chains (a root alone, DFlash's argmax chain) need neither a tree mask on the sdpa path nor moves
        chain = width == 1 or self.policy.chain_trees
        with timer("verify"):
            logits, hidden_states = self.verifier.verify_batch(tree, B, chain=chain)
        if self.round_hook is not None:
            self.round_hook(self)
        P = min(width - 1, self._max_depth) + 1
        with timer("accept"):  # the target's tokens, the walk, the history append, the compaction: one call
            history = None if self._history is None else self._history.buffers(B)
            path, accept_len, next_token, committed = self.verifier.commit_round(
                tree, active, P - 1, history=history, moves=not chain, **self._choice(logits, rows))
        if self.drafter is not None:
            with timer("context"):  # the accepted rows' features, kept unprojected until a draft needs them
                feats = self.verifier.features(hidden_states)
                self.drafter.append_context(self._state, feats, counts=accept_len, path=path)
        self._remaining[:B] -= accept_len
        bonus = torch.where(active, next_token, self._bonus[:B])
        # the next trees (host decides whether to draft: a row may still need >= 2 tokens after this round)
        running = sum(r is not None for r in rows)
        drafted = (self.drafter is not None and any(r is not None and r.remaining >= 3 for r in rows)
                   and self.policy.wants_draft())
        depth_cap = torch.where(active, (self._remaining[:B] - 1).clamp(min=0), torch.zeros_like(accept_len))
        built = self._build(bonus, drafted, depth_cap, running, timer)
        readout = RoundReadout(committed, accept_len, built.tree.num_nodes, built.tree.tokens[:, 0] == bonus,
                               built.expected, built.sizes, built.aux)
        round_end = clock.stop()
        host = readout.read()  # THE host read of the round
        # --- host side: nothing above changed host state, so an exception there left everything restorable
        for b in range(B):
            if rows[b] is not None and not host.root_ok[b]:
                raise ValueError(f"policy {self.policy.name}: tree root of row {b} is not its bonus token")
        return self._apply(host, rows, built, bonus, drafted, timer.seconds(), RoundClock.seconds(round_end))

    def _apply(self, host: HostReadout, rows: List[Optional[_Row]], built: BuiltTree, bonus: torch.Tensor,
               drafted: bool, times: Dict[str, float], round_s: float) -> Dict[int, RoundStats]:
        """The round's host bookkeeping from its one read: tokens, lengths, stats, pending trees, the policy's
        observations, finished rows."""
        B = len(rows)
        build_times = {k: v for k, v in times.items() if k in BUILD_STAGES}
        verify_times = {k: v for k, v in times.items() if k not in build_times}
        out: Dict[int, RoundStats] = {}
        new_lengths = list(self.verifier.host_lengths)
        for b, row in enumerate(rows):
            if row is None:
                continue
            acc = host.accept_len[b]
            kept = row.extend(host.tokens(b))
            new_lengths[b] += acc
            r = RoundStats(accept_len=acc, nodes=row.next_nodes, committed=kept,
                           times={**row.next_times, **verify_times}, drafted=row.next_drafted, round_s=round_s)
            row.stats.rounds.append(r)
            out[row.rid] = r
            row.next_nodes, row.next_drafted, row.next_times = host.next_nodes[b], drafted, dict(build_times)
        for b in range(B):
            self._pending_nodes[b] = host.next_nodes[b]
        self.verifier.set_host_lengths(new_lengths)
        if self._state is not None:
            self._state.set_host_lengths(new_lengths)
        self._bonus[:B] = bonus
        nxt = built.tree
        self._pending = pad_tree(nxt, nxt.tokens.shape[1]) if B == self.max_batch else self._merge_pending(nxt, B)
        live = [b for b in range(B) if rows[b] is not None]
        if host.aux is not None:
            self.policy.observe_rows({b: host.committed[b][:host.accept_len[b]] for b in live},
                                     {b: host.aux[b] for b in live})
        if drafted:
            exp = [host.expected[b] for b in live] if host.expected is not None else None
            siz = [host.sizes[b] for b in live] if host.sizes is not None else None
            self._observe(built, exp, siz, build_times)
        for b, row in enumerate(rows):
            if row is not None and row.stop_reason is not None:
                self._finish(b)
        return out

    def _merge_pending(self, nxt: Tree, B: int) -> Tree:
        width = max(nxt.tokens.shape[1], 1)
        pend = pad_tree(self._pending, max(width, self._pending.tokens.shape[1]))
        nxt = pad_tree(nxt, pend.tokens.shape[1])
        return Tree(*(torch.cat([getattr(nxt, f), getattr(pend, f)[B:]]) for f in ("tokens", "parents", "depth",
                                                                                       "num_nodes")))

    def _observe(self, built: BuiltTree, expected, sizes, times) -> None:
        if built.expected is None:
            expected = sizes = None
        self.policy.observe(expected, sizes, times)

    # --- drivers -------------------------------------------------------------------------------------------------

    def run(self) -> Dict[int, GenerationResult]:
        """Admit and step until every submitted request finished; returns ``{id: GenerationResult}``."""
        while not self.idle:
            self.admit()
            if self.running:
                self.step()
        return dict(self._results)

    def generate_batch(self, requests: Sequence[Union[Request, Sequence[int]]], max_new_tokens: int = 64,
                       seed: Optional[int] = None) -> List[GenerationResult]:
        """Generate for every request (lists of token ids or :class:`Request`), ``max_batch`` at a time with
        continuous batching; results in input order. ``seed`` seeds request i with ``seed + i`` when the
        requests carry none."""
        reqs = []
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                r = Request(r, max_new_tokens, None, None if seed is None else seed + i)
            reqs.append(r)
        if self.max_requests is not None and len(reqs) > self.max_requests:
            raise GenerationError(f"request {self.max_requests}: a batch of {len(reqs)} requests; this decoder takes "
                                  f"at most {self.max_requests} requests at a time")
        for i, r in enumerate(reqs):  # validate all before running any
            self._validate(i, r)
        self.reset()
        ids = [self.submit(r) for r in reqs]
        results = self.run()
        return [results[i] for i in ids]


class SpeculativeDecoder(BatchDecoder):
    """One request at a time (``max_batch=1``): ``start`` / ``step`` / ``generate`` of a single prompt; the
    same loop as :class:`BatchDecoder` with B = 1."""

    def __init__(self, target, policy: TreePolicy, drafter=None, sampling: Optional[SamplingConfig] = None,
                 stop_token_ids: Iterable[int] = (), max_context: Optional[int] = None, attention: str = "auto",
                 profile: bool = False, static_shapes: bool = False, prefix_reuse: bool = True):
        super().__init__(target, policy, drafter=drafter, sampling=sampling, stop_token_ids=stop_token_ids,
                         max_context=max_context, max_batch=1, attention=attention, profile=profile,
                         static_shapes=static_shapes, prefix_reuse=prefix_reuse)
        self._rid: Optional[int] = None

    def start(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: Optional[int] = None) -> None:
        """Validate, prefill the prompt, choose the first token, build the first tree."""
        req = Request(prompt_ids, max_new_tokens, None, seed)
        self._validate(0, req)
        self.reset()
        self._rid = self.submit(req)
        self.admit()

    def _row(self) -> Optional[_Row]:
        return self._rows[0]

    @property
    def done(self) -> bool:
        return self._rid is None or self._rid in self._results

    @property
    def generated(self) -> List[int]:
        row = self._row()
        if row is not None:
            return row.generated
        res = self._results.get(self._rid)
        return list(res.token_ids) if res is not None else []

    @property
    def stop_reason(self) -> Optional[str]:
        res = self._results.get(self._rid)
        return res.stop_reason if res is not None else None

    @property
    def stats(self) -> GenerationStats:
        row = self._row()
        if row is not None:
            return row.stats
        res = self._results.get(self._rid)
        return res.stats if res is not None else GenerationStats()

    def step(self) -> RoundStats:
        """Run one round; on an exception the caches and the drafter state are restored first."""
        if self.done:
            raise RuntimeError("step: the generation is finished; call start() again")
        return super().step()[self._rid]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: Optional[int] = None) -> GenerationResult:
        """Prefill and run rounds until a stop token, ``max_new_tokens`` or the context end."""
        self.start(prompt_ids, max_new_tokens, seed=seed)
        while not self.done:
            self.step()
        return self._results[self._rid]


def generate(target, prompt_ids: Sequence[int], policy: TreePolicy, drafter=None, max_new_tokens: int = 64,
             sampling: Optional[SamplingConfig] = None, stop_token_ids: Iterable[int] = (), seed: Optional[int] = None,
             max_context: Optional[int] = None, attention: str = "auto") -> GenerationResult:
    """Generate with speculative decoding (one prompt); see :class:`BatchDecoder` for the arguments.

    Returns a :class:`GenerationResult` whose ``token_ids`` (generated tokens only) equal plain greedy
    decoding of the target when ``sampling`` is greedy.
    """
    dec = SpeculativeDecoder(target, policy, drafter=drafter, sampling=sampling, stop_token_ids=stop_token_ids,
                             max_context=max_context, attention=attention)
    return dec.generate(prompt_ids, max_new_tokens, seed=seed)
