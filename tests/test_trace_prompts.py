"""`taps traces` inputs: code/chat prompt interleaving, Magpie exclusion of the drafter's prompts, resume, drafter identity."""
import json
from types import SimpleNamespace

import pytest

from taps.data.magpie import MagpieWriter
from taps.scoring.traces import TraceConfig, _prompt_list, interleave

TURNS = ["Write a short poem about the sea and the wind tonight.",
         "Explain how a bicycle gear system works for a child.",
         "Give me three ideas for a rainy weekend with friends.",
         "What should I pack for a week of hiking in the mountains?"]


class _Tok:
    """Just enough of a chat tokenizer: token k >= 10 decodes to TURNS[k - 10], 1 ends a turn."""
    chat_template = "stub"
    eos_token_id = 1

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "<user>" + messages[0]["content"]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2] * len(text)}

    def convert_tokens_to_ids(self, token):
        return None

    def decode(self, ids, skip_special_tokens=False):
        return TURNS[ids[0] - 10]


class _Gen:
    """Samples the turns in order, one per row, so a batch of 4 proposes every turn once."""
    device = "cpu"

    def generate(self, prompts, max_new_tokens, **kw):
        return [SimpleNamespace(tokens=p + [10 + i % len(TURNS), 1], prompt_len=len(p)) for i, p in enumerate(prompts)]


class _NoEval:
    def overlaps(self, text):
        return False


def test_interleave_spreads_chat_evenly_and_keeps_everything():
    code = [{"id": f"c{i}"} for i in range(7)]
    chat = [{"id": f"h{i}"} for i in range(3)]
    out = interleave(code, chat)
    assert [p["id"] for p in out] == ["c0", "c1", "c2", "h0", "c3", "c4", "h1", "c5", "c6", "h2"]
    for n in range(1, len(out) + 1):  # every prefix (a run cut short) holds about the asked mix
        assert abs(sum(p["id"][0] == "h" for p in out[:n]) - 0.3 * n) < 1
    assert interleave(code, []) == code and interleave([], chat) == chat


def test_magpie_writer_rejects_excluded_turns(tmp_path):
    w = MagpieWriter(tmp_path, _Gen(), _Tok(), eval_filter=_NoEval(), batch_size=4)
    w.exclude([TURNS[1].upper()])  # duplicates are found on normalised text
    got = [t["text"] for t in w.ensure(3)]
    assert got == [TURNS[0], TURNS[2], TURNS[3]]
    assert w.stats["rejected_dup"] == 1
    again = MagpieWriter(tmp_path, _Gen(), _Tok(), eval_filter=_NoEval(), batch_size=4)  # resumes from the file
    assert [t["text"] for t in again.turns] == got


def test_prompt_list_is_read_back_and_checked(tmp_path):
    prompts = [{"id": str(i), "kind": "chat", "text": t} for i, t in enumerate(TURNS)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    assert _prompt_list(tmp_path, TraceConfig(num_prompts=4), None, None) == prompts
    with pytest.raises(ValueError, match="holds 4 prompts.*num_prompts=5"):
        _prompt_list(tmp_path, TraceConfig(num_prompts=5), None, None)


def test_trace_config_checks_new_options():
    with pytest.raises(ValueError, match="chat_fraction"):
        TraceConfig(chat_fraction=1.5)
    with pytest.raises(ValueError, match="draft_dtype.*'float16'"):
        TraceConfig(draft_dtype="float16")


def test_drafter_identity_hashes_the_weights_not_the_draft_vocabulary(tmp_path):
    from taps.scoring.traces import drafter_identity, file_digest

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    before = drafter_identity(tmp_path)["sha256"]
    (tmp_path / "draft_vocab.safetensors").write_bytes(b"vocab")  # sorts first; must not name the drafter
    assert drafter_identity(tmp_path)["sha256"] == before == file_digest(tmp_path / "model.safetensors")
