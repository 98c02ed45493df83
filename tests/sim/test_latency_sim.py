"""The multi-model fleet simulator with every model-level router of the core's registry, on small
generated workloads (the routers' own unit tests: tests/core/test_model_routing.py).

Fleet: the a40 profile's engine as `small`, the same engine with every step-time term ×2.5 as
`large` (disagg.sim.latency_study.fleet_models). Accuracy from priors only (large 0.8, small 0.6),
so at λ = 0 an accuracy/cost router wants the large model for every query.
"""

from __future__ import annotations

import pytest

from disagg.core.cost_model import load_profile
from disagg.core.engine_model import EngineModel, Job
from disagg.core.model_routing import build_model_router, known_model_routers
from disagg.core.ttft_estimator import snapshot_of
from disagg.core.types import SloClass
from disagg.core.utility import AccuracyTable
from disagg.sim.latency_sim import (
    RouterSnapshots,
    make_fleet,
    naive_remaining_output,
    parse_fleet,
    poll_snapshot,
    remaining_output,
    simulate_fleet,
)
from disagg.sim.latency_study import fleet_models
from disagg.sim.traces import TraceRequest, assign_slo_classes
from disagg.sim.workloads import generate

CM = load_profile("a40")
ACC = AccuracyTable(priors={"small": 0.6, "large": 0.8})


def limit(r: TraceRequest) -> float:
    return CM.target(r.slo_class).ttft_s


def fleet(spec: str = "small:1,large:1"):
    return make_fleet(parse_fleet(spec), fleet_models(CM, 2.5))


def workload(n: int, rate: float, seed: int = 1) -> list[TraceRequest]:
    return assign_slo_classes(generate("short_chat", n, rate, seed), 0.5, seed)


def attainment(records) -> float:
    return sum(r.met_limit for r in records) / len(records)


# --- the routers in the simulator ----------------------------------------------------------------


@pytest.mark.parametrize("router", known_model_routers())
def test_same_inputs_same_records_and_every_query_is_recorded_once(router):
    trace = workload(150, 8.0)
    a = simulate_fleet(trace, fleet(), build_model_router(router, 100.0, ACC), limit)
    b = simulate_fleet(trace, fleet(), build_model_router(router, 100.0, ACC), limit)
    assert a.records == b.records
    assert [r.request_id for r in a.records] == [f"r{i}" for i in range(len(trace))]
    assert all(r.ttft_s is not None and r.ttft_s > 0 and r.estimated_ttft_s is not None for r in a.records)
    assert sum(a.queries_per_instance.values()) == len(trace)


def test_under_load_latency_aware_meets_far_more_ttft_limits_than_accuracy_cost():
    # 12 req/s is beyond what the large instance alone sustains; the fleet as a whole copes
    trace = workload(300, 12.0)
    la = simulate_fleet(trace, fleet(), build_model_router("latency_aware", 0.0, ACC), limit)
    ac = simulate_fleet(trace, fleet(), build_model_router("accuracy_cost", 0.0, ACC), limit)
    assert ac.queries_per_instance == {"small-0": 0, "large-0": 300}  # it ignores load
    assert 0 < la.queries_per_instance["small-0"] < 300  # spills to the fast model, not all of it
    assert attainment(la.records) >= 0.85
    assert attainment(la.records) >= attainment(ac.records) + 0.3


def test_at_light_load_latency_aware_follows_accuracy_and_load_balance_follows_speed():
    trace = workload(200, 1.0)
    la = simulate_fleet(trace, fleet(), build_model_router("latency_aware", 0.0, ACC), limit)
    lb = simulate_fleet(trace, fleet(), build_model_router("load_balance", 0.0, ACC), limit)
    assert la.queries_per_instance["large-0"] >= 0.9 * len(trace)
    assert lb.queries_per_instance["small-0"] >= 0.9 * len(trace)
    assert attainment(la.records) >= 0.95 and attainment(lb.records) >= 0.95


