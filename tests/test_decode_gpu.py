"""GPU-only checks of the decode loop (skipped without CUDA).

* Stage times come from CUDA events (read after the round's one host read), with and without
  ``profile=True``; the output still equals HF ``generate``.
* One verify round (taps_tree attention through ``taps_kernels.tree_attention``, target-token choice and
  the accept walk) is captured in a CUDA graph and replayed: it equals the eager round.
"""
import pytest
import torch

from helpers import hf_greedy, tiny_drafter, tiny_target
from taps.decode import BatchDecoder, SpeculativeDecoder, make_policy
from taps.decode.timing import StageTimer
import taps_kernels as tk
from taps_kernels import Tree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

V = 61


def cuda_models():
    return tiny_target(0, vocab=V).cuda(), tiny_drafter(0, vocab=V).cuda()


@pytest.mark.parametrize("profile", [False, True])
def test_stage_times_use_cuda_events(profile):
    target, drafter = cuda_models()
    dec = SpeculativeDecoder(target, make_policy("ddtree:4"), drafter=drafter, attention="taps_tree", profile=profile)
    prompt = [5, 9, 2, 44, 17, 3]
    res = dec.generate(prompt, 16)
    assert res.token_ids == hf_greedy(target.cpu(), prompt, 16)
    target.cuda()
    rounds = res.stats.rounds
    assert rounds and all(r.round_s > 0 for r in rounds)
    for r in rounds:
        assert {"verify", "accept", "context"} <= set(r.times)
        assert all(v >= 0 and v == v for v in r.times.values())
    timer = StageTimer(torch.device("cuda"), profile=profile)
    with timer("work"):
        torch.randn(512, 512, device="cuda").matmul(torch.randn(512, 512, device="cuda"))
    assert timer.cuda and timer._events  # recorded as events, resolved only on request
    torch.cuda.synchronize()
    assert timer.seconds()["work"] > 0


def test_verify_round_replays_in_a_cuda_graph():
    target, drafter = cuda_models()
    dec = BatchDecoder(target, make_policy("ddtree:4"), drafter=drafter, max_batch=2, attention="taps_tree",
                       static_shapes=True)
    ver = dec.verifier
    for b, p in enumerate([[5, 9, 2, 44, 17, 3], [8, 1, 7]]):
        ver.prefill_row(b, p)
    ver.reserve(64)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, V, (2, 5), generator=g).cuda()
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, -1, -1]], dtype=torch.int32, device="cuda")
    depth = torch.tensor([[0, 1, 1, 2, 2], [0, 1, 2, 0, 0]], dtype=torch.int32, device="cuda")
    tree = Tree(tokens, parents, depth, torch.tensor([5, 3], dtype=torch.int32, device="cuda"))

    def round_():
        logits, _ = ver.verify_batch(tree, 2)
        choice = logits.argmax(-1)
        path, acc, nxt = tk.accept_greedy(tree, choice, max_depth=2, validate="none")
        return logits, path, acc, nxt

    eager = [t.clone() for t in round_()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, autotuning, lazy init)
        for _ in range(2):
            round_()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = round_()
    # new inputs in the same static buffers: the replay must follow them
    for t in captured:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[0], eager[0], rtol=1e-4, atol=1e-4)
    for got, want in zip(captured[1:], eager[1:]):
        assert torch.equal(got, want)
    tokens.copy_(torch.randint(0, V, (2, 5), generator=g).cuda())
    graph.replay()
    fresh = round_()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[0], fresh[0], rtol=1e-4, atol=1e-4)
