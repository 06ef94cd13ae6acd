"""DFlash: verify the chain of per-position argmax draft tokens."""
from __future__ import annotations

from .base import PolicyError, Stopwatch, TreePolicy, chain_tree, register_policy


class DFlashPolicy(TreePolicy):
    """Chain ``bonus -> argmax q_1 -> ... -> argmax q_D`` (ties: the smallest token id)."""

    def build(self, draft_logits, draft_hidden, bonus):
        sw = Stopwatch()
        with sw("selection"):
            chain = draft_logits[0].argmax(-1)
            tree = chain_tree(bonus, chain)
        return tree, sw.times


@register_policy("dflash", "DFlash: the argmax chain of the D draft positions")
def _make(arg):
    if arg is not None:
        raise PolicyError(f"policy dflash: takes no argument, received {arg!r}")
    return DFlashPolicy()
