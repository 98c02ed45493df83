"""benchmarks/host_cpu_live_vs_sim.py: a run's CPU by part live against what the model charges."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling memory.py
spec = importlib.util.spec_from_file_location("host_cpu_live_vs_sim", ROOT / "benchmarks" / "host_cpu_live_vs_sim.py")
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)

HOST = {"cores": 2.0, "engine_cores": 1.1, "token_cpu_s": 0.0002, "request_cpu_s": 0.01, "idle_cores": 0.2}


def test_vllms_processes_are_their_roles_steps_and_every_other_process_the_serving_path():
    assert study.part_of("prefill vLLM EngineCore/worker") == "prefill_steps"
    assert study.part_of("decode vLLM EngineCore/worker") == "decode_steps"
    assert study.part_of("vLLM EngineCore/worker (other)") == "decode_steps"
    for other in ("decode replica", "router replica", "Serve proxy", "Ray system: raylet"):
        assert study.part_of(other) == "serving"


def test_a_run_is_compared_part_by_part_with_the_models_charges():
    live = {"host_cpu_s": {"window_s": 10.0, "prefill_steps": 1.5, "decode_steps": 4.5, "serving": 4.0}}
    sim = {"engine_time": {"makespan_s": 9.5, "engines": {"prefill-0": {"work_s": 1.0, "stepping_s": 2.0, "steps": 9},
                                                         "decode-0": {"work_s": 2.0, "stepping_s": 5.0, "steps": 90}}}}
    records = [{"output_tokens": 100, "error": None}] * 20 + [{"output_tokens": None, "error": "timeout"}]
    row = study.compare(live, sim, {"prefill_steps": 0.0, "decode_steps": 0.01, "serving": 0.15}, records, HOST)
    assert row["requests"] == 20 and row["tokens"] == 2000
    # 1.5 s of prefill steps live for 1 s of modelled compute, 4.5 s of decode steps for 2 s
    assert row["prefill_live_over_sim"] == 1.5 and row["decode_live_over_sim"] == 2.25
    assert row["sim_mean_stretch"] == pytest.approx(7 / 3, abs=0.01)
    assert row["serving_live_s"] == 2.5  # 4 s less 0.15 cores of rest over the 10 s window
    assert row["serving_model_s"] == 0.6 and row["serving_live_over_model"] == pytest.approx(4.17, abs=0.01)
    assert row["idle_live_cores"] == 0.16 and row["host_cores_live"] == 1.0
