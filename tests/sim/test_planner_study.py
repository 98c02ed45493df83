"""`disagg study planner`: one row per scaler on one trace, results written atomically; bad flags
refused before any work, nothing written."""

from __future__ import annotations

import json

import pytest

from disagg.cli import main
from disagg.sim.traces import write_native
from disagg.sim.workloads import generate

SMALL = ["--max-topology", "2P2D", "--fixed", "1P1D", "--startup-s", "5", "--interval-s", "5"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "bursty.csv"
    write_native(path, generate("mixed_bursty", 300, 8.0, 1))
    return path


def test_the_study_writes_a_row_per_scaler_with_widths_and_cost(trace, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["study", "planner", "--trace", str(trace), *SMALL, "--serve-targets", "2/32,1/8",
                 "--down-after", "default,startup,3", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    labels = [r["scaler"] for r in result["rows"]]
    assert labels == ["fixed 1P1D", "fixed 2P2D", "serve default (2/32)", "serve default (1/8)",
                      "planner (down_after 3)", "planner (down_after 2)"]  # 'default' and 3 are one row
    for r in result["rows"]:
        assert 0.0 <= r["attainment"] <= 1.0 and r["gpu_hours"] > 0
        assert r["attainment_per_gpu_hour"] == pytest.approx(r["attainment"] / r["gpu_hours"])
        assert r["series"]["points"][0][0] == 0.0
    fixed = result["rows"][1]
    assert fixed["gpu_hours"] == pytest.approx(4 * fixed["duration_s"] / 3600)
    md = (out / "results.md").read_text()
    assert "attainment / GPU-h" in md and "planner (down_after 2)" in md
    assert (out / "widths.png").stat().st_size > 0
    assert "serve default (1/8)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, says", [
    (["--fixed", "3P1D"], "exceeds --max-topology"),
    (["--serve-targets", "2"], "--serve-targets"),
    (["--down-after", "soon"], "--down-after"),
    (["--policy", "nope"], "--policy"),
    (["--startup-s", "-1"], "--startup-s"),
])
def test_bad_flags_are_refused_and_nothing_is_written(trace, tmp_path, capsys, flags, says):
    out = tmp_path / "out"
    assert main(["study", "planner", "--trace", str(trace), *SMALL, *flags, "--out", str(out)]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()
