"""benchmarks/recompute_divergence.py: its arguments (the measurement itself needs an engine: run it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("recompute_divergence", ROOT / "benchmarks" / "recompute_divergence.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_cuts_must_leave_tokens_on_both_sides():
    a = bench.parse_args(["--max-tokens", "20", "--cuts", "1", "19"])
    assert a.cuts == [1, 19] and a.dtype is None
    for bad in ("0", "20"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--max-tokens", "20", "--cuts", bad])
