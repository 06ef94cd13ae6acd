"""Batched decoding: every request of a batch gets exactly its own greedy output, whatever shares the batch.

Ragged prompt lengths, stop tokens reached in different rounds, requests joining mid-run, batch sizes
1/2/3/8, both attention paths: each request's tokens equal HF ``generate`` (the independent decoder) and
its own batch-1 run. Sampled decoding is reproducible per request seed within the same batch. The
drafter's batched state drafts each ragged row as it would alone. Bad input names the request index.
"""
import random

import pytest
import torch

from helpers import hf_greedy, random_scorer, tiny_drafter, tiny_target
from taps.decode import BatchDecoder, GenerationError, Request, SamplingConfig, SpeculativeDecoder, make_policy
from taps.decode.policies.taps import taps_policy as make_taps

V = 61


@pytest.fixture(scope="module")
def models():
    return tiny_target(0, vocab=V), tiny_drafter(0, vocab=V)


def requests(target, n, seed):
    """Ragged prompts; every other request stops on a token that occurs in its continuation."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 24))]
        max_new = rng.randint(3, 20)
        stops = ()
        if i % 2:
            full = hf_greedy(target, prompt, max_new)
            stops = (full[rng.randrange(len(full))],)
        out.append((Request(prompt, max_new, stops), hf_greedy(target, prompt, max_new, stops)))
    return out


def taps_policy():
    latency = {"latency": [0.05 + 0.004 * n for n in range(17)], "t0": 0.02, "t0_parts": {"context": 0.001}}
    return make_taps(8, rule="reach", pool_size=16, scorer=random_scorer(False).to_weights(), top_k=8,
                     latency=latency)


@pytest.mark.parametrize("spec,positions", [("ddtree:2", 2), ("ddtree:64", None), ("dflash", None)])
def test_drafter_projects_only_the_positions_the_policy_can_reach(models, spec, positions, monkeypatch):
    # A DDTree of budget B is at most B deep: the loop asks the drafter for B positions only (None: all D).
    target, drafter = models
    asked = []
    real = type(drafter).draft

    def draft(self, *args, **kwargs):
        asked.append(kwargs.get("num_positions"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(drafter), "draft", draft)
    prompt = [3, 14, 15, 9, 26]
    res = SpeculativeDecoder(target, make_policy(spec), drafter=drafter).generate(prompt, 12)
    assert res.token_ids == hf_greedy(target, prompt, 12)
    D = drafter.block_size - 1
    assert asked and set(asked) == {positions if positions is not None else D}


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
@pytest.mark.parametrize("spec", ["ddtree:4", "dflash"])
def test_batch_equals_hf_generate_and_batch_one(models, spec, batch):
    target, drafter = models
    reqs = requests(target, 9, seed=batch)
    dec = BatchDecoder(target, make_policy(spec), drafter=drafter, max_batch=batch)
    got = dec.generate_batch([r for r, _ in reqs])
    one = SpeculativeDecoder(target, make_policy(spec), drafter=drafter)
    for (req, ref), res in zip(reqs, got):
        assert res.token_ids == ref, (spec, batch, req)
        one.stop_token_ids = frozenset(req.stop_token_ids)
        assert one.generate(req.prompt_ids, req.max_new_tokens).token_ids == ref
        assert res.stop_reason == ("stop_token" if req.stop_token_ids and ref[-1] in req.stop_token_ids
                                   else "max_new_tokens")
    # rows really ended in different rounds
    assert len({r.stats.num_rounds for r in got}) > 1


@pytest.mark.parametrize("attention", ["taps_tree", "sdpa"])
def test_taps_policy_batched_and_both_attention_paths(models, attention):
    target, drafter = models
    reqs = requests(target, 5, seed=11)
    dec = BatchDecoder(target, taps_policy(), drafter=drafter, max_batch=3, attention=attention)
    assert dec.verifier.attention == attention
    for (req, ref), res in zip(reqs, dec.generate_batch([r for r, _ in reqs])):
        assert res.token_ids == ref


def test_requests_join_mid_run(models):
    """New requests join free rows between rounds (prefilled alone); nobody's output changes."""
    target, drafter = models
    reqs = requests(target, 6, seed=21)
    dec = BatchDecoder(target, make_policy("ddtree:4"), drafter=drafter, max_batch=3)
    ids = [dec.submit(r) for r, _ in reqs[:2]]
    dec.admit()
    dec.step()
    dec.step()
    lengths_before = list(dec.verifier.host_lengths)
    running = dec.running
    keys_before = [k[b, :, :lengths_before[b]].clone() for b in running for k in dec.verifier.keys]
    ids += [dec.submit(r) for r, _ in reqs[2:]]
    free = 3 - len(running)
    joined = dec.admit()
    assert joined == ids[2:2 + free]  # as many as rows are free: the rest waits for rows to free up
    # the running rows kept their caches untouched (a newcomer is prefilled alone into its own row)
    assert [dec.verifier.host_lengths[b] for b in running] == [lengths_before[b] for b in running]
    keys_after = [k[b, :, :lengths_before[b]] for b in running for k in dec.verifier.keys]
    assert all(torch.equal(a, b) for a, b in zip(keys_before, keys_after))
    results = dec.run()
    assert [results[i].token_ids for i in ids] == [ref for _, ref in reqs]


