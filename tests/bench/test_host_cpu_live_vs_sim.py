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

HOST = {"cores": 2.0, "engine_cores": 1.1, "token_cpu_s": 0.0002, "request_cpu_s": 0.01, "idle_cores": 0.2,
        "step_cpu_s": 0.0, "event_cpu_s": 0.0}
BY_STEPS = {**HOST, "token_cpu_s": 0.0, "step_cpu_s": 0.0005, "event_cpu_s": 0.001}


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
    # a host priced per step and per message: the engines' steps over the run, the client's messages
    live["host_cpu_s"]["engine_steps"] = 1000.0
    records = [{"output_tokens": 100, "content_events": 12, "error": None}] * 20
    row = study.compare(live, sim, {"prefill_steps": 0.0, "decode_steps": 0.01, "serving": 0.15}, records, BY_STEPS)
    assert (row["engine_steps"], row["events"]) == (1000, 240)
    assert row["serving_path_model_s"] == pytest.approx(0.5 + 0.24)
    assert row["serving_model_s"] == pytest.approx(0.2 + 0.74, abs=0.005)


def test_a_run_at_its_own_serving_cost_scales_every_serving_path_term_by_what_the_run_measured():
    from disagg.core.cost_model import SharedHost, load_profile
    cm = load_profile("cpu-tiny").model_copy(update={"shared_host": SharedHost(**BY_STEPS)})
    row = {"serving_live_s": 2.2, "requests": 20, "serving_path_model_s": 1.0, "idle_live_cores": 0.3}
    host = study.at_serving(cm, row).shared_host
    # 2 s of serving path live past the requests' 0.2 s, for 1 s its terms charge: each doubled
    assert (host.step_cpu_s, host.event_cpu_s, host.token_cpu_s) == pytest.approx((0.001, 0.002, 0.0))
    assert host.request_cpu_s == 0.01 and host.idle_cores == 0.3


def test_a_run_at_its_own_speed_scales_every_engines_step_times_and_nothing_else():
    from disagg.core.cost_model import load_profile
    cm = load_profile("cpu-tiny")
    cm = cm.model_copy(update={"instances": {"decode-0": cm.engine}})
    slow = study.scaled(cm, 1.5)
    for before, after in ((cm.engine, slow.engine), (cm.instances["decode-0"], slow.instances["decode-0"])):
        assert after.step_s(64, 4) == pytest.approx(1.5 * before.step_s(64, 4))
        assert after.prefill_s(900) == pytest.approx(1.5 * before.prefill_s(900))
        assert after.kv_capacity_tokens == before.kv_capacity_tokens
    assert slow.transfer == cm.transfer and slow.shared_host == cm.shared_host


def test_latency_percentiles_leave_failed_requests_out():
    ok = [{"ttft_s": 0.01 * i, "tpot_s": 0.001 * i, "error": None} for i in range(1, 11)]
    got = study.latency(ok + [{"ttft_s": None, "tpot_s": None, "error": "timeout"}])
    assert got["ttft_p50_ms"] == pytest.approx(55, abs=5) and got["tpot_p90_ms"] == pytest.approx(9.5, abs=0.6)
    assert study.latency([]) == {"ttft_p50_ms": None, "ttft_p90_ms": None, "tpot_p50_ms": None, "tpot_p90_ms": None}


def test_each_requests_live_ttft_is_set_against_its_own_simulated_one_by_prompt_length():
    live = [{"index": 0, "prompt_tokens": 100, "ttft_s": 0.02, "error": None},
            {"index": 1, "prompt_tokens": 1500, "ttft_s": 0.12, "error": None},
            {"index": 2, "prompt_tokens": 1500, "ttft_s": None, "error": "timeout"}]
    simulated = [{"index": 1, "ttft_s": 0.08, "error": None}, {"index": 0, "ttft_s": 0.02, "error": None},
                 {"index": 2, "ttft_s": 0.05, "error": None}]
    assert study.by_prompt(live, simulated) == {"<512": [1.0], ">=512": [1.5]}


def test_the_summary_gives_each_simulations_median_error_and_the_cells_within_15_percent():
    def sim(scale: float, ratios: list[float]) -> dict:
        return {**{k: 10.0 * scale for k in study.STATS}, "live_over_sim_ttft": {"<512": ratios, ">=512": ratios}}
    rows = [{"live": {k: 10.0 for k in study.STATS}, "sim": sim(0.9, [1.0]), "sim_at_run_speed": sim(1.5, [0.5]),
             "sim_at_run_serving": sim(1.0, [1.0, 1.2])}]
    got = study.summarize(rows)
    assert got["sim"]["median_error"]["ttft_p90_ms"] == pytest.approx(-0.1) and got["sim"]["within_15pct"] == "4 of 4"
    assert got["sim_at_run_speed"]["within_15pct"] == "0 of 4"
    assert got["sim_at_run_serving"]["live_over_sim_ttft_median"] == {"<512": 1.1, ">=512": 1.1}
