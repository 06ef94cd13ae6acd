"""``LatencyTable``: load/save, the cost at (rows, nodes), round and plain-round seconds, and the one rule past
the table's end, which every reader (the policies' batch tables, the projection report, the GPU benchmark's
verify table) now follows."""
import json
from pathlib import Path

import pytest

from taps.decode.latency import LatencyTable, load_table, round_seconds, save_table
from taps.decode.policies import gate
from taps.bench import run_report as report

from helpers import load_bench_script

ROOT = Path(__file__).resolve().parents[1]
RECORD = {"latency": [0.05, 0.06, 0.07, 0.09, 0.09], "t0": 0.03, "machine": "m", "model": "x",
          "t0_parts": {"draft": 0.02, "context": 0.01, "draft_by_positions": [0.005, 0.01, 0.02]},
          "batch_latency": {"2": [0.08, 0.085, 0.09, 0.1, 0.1], "3": []}}


def test_cost_inside_the_table():
    t = LatencyTable(RECORD)
    assert [t.seconds(1, n) for n in range(5)] == RECORD["latency"]
    assert t.seconds(1, 2.5) == pytest.approx(0.08, rel=1e-12)       # linear between points
    assert t.seconds(1, -3) == 0.05                                  # below 0: the cost at 0
    assert [t.seconds(2, n) for n in range(5)] == RECORD["batch_latency"]["2"]  # the measured 2-row table
    assert [t.seconds(3, n) for n in range(3)] == [0.07, 0.09, 0.09]  # none measured: latency[rows - 1 + n]
    assert t.measured_rows == [2]
    with pytest.raises(ValueError, match="rows"):
        t.seconds(0, 1)


def test_one_rule_past_the_end_is_the_mean_slope():
    t = LatencyTable(RECORD)
    slope = (0.09 - 0.05) / 4  # the mean over the table, not its last (flat) step
    assert t.seconds(1, 6) == pytest.approx(0.09 + 2 * slope, rel=1e-12)
    assert t.seconds(1, 4.5) == pytest.approx(0.09 + 0.5 * slope, rel=1e-12)
    assert t.seconds(3, 4) == pytest.approx(0.09 + 2 * slope, rel=1e-12)  # by total rows, same rule
    slope2 = (0.1 - 0.08) / 4
    assert t.seconds(2, 7) == pytest.approx(0.1 + 3 * slope2, rel=1e-12)
    assert LatencyTable({"latency": [0.2, 0.1]}).seconds(1, 5) == 0.1    # a falling table: no negative slope
    assert LatencyTable({"latency": [0.2]}).seconds(1, 5) == 0.2         # one point: flat
    assert t.batch_seconds(1, 6) == [t.seconds(1, n) for n in range(7)]


def _old_batch_seconds(latency, rows, n_total):
    """The policies' reader as it was: the rule the table keeps."""
    measured = (latency.get("batch_latency") or {}).get(str(rows)) if rows > 1 else None
    base, offset = ([float(x) for x in measured], 0) if measured else ([float(x) for x in latency["latency"]],
                                                                       rows - 1)
    slope = max((base[-1] - base[0]) / (len(base) - 1), 0.0) if len(base) > 1 else 0.0
    return [base[n + offset] if n + offset < len(base) else base[-1] + slope * (n + offset - len(base) + 1)
            for n in range(n_total + 1)]


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_policy_reader_unchanged(rows):
    assert gate.batch_seconds(RECORD, rows, 12) == _old_batch_seconds(RECORD, rows, 12)
    assert gate.batch_table(RECORD, rows, 3).tolist() == _old_batch_seconds(RECORD, rows, 3)
    assert gate.plain_round_seconds(RECORD, rows) == _old_batch_seconds(RECORD, rows, 0)[0]


def test_round_seconds():
    t = LatencyTable(RECORD)
    assert t.round_seconds() == 0.03 == round_seconds(RECORD)
    assert t.round_seconds(2) == 0.01 + 0.01
    assert t.round_seconds(99) == 0.02 + 0.01 and t.round_seconds(0) == 0.005 + 0.01  # clamped to [1, D]
    assert LatencyTable({"latency": [1.0], "t0": 0.5}).round_seconds(3) == 0.5     # no per-position parts
    assert LatencyTable({"latency": [1.0]}).t0 == 0.0
    # a plain round keeps its context features unprojected: the drafted round pays the context update
    assert t.plain_round_seconds() == 0.05 and t.plain_round_seconds(2) == 0.08


