"""``model.generate(custom_generate=taps.hf.custom_generate_path(), trust_remote_code=True, ...)`` runs this
project's decoder with transformers' generation-config conventions: greedy tokens equal plain ``generate``
for every policy, EOS from the generation config, ``max_length``, streamer, bad options rejected."""
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

import taps.hf
from helpers import hf_greedy, random_scorer, tiny_drafter, tiny_target
from taps.scoring.io import save_scorer
from taps.decode.latency import save_table

V = 61
POLICIES = ["ar", "dflash", "ddtree:8", "taps", "taps-lookup", "lookup"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A random scorer (passed as ``taps_scorer``) and a synthetic latency table (no calibration)."""
    d = tmp_path_factory.mktemp("hf")
    save_scorer(d / "scorer", random_scorer(False), meta={})
    save_table({"latency": [0.05 + 0.004 * n for n in range(129)], "t0": 0.02, "machine": "t", "model": "t"},
               d / "lat.json")
    mp = pytest.MonkeyPatch()
    mp.setenv("TAPS_LATENCY", str(d / "lat.json"))
    yield d
    mp.undo()


@pytest.fixture(scope="module")
def models():
    return tiny_target(0, vocab=V), tiny_drafter(0, vocab=V)


def custom(model, inp, **kw):
    with torch.no_grad():
        return model.generate(inp, custom_generate=taps.hf.custom_generate_path(), trust_remote_code=True, **kw)


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_plain_generate(env, models, policy):
    target, drafter = models
    for prompt, n in (([5, 9, 17, 3], 20), ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 13)):
        inp = torch.tensor([prompt])
        out = custom(target, inp, attention_mask=torch.ones_like(inp), drafter=drafter, taps_policy=policy,
                     taps_scorer=str(env / "scorer"), taps_pool_size=24, max_new_tokens=n, do_sample=False,
                     pad_token_id=0)
        assert out.shape == (1, len(prompt) + n)
        assert out[0, :len(prompt)].tolist() == prompt
        assert out[0, len(prompt):].tolist() == hf_greedy(target, prompt, n)


def test_eos_from_generation_config_and_max_length(env, models):
    target, drafter = models
    prompt = [7, 3, 21, 40, 2]
    full = hf_greedy(target, prompt, 16)
    stop = full[5]
    ref = hf_greedy(target, prompt, 16, stops=[stop])
    assert ref[-1] == stop and len(ref) < 16  # the stop really ends the plain generation early
    gc = GenerationConfig(eos_token_id=stop, pad_token_id=0, max_new_tokens=16, do_sample=False)
    out = custom(target, torch.tensor([prompt]), generation_config=gc, drafter=drafter, taps_policy="ddtree:4")
    assert out[0, len(prompt):].tolist() == ref
    out = custom(target, torch.tensor([prompt]), drafter=drafter, taps_policy="dflash", max_length=len(prompt) + 9,
                 do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == full[:9]


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_and_return_dict(env, models):
    target, drafter = models
    prompt = [4, 8, 15, 16, 23]
    s = Collect()
    out = custom(target, torch.tensor([prompt]), drafter=drafter, taps_policy="ddtree:4", max_new_tokens=10,
                 do_sample=False, pad_token_id=0, streamer=s, return_dict_in_generate=True)
    assert s.ended and s.chunks[0] == prompt
    assert sum(s.chunks[1:], []) == out.sequences[0, len(prompt):].tolist() == hf_greedy(target, prompt, 10)


def test_sampling_repeatable_with_torch_seed(env, models):
    target, drafter = models
    inp = torch.tensor([[3, 1, 4, 1, 5]])
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(custom(target, inp, drafter=drafter, taps_policy="ddtree:4", max_new_tokens=12, do_sample=True,
                           temperature=0.8, top_p=0.9, pad_token_id=0)[0].tolist())
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kw,msg", [({"num_beams": 2}, "num_beams"), ({"repetition_penalty": 1.3}, "repetition_penalty"),
                                     ({"taps_policy": "nope"}, "unknown policy")])
def test_rejects_what_it_cannot_honour(env, models, kw, msg):
    target, drafter = models
    args = {"drafter": drafter, "taps_policy": "ddtree:4", "max_new_tokens": 4, "pad_token_id": 0, **kw}
    with pytest.raises(Exception, match=msg):
        custom(target, torch.tensor([[1, 2, 3]]), **args)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_smollm2_shipped_drafter_equals_plain_generate(policy):
    from taps.models.target import load_target

    try:
        model, tok = load_target("smollm2", linear_kernel="torch")
    except (FileNotFoundError, ImportError, OSError) as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
    out = custom(model, ids, attention_mask=torch.ones_like(ids), taps_policy=policy, max_new_tokens=24,
                 do_sample=False)
    assert out[0].tolist() == ref[0].tolist()