def test_sampled_batch_is_reproducible_per_seed(models):
    target, drafter = models
    cfg = SamplingConfig(temperature=1.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]

    def run(seeds):
        dec = BatchDecoder(target, make_policy("ddtree:4"), drafter=drafter, sampling=cfg, max_batch=3)
        return [r.token_ids for r in dec.generate_batch([Request(p, 12, (), s) for p, s in zip(prompts, seeds)])]

    a, b, c = run([1, 2, 3]), run([1, 2, 3]), run([7, 8, 9])
    assert a == b and a != c and all(len(t) == 12 for t in a)


def test_drafter_batched_rows_draft_as_alone(models):
    """Ragged context lengths in one state (boolean key mask) draft exactly what each row drafts alone."""
    _, drafter = models
    emb = tiny_target(0, vocab=V).get_input_embeddings()
    head = tiny_target(0, vocab=V).get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    lens = [3, 9, 1]
    feats = [torch.randn(1, n, drafter.config.num_context_features, generator=g) for n in lens]
    state = drafter.new_state(3)
    for b, f in enumerate(feats):
        drafter.append_context(state, f, rows=slice(b, b + 1))
    assert state.host_lengths == lens
    bonus = torch.tensor([4, 5, 6])
    logits, hidden = drafter.draft(state, bonus, emb, head)
    for b, f in enumerate(feats):
        alone = drafter.new_state(1)
        drafter.append_context(alone, f)
        want, want_h = drafter.draft(alone, bonus[b:b + 1], emb, head)
        torch.testing.assert_close(logits[b:b + 1], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden[b:b + 1], want_h, rtol=1e-5, atol=1e-5)
    # device-side counts: the next positions continue per row, and the host mirror is re-synced by the owner
    extra = torch.randn(3, 4, drafter.config.num_context_features, generator=g)
    drafter.append_context(state, extra, counts=torch.tensor([1, 4, 0]))
    assert state.host_lengths is None and state.lengths.tolist() == [4, 13, 1]
    state.set_host_lengths([4, 13, 1])
    alone = drafter.new_state(1)
    drafter.append_context(alone, torch.cat([feats[0], extra[:1, :1]], 1))
    torch.testing.assert_close(drafter.draft(state, bonus, emb, head)[0][:1], drafter.draft(alone, bonus[:1], emb, head)[0],
                               rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_request(models):
    target, drafter = models
    dec = BatchDecoder(target, make_policy("ddtree:4"), drafter=drafter, max_batch=2, max_requests=3)
    with pytest.raises(GenerationError, match="request 1: prompt: expected at least one token"):
        dec.generate_batch([[1, 2], [], [3]])
    with pytest.raises(GenerationError, match="request 3: .*at most 3 requests"):
        dec.generate_batch([[1], [2], [3], [4]])
    with pytest.raises(GenerationError, match="request 1: prompt_ids on meta"):
        dec.generate_batch([[1], torch.zeros(3, dtype=torch.int64, device="meta")])
    with pytest.raises(GenerationError, match="request 0: max_new_tokens"):
        dec.generate_batch([Request([1], 0)])
    with pytest.raises(GenerationError, match=f"request 1: prompt: token {V} is outside the vocabulary"):
        dec.generate_batch([[1], [V]])
    with pytest.raises(GenerationError, match="max_batch"):
        BatchDecoder(target, make_policy("ar"), max_batch=0)
    # nothing half-started: a good batch still runs
    assert [r.token_ids for r in dec.generate_batch([[1, 2]], 3)] == [hf_greedy(target, [1, 2], 3)]


def test_tree_attention_reads_the_cache_buffers_in_place(models, monkeypatch):
    """On the taps_tree path every layer's K/V reach tree_attention as strided views of the preallocated
    buffers (same storage, no copy of a layer's cache)."""
    from taps_kernels.integrations import transformers as taps_hf

    target, drafter = models
    dec = BatchDecoder(target, make_policy("ddtree:4"), drafter=drafter, max_batch=2, attention="taps_tree")
    seen = []
    real = taps_hf.attention.tree_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr(), k.is_contiguous()))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(taps_hf.attention, "tree_attention", spy)
    dec.submit([1, 2, 3], 8)
    dec.submit([4, 5, 6, 7, 8, 9, 10], 8)
    dec.admit()
    dec.step()
    buffers = {t.untyped_storage().data_ptr() for t in dec.verifier.keys + dec.verifier.values}
    assert len(seen) == target.config.num_hidden_layers
    assert all(k in buffers and v in buffers for k, v, _ in seen)
    assert not any(contiguous for _, _, contiguous in seen)  # a [:, :, :L] view of a longer buffer


