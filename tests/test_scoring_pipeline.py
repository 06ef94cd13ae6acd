"""Scorer pipeline on tiny random models: traces, targets, training, evaluation (ECE), latency tables."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import hf_greedy
from taps.models.drafter import DFlashConfig, DFlashDrafter
from taps.decode.latency import round_seconds
from taps.scoring.eval_scorer import evaluate_scorer, reliability
from taps.decode.latency import (T0_TIMING, drafter_key, get_table, isotonic, kernels_build, measure_draft_time,
                                 measure_latency)
from taps.scoring.traces import accepted_mask, load_traces, split_by_prompt, stack_records, trace_prompt
from taps.scoring.model import TapsScorer
from taps.scoring.train_scorer import DEPTH_TABLE, edge_targets, train_scorer

V, HID, D = 61, 32, 4


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=HID, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    dcfg = DFlashConfig(hidden_size=HID, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                        num_hidden_layers=2, vocab_size=V, block_size=D + 1, num_target_layers=4,
                        target_layer_ids=[0, 1], mask_token_id=V - 1, rope_theta=10000.0)
    return target, DFlashDrafter(dcfg).eval()


@pytest.fixture(scope="module")
def traces(models, tmp_path_factory):
    from safetensors.torch import save_file

    target, drafter = models
    d = tmp_path_factory.mktemp("traces")
    g = torch.Generator().manual_seed(2)
    recs = []
    for i in range(6):
        prompt = torch.randint(0, V - 1, (8,), generator=g).tolist()
        recs += trace_prompt(target, drafter, prompt, max_new_tokens=12, pool_size=20, top_k=6, lattice_k=4,
                             stop_ids=set(), prompt_index=i)
    save_file(stack_records(recs), str(d / "traces_00000.safetensors"))
    return d, load_traces(d)


def test_trace_records_follow_the_greedy_continuation(models):
    target, drafter = models
    prompt = [5, 9, 17, 3, 44, 2]
    recs = trace_prompt(target, drafter, prompt, max_new_tokens=10, pool_size=20, top_k=6, lattice_k=4,
                        stop_ids=set())
    ref = hf_greedy(target, prompt, 10 + D + 1)
    got = [int(recs[0]["tokens"][0])]  # the first bonus
    for r in recs:
        n = int(r["accept_len"])
        path = r["path"][:n].long()
        assert torch.equal(path[0], torch.tensor(0))
        toks = r["tokens"][path].tolist()
        # each accepted child carries the target's argmax after its parent, and its child_prob is that of the argmax
        for a, b in zip(path[:-1], path[1:]):
            assert int(r["target_argmax"][a]) == int(r["tokens"][b])
            assert int(r["parents"][b]) == int(a)
            torch.testing.assert_close(r["child_prob"][b].float(), r["target_top1_prob"][a].float(), atol=1e-3, rtol=1e-3)
        got += toks[1:] + [int(r["target_argmax"][path[-1]])]
    assert got[: len(ref)] == ref[: len(got)]
    r = recs[0]
    N = 21
    assert r["tokens"].shape == (N,) and r["hidden"].shape == (D, HID) and r["lattice_ids"].shape == (D, 4)
    assert r["hidden"].dtype == torch.float16 and r["parents"].dtype == torch.int16


def test_greedy_r_star_is_the_accepted_path(traces):
    _, tr = traces
    tgt = edge_targets(tr, "greedy")
    acc = accepted_mask(tr)
    assert torch.equal(tgt["r_star"] > 0.5, acc)
    assert torch.equal(tgt["r_star"], acc.float())
    soft = edge_targets(tr, "soft")
    assert (soft["r_star"] <= 1).all() and (soft["p_other"] >= 0).all()


def test_split_holds_out_whole_prompts(traces):
    _, tr = traces
    a, b = split_by_prompt(tr, 0.4)
    assert a["tokens"].shape[0] + b["tokens"].shape[0] == tr["tokens"].shape[0]
    assert not set(a["prompt_index"].tolist()) & set(b["prompt_index"].tolist())


def follow_the_draft_argmax(tr):
    """The same pools with a synthetic target whose answer is known: at every node it picks the child of
    draft rank 0, so that child is accepted with probability 1 and every other child with 0. A scorer can
    learn this from its features (the sibling with the largest draft log-prob); the marginal product cannot,
    it gives that child only its draft probability."""
    tr = dict(tr)
    parents, rank, tokens = tr["parents"].long(), tr["rank"].long(), tr["tokens"]
    ta = torch.full_like(tr["target_argmax"], -1)  # -1: no child matches (leaves)
    rows, cols = torch.nonzero((parents >= 0) & (rank == 0), as_tuple=True)
    ta[rows, parents[rows, cols]] = tokens[rows, cols].to(ta.dtype)
    tr["target_argmax"] = ta
    return tr


def marginal_loss(tr):
    """The training loss of the marginal product: children get their draft probability, "other" the rest."""
    from taps.scoring.train_scorer import scorer_loss

    step, parents = tr["step_logq"].float(), tr["parents"].long()
    valid = parents >= 0
    q = torch.where(valid, step.exp(), torch.zeros_like(step))
    child_mass = torch.zeros_like(q).scatter_add(1, parents.clamp(min=0), q)
    other = torch.log((1 - child_mass).clamp(min=1e-6))
    logq = torch.where(valid | (torch.arange(step.shape[1])[None] == 0), tr["logq"].float(), torch.full_like(step, -30.0))
    return scorer_loss(torch.where(valid, step, torch.zeros_like(step)), other, logq, edge_targets(tr, "greedy"))[1]


@pytest.mark.parametrize("tiny", [False, True])
def test_trained_scorer_beats_the_marginal_product_on_a_known_target(traces, models, tiny):
    from taps.scoring.train_scorer import evaluate_loss

    _, tr = traces
    syn = follow_the_draft_argmax(tr)
    tgt = edge_targets(syn, "greedy")
    assert torch.equal(tgt["p_child"] > 0, (syn["rank"] == 0) & (syn["parents"] >= 0))  # the known answer
    train, val = split_by_prompt(syn, 0.34)
    assert val["tokens"].shape[0] > 0 and train["tokens"].shape[0] > 0
    emb = models[0].get_input_embeddings().weight.detach()
    model, hist = train_scorer(train, val, emb, tiny=tiny, epochs=5, batch=8, lr=1e-2, seed=0, top_k=6,
                               progress=False)
    got = evaluate_loss(model, val, edge_targets(val, "greedy"), None if tiny else emb)
    base = marginal_loss(val)
    # held-out prompts: the scorer's loss is under half the marginal product's on the same rounds
    assert got["loss"] < 0.5 * base["loss"], (got, base)
    assert got["kl"] < 0.5 * base["kl"]


def test_train_from_an_initial_scorer(traces, models):
    """``init`` starts from given weights (lr 0 keeps them exactly); a scorer of another shape is refused, but
    for a deeper depth table (a drafter with a longer block), whose first rows are taken."""
    _, tr = traces
    train, val = split_by_prompt(tr, 0.34)
    emb = models[0].get_input_embeddings().weight.detach()
    first, _ = train_scorer(train, val, emb, epochs=1, batch=8, lr=1e-2, seed=0, top_k=6, progress=False)
    again, _ = train_scorer(train, val, emb, epochs=1, batch=8, lr=0.0, weight_decay=0.0, seed=1, top_k=6,
                            progress=False, init=first)
    for (k, a), b in zip(first.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    from taps.cli.scorer_cmds import _readme

    doc = _readme("s", "taps train-scorer ...", {"init_from": "checkpoints/prev", "drafter": {}}, {}, {}, 1, False)
    assert "Started from the scorer `checkpoints/prev`" in doc  # the recipe names where training started
    tiny, _ = train_scorer(train, val, emb, tiny=True, epochs=1, batch=8, seed=0, top_k=6, progress=False)
    with pytest.raises(ValueError, match="init: scorer shapes differ"):
        train_scorer(train, val, emb, epochs=1, batch=8, seed=0, top_k=6, progress=False, init=tiny)
    # a scorer of a deeper drafter block: the first D + 1 depth rows carry over, the rest as before
    D = train["entropy"].shape[1]
    deeper = TapsScorer(**dict(first.config(), max_depth=D + 5))
    with torch.no_grad():
        deeper.depth_embedding.weight.normal_()
    deeper.load_state_dict({**deeper.state_dict(), **{k: v for k, v in first.state_dict().items()
                                                      if k != DEPTH_TABLE}})
    cut, _ = train_scorer(train, val, emb, epochs=1, batch=8, lr=0.0, weight_decay=0.0, seed=1, top_k=6,
                          progress=False, init=deeper)
    assert torch.equal(cut.state_dict()[DEPTH_TABLE], deeper.state_dict()[DEPTH_TABLE][:D + 1])
    shallow = TapsScorer(**dict(first.config(), max_depth=D - 1))
    with pytest.raises(ValueError, match="init: scorer shapes differ"):
        train_scorer(train, val, emb, epochs=1, batch=8, seed=0, top_k=6, progress=False, init=shallow)


def test_reliability_hand_made():
    pred = torch.tensor([0.15, 0.15, 0.95, 0.95], dtype=torch.float64)
    label = torch.tensor([0.0, 1.0, 1.0, 1.0])
    r = reliability(pred, label, bins=10)
    assert r["ece"] == pytest.approx(0.5 * 0.35 + 0.5 * 0.05)
    assert [b["count"] for b in r["bins"]] == [0, 2, 0, 0, 0, 0, 0, 0, 0, 2]
    assert r["bins"][1]["acc"] == pytest.approx(0.5) and r["bins"][9]["pred"] == pytest.approx(0.95)
    # perfectly calibrated -> 0; pred 1.0 lands in the last bin
    assert reliability(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))["ece"] == 0.0


def test_marginal_offline_tau_at_full_pool_is_the_trace_tau(traces):
    _, tr = traces
    ev = evaluate_scorer(tr, None, None, budgets=(20,))
    assert ev["marginal"]["offline_tau"]["20"] == pytest.approx(float(tr["accept_len"].float().mean()))
    assert "scorer" not in ev


def test_isotonic():
    assert isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert isotonic([3, 2, 1]) == [2, 2, 2]


def test_calibrate_table(models, tmp_path, monkeypatch):
    target, drafter = models
    t = measure_latency(target, n_max=10, prefix_len=16, repeats=1, drafter=drafter)
    lat = t["latency"]
    assert len(lat) == 11
    assert all(x > 0 for x in lat) and all(b >= a for a, b in zip(lat, lat[1:]))
    parts = t["t0_parts"]
    assert t["t0"] > 0 and set(parts) == {"draft", "context", "draft_by_positions", "timed"}
    assert parts["timed"] == T0_TIMING
    by_pos = parts["draft_by_positions"]
    assert len(by_pos) == drafter.config.block_size - 1 and all(b >= a > 0 for a, b in zip(by_pos, by_pos[1:]))
    assert parts["draft"] == by_pos[-1] and t["t0"] == parts["draft"] + parts["context"]
    assert round_seconds(t) == t["t0"] and round_seconds(t, 1) == by_pos[0] + parts["context"]
    assert round_seconds(t, 99) == t["t0"] and round_seconds({"latency": [0.1], "t0": 0.5}, 3) == 0.5
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    monkeypatch.delenv("TAPS_LATENCY", raising=False)
    t1 = get_table(target, None, n_max=6, repeats=1)
    files = list((tmp_path / "latency").glob("*.json"))
    assert len(files) == 1 and len(t1["latency"]) == 7
    t2 = get_table(target, None, n_max=6)
    assert t2["latency"] == t1["latency"]  # from the cache, not re-measured
    assert t1["t0"] == 0 and t1["drafter"] is None
    # a drafter the cached t0 was not measured with: t0 alone is measured and saved, the verify table stays
    t3 = get_table(target, drafter, n_max=6)
    assert t3["latency"] == t1["latency"] and t3["t0"] > 0 and t3["drafter"] == drafter_key(drafter)
    assert len(t3["t0_parts"]["draft_by_positions"]) == drafter.config.block_size - 1
    assert json.loads(files[0].read_text())["drafter"] == drafter_key(drafter)
    # a cached t0 timed another way (back to back, before drafts followed target steps): measured again
    rec = json.loads(files[0].read_text())
    rec["t0"], rec["t0_parts"] = 123.0, {k: v for k, v in rec["t0_parts"].items() if k != "timed"}
    files[0].write_text(json.dumps(rec))
    t4 = get_table(target, drafter, n_max=6)
    assert t4["t0"] != 123.0 and t4["t0_parts"]["timed"] == T0_TIMING and t4["latency"] == t1["latency"]
    drafter.head_dtype = torch.bfloat16  # another head dtype is another drafter cost
    try:
        assert drafter_key(drafter) != t3["drafter"]
        assert get_table(target, drafter, n_max=6)["drafter"] == drafter_key(drafter)
    finally:
        drafter.head_dtype = None
    # a table measured with other compiled kernels: the whole table is measured again, with this build's mark
    rec = json.loads(files[0].read_text())
    assert rec["kernels_build"] == kernels_build()
    rec["kernels_build"], rec["latency"] = "0" * 16, [5.0] * len(rec["latency"])
    files[0].write_text(json.dumps(rec))
    t5 = get_table(target, drafter, n_max=6)
    assert t5["kernels_build"] == kernels_build() and t5["latency"] != [5.0] * 7
    assert json.loads(files[0].read_text())["latency"] == t5["latency"]


def test_draft_time_follows_a_target_step_each_time(models):
    """Each timed draft and context update comes right after a verify, as in decoding (caches as a round leaves
    them)."""
    from taps.decode.verifier import make_verifier

    target, drafter = models
    ver = make_verifier(target, list(drafter.config.target_layer_ids))
    prompt = torch.randint(0, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    _, feats = ver.prefill(prompt)
    calls = []
    verify = ver.verify
    ver.verify = lambda tree: calls.append(int(tree.num_nodes[0])) or verify(tree)
    repeats = 2
    measure_draft_time(target, drafter, ver, prompt, feats, repeats)
    D = drafter.config.block_size - 1
    assert calls == [1] * ((D + 1) * (repeats + 1))  # one root-only verify before every timed call


def test_replay_full_pool_tau_and_costs(traces, models):
    from taps.scoring.eval_scorer import replay_throughput

    _, tr = traces
    emb = models[0].get_input_embeddings().weight.detach()
    w = train_scorer(tr, None, emb, epochs=1, batch=8, top_k=6, progress=False)[0].to_weights()
    table = {"latency": [0.1 + 0.01 * n for n in range(21)], "t0": 0.05}
    res = replay_throughput(tr, w, emb, table, {"taps": 0.01}, budgets=(20,), cap=8, fixed_budgets=(3,))
    assert res["ar"]["tau"] == 1.0 and res["ar"]["speedup"] == pytest.approx(1.0)
    assert res["ddtree:20"]["tau"] == pytest.approx(float(tr["accept_len"].float().mean()))
    assert res["ddtree:20"]["nodes_per_round"] == 21
    assert res["taps-fixed:3"]["nodes_per_round"] == 4
    # cost per round of a fixed tree: t0 + overhead + latency[n]
    assert res["taps-fixed:3"]["tau"] / res["taps-fixed:3"]["tokens_per_s"] == pytest.approx(0.05 + 0.01 + 0.13)
    assert res["taps"]["nodes_per_round"] <= 9
    # the oracle verifies exactly the accepted path: the full pool's tau at fewer nodes, and the best rate
    assert res["oracle-path"]["tau"] == pytest.approx(res["ddtree:20"]["tau"])
    assert res["oracle-path"]["nodes_per_round"] <= res["ddtree:20"]["nodes_per_round"]
    best = max(v["tokens_per_s"] for k, v in res.items() if not k.startswith("oracle"))
    assert res["oracle-path+skip"]["tokens_per_s"] >= max(res["oracle-path"]["tokens_per_s"], best) - 1e-9


def test_best_mix_maximises_the_aggregate_rate():
    """Dinkelbach's choice equals the brute-force optimum over every subset (small random cases)."""
    import itertools

    from taps.scoring.eval_scorer import _best_mix

    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        R = 6
        tok_a = torch.randint(1, 6, (R,), generator=g).double()
        t_a = torch.rand(R, generator=g, dtype=torch.float64) + 0.2
        tok_b, t_b = torch.ones(R, dtype=torch.float64), torch.full((R,), 0.4, dtype=torch.float64)
        pick = _best_mix(tok_a, t_a, tok_b, t_b)
        rate = lambda p: float(torch.where(p, tok_a, tok_b).sum() / torch.where(p, t_a, t_b).sum())  # noqa: E731
        brute = max(rate(torch.tensor(bits, dtype=torch.bool)) for bits in itertools.product((0, 1), repeat=R))
        assert rate(pick) == pytest.approx(brute)


def test_save_table_from_two_processes_at_once(tmp_path):
    """Each writer has its own temporary file, so concurrent saves of one table never collide."""
    import multiprocessing as mp

    table = {"latency": [0.1, 0.2], "t0": 0.0, "machine": "m", "model": "x"}
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_save_many, args=(table, tmp_path / "t.json")) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    assert json.loads((tmp_path / "t.json").read_text())["latency"] == [0.1, 0.2]


def _save_many(table, path):
    from taps.decode.latency import save_table

    for _ in range(200):
        save_table(table, path)
