"""Prompt lookup: the n-gram match and the graft into a tree (both backends: the torch reference and C++) and the
token history equal plain Python references exactly on random inputs of awkward shapes; the ``lookup`` and ``taps-lookup`` policies decode
exactly HF ``generate``'s greedy output (batched, rows joining, both attention paths); their acceptance
estimate counts what the target really accepted; a failed round restores the history."""
import random

import pytest
import torch

from helpers import hf_greedy, random_scorer, random_tree, tiny_drafter, tiny_target
from taps.decode import BatchDecoder, Request, SpeculativeDecoder, make_policy
from taps.decode.token_history import TokenHistory, accepted_prefix, lookup_only_tree
from taps.decode.policies.base import PolicyError
from taps.decode.policies.lookup import costed_lookup_policy, taps_lookup_policy
from taps.decode.policies.sources import ChainAcceptance
from taps_kernels import Tree, graft_chain, lookup_chain
from taps_kernels.backend import unavailable_reason
from taps_kernels.reference.accept import append_history_reference

V = 61
LATENCY = {"latency": [0.05 + 0.004 * n for n in range(17)], "t0": 0.02, "t0_parts": {"context": 0.001}}


# --- references ---------------------------------------------------------------------------------------------------

def lookup_reference(history, num_tokens, max_ngram):
    """(chain, ngram, sibling) of one row: the latest earlier occurrence of the longest matching suffix, and the
    next token of the latest occurrence that continued differently (-1: none)."""
    L = len(history)
    for n in range(min(max_ngram, L - 1), 0, -1):
        suffix = history[L - n:]
        starts = [s for s in range(0, L - n) if history[s:s + n] == suffix]
        if starts:
            first = history[starts[-1] + n]
            others = [history[s + n] for s in starts if history[s + n] != first]
            return history[starts[-1] + n:starts[-1] + n + num_tokens], n, (others[-1] if others else -1)
    return [], 0, -1


def graft_reference(par, tok, reach, chain, chain_reach):
    """Plain-list graft of one row: (parents, tokens, depth, reach, chain node indices)."""
    par, tok, reach = list(par), list(tok), list(reach)
    depth = [0] * len(par)
    for i in range(1, len(par)):
        depth[i] = depth[par[i]] + 1
    cur, nodes = 0, []
    for k, c in enumerate(chain):
        kids = [i for i in range(len(par)) if par[i] == cur and tok[i] == c and i > 0]
        if kids:
            child = kids[0]
            reach[child] = max(reach[child], chain_reach[k])
        else:
            par.append(cur), tok.append(c), depth.append(depth[cur] + 1), reach.append(chain_reach[k])
            child = len(par) - 1
        nodes.append(child)
        cur = child
    return par, tok, depth, reach, nodes


def rows_of(tree: Tree, b: int):
    n = int(tree.num_nodes[b])
    return tree.parents[b, :n].tolist(), tree.tokens[b, :n].tolist(), tree.depth[b, :n].tolist()


# --- device ops against the references ----------------------------------------------------------------------------

