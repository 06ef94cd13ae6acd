"""``bench/compare_runs.py``: equal ids pass, one changed id fails, tokens/s per policy from totals."""
import json

from helpers import load_bench_script


def _load():
    return load_bench_script("compare_runs")


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _rec(policy, pid, ids, seconds):
    return {"policy": policy, "id": pid, "turns": [{"token_ids": ids, "seconds": seconds}]}


def test_same_ids_pass_and_a_changed_id_fails(tmp_path):
    cr = _load()
    before = _write(tmp_path / "a.jsonl", [_rec("ar", "p0", [1, 2, 3], 1.0), _rec("ar", "p1", [4, 5], 1.0),
                                            _rec("taps", "p0", [1, 2, 3], 0.5)])
    after = _write(tmp_path / "b.jsonl", [_rec("ar", "p0", [1, 2, 3], 0.5), _rec("ar", "p1", [4, 5], 0.5),
                                           _rec("taps", "p0", [1, 2, 3], 0.5)])
    out = tmp_path / "s.json"
    assert cr.main([before, after, "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["policies"]["ar"]["tokens_per_s_before"] == 2.5 and s["policies"]["ar"]["ratio"] == 2.0
    changed = _write(tmp_path / "c.jsonl", [_rec("ar", "p0", [1, 2, 9], 1.0), _rec("taps", "p0", [1, 2, 3], 0.5)])
    assert cr.main([before, changed]) == 1
    s = cr.compare(cr.load(before), cr.load(changed))
    assert s["policies"]["ar"]["different_ids"] == 1 and s["only_before"] == 1 and s["shared_turns"] == 2