def test_a_large_lambda_sends_everything_to_the_cheap_model():
    trace = workload(100, 2.0)
    for router in ("latency_aware", "accuracy_cost"):
        res = simulate_fleet(trace, fleet(), build_model_router(router, 1e5, ACC), limit)
        assert res.queries_per_instance["large-0"] == 0, router


def test_latency_aware_estimate_is_exact_with_exact_state_and_true_outputs_on_an_idle_fleet():
    # queries far apart: each finds the fleet idle, so the estimate has nothing to get wrong
    trace = [TraceRequest(10.0 * i, 100 + 50 * i, 20, SloClass.LOOSE) for i in range(5)]
    res = simulate_fleet(trace, fleet(), build_model_router("latency_aware", 0.0, ACC), limit, poll_interval_s=None)
    for r in res.records:
        assert r.estimated_ttft_s == pytest.approx(r.ttft_s, abs=1e-9)


# --- what the router knows -----------------------------------------------------------------------


def _engine_with(n_jobs: int, run_steps: int = 0) -> EngineModel:
    e = EngineModel("e", CM.engine)
    for k in range(n_jobs):
        e.submit(Job(k, 300 + 100 * k, 40 + 10 * k))
    t = 0.0
    for _ in range(run_steps):
        end = e.poke(t)
        if end is None:
            break
        t = end
        e.end_step(t)
    return e


@pytest.mark.parametrize("steps", [0, 1, 3, 6])
def test_a_poll_at_a_step_boundary_with_true_outputs_is_the_engines_own_snapshot(steps):
    e = _engine_with(5, steps)
    assert not e.busy
    polled = poll_snapshot(e, lambda j: j.target, 0.0, naive_remaining_output)
    assert polled == snapshot_of(e)


def test_router_snapshots_add_queries_sent_since_the_poll_and_drop_them_at_the_next():
    e = _engine_with(0)
    snaps = RouterSnapshots([e], lambda j: j.target, poll_interval_s=0.05)
    snaps.refresh(0, 0.01)
    snaps.sent(0, 500, 80)
    assert [q.prompt_tokens for q in snaps.view(0, 0.02).waiting] == [500]
    e.submit(Job("x", 500, 80))  # the engine got it; the next poll shows it from the engine
    view = snaps.view(0, 0.06)
    assert [q.prompt_tokens for q in view.waiting] == [500]
    assert view.waiting[0].output_tokens == 80


@pytest.mark.parametrize("predicted,generated,expected", [
    (100, 0, 100), (100, 40, 60), (100, 60, 50), (100, 99, 50), (100, 100, 50), (100, 300, 150), (1, 0, 1),
    (1, 5, 2),
])
def test_remaining_output_never_drops_below_half_of_what_is_known(predicted, generated, expected):
    assert remaining_output(predicted, generated) == expected
    assert naive_remaining_output(predicted, generated) == max(1, predicted - generated)


def test_bad_fleets_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="model:count"):
        parse_fleet("small=2")
    with pytest.raises(ValueError, match="unknown model 'medium'"):
        make_fleet([("medium", 1)], fleet_models(CM, 2.5))
    with pytest.raises(ValueError, match="unique"):
        simulate_fleet(workload(3, 1.0), fleet() + fleet(), build_model_router("load_balance", 0.0, ACC), limit)
    with pytest.raises(ValueError, match="unknown model-level router 'fastest'"):
        build_model_router("fastest", 0.0, ACC)


def test_true_outputs_tell_the_router_each_querys_real_output_length():
    trace = workload(60, 4.0)
    res = simulate_fleet(trace, fleet(), build_model_router("latency_aware", 0.0, ACC), limit, true_outputs=True)
    assert all(r.predicted_output_tokens == r.output_tokens for r in res.records)
    res = simulate_fleet(trace, fleet(), build_model_router("latency_aware", 0.0, ACC), limit)
    assert any(r.predicted_output_tokens != r.output_tokens for r in res.records)
