"""Greedy speculative decoding is token-identical to HF ``generate(do_sample=False)``, for every policy.

Tiny random Llama targets and tiny random DFlash drafters (built here, no downloads). A random drafter
is rarely right, so an extra test-only policy (``OraclePolicy``) hides the target's true continuation at
random sibling slots of a bushy tree: deep acceptances, non-contiguous accepted paths (real KV
compaction), stop tokens and length limits falling inside a round.
"""
import random

import pytest
import torch

import taps_kernels
from taps.decode import SpeculativeDecoder, generate, make_policy, truncate_depth
from taps.decode.policies import PolicyError, TreePolicy, available_policies
from taps.decode.timing import StageTimer
from taps.decode.policies.base import BuiltTree
from taps_kernels import Tree

from helpers import V, hf_greedy, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def models():
    return tiny_target(0), tiny_drafter(0)


def make_cases(model, n, seed):
    """Random prompts and limits; half the cases stop on a token that really occurs in the continuation."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 20))]
        max_new = rng.randint(1, 24)
        stops = ()
        if i % 2:
            full = hf_greedy(model, prompt, max_new)
            stops = (full[rng.randrange(len(full))],)
        cases.append((prompt, max_new, stops, hf_greedy(model, prompt, max_new, stops)))
    return cases


@pytest.fixture(scope="module")
def cases(models):
    return make_cases(models[0], 8, seed=1)


@pytest.mark.parametrize("spec", ["ar", "dflash", "ddtree:1", "ddtree:4", "ddtree:16"])
def test_greedy_equals_hf_generate(models, cases, spec):
    target, drafter = models
    dec = SpeculativeDecoder(target, make_policy(spec), drafter=drafter)
    for prompt, max_new, stops, ref in cases:
        dec.stop_token_ids = frozenset(stops)
        res = dec.generate(prompt, max_new)
        assert res.token_ids == ref, (spec, prompt, max_new, stops)
        assert res.stop_reason == ("stop_token" if stops and ref[-1] in stops else "max_new_tokens")
        assert sum(r.committed for r in res.stats.rounds) + 1 == len(ref)


def test_deeper_block_and_other_target():
    target, drafter = tiny_target(7), tiny_drafter(7, block_size=9)
    for prompt, max_new, stops, ref in make_cases(target, 4, seed=2):
        for spec in ("dflash", "ddtree:16"):
            res = generate(target, prompt, make_policy(spec), drafter=drafter, max_new_tokens=max_new,
                           stop_token_ids=stops)
            assert res.token_ids == ref, (spec, prompt, max_new, stops)


class OraclePolicy(TreePolicy):
    """Test-only policy: knows the target's greedy continuation and hides it in a bushy random tree.

    At each depth the true token sits at a random slot among ``width - 1`` distractor siblings, some
    distractors get children of their own, and with probability ``p_wrong`` the truth stops at a random
    depth (the rest of the chain is wrong), so rounds end at every possible depth. It reads the decoder's
    committed length on the host (a test policy may; the loop's own policies never do).
    """

    def __init__(self, reference, prompt_len, rng, width=3, depth=6, p_wrong=0.3):
        self.reference, self.rng, self.width, self.depth, self.p_wrong = reference, rng, width, depth, p_wrong
        self.prompt_len = prompt_len
        self.decoder = None
        self.name = "oracle"

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None):
        # tokens generated so far = committed target rows - prompt + the bonus (chosen, not yet run)
        pos = int(self.decoder.verifier.lengths[0]) - self.prompt_len + 1
        truth = self.reference[pos:pos + self.depth]
        if truth and self.rng.random() < self.p_wrong:
            truth = truth[:self.rng.randrange(len(truth))]
        tokens, parents = [int(bonus[0])], [-1]
        on_path = 0
        for d in range(self.depth):
            want = truth[d] if d < len(truth) else None
            others = [t for t in range(V) if t != want]
            kids = self.rng.sample(others, self.width - 1) + ([want] if want is not None else [])
            self.rng.shuffle(kids)
            next_on_path = None
            for t in kids:
                tokens.append(t)
                parents.append(on_path)
                if t == want:
                    next_on_path = len(tokens) - 1
                elif self.rng.random() < 0.3:  # an off-path grandchild
                    tokens.append(self.rng.randrange(V))
                    parents.append(len(tokens) - 2)
            if next_on_path is None:
                break
            on_path = next_on_path
        depth = [0] * len(tokens)
        for i in range(1, len(tokens)):
            depth[i] = depth[parents[i]] + 1
        n = len(tokens)
        tree = Tree(torch.tensor([tokens]), torch.tensor([parents], dtype=torch.int32),
                    torch.tensor([depth], dtype=torch.int32), torch.tensor([n], dtype=torch.int32))
        return BuiltTree(truncate_depth(tree, depth_cap) if depth_cap is not None else tree)


def run_oracle(target, drafter, prompt, max_new, stops, seed):
    full = hf_greedy(target, prompt, max_new + 8)
    policy = OraclePolicy(full, len(prompt), random.Random(seed))
    dec = SpeculativeDecoder(target, policy, drafter=drafter, stop_token_ids=stops)
    policy.decoder = dec
    return dec, dec.generate(prompt, max_new)


def test_oracle_trees_equal_hf_generate(models):
    target, drafter = models
    rng = random.Random(5)
    deep = non_contiguous = 0
    for i in range(10):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 16))]
        max_new = rng.randint(1, 30)
        full = hf_greedy(target, prompt, max_new)
        stops = (full[rng.randrange(len(full))],) if i % 2 else ()
        ref = hf_greedy(target, prompt, max_new, stops)
        dec, res = run_oracle(target, drafter, prompt, max_new, stops, seed=i)
        assert res.token_ids == ref, (prompt, max_new, stops)
        deep += sum(r.accept_len >= 3 for r in res.stats.rounds)
        non_contiguous += sum(r.accept_len >= 2 for r in res.stats.rounds)
    # the test is only meaningful if deep, compacted acceptances happened
    assert deep >= 5 and non_contiguous >= 10


def test_drafter_context_equals_recomputation(models):
    """Mid-generation, the drafter's context cache equals the one built from one target pass over the
    committed sequence: the right rows' features were appended each round."""
    target, drafter = models
    prompt = [3, 14, 15, 9, 26]
    full = hf_greedy(target, prompt, 60)
    policy = OraclePolicy(full, len(prompt), random.Random(3), p_wrong=0.2)
    dec = SpeculativeDecoder(target, policy, drafter=drafter)
    policy.decoder = dec
    dec.start(prompt, 60)
    rounds = [dec.step() for _ in range(6)]
    assert not dec.done and max(r.accept_len for r in rounds) >= 3
    committed = prompt + dec.generated[:-1]  # the last token was chosen but never run
    n = len(committed)
    assert dec.verifier.length == n == dec._state.host_lengths[0] == int(dec._state.lengths[0])
    with torch.no_grad():
        hs = target(torch.tensor([committed]), output_hidden_states=True).hidden_states
    fresh = drafter.new_state(1)
    drafter.append_context(fresh, torch.cat([hs[i + 1] for i in drafter.config.target_layer_ids], -1))
    for st in (dec._state, fresh):  # the rounds since the last draft left their features unprojected
        drafter.flush_context(st)
    for a, b in zip(dec._state.k + dec._state.v, fresh.k + fresh.v):
        torch.testing.assert_close(a[:, :, :n], b[:, :, :n], rtol=1e-4, atol=1e-5)


def test_context_limit_stops_exactly():
    target, drafter = tiny_target(3, ctx=32), tiny_drafter(3)
    prompt = list(range(1, 21))
    ref = hf_greedy(target, prompt, 12)
    for spec in ("ar", "ddtree:16"):
        res = generate(target, prompt, make_policy(spec), drafter=drafter, max_new_tokens=100)
        assert res.token_ids == ref and res.stop_reason == "context"
    from taps.decode import GenerationError
    with pytest.raises(GenerationError, match="prompt: 32 tokens do not fit"):
        generate(target, list(range(32)), make_policy("ar"), max_new_tokens=1)
    with pytest.raises(GenerationError, match="empty prompt"):
        generate(target, [], make_policy("ar"), max_new_tokens=1)
    with pytest.raises(GenerationError, match="max_new_tokens"):
        generate(target, [1], make_policy("ar"), max_new_tokens=0)
    with pytest.raises(GenerationError, match="needs a drafter"):
        generate(target, [1], make_policy("dflash"), max_new_tokens=1)


def real(tree, b=0):
    n = int(tree.num_nodes[b])
    return tree.tokens[b, :n].tolist(), tree.parents[b, :n].tolist()


def test_truncate_depth_keeps_prefix_closed_order():
    #      0 -> 1 -> 3 -> 5 ; 0 -> 2 -> 4
    tree = Tree(torch.tensor([[10, 11, 12, 13, 14, 15]]), torch.tensor([[-1, 0, 0, 1, 2, 3]], dtype=torch.int32),
                torch.tensor([[0, 1, 1, 2, 2, 3]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))
    t = truncate_depth(tree, 1)
    assert real(t) == ([10, 11, 12], [-1, 0, 0]) and t.num_nodes.tolist() == [3]
    assert t.tokens.shape == tree.tokens.shape and t.parents[0, 3:].tolist() == [-1, -1, -1]  # static shape, padded
    t = truncate_depth(tree, 2)
    assert real(t) == ([10, 11, 12, 13, 14], [-1, 0, 0, 1, 2])
    t = truncate_depth(tree, 3)
    assert real(t) == real(tree)
    t = truncate_depth(tree, 0)
    assert real(t) == ([10], [-1])
    t.validate()
    # per-row caps on the device, one call for the batch
    two = Tree(*(torch.cat([x, x]) for x in (tree.tokens, tree.parents, tree.depth, tree.num_nodes)))
    t = truncate_depth(two, torch.tensor([2, 0]))
    assert real(t, 0) == ([10, 11, 12, 13, 14], [-1, 0, 0, 1, 2]) and real(t, 1) == ([10], [-1])
    t.validate()


def test_policy_trees():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, V)
    bonus = torch.tensor([7])
    tree = make_policy("dflash").build(logits, None, bonus).tree
    assert tree.tokens[0].tolist() == [7] + logits[0].argmax(-1).tolist()
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3] and tree.depth[0].tolist() == [0, 1, 2, 3, 4]
    sw = StageTimer()
    tree = make_policy("ddtree:6").build(logits, None, bonus, timer=sw).tree
    pool = taps_kernels.candidate_pool(logits, bonus, top_k=6, pool_size=6)
    assert torch.equal(tree.tokens, pool.tree.tokens) and torch.equal(tree.parents, pool.tree.parents)
    assert "pool" in sw.times
    tree = make_policy("ddtree:6").build(logits, None, bonus, depth_cap=torch.tensor([1])).tree
    assert int(tree.depth.max()) <= 1 and tree.tokens.shape == (1, 7)
    tree = make_policy("ar").build(None, None, bonus).tree
    assert tree.tokens.tolist() == [[7]] and tree.num_nodes.tolist() == [1]
    assert not make_policy("ar").uses_drafter and make_policy("ddtree:3").uses_drafter
    assert make_policy("ddtree").budget == 8
    assert {"ar", "dflash", "ddtree"} <= set(available_policies())
    # batched: every row gets its own tree in one call
    logits = torch.randn(3, 4, V)
    bonus = torch.tensor([7, 8, 9])
    tree = make_policy("dflash").build(logits, None, bonus).tree
    assert tree.tokens[:, 0].tolist() == [7, 8, 9] and torch.equal(tree.tokens[:, 1:], logits.argmax(-1))
    tree = make_policy("ddtree:5").build(logits, None, bonus).tree
    for b in range(3):
        one = make_policy("ddtree:5").build(logits[b:b + 1], None, bonus[b:b + 1]).tree
        assert torch.equal(tree.tokens[b:b + 1], one.tokens) and torch.equal(tree.parents[b:b + 1], one.parents)


@pytest.mark.parametrize("spec,msg", [("nope", "unknown policy 'nope'"),
                                      ("ddtree:x", "expected an integer budget"), ("ddtree:0", "budget >= 1"),
                                      ("ar:3", "takes no argument"), ("", "expected a name")])
def test_bad_policy_specs(spec, msg):
    with pytest.raises(PolicyError, match=msg):
        make_policy(spec)


def test_preallocated_cache_grows(models, cases, monkeypatch):
    """Buffers far too small for the generation must grow (between rounds and inside the drafter) without
    changing a token."""
    from taps.decode.loop import BatchDecoder

    monkeypatch.setattr(BatchDecoder, "_tree_width", lambda self: 0)
    monkeypatch.setattr(type(models[1]), "INITIAL_CAPACITY", 1)
    target, drafter = models
    for prompt, max_new, stops, ref in cases[:4]:
        res = generate(target, prompt, make_policy("ddtree:4"), drafter=drafter, max_new_tokens=max_new,
                       stop_token_ids=stops)
        assert res.token_ids == ref
