"""Lossless speculative decoding: the loop, the target verifier, sampling and per-round statistics."""
from .loop import GenerationError, GenerationResult, SpeculativeDecoder, generate, truncate_depth
from .policies import TreePolicy, available_policies, make_policy
from .sampling import SamplingConfig, choose_tokens, processed_probs
from .stats import STAGES, GenerationStats, RoundStats

__all__ = ["generate", "SpeculativeDecoder", "GenerationResult", "GenerationError", "truncate_depth", "TreePolicy",
           "make_policy", "available_policies", "SamplingConfig", "choose_tokens", "processed_probs", "STAGES",
           "GenerationStats", "RoundStats"]
