"""Per-round and per-generation statistics of the decode loop."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

#: Stages timed in every round, in the order a round runs them. "verify" is the target's forward; "accept" the
#: commit (the target's tokens, the acceptance walk, KV compaction: :func:`taps_kernels.commit_round`); "context"
#: the drafter's update with the accepted tokens' target features (zero for policies without a drafter); "lookup"
#: the prompt-lookup match and graft (lookup policies only).
STAGES = ("draft", "pool", "scoring", "selection", "lookup", "verify", "accept", "context")
#: The stages that build the next round's tree (they run at the end of a round, for the tree verified next);
#: all but "draft" are the policy's own work.
BUILD_STAGES = STAGES[:5]
#: The time-split columns of benchmark tables (prefill, then every round stage) and their header.
SPLIT_STAGES = ("prefill",) + STAGES
SPLIT_HEADER = "time split % (prefill/draft/pool/score/select/lookup/verify/accept/context)"


@dataclass
class RoundStats:
    """One round: ``accept_len`` (tau: tokens committed, root included), ``nodes`` verified (root included),
    ``committed`` tokens kept after stop/limit truncation, ``times`` seconds per stage (keys from STAGES),
    ``drafted`` whether the verified tree came from a draft (False for plain rounds: no drafter, a gated round,
    the last token); ``round_s`` the whole round's seconds (device time on a GPU), shared by the batch's rows.
    ``times`` holds the stages that verified this round's tree plus those that built it (its draft, pool,
    scoring and selection ran at the end of the previous round, or when the request joined)."""

    accept_len: int
    nodes: int
    committed: int
    times: Dict[str, float] = field(default_factory=dict)
    drafted: bool = True
    round_s: float = 0.0


@dataclass
class GenerationStats:
    """Whole call: prefill time, rounds, and aggregates over rounds."""

    prompt_len: int = 0
    #: leading prompt tokens whose cache rows an earlier request of the same row had left (not recomputed)
    prefix_reused: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0
    rounds: List[RoundStats] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def tau(self) -> float:
        """Mean acceptance length per round (root included), before stop/limit truncation; 0 without rounds."""
        return sum(r.accept_len for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def nodes_per_round(self) -> float:
        return sum(r.nodes for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    def stage_totals(self) -> Dict[str, float]:
        """Seconds per stage summed over rounds (every key of STAGES present), plus ``"prefill"``."""
        out = {s: 0.0 for s in STAGES}
        for r in self.rounds:
            for k, v in r.times.items():
                out[k] = out.get(k, 0.0) + v
        out["prefill"] = self.prefill_s
        return out

    def to_dict(self) -> dict:
        return {"prompt_len": self.prompt_len, "prefix_reused": self.prefix_reused, "prefill_s": self.prefill_s,
                "total_s": self.total_s,
                "rounds": self.num_rounds, "tau": self.tau, "nodes_per_round": self.nodes_per_round,
                "time_split": self.stage_totals(),
                "accept_lens": [r.accept_len for r in self.rounds]}
