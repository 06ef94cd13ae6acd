"""Tree policies: one file per policy, all behind :class:`TreePolicy`; build one with ``make_policy("ddtree:16")``."""
from .base import (BuiltTree, PolicyError, TreePolicy, available_policies, chain_tree, make_policy,
                   parse_budget, policy_from_options, policy_options, policy_params, register_policy,
                   root_only_tree)

__all__ = ["TreePolicy", "BuiltTree", "policy_params", "policy_options", "PolicyError", "make_policy", "policy_from_options", "register_policy", "available_policies",
           "parse_budget", "root_only_tree", "chain_tree"]
