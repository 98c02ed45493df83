"""benchmarks/live_repeats.py: the capacity summary over repeats (the searches themselves need the app)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("live_repeats", ROOT / "benchmarks" / "live_repeats.py")
repeats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repeats)


def test_a_trace_may_name_its_attainment():
    assert repeats.trace_spec("azure_code_2023:0.75") == ("azure_code_2023", 0.75)
    assert repeats.trace_spec("runs/chat.csv") == ("runs/chat.csv", 0.9)
    with pytest.raises(argparse.ArgumentTypeError, match="1.5"):
        repeats.trace_spec("chat:1.5")


def _found(**caps):
    return {p: {"capacity_rps": c, "bracketed": c is not None} for p, c in caps.items()}


def test_capacity_summary_takes_medians_and_our_best_against_the_best_other():
    per_repeat = [
        {"conv": _found(round_robin=1.0, colocated=1.5, slo_goodput=2.0)},
        {"conv": _found(round_robin=1.2, colocated=1.0, slo_goodput=1.8)},
        {"conv": _found(round_robin=0.8, colocated=None, slo_goodput=2.4)},
    ]
    out = repeats.capacity_summary(per_repeat, ["round_robin", "colocated", "slo_goodput"], ["slo_goodput"],
                                   {"conv": 0.9})
    cells = out["conv"]["policies"]
    assert cells["colocated"]["capacity_rps"] == [1.5, 1.0, 0.0]  # never passed: 0 req/s, and said so
    assert cells["colocated"]["bracketed"] == [True, True, False]
    assert cells["round_robin"]["median_rps"] == 1.0 and cells["colocated"]["median_rps"] == 1.0
    assert cells["slo_goodput"]["range_rps"] == [1.8, 2.4]
    ratio = out["conv"]["ratio"]
    assert ratio["ours"] == "slo_goodput" and ratio["of_medians"] == pytest.approx(2.0 / 1.0)
    # per repeat, against whichever other policy did best in that repeat
    assert ratio["per_repeat"] == pytest.approx([2.0 / 1.5, 1.8 / 1.2, 2.4 / 0.8])


def test_no_ratio_without_both_sides():
    out = repeats.capacity_summary([{"t": _found(round_robin=1.0, least_loaded=2.0)}],
                                   ["round_robin", "least_loaded"], ["slo_goodput"], {"t": 0.9})
    assert "ratio" not in out["t"] and out["t"]["policies"]["least_loaded"]["median_rps"] == 2.0


def test_a_policy_with_parameters_counts_under_its_name():
    spec = "slo_goodput:allow_hosted=false"
    out = repeats.capacity_summary([{"t": _found(round_robin=1.0, **{spec: 1.5})}], ["round_robin", spec],
                                   ["slo_goodput"], {"t": 0.9})
    assert out["t"]["ratio"]["ours"] == spec and out["t"]["ratio"]["of_medians"] == pytest.approx(1.5)


def test_the_crossing_is_read_from_each_searchs_stored_probes_and_ratioed_like_the_grid():
    def search(lo, at_lo, hi, at_hi):
        return {"capacity_rps": lo, "bracket": [lo, hi], "bracketed": True, "probes": [[lo, at_lo], [hi, at_hi]]}
    per_repeat = [{"t": {"colocated": search(1.0, 0.80, 2.0, 0.70), "slo_goodput": search(1.0, 0.90, 2.0, 0.70)}},
                  {"t": {"colocated": search(1.0, 0.76, 2.0, 0.74), "slo_goodput": search(2.0, 0.76, 4.0, 0.74)}}]
    out = repeats.capacity_summary(per_repeat, ["colocated", "slo_goodput"], ["slo_goodput"], {"t": 0.75})
    cells = out["t"]["policies"]
    # at 0.75 between 0.80 at 1 and 0.70 at 2: halfway in log(rate); between 0.90 and 0.70: 3/4 of the way
    assert cells["colocated"]["crossing_rps"] == pytest.approx([2 ** 0.5, 2 ** 0.5])
    assert cells["slo_goodput"]["crossing_rps"] == pytest.approx([2 ** 0.75, 2 * 2 ** 0.5])
    assert out["t"]["ratio"]["per_repeat"] == pytest.approx([1.0, 2.0])  # the grid cannot tell the first apart
    assert out["t"]["crossing_ratio"]["per_repeat"] == pytest.approx([2 ** 0.25, 2.0])
    assert out["t"]["crossing_ratio"]["of_medians"] == pytest.approx(
        cells["slo_goodput"]["crossing_median_rps"] / cells["colocated"]["crossing_median_rps"])
    # a search with no probes stored (never passed) reads as its grid value, 0 req/s
    out = repeats.capacity_summary([{"t": _found(colocated=None, slo_goodput=1.0)}], ["colocated", "slo_goodput"],
                                   ["slo_goodput"], {"t": 0.75})
    assert out["t"]["policies"]["colocated"]["crossing_rps"] == [0.0]


def test_a_refitted_study_keeps_a_finished_run_and_fits_before_a_new_one(tmp_path, monkeypatch):
    """--refit: a repeat already finished is read back, not fitted again nor run; a new one is
    fitted first, then run (both capacity and goodput studies go through `bench`)."""
    import json

    from disagg.bench.harness import BenchConfig
    from disagg.bench.report import RESULTS_JSON

    done_dir, new_dir = tmp_path / "repeat0", tmp_path / "repeat1"
    done_dir.mkdir()
    (done_dir / RESULTS_JSON).write_text(json.dumps({"resolved": {"capacity": {"t": 1.0}}}))
    events = []
    monkeypatch.setattr(repeats, "run_bench", lambda cfg: events.append(("run", cfg.out)) or {"ran": True})

    def cfg(out):
        return BenchConfig(out=out, traces=("t",), policies=("a", "b"), url="http://127.0.0.1:1")

    assert repeats.bench(cfg(done_dir), lambda: events.append("fit")) == {"resolved": {"capacity": {"t": 1.0}}}
    assert events == []
    assert repeats.bench(cfg(new_dir), lambda: events.append("fit")) == {"ran": True}
    assert events == ["fit", ("run", new_dir)]
    assert repeats.bench(cfg(new_dir), None) == {"ran": True}  # without --refit: always run
    assert events[-1] == ("run", new_dir)
