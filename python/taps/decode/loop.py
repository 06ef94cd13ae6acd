"""The speculative decoding loop: prefill, then rounds of draft -> tree -> verify -> accept -> compact -> context.

Exactness: every emitted token is the target's own choice (argmax, or a target
sample) given its real prefix, so greedy output equals plain autoregressive
decoding token for token, and sampled output has the target's distribution.
Stop tokens and ``max_new_tokens`` truncate the last round's committed tokens.
A round that raises leaves the target cache and the drafter state as they were
before it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import torch

import taps_kernels
from taps_kernels import Tree

from .policies.base import Stopwatch, TreePolicy, root_only_tree
from .sampling import SamplingConfig, choose_tokens
from .stats import GenerationStats, RoundStats
from .verifier import TargetVerifier


class GenerationError(ValueError):
    """Bad generation request (empty prompt, prompt too long, bad limits): the message names the argument."""


@dataclass
class GenerationResult:
    """``token_ids``: generated tokens only (stop token included when one ended the generation);
    ``stop_reason``: ``"stop_token"``, ``"max_new_tokens"`` or ``"context"``."""

    token_ids: List[int]
    stop_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


def truncate_depth(tree: Tree, max_depth: int) -> Tree:
    """Drop the nodes deeper than ``max_depth`` from a batch-1 tree (the rest stays prefix-closed and keeps
    its order); returns the input when nothing is dropped."""
    n = int(tree.num_nodes[0])
    depth = tree.depth[0, :n]
    keep = depth <= max_depth
    if bool(keep.all()):
        return tree
    idx = keep.nonzero().view(-1)
    new_index = torch.cumsum(keep.to(torch.int64), 0) - 1
    parents = tree.parents[0, idx].long()
    new_parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents).to(torch.int32)
    m = idx.numel()
    return Tree(tree.tokens[:, idx], new_parents.view(1, m), tree.depth[:, idx],
                torch.tensor([m], dtype=torch.int32, device=tree.device))


class SpeculativeDecoder:
    """Batch-1 decoder for one target, one policy and (when the policy needs one) one drafter.

    Args:
        target: HF causal LM (eval mode).
        policy: a :class:`TreePolicy` (``make_policy("ddtree:16")``).
        drafter: a ``DFlashDrafter`` (``new_state``, ``append_context``, ``draft``, ``rollback``,
            ``config.target_layer_ids``); required iff ``policy.uses_drafter``.
        sampling: :class:`SamplingConfig` (greedy by default).
        stop_token_ids: tokens that end the generation (kept in the output, like HF ``generate``).
        max_context: the target's context length (default ``config.max_position_embeddings``).
    """

    def __init__(self, target, policy: TreePolicy, drafter=None, sampling: Optional[SamplingConfig] = None,
                 stop_token_ids: Iterable[int] = (), max_context: Optional[int] = None):
        if policy.uses_drafter and drafter is None:
            raise GenerationError(f"drafter: policy {policy.name!r} needs a drafter, received None")
        self.target = target
        self.policy = policy
        self.drafter = drafter if policy.uses_drafter else None
        self.sampling = sampling or SamplingConfig()
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_context = int(max_context or getattr(target.config, "max_position_embeddings", 1 << 30))
        layer_ids = list(self.drafter.config.target_layer_ids) if self.drafter is not None else None
        self.verifier = TargetVerifier(target, layer_ids)
        self.device = self.verifier.device
        if self.drafter is not None:
            self._embed = target.get_input_embeddings()
            self._head = target.get_output_embeddings()
        policy.bind(target, self.drafter, self.device)
        self._state = None
        self.generated: List[int] = []
        self.max_new_tokens = 0
        self.stop_reason: Optional[str] = None
        self.stats = GenerationStats()
        self.generator: Optional[torch.Generator] = None

    # --- one generation, step by step ----------------------------------------------------------------------------

    def start(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: Optional[int] = None) -> None:
        """Validate, prefill the prompt, choose the first token.

        Args:
            prompt_ids: token ids of the prompt (non-empty, shorter than the context).
            max_new_tokens: ``>= 1``; clipped so that prompt + output fits the context.
            seed: RNG seed for sampling (ignored when greedy).
        """
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise GenerationError("prompt: expected at least one token, received an empty prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens: expected an int >= 1, received {max_new_tokens!r}")
        if len(prompt_ids) >= self.max_context:
            raise GenerationError(f"prompt: {len(prompt_ids)} tokens do not fit the target's context of "
                                  f"{self.max_context} tokens (at least one position must stay free)")
        self.max_new_tokens = min(max_new_tokens, self.max_context - len(prompt_ids))
        self._clipped = self.max_new_tokens < max_new_tokens
        if not self.sampling.greedy:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(int(seed) if seed is not None else torch.seed())
        self.stats = GenerationStats(prompt_len=len(prompt_ids))
        self.generated, self.stop_reason = [], None
        self.policy.reset()
        t0 = time.perf_counter()
        logits, feats = self.verifier.prefill(torch.tensor([prompt_ids], dtype=torch.int64),
                                              capacity=len(prompt_ids) + self.max_new_tokens + 64)
        if self.drafter is not None:
            self._state = self.drafter.new_state(batch_size=1)
            self.drafter.append_context(self._state, feats)
        first = int(choose_tokens(logits.view(1, -1), self.sampling, self.generator)[0])
        self.stats.prefill_s = time.perf_counter() - t0
        self._extend([first])

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def _extend(self, tokens: List[int]) -> int:
        # Commit tokens up to (and including) the first stop token, and never past max_new_tokens.
        kept = 0
        for t in tokens:
            if len(self.generated) >= self.max_new_tokens:
                break
            self.generated.append(t)
            kept += 1
            if t in self.stop_token_ids:
                self.stop_reason = "stop_token"
                return kept
        if len(self.generated) >= self.max_new_tokens:
            self.stop_reason = "context" if self._clipped else "max_new_tokens"
        return kept

    def step(self) -> RoundStats:
        """Run one round. On an exception the target cache and the drafter state are restored to their
        pre-round length before it propagates."""
        if self.done:
            raise RuntimeError("step: the generation is finished; call start() again")
        pre_len = self.verifier.length
        try:
            return self._round()
        except BaseException:
            self.verifier.crop(pre_len)
            if self._state is not None:
                self.drafter.rollback(self._state, pre_len)
            raise

    @torch.inference_mode()
    def _round(self) -> RoundStats:
        sw = Stopwatch()
        bonus = torch.tensor([self.generated[-1]], dtype=torch.int64, device=self.device)
        # Nodes deeper than this could only produce tokens the limit truncates.
        depth_cap = self.max_new_tokens - len(self.generated) - 1
        drafted = self.drafter is not None and depth_cap > 0 and self.policy.wants_draft()
        if self.drafter is None:
            tree, policy_times = self.policy.build(None, None, bonus)
        elif not drafted:
            tree, policy_times = root_only_tree(bonus), {}
        else:
            with sw("draft"):
                draft_logits, draft_hidden = self.drafter.draft(self._state, bonus, self._embed, self._head)
            tree, policy_times = self.policy.build(draft_logits, draft_hidden, bonus)
        for k, v in policy_times.items():
            sw.times[k] = sw.times.get(k, 0.0) + v
        if int(tree.tokens[0, 0]) != self.generated[-1]:
            # the root must be the bonus token, else the round would verify a token the target never chose
            raise ValueError(f"policy {self.policy.name}: tree root token {int(tree.tokens[0, 0])} is not the "
                             f"bonus token {self.generated[-1]}")
        tree = truncate_depth(tree, depth_cap)

        with sw("verify"):
            logits, hidden_states, tree = self.verifier.verify(tree)
            target_tokens = choose_tokens(logits, self.sampling, self.generator)
        n = tree.tokens.shape[1]
        with sw("accept"):
            if n == 1:
                path = torch.zeros(1, 1, dtype=torch.int64)
                accept_len, next_token = 1, int(target_tokens[0])
            else:
                path, acc, nxt = taps_kernels.accept_greedy(tree, target_tokens.view(1, n).to(tree.device))
                accept_len, next_token = int(acc[0]), int(nxt[0])
            nodes = path[0, :accept_len].cpu()
            committed = tree.tokens[0].cpu()[nodes[1:]].tolist() + [next_token]
        with sw("compaction"):
            self.verifier.commit(path, accept_len)
        if self._state is not None:
            with sw("context"):
                self.drafter.append_context(self._state, self.verifier.features(hidden_states,
                                                                                 nodes.to(self.device)))
        kept = self._extend(committed)
        r = RoundStats(accept_len=accept_len, nodes=n, committed=kept, times=sw.times, drafted=drafted)
        self.stats.rounds.append(r)
        return r

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: Optional[int] = None) -> GenerationResult:
        """Prefill and run rounds until a stop token, ``max_new_tokens`` or the context end."""
        t0 = time.perf_counter()
        self.start(prompt_ids, max_new_tokens, seed=seed)
        while not self.done:
            self.step()
        self.stats.total_s = time.perf_counter() - t0
        return GenerationResult(list(self.generated), self.stop_reason, self.stats)


def generate(target, prompt_ids: Sequence[int], policy: TreePolicy, drafter=None, max_new_tokens: int = 64,
             sampling: Optional[SamplingConfig] = None, stop_token_ids: Iterable[int] = (), seed: Optional[int] = None,
             max_context: Optional[int] = None) -> GenerationResult:
    """Generate with speculative decoding (batch 1); see :class:`SpeculativeDecoder` for the arguments.

    Returns a :class:`GenerationResult` whose ``token_ids`` (generated tokens only) equal plain greedy
    decoding of the target when ``sampling`` is greedy.
    """
    dec = SpeculativeDecoder(target, policy, drafter=drafter, sampling=sampling, stop_token_ids=stop_token_ids,
                             max_context=max_context)
    return dec.generate(prompt_ids, max_new_tokens, seed=seed)