def test_decode_never_imports_scoring():
    """Imports run one way: scoring (traces, training, evaluation) may import decode, never the reverse."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "python" / "taps" / "decode"
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for n in names:
                assert not (n.startswith("taps.scoring") or n.lstrip(".").startswith("scoring")), (f, n)


def test_idle_rows_verify_a_root_alone(models):
    """A row whose request ended sits idle inside later rounds' range: its pending tree is the root alone, and
    every pending tree stays a valid tree of the width the next round verifies."""
    target, drafter = models
    dec = BatchDecoder(target, make_policy("ddtree:16"), drafter=drafter, max_batch=3)
    # row 0 ends on a stop token (a token first seen a few steps in), long before its length limit
    prompt0 = next(p for p in ([k, k + 7, 3] for k in range(V - 7))
                   if any(t not in hf_greedy(target, p, 20)[:i] for i, t in enumerate(hf_greedy(target, p, 20))
                          if 3 <= i < 10))
    full = hf_greedy(target, prompt0, 20)
    stop = next(t for i, t in enumerate(full) if 3 <= i < 10 and t not in full[:i])
    reqs = [Request(prompt0, 20, (stop,)), Request([4, 5], 30), Request([6], 3)]
    ids = [dec.submit(r) for r in reqs]
    dec.admit()
    seen_idle = False
    while dec.running:
        dec.step()
        dec._pending.validate()
        for b, row in enumerate(dec._rows):
            if row is None and b < max(dec.running, default=-1):
                seen_idle = True
                assert dec._pending.num_nodes[b].item() == 1 and dec.verifier.host_lengths[b] == 0
    assert seen_idle
    results = dec._results
    for i, r in zip(ids, reqs):
        assert results[i].token_ids == hf_greedy(target, r.prompt_ids, r.max_new_tokens, r.stop_token_ids or ())