def test_load_save_round_trip_and_checks(tmp_path):
    p = LatencyTable(RECORD).save(tmp_path / "sub" / "t.json")
    assert json.loads(p.read_text()) == RECORD
    assert LatencyTable.load(p).to_dict() == RECORD and load_table(p) == RECORD
    assert save_table(RECORD, tmp_path / "u.json").is_file()
    assert not list(tmp_path.glob("**/*.tmp"))
    assert LatencyTable.of(LatencyTable(RECORD)).record == RECORD
    for bad in ([], [0.1, float("nan")], [True], "0.1"):
        (tmp_path / "bad.json").write_text(json.dumps({"latency": bad}).replace("NaN", "NaN"))
        with pytest.raises(ValueError, match="bad.json.*latency"):
            LatencyTable.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="latency"):
        LatencyTable({"t0": 1.0})


def test_report_projection_reads_the_table():
    t = {"latency": [0.05, 0.07, 0.09], "t0": 0.01}
    assert report._lat(t, 1) == 0.07 and report._lat(t, 0.5) == pytest.approx(0.06, rel=1e-12)
    assert report._lat(t, 3) == pytest.approx(0.11, rel=1e-12)  # past the end: the table's rule (was: flat)
    assert report.projected_tps({"tau": 2.0, "nodes_per_round": 2.0}, t) == pytest.approx(2.0 / 0.08, rel=1e-12)


def test_bench_verify_table_reads_through_the_table():
    bench = load_bench_script("bench_decode_gpu")
    rows = [{"batch": 1, "nodes": n, "ms": ms} for n, ms in ((1, 1.0), (2, 1.5), (4, 1.4), (8, 3.0))]
    rows.append({"batch": 4, "nodes": 1, "ms": 9.0})
    # points made non-decreasing (1.5, 1.4 -> 1.45, 1.45), linear in between
    assert bench.interp_ms(rows, 1, 1) == (pytest.approx(1.0), False)
    assert bench.interp_ms(rows, 1, 3) == (pytest.approx(1.45), False)
    assert bench.interp_ms(rows, 1, 6) == (pytest.approx(1.45 + (3.0 - 1.45) / 2), False)
    ms, extrapolated = bench.interp_ms(rows, 1, 10)
    assert extrapolated and ms == pytest.approx(3.0 + 2 * (3.0 - 1.0) / 7)  # mean slope over n = 0..7
    assert bench.interp_ms(rows, 4, 3) == (pytest.approx(9.0), True)       # one point: flat
    assert bench.interp_ms(rows, 2, 3) == (None, False)


def test_from_points():
    t = LatencyTable.from_points({0: 1.0, 2: 3.0, 3: 2.0}, t0=0.5)
    assert t.latency == pytest.approx([1.0, 1.75, 2.5, 2.5]) and t.t0 == 0.5
    assert LatencyTable.from_points({2: 4.0}).latency == [4.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="points"):
        LatencyTable.from_points({})


def test_bench_batch_note_names_the_measured_tables():
    from types import SimpleNamespace

    from taps.bench.sweep import latency_note

    assert latency_note(SimpleNamespace(_latency=LatencyTable(RECORD))) == (
        "one-row table to 4 nodes; batch tables measured for [2] rows")
    assert latency_note(SimpleNamespace(_latency={"latency": [0.1, 0.2]})) == (
        "one-row table to 1 nodes, no batch tables: a verify priced by its total rows")
    assert latency_note(SimpleNamespace()) is None


def test_calibration_sweeps_the_grid_once_per_repeat():
    """Every grid point is timed in every sweep (a warm-up sweep first, not kept), so a machine that drifts during
    the calibration shifts all points alike: a clock that slows by one unit per call leaves each point's timings
    one sweep apart, the same for every point."""
    from taps.decode import latency

    calls = []
    out = latency._interleaved([0, 1, 4], 2, lambda n: calls.append(n) or float(len(calls)))
    assert calls == [0, 1, 4] * 3
    assert out == {0: [4.0, 7.0], 1: [5.0, 8.0], 4: [6.0, 9.0]}
