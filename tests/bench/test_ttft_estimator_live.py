"""benchmarks/ttft_estimator_live.py: the table of where the engine's time to a first token went."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ttft_estimator_live", ROOT / "benchmarks" / "ttft_estimator_live.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _row(prompt, queued, scheduled, first, measured, estimate):
    return {"model": "m", "prompt_tokens": prompt, "estimated_ttft_s": estimate, "decode_engine_first_s": measured,
            "decode_engine_timeline": {"queued_s": queued, "scheduled_s": scheduled, "first_token_s": first},
            "ttft_s": measured, "feasible": True, "limit_s": 1.0}


def test_the_timeline_splits_the_engines_time_into_its_four_parts():
    rows = [_row(50, 0.002, 0.003, 0.008, 0.010, 0.006), _row(60, 0.004, 0.007, 0.012, 0.015, 0.008),
            _row(70, 0.003, 0.005, 0.011, 0.012, 0.007)]
    t = bench.timeline(rows)
    assert t["n"] == 3
    assert t["into_core_ms"] == pytest.approx(3.0) and t["queued_ms"] == pytest.approx(2.0)
    assert t["steps_ms"] == pytest.approx(5.0) and t["back_ms"] == pytest.approx(2.0)
    assert t["measured_ms"] == pytest.approx(12.0) and t["estimate_ms"] == pytest.approx(7.0)


def test_rows_without_a_timeline_are_left_out_and_prompts_are_split_by_size():
    rows = [_row(50, 0.002, 0.003, 0.008, 0.010, 0.006), _row(500, 0.002, 0.003, 0.030, 0.032, 0.025),
            {**_row(60, 0.0, 0.0, 0.0, 0.01, 0.01), "decode_engine_timeline": None}]
    s = bench.summarize(rows)
    assert s["timeline"]["short"]["n"] == 1 and s["timeline"]["long"]["n"] == 1
    assert s["timeline"]["long"]["steps_ms"] == pytest.approx(27.0)
    table = bench.markdown_timeline({"rates": {"2": s}})
    assert "| 2 | < 100 | 1 |" in table and "| 2 | >= 100 | 1 |" in table
    assert bench.timeline([])["n"] == 0
