"""``bench/lookup_tree_study.py``: its chains are ``lookup_chain``'s, its sibling and replay count as documented."""
import random

import torch

import taps_kernels
from helpers import load_bench_script


def test_chain_and_sibling_equal_lookup_chain_on_random_histories():
    st = load_bench_script("lookup_tree_study")
    rng = random.Random(0)
    for _ in range(300):
        history = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]  # small vocabulary: many matches
        k = rng.randrange(1, 6)
        op_chain, op_len, _, op_sibling = taps_kernels.lookup_chain(torch.tensor([history]),
                                                                    torch.tensor([len(history)]), k, st.MAX_NGRAM)
        found = st.occurrences(history)
        assert op_chain[0, :int(op_len[0])].tolist() == st.chain(history, found, k), history
        assert int(op_sibling[0]) == (st.sibling(history, found) + [-1, -1])[1], history


def test_sibling_and_replay():
    st = load_bench_script("lookup_tree_study")
    history = [7, 1, 7, 2, 7, 2, 7]  # the 3-token suffix occurs at 2: only its continuation counts
    assert st.occurrences(history) == [5]
    history = [7, 1, 7, 2, 3, 7]  # only [7] matches, at 2 (then 2) and at 0 (then 1): latest first
    assert st.occurrences(history) == [3, 1] and st.sibling(history, [3, 1]) == [2, 1]
    assert st.sibling([5, 1, 5, 1, 5], st.occurrences([5, 1, 5, 1, 5])) == [1]  # one continuation: no sibling
    shapes = {name: accepted for name, (_, accepted) in st.shapes(3).items()}
    # prompt [1, 2, 1, 3, 1] then answer [2, 9]: round 1 proposes by the latest "1" -> chain [3, 1], siblings
    # {3, 2}; the truth is 2, so only the sibling shape accepts it (then 9 is the bonus)
    prompt, answer = [1, 2, 1, 3, 1], [2, 9]
    assert st.replay(prompt, answer, shapes["chain:2"]) == {"rounds": 2, "tokens": 2}
    assert st.replay(prompt, answer, shapes["sibling"], check_chain=2) == {"rounds": 1, "tokens": 2}
    assert st.replay(prompt, answer, shapes["chain:2+sibling"]) == {"rounds": 1, "tokens": 2}