_CPP_WHY = unavailable_reason("cpp", "cpu")
BACKENDS = ["reference", pytest.param("cpp", marks=pytest.mark.skipif(bool(_CPP_WHY), reason=_CPP_WHY or "-"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,C,K,max_ngram,vocab", [(1, 1, 1, 3, 5), (3, 17, 4, 3, 4), (5, 40, 10, 2, 7),
                                                   (2, 9, 12, 4, 2), (4, 64, 3, 1, 30)])
def test_lookup_chain_equals_reference(B, C, K, max_ngram, vocab, backend):
    rng = random.Random(B * 1000 + C)
    for _ in range(20):
        lengths = [rng.randint(1, C) for _ in range(B)]
        rows = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        tokens = torch.full((B, C), 99, dtype=torch.int64)  # junk past each length must never be matched
        for b, r in enumerate(rows):
            tokens[b, :len(r)] = torch.tensor(r)
        chain, chain_len, ngram, sibling = lookup_chain(tokens, torch.tensor(lengths), K, max_ngram, backend=backend)
        assert chain.shape == (B, K)
        for b, r in enumerate(rows):
            want, n, sib = lookup_reference(r, K, max_ngram)
            assert int(ngram[b]) == n and int(chain_len[b]) == len(want) and int(sibling[b]) == sib, (r, want, n)
            assert chain[b, :len(want)].tolist() == want and not chain[b, len(want):].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,N,K", [(1, 1, 1), (3, 7, 4), (4, 20, 10), (2, 33, 3)])
def test_graft_chain_equals_reference(B, N, K, backend):
    rng = random.Random(N * 31 + K)
    for _ in range(15):
        tree = random_tree(rng, B, N, vocab=4)
        # distinct sibling tokens, as pools have: re-token every node by its rank among its siblings
        tok = tree.tokens.clone()
        for b in range(B):
            seen = {}
            for i in range(1, int(tree.num_nodes[b])):
                p = int(tree.parents[b, i])
                tok[b, i] = seen.get(p, 0)
                seen[p] = int(tok[b, i]) + 1
        tree = Tree(tok, tree.parents, tree.depth, tree.num_nodes)
        reach = -torch.rand(B, N) * 4
        reach[:, 0] = 0
        reach = torch.where(torch.arange(N)[None, :] < tree.num_nodes[:, None].long(), reach,
                            torch.tensor(float("-inf")))
        # chains that follow existing paths for a while, then leave them
        chain = torch.tensor([[rng.randrange(3) for _ in range(K)] for _ in range(B)])
        chain_len = torch.tensor([rng.randint(0, K) for _ in range(B)])
        chain_reach = torch.cumsum(-torch.rand(B, K), 1)
        got, got_reach, nodes = graft_chain(tree, reach, chain, chain_len, chain_reach, backend=backend)
        assert got.tokens.shape == (B, N + K)
        for b in range(B):
            n = int(tree.num_nodes[b])
            L = int(chain_len[b])
            par, tk, dep, rr, want_nodes = graft_reference(tree.parents[b, :n].tolist(), tree.tokens[b, :n].tolist(),
                                                            reach[b, :n].tolist(), chain[b, :L].tolist(),
                                                            chain_reach[b, :L].tolist())
            assert rows_of(got, b) == (par, tk, dep)
            assert got_reach[b, :len(par)].tolist() == pytest.approx(rr, abs=0)
            assert torch.isinf(got_reach[b, len(par):]).all()
            assert nodes[b].tolist() == want_nodes + [-1] * (K - L)
            assert all(p < i for i, p in enumerate(par) if i > 0)  # topological


@pytest.mark.skipif(bool(_CPP_WHY), reason=_CPP_WHY or "-")
def test_cpp_lookup_equals_reference_bit_for_bit():
    """Edge values the list references do not cover: empty histories, chain lengths outside [0, K], NaN and
    -inf reach; the C++ and torch paths give the same tensors (NaN in the same places)."""
    rng = random.Random(11)
    for trial in range(40):
        B, C, K = rng.randint(1, 4), rng.randint(1, 30), rng.randint(0, 9)
        tokens = torch.randint(0, 3, (B, C))
        lengths = torch.tensor([rng.choice([0, 1, rng.randint(0, C), C]) for _ in range(B)])
        ref = lookup_chain(tokens, lengths, K, 3, backend="reference")
        got = lookup_chain(tokens, lengths, K, 3, backend="cpp")
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
        tree = random_tree(rng, B, rng.randint(1, 12), vocab=3)
        N = tree.tokens.shape[1]
        reach = torch.cumsum(-torch.rand(B, N), 1)
        reach[torch.rand(B, N) < 0.1] = float("nan")
        reach[torch.rand(B, N) < 0.1] = float("-inf")
        chain = torch.randint(0, 3, (B, K))
        chain_len = torch.tensor([rng.randint(-1, K + 2) for _ in range(B)])
        chain_reach = torch.cumsum(-torch.rand(B, K), 1)
        chain_reach[torch.rand(B, K) < 0.1] = float("nan")
        (rt, rr, rn), (gt, gr, gn) = (graft_chain(tree, reach, chain, chain_len, chain_reach, backend=b)
                                      for b in ("reference", "cpp"))
        for f in ("tokens", "parents", "depth", "num_nodes"):
            assert torch.equal(getattr(rt, f), getattr(gt, f)), (trial, f)
        # NaN where the reference has NaN (its payload is not part of the contract), the same bits elsewhere
        assert torch.equal(rr.isnan(), gr.isnan()) and torch.equal(rn, gn)
        assert rr[~rr.isnan()].numpy().tobytes() == gr[~gr.isnan()].numpy().tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookup_ops_refuse_bad_input(backend):
    tokens, lengths = torch.zeros(2, 5, dtype=torch.int64), torch.tensor([3, 6])
    with pytest.raises(ValueError, match=r"lengths\[1\]: expected a history length in \[0, 5\].*received 6"):
        lookup_chain(tokens, lengths, 4, backend=backend)
    with pytest.raises(TypeError, match="tokens"):
        lookup_chain(tokens.int(), torch.tensor([3, 3]), 4, backend=backend)
    with pytest.raises(ValueError, match="num_tokens"):
        lookup_chain(tokens, torch.tensor([3, 3]), -1, backend=backend)
    with pytest.raises(ValueError, match="num_tokens: .* of outputs"):
        lookup_chain(tokens, torch.tensor([3, 3]), 2 ** 31 - 3, backend=backend)
    with pytest.raises(TypeError, match="tokens"):
        lookup_chain(None, torch.tensor([3, 3]), 4, backend=backend)
    tree = Tree(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([[-1, 0, -1]] * 2, dtype=torch.int32),
                torch.tensor([[0, 1, 0]] * 2, dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32))
    reach = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="chain: expected 2 rows"):
        graft_chain(tree, reach, torch.zeros(3, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                    torch.zeros(3, 4), backend=backend)
    with pytest.raises(ValueError, match="chain_log_reach: requires grad, but graft_chain has no backward"):
        graft_chain(tree, reach, torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                    torch.zeros(2, 4, requires_grad=True), backend=backend)
    with pytest.raises(ValueError, match="chain_log_reach"):
        graft_chain(tree, reach, torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                    torch.zeros(2, 3), backend=backend)
    with pytest.raises(TypeError, match="log_reach"):
        graft_chain(tree, reach.double(), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                    torch.zeros(2, 4), backend=backend)


def test_token_history_appends_like_lists():  # the reference append (accept_round appends through it)
    rng = random.Random(5)
    h = TokenHistory(3, "cpu")
    ref = [[], [], []]
    for b in range(3):
        ref[b] = [rng.randrange(V) for _ in range(rng.randint(1, 5))]
        h.set_row(b, ref[b])
    for _ in range(30):
        P = rng.randint(1, 6)
        counts = [rng.randint(0, P) for _ in range(3)]
        committed = torch.full((3, P), -1, dtype=torch.int64)
        for b in range(3):
            new = [rng.randrange(V) for _ in range(counts[b])]
            committed[b, :counts[b]] = torch.tensor(new, dtype=torch.int64)
            ref[b] += new
        h.reserve(max(len(r) for r in ref))  # grows between rounds, keeping every row
        append_history_reference(*h.buffers(3), committed, torch.tensor(counts))
        tokens, lengths = h.rows(slice(0, 3))
        assert lengths.tolist() == [len(r) for r in ref]
        assert [tokens[b, :len(r)].tolist() for b, r in enumerate(ref)] == ref


def test_lookup_only_tree_is_the_capped_chain():
    chain = torch.tensor([[4, 5, 6], [7, 8, 9], [1, 2, 3]])
    tree = lookup_only_tree(torch.tensor([10, 11, 12]), chain, torch.tensor([3, 0, 2]), torch.tensor([1, 5, 5]))
    assert tree.num_nodes.tolist() == [2, 1, 3]
    assert rows_of(tree, 0) == ([-1, 0], [10, 4], [0, 1])
    assert rows_of(tree, 1) == ([-1], [11], [0])
    assert rows_of(tree, 2) == ([-1, 0, 1], [12, 1, 2], [0, 1, 2])
    assert tree.tokens[0, 2:].tolist() == [0, 0] and tree.parents[0, 2:].tolist() == [-1, -1]


# --- acceptance estimate ------------------------------------------------------------------------------------------

def test_acceptance_counts_the_accepted_prefix_of_the_kept_chain_and_the_next_token_for_the_sibling():
    pol = taps_lookup_policy(8, scorer=random_scorer(False).to_weights(), top_k=8, latency=LATENCY, sibling=True)
    est, sib = pol.lookup.acceptance, pol.lookup.sibling_acceptance
    assert accepted_prefix([4, 5, 9], [4, 5, 6, 7]) == 2 and accepted_prefix([], [1]) == 0
    # rows: match length, chain length, chain nodes kept, sibling (-1: none), sibling kept, the chain. Row 0
    # proposes chain 4 5 6 7 and sibling 8 after a 2-token match, 3 chain nodes kept; row 1 kept none, no sibling
    start = ([1.0] * 4, [2.0] * 4)  # the prior's pseudo-counts
    pol.observe_rows({0: None, 1: None}, {0: [2, 4, 3, 8, 1, 4, 5, 6, 7], 1: [1, 4, 0, -1, 0, 9, 9, 9, 9]})
    assert (est.success, est.failure) == start and (sib.success, sib.failure) == start
    # committed: row 0 accepted 4 5, then the target said 1; row 1's target said 9
    pol.observe_rows({0: [4, 5, 1], 1: [9]}, {0: [3, 2, 2, 7, 1, 1, 1, 0, 0], 1: [1, 4, 0, 3, 0, 0, 0, 0, 0]})
    # 2 of 3 kept chain tokens accepted, then one rejected; the next token was not the sibling
    assert est.success[2] == pytest.approx(0.9 + 2) and est.failure[2] == pytest.approx(1.8 + 1)
    assert sib.success[2] == pytest.approx(0.9) and sib.failure[2] == pytest.approx(1.8 + 1)
    assert (est.success[1], est.failure[1], sib.success[1], sib.failure[1]) == (1.0, 2.0, 1.0, 2.0)  # nothing to learn
    # row 1's sibling 3 was not in its tree, but the target's next token tells whether it was right
    pol.observe_rows({0: [1, 1, 5], 1: [3]}, {0: [0] * 9, 1: [0] * 9})
    assert est.success[3] == pytest.approx(0.9 + 2) and est.failure[3] == pytest.approx(1.8)
    assert sib.success[3] == pytest.approx(0.9) and sib.failure[3] == pytest.approx(1.8 + 1)
    assert sib.success[1] == pytest.approx(0.9 + 1) and sib.failure[1] == pytest.approx(1.8)
    assert est.success[1] == 1.0 and est.failure[1] == 2.0
    acc = ChainAcceptance(3)
    assert acc.rate(2) == pytest.approx(1 / 3)
    acc.record(2, 3, False)
    lr = acc.log_reach(torch.tensor([0, 2]), 4)
    q = (0.9 + 3) / (0.9 + 3 + 1.8)
    assert torch.allclose(lr[1], torch.log(torch.tensor(q)) * torch.arange(1, 5)), lr
    assert lr[0].tolist() == [0.0] * 4  # no match: the chain is empty (its reach is never used)
    for _ in range(12):  # lookup that is never right: the rate falls below a node's price (the prior fades)
        acc.record(1, 0, True)
    assert acc.rate(1) < 0.05
    acc.success[1] = 0.0  # what thousands of failures leave (the decayed successes underflow)
    assert acc.log_reach(torch.tensor([1]), 2).tolist() == [[float("-inf")] * 2]


# --- decoding ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    return tiny_target(0, vocab=V), tiny_drafter(0, vocab=V)


def taps_lookup(sibling=False):
    return taps_lookup_policy(8, pool_size=16, scorer=random_scorer(False).to_weights(), top_k=8, latency=LATENCY,
                              sibling=sibling)


def policy_of(spec):
    if spec.startswith("taps-lookup"):
        return taps_lookup(sibling=spec.endswith("-sibling"))
    if spec.startswith("lookup-cost"):
        return costed_lookup_policy(latency=LATENCY, sibling=spec.endswith("-sibling"))
    return make_policy(spec)


def repetitive_requests(target, n, seed):
    """Prompts that repeat a short pattern (lookup matches and is often right), ragged lengths and stops."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pattern = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
        prompt = (pattern * 12)[:rng.randint(1, 40)]
        max_new = rng.randint(3, 30)
        stops = ()
        if i % 3 == 2:
            full = hf_greedy(target, prompt, max_new)
            stops = (full[rng.randrange(len(full))],)
        out.append((Request(prompt, max_new, stops), hf_greedy(target, prompt, max_new, stops)))
    return out


@pytest.mark.parametrize("spec", ["lookup", "lookup:3", "taps-lookup", "lookup-cost", "taps-lookup-sibling",
                                  "lookup-cost-sibling"])
def test_lookup_policies_equal_hf_generate(models, spec):
    target, drafter = models
    for req, ref in repetitive_requests(target, 8, seed=3):
        policy = policy_of(spec)
        res = SpeculativeDecoder(target, policy, drafter=drafter if policy.uses_drafter else None,
                                 stop_token_ids=req.stop_token_ids).generate(req.prompt_ids, req.max_new_tokens)
        assert res.token_ids == ref, spec


@pytest.mark.parametrize("attention", ["taps_tree", "sdpa"])
@pytest.mark.parametrize("spec", ["lookup:4", "taps-lookup", "lookup-cost", "lookup-cost-sibling"])
def test_lookup_policies_batched(models, spec, attention):
    """Rows of a batch, requests joining as rows free up: each request gets its own greedy output, and the
    chains (several tokens per round on these prompts) really were accepted; with the sibling the trees branch at
    the root."""
    target, drafter = models
    reqs = repetitive_requests(target, 7, seed=8)
    policy = policy_of(spec)
    dec = BatchDecoder(target, policy, drafter=drafter if policy.uses_drafter else None, max_batch=3,
                       attention=attention)
    sibling_rows, observe = [], policy.observe_rows
    policy.observe_rows = lambda accepted, aux: (sibling_rows.extend(aux.values()), observe(accepted, aux))
    got = dec.generate_batch([r for r, _ in reqs])
    assert [g.token_ids for g in got] == [ref for _, ref in reqs]
    assert max(r.accept_len for g in got for r in g.stats.rounds) > 2
    if spec != "lookup:4":  # the estimate learned from the target's verdicts (it starts at 1 and 2 per length)
        assert sum(policy.lookup.acceptance.success) + sum(policy.lookup.acceptance.failure) != 3.0 * 4
    if spec.endswith("-sibling"):  # siblings were found, verified (trees that branch at the root) and learned from
        assert not policy.chain_trees and any(row[4] == 1 for row in sibling_rows)
        assert sum(policy.lookup.sibling_acceptance.success) + sum(policy.lookup.sibling_acceptance.failure) != 12


def test_failed_round_restores_the_history(models, monkeypatch):
    target, drafter = models
    prompt, max_new = [3, 4, 5, 3, 4, 5, 3, 4], 20
    ref = hf_greedy(target, prompt, max_new)
    dec = SpeculativeDecoder(target, taps_lookup(), drafter=drafter)
    dec.start(prompt, max_new)
    dec.step()
    tokens, lengths = (t.clone() for t in dec._history.rows(slice(0, 1)))
    n = int(lengths[0])
    assert tokens[0, :n].tolist() == prompt + dec.generated
    with monkeypatch.context() as m:
        m.setattr(dec.policy, "build", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            dec.step()  # the history was appended before the policy raised
    assert torch.equal(dec._history.lengths[:1], lengths)
    while not dec.done:
        dec.step()
    assert dec.generated == ref


def test_bad_lookup_specs():
    with pytest.raises(PolicyError, match="expected a budget >= 1"):
        make_policy("lookup:0")
    with pytest.raises(PolicyError, match="num_tokens expected an integer >= 1"):
        taps_lookup_policy(8, num_tokens=0)
    with pytest.raises(RuntimeError, match="needs history="):
        make_policy("lookup").build(None, None, torch.tensor([1]))


def test_costed_lookup_sizes_the_chain_by_its_measured_rate(models):
    """A chain the target keeps rejecting shrinks to the root alone (plain ``lookup`` verifies K nodes every
    round); one it keeps accepting is verified in full."""
    target, _ = models
    policy = costed_lookup_policy(latency=LATENCY)
    policy.bind(target, None, torch.device("cpu"))
    history = (torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5, 6, 7]]), torch.tensor([15]))

    def nodes():
        return int(policy.build(None, None, torch.tensor([7]), history=history).tree.num_nodes[0])

    assert nodes() == 3  # the prior (1 in 3): two chain nodes pay at 4 ms a node against a 51 ms plain round
    for _ in range(20):
        policy.lookup.acceptance.record(3, 0, True)
    assert nodes() == 1
    for _ in range(40):
        policy.lookup.acceptance.record(3, 9, False)
    assert nodes() == 1 + 10  # the whole chain: K = 10 of the 12 tokens after the match
