"""benchmarks/calibrate_live.py: `stability`, how far each run's fit lies from what every run measured."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from disagg.core.cost_model import load_profile

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("calibrate_live", ROOT / "benchmarks" / "calibrate_live.py")
calibrate_live = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calibrate_live)

ENGINE = load_profile("cpu-tiny").engine


def run(engine, factor: float = 1.0) -> dict:
    """One run of one instance priced by `engine`, whose probes measured ENGINE's times × factor."""
    samples = {"prefill": [[n, factor * ENGINE.prefill_s(n)] for n in (64, 512)],
               "decode": [[b, factor * ENGINE.decode_token_s(b)] for b in (1, 16)],
               "held_out_prefill": [[198, factor * ENGINE.prefill_s(198)]],
               "held_out_decode": [[3, factor * ENGINE.decode_token_s(3)]]}
    return {"instances": {"i": {"priced_engine": engine.model_dump(mode="json"), "samples": samples}}}


def test_fits_that_describe_every_run_are_steady_and_exact():
    got = calibrate_live.stability([run(ENGINE), run(ENGINE)])
    assert got["points"] == 6
    assert got["median_rel_error"] == pytest.approx(0.0, abs=1e-12)
    assert got["max_over_min"] == {"prefill": pytest.approx(1.0), "decode": pytest.approx(1.0)}


def test_a_fit_that_moves_from_run_to_run_shows_in_the_spread_and_the_error():
    slow = ENGINE.model_copy(update={"decode_seq_s": 4 * ENGINE.decode_seq_s, "step_base_s": 2 * ENGINE.step_base_s})
    got = calibrate_live.stability([run(ENGINE), run(slow)])
    assert got["max_over_min"]["decode"] > 1.5
    assert got["p90_rel_error"] > 0.3
    # the typical time is the median of every run's probes: runs that measured 1× and 3× put it at 2×,
    # so constants that describe either run alone are 50% off half the time
    got = calibrate_live.stability([run(ENGINE, 1.0), run(ENGINE, 3.0)])
    assert got["median_rel_error"] == pytest.approx(0.5)


def test_the_repeatability_floor_is_each_probe_against_its_points_typical_time():
    got = calibrate_live.stability([run(ENGINE, 1.0), run(ENGINE, 1.0), run(ENGINE, 1.3)])
    # two of three probes of every point at its typical time, one 30% above it
    assert got["repeatability_mape"] == {"prefill": pytest.approx(0.1), "decode": pytest.approx(0.1)}
