"""DFlash: verify the chain of per-position argmax draft tokens."""
from __future__ import annotations

from ..tree_ops import truncate_depth
from .base import NO_TIMER, BuiltTree, PolicyError, TreePolicy, chain_tree, register_policy


class DFlashPolicy(TreePolicy):
    """Chain ``bonus -> argmax q_1 -> ... -> argmax q_D`` per row (ties: the smallest token id), cut at the
    row's depth cap; ``N = D + 1`` columns."""

    chain_trees = True
    handles_draft_vocab = True

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None):
        timer = timer or NO_TIMER
        with timer("selection"):
            ids = draft_logits.argmax(-1)  # sorted vocab_ids: the smallest column is the smallest token id
            tree = chain_tree(bonus, ids if self.vocab_ids is None else self.vocab_ids[ids])
            if depth_cap is not None:
                tree = truncate_depth(tree, depth_cap)
        return BuiltTree(tree)


@register_policy("dflash", "DFlash: the argmax chain of the D draft positions")
def _make(arg):
    if arg is not None:
        raise PolicyError(f"policy dflash: takes no argument, received {arg!r}")
    return DFlashPolicy()
