"""Lossless speculative decoding: the batched loop, the target verifier, sampling and per-round statistics."""
from .loop import (BatchDecoder, GenerationError, GenerationResult, Request, SpeculativeDecoder, generate)
from .policies import TreePolicy, available_policies, make_policy
from .sampling import SamplingConfig, choose_tokens, processed_probs
from .stats import STAGES, GenerationStats, RoundStats
from .tree_ops import truncate_depth

__all__ = ["generate", "BatchDecoder", "SpeculativeDecoder", "Request", "GenerationResult", "GenerationError",
           "truncate_depth", "TreePolicy", "make_policy", "available_policies", "SamplingConfig", "choose_tokens",
           "processed_probs", "STAGES", "GenerationStats", "RoundStats"]
