"""benchmarks/serving_cpu_terms.py: the two models of the serving path's CPU, fitted over windows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("serving_cpu_terms", ROOT / "benchmarks" / "serving_cpu_terms.py")
terms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(terms)


def _windows(step_s: float, event_s: float, request_s: float) -> list[dict]:
    """Windows as the CPU profile served them: steps and messages flatten as streams grow, tokens do not."""
    out = []
    for requests, tokens, steps, events in ((3, 384, 390, 50), (6, 768, 420, 100), (12, 1536, 450, 200),
                                            (24, 3072, 430, 260), (48, 6144, 460, 330), (120, 480, 240, 245)):
        cpu = steps * step_s + events * event_s + requests * request_s
        out.append({"tokens": tokens, "events": events, "steps": steps, "requests": requests, "serving_cpu_s": cpu})
    return out


def test_the_per_step_model_recovers_its_terms_where_the_per_token_model_cannot():
    windows = _windows(0.0006, 0.0009, 0.004)
    got, errors = terms.fit(windows, ("steps", "events", "requests"))
    assert got == pytest.approx({"steps": 0.0006, "events": 0.0009, "requests": 0.004}, rel=1e-6)
    assert max(map(abs, errors)) < 1e-9
    _, token_errors = terms.fit(windows, ("tokens", "requests"))
    assert max(map(abs, token_errors)) > 0.3  # no constant per token holds from one stream to sixteen
