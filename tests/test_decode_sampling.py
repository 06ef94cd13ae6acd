"""Sampling: the processed target distribution matches HF's warpers, and speculative sampling (the
lossless walk over a DDTree tree) gives the target's own distribution of the first generated tokens."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from taps.decode import SamplingConfig, SpeculativeDecoder, choose_tokens, make_policy, processed_probs

from helpers import tiny_drafter, tiny_target


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                                     (0.6, 12, 0.9), (2.0, 1, 0.5), (1.0, 0, 0.01)])
def test_processed_probs_match_hf_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(9, 37) * 3
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = processed_probs(logits, cfg)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    theirs = torch.softmax(scores, -1)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_sampling_config_validation_and_greedy():
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0]])
    assert choose_tokens(logits, SamplingConfig()).tolist() == [1]  # ties: smallest id, like torch/HF argmax


VS = 5          # tiny vocabulary: every 3-token outcome has a reasonable probability
PROMPT = [1, 3, 0, 2]


def exact_first_tokens(target, cfg, n_tokens):
    """Exact joint distribution of the first ``n_tokens`` sampled tokens: ``{tuple: prob}``."""
    dist = {(): 1.0}
    for _ in range(n_tokens):
        prefixes = list(dist)
        with torch.no_grad():
            logits = target(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        probs = processed_probs(logits, cfg).double()
        dist = {p + (t,): dist[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in range(VS)}
    return dist


def chi_square(counts, dist, n):
    """Pearson statistic with bins of expected count < 5 merged into one; returns (stat, dof)."""
    stat, rest_obs, rest_exp, bins = 0.0, 0, 0.0, 0
    for k, p in dist.items():
        e, o = n * p, counts.get(k, 0)
        if e < 5:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
        else:
            stat += (o - e) ** 2 / e
            bins += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        bins += 1
    return stat, bins - 1


def chi2_critical(dof, z=3.3):
    # Wilson-Hilferty approximation of the chi-square quantile; z=3.3 is about the 0.9995 quantile.
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.parametrize("spec,cfg", [
    ("ddtree:8", SamplingConfig(temperature=1.0)),
    ("lookup:3", SamplingConfig(temperature=1.0)),  # chains from the row's own history, no drafter
    pytest.param("ddtree:8", SamplingConfig(temperature=0.8, top_k=4, top_p=0.9), marks=pytest.mark.slow)])
def test_speculative_sampling_has_the_target_distribution(spec, cfg):
    target = tiny_target(21, vocab=VS, layers=3)
    drafter = tiny_drafter(21, vocab=VS, block_size=4, target_layers=3, layers=1)
    with torch.no_grad():
        # A peaked target (init is nearly uniform) so that a wrong distribution is detectable; the
        # near-uniform random drafter makes wide trees (all 5 tokens at depth 1) that the walk often enters.
        target.model.norm.weight.mul_(6.0)  # the drafter borrows lm_head: leave that alone
    n_tokens, n = 3, 1000
    exact = exact_first_tokens(target, cfg, n_tokens)
    policy = make_policy(spec)
    dec = SpeculativeDecoder(target, policy, drafter=drafter if policy.uses_drafter else None, sampling=cfg)
    counts, accepted = {}, 0
    for i in range(n):
        # one more token than recorded, so the first round's tree keeps depth 2 (the length limit prunes it)
        res = dec.generate(PROMPT, n_tokens + 1, seed=1000 + i)
        key = tuple(res.token_ids[:n_tokens])
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(r.accept_len - 1 for r in res.stats.rounds)
    assert accepted > n // 4, "the tree walk must accept draft tokens often, else this only tests AR sampling"
    stat, dof = chi_square(counts, exact, n)
    assert stat < chi2_critical(dof), (stat, dof)
    # Power check: the same samples clearly reject a nearby wrong distribution.
    wrong = exact_first_tokens(target, SamplingConfig(temperature=cfg.temperature * 0.8, top_k=cfg.top_k,
                                                      top_p=cfg.top_p), n_tokens)
    wstat, wdof = chi_square(counts, wrong, n)
    assert wstat > chi2_critical(wdof), (wstat, wdof)


def test_seed_reproducible():
    target, drafter = tiny_target(4), tiny_drafter(4)
    dec = SpeculativeDecoder(target, make_policy("ddtree:4"), drafter=drafter, sampling=SamplingConfig(temperature=1.0))
    a = dec.generate([1, 2, 3], 12, seed=7).token_ids
    b = dec.generate([1, 2, 3], 12, seed=7).token_ids
    c = dec.generate([1, 2, 3], 12, seed=8).token_ids
    assert a == b and len(a) == 12 and a != c
