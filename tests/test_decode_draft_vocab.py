"""A drafter with a reduced draft vocabulary: policies that map logit columns back (``handles_draft_vocab``)
get the ``[B, D, V_draft]`` logits and build exactly the trees they build from full-size logits with ``-inf``
outside the vocabulary; both decode the HF greedy output."""
import pytest
import torch

from helpers import hf_greedy, random_scorer, tiny_drafter, tiny_target
from taps.decode import SpeculativeDecoder, make_policy
from taps.decode.policies.ddtree_cost import cost_aware_ddtree_policy
from taps.decode.policies.taps import taps_policy

V = 61
LATENCY = {"latency": [0.05 + 0.004 * n for n in range(17)], "t0": 0.02, "t0_parts": {"context": 0.001}}


def policy(spec):
    if spec == "taps":  # ungated: every round drafts, whatever the timings
        return taps_policy(8, rule="reach", pool_size=16, scorer=random_scorer(False).to_weights(), top_k=8,
                           latency=LATENCY, gate=False)
    if spec == "ddtree-cost":
        return cost_aware_ddtree_policy(8, latency=LATENCY, gate=False)
    return make_policy(spec)


@pytest.mark.parametrize("spec", ["dflash", "ddtree:4", "ddtree:16", "ddtree-cost", "taps"])
def test_draft_vocab_logits_build_the_same_trees(spec):
    target = tiny_target(0, vocab=V)
    drafter = tiny_drafter(0, vocab=V)
    # the target's own greedy continuations are mostly inside the vocabulary: rounds accept tokens
    prompt = [3, 14, 15, 9, 26, 5]
    want = hf_greedy(target, prompt, 24)
    ids = sorted(set(want) | set(range(0, V, 3)))
    drafter.set_draft_vocab(torch.tensor(ids, dtype=torch.int64))
    widths, trees, rounds = {}, {}, {}
    for mapped in (True, False):
        p = policy(spec)
        p.handles_draft_vocab = mapped  # False: the loop hands full-size logits, as to a policy that cannot map
        real_build = p.build

        def build(draft_logits, *args, _real=real_build, _mapped=mapped, **kwargs):
            widths.setdefault(_mapped, set()).add(draft_logits.shape[-1])
            built = _real(draft_logits, *args, **kwargs)
            t = built.tree
            trees.setdefault(_mapped, []).append([x.tolist() for x in (t.tokens, t.parents, t.num_nodes)])
            return built

        p.build = build
        res = SpeculativeDecoder(target, p, drafter=drafter).generate(prompt, 24)
        assert res.token_ids == want
        rounds[mapped] = [(r.accept_len, r.nodes, r.drafted) for r in res.stats.rounds]
        assert (p.vocab_ids is not None) == mapped
    assert widths == {True: {len(ids)}, False: {V}}
    assert len(trees[True]) > 1 and trees[True] == trees[False]
    assert rounds[True] == rounds[False]
