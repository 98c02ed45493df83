"""benchmarks/shared_host_steady.py: the TPOT the cost model gives the streams it measures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from disagg.core.cost_model import SharedHost, load_profile

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("shared_host_steady", ROOT / "benchmarks" / "shared_host_steady.py")
steady = importlib.util.module_from_spec(spec)
spec.loader.exec_module(steady)


def test_streams_on_engines_that_own_their_devices_decode_at_the_step_time():
    cm = load_profile("cpu-tiny")
    got = steady.modelled_tpot_s(cm, {"d0": 2, "d1": 8})
    assert got == {"d0": cm.engine.decode_token_s(2), "d1": cm.engine.decode_token_s(8)}


def test_streams_on_a_shared_host_decode_at_its_stretch_for_every_engine_busy():
    host = SharedHost(engine_cores=1, cores=2, token_cpu_s=0.0005)
    cm = load_profile("cpu-tiny").model_copy(update={"shared_host": host})
    alone = steady.modelled_tpot_s(cm, {"d0": 4})["d0"]
    both = steady.modelled_tpot_s(cm, {"d0": 4, "d1": 4})
    tokens, relay = host.serving_cores(4, cm.engine.step_s(0, 4))
    assert relay == 0.0  # priced per token: nothing at a rate of its own
    tokens *= 2
    assert both["d0"] == both["d1"] == pytest.approx(cm.engine.decode_token_s(4) * host.stretch(2, tokens))
    assert 1.8 * alone < both["d0"] < 2.2 * alone  # two engines on one core: about twice as long
