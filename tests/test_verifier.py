"""``TargetVerifier`` on its own: every tree node's logits and features are the target's on that node's path
decoded as an ordinary sequence (the structural oracle: no mask code shared), rows of different lengths share
one forward, commits keep exactly the accepted rows, and the row bookkeeping (prefill into one row, crop,
reset) touches nothing else.

Float outputs are compared with flash-attention's rule (:func:`assert_within_torch_error`): the error
against a float64 forward of the same weights may be at most twice that of the plain float32 forward."""
import copy

import pytest
import torch

from helpers import assert_within_torch_error, make_tree, random_tree, tiny_target, tree_rows
from taps.decode.verifier import TargetVerifier
from taps_kernels import accept_greedy

V = 61
LAYERS = (0, 2)  # feature layers read by a drafter (hidden_states[i + 1])


@pytest.fixture(scope="module")
def models():
    t32 = tiny_target(seed=3, vocab=V, layers=4)
    return t32, copy.deepcopy(t32).double()


def _plain(model, ids):
    """Last-position logits ``[V]`` and features ``[2H]`` of a plain forward over ``ids``."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0, -1], torch.cat([out.hidden_states[i + 1][0, -1] for i in LAYERS])


def _path(par, tok, i):
    """Tokens from the root to node ``i`` (root first)."""
    out = []
    while i >= 0:
        out.append(tok[i])
        i = par[i]
    return out[::-1]


def _check_rows(models, ver, tree, prompts, logits, feats):
    """Row by row, all nodes at once (the rule takes the largest error over the whole output)."""
    t32, t64 = models
    for b, prompt in enumerate(prompts):
        par, tok = tree_rows(tree, b)
        paths = [list(prompt) + _path(par, tok, i) for i in range(len(par))]
        want = [torch.stack(x) for x in zip(*(_plain(t32, ids) for ids in paths))]
        ref = [torch.stack(x) for x in zip(*(_plain(t64, ids) for ids in paths))]
        n = len(par)
        assert_within_torch_error(logits[b, :n], want[0], ref[0], what=f"row {b} logits")
        assert_within_torch_error(feats[b, :n], want[1], ref[1], what=f"row {b} features")


PROMPTS = {"ragged": [[5, 9, 17, 3, 44, 2, 8], [11, 4, 30]],  # different lengths in one forward
           "equal": [[5, 9, 17, 3, 44], [11, 4, 30, 30, 1]]}  # equal lengths (the sdpa path's causal shortcut)


@pytest.mark.parametrize("attention", ["sdpa", "taps_tree"])
@pytest.mark.parametrize("lengths", list(PROMPTS))
def test_every_node_equals_its_path_decoded_alone(models, attention, lengths):
    t32, _ = models
    prompts = PROMPTS[lengths]
    ver = TargetVerifier(t32, LAYERS, attention=attention, max_batch=2)
    ver.reset(2, 8)  # small on purpose: the verify must grow the buffers
    for r, p in enumerate(prompts):
        last, _ = ver.prefill_row(r, p)
        assert_within_torch_error(last, *(_plain(m, p)[0] for m in models), what=f"prefill row {r}")
    assert ver.host_lengths == [len(p) for p in prompts] and ver.lengths.tolist() == ver.host_lengths
    tree = random_tree(4, 2, 13, vocab=V, num_nodes=[13, 9])  # row 1 padded after 9 nodes
    logits, hs = ver.verify_batch(tree)
    assert logits.shape == (2, 13, V)
    assert ver.lengths.tolist() == ver.host_lengths, "a verify must not advance the lengths"
    feats = ver.features(hs)
    assert feats.shape == (2, 13, 2 * 32)
    _check_rows(models, ver, tree, prompts, logits, feats)


def test_commit_keeps_exactly_the_accepted_rows(models):
    t32, _ = models
    prompts = [[5, 9, 17, 3], [7, 7, 1, 40, 2, 2]]
    ver = TargetVerifier(t32, LAYERS, attention="sdpa", max_batch=2)
    ver.reset(2, 32)
    for r, p in enumerate(prompts):
        ver.prefill_row(r, p)
    tree = random_tree(6, 2, 11, vocab=V, num_nodes=[11, 11], parents="recent")
    logits, _ = ver.verify_batch(tree)
    # a target that walks deep: each node's target token is its last child's token
    target = torch.zeros(2, 11, dtype=torch.int64)
    for b in range(2):
        par, tok = tree_rows(tree, b)
        for i in range(11):
            kids = [j for j in range(11) if par[j] == i]
            target[b, i] = tok[kids[-1]] if kids else 0
    path, acc, _ = accept_greedy(tree, target)
    assert int(acc.min()) >= 3, "the case must accept (and move) several nodes in each row"
    ver.commit_batch(path, acc)
    assert ver.lengths.tolist() == [4 + int(acc[0]), 6 + int(acc[1])]
    ver.set_host_lengths(ver.lengths.tolist())
    # the next round's root sees exactly prompt + accepted tokens
    nxt = torch.tensor([13, 21])
    logits2, hs2 = ver.verify_batch(make_tree([([-1], [13]), ([-1], [21])]))
    feats2 = ver.features(hs2)
    for b in range(2):
        kept = [int(tree.tokens[b, j]) for j in path[b, :int(acc[b])].tolist()]
        ids = prompts[b] + kept + [int(nxt[b])]
        (want, want_f), (ref, ref_f) = _plain(t32, ids), _plain(models[1], ids)
        assert_within_torch_error(logits2[b, 0], want, ref, what=f"row {b} after commit")
        assert_within_torch_error(feats2[b, 0], want_f, ref_f, what=f"row {b} features after commit")


def test_rows_are_independent_and_bookkeeping_checks(models):
    t32, _ = models
    ver = TargetVerifier(t32, None, attention="sdpa", max_batch=2)
    ver.reset(2, 16)
    ver.prefill_row(0, [3, 4, 5, 6])
    keys0 = [k[0, :, :4].clone() for k in ver.keys]
    ver.prefill_row(1, [9, 9, 9])  # another row's prefill leaves row 0's cache as it was
    assert all(torch.equal(k[0, :, :4], k0) for k, k0 in zip(ver.keys, keys0))
    assert ver.features(None) is None  # no drafter: no features
    ver.reset_row(1)
    assert ver.host_lengths == [4, 0] and ver.lengths.tolist() == [4, 0]
    with pytest.raises(ValueError, match="expected 1 rows, received 2"):
        ver.verify_batch(make_tree([([-1], [1]), ([-1], [2])]), rows=1)
    # batch-1 interface: verify, commit, crop
    logits, _, sliced = ver.verify(make_tree([([-1, 0, 1], [7, 8, 9])], N=5))
    assert logits.shape == (3, V) and sliced.tokens.shape == (1, 3)
    ver.commit(torch.tensor([[0, 1, -1]]), 2)
    assert ver.length == 6 and int(ver.lengths[0]) == 6
    ver.crop(5)
    assert ver.length == 5 and int(ver.lengths[0]) == 5
    with pytest.raises(ValueError, match="length"):
        ver.crop(6)
