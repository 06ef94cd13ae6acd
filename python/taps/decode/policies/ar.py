"""Plain autoregressive decoding as a policy: the tree is the root alone, no drafter runs."""
from __future__ import annotations

from .base import BuiltTree, PolicyError, TreePolicy, register_policy, root_only_tree


class AutoregressivePolicy(TreePolicy):
    uses_drafter = False
    chain_trees = True

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None):
        return BuiltTree(root_only_tree(bonus))


@register_policy("ar", "autoregressive baseline: verify the bonus token alone (no drafter)")
def _make(arg):
    if arg is not None:
        raise PolicyError(f"policy ar: takes no argument, received {arg!r}")
    return AutoregressivePolicy()
