"""Pool widths that change during a simulation (disagg.sim.autoscaling): start-up delay, draining,
GPU-seconds, Ray Serve's default rule, the planner under a load step, and fixed widths unchanged."""

from __future__ import annotations

import math
import random

import pytest

from disagg.core.cost_model import load_profile
from disagg.core.planner import Planner, PlannerConfig, Widths, Window
from disagg.core.policies import build_policy
from disagg.core.types import Role, SloClass
from disagg.sim.autoscaling import (
    FixedWidths, FleetState, PlannerScaler, ServeAutoscaling, ServeDefault, ServeRule,
)
from disagg.sim.runner import prepare_trace, simulate
from disagg.sim.simulator import Simulator, Topology
from disagg.sim.traces import TraceRequest
from disagg.sim.workloads import generate

CM = load_profile("a40")


class Schedule:
    """A scaler that sets the given widths at the given times (evaluated every `interval_s`)."""

    name = "schedule"

    def __init__(self, initial: Widths, steps: dict[float, Widths], interval_s: float = 1.0) -> None:
        self.initial, self.steps, self.interval_s = initial, steps, interval_s
        self.seen: list[FleetState] = []

    def decide(self, state: FleetState) -> Widths:
        self.seen.append(state)
        current = self.initial
        for t, w in sorted(self.steps.items()):
            if state.now >= t - 1e-9:
                current = w
        return current


def steady(rate: float, start: float, end: float, prompt: int = 300, output: int = 50) -> list[TraceRequest]:
    n = int((end - start) * rate)
    return [TraceRequest(start + i / rate, prompt, output, SloClass.LOOSE) for i in range(n)]


def run(trace, topology: Topology, scaler, startup_s: float, policy: str = "round_robin"):
    sim = Simulator(CM, topology, build_policy(policy, CM), scaler=scaler, startup_s=startup_s)
    return sim, sim.run(trace)


def finish_time(rec) -> float:
    return rec.arrival_s + rec.e2e_s - CM.serving_overhead_s


# --- the life cycle ------------------------------------------------------------------------------


def test_an_instance_requested_at_t_is_not_routed_to_before_t_plus_startup():
    trace = steady(4.0, 0.0, 40.0)
    scaler = Schedule(Widths(1, 1), {10.0: Widths(1, 2)})
    sim, res = run(trace, Topology(1, 2), scaler, startup_s=15.0)
    on_new = [r for r in res.records if r.decode_id == "decode-1"]
    assert on_new, "round robin uses the new instance once it serves"
    assert min(r.arrival_s for r in on_new) >= 25.0
    assert min(r.arrival_s for r in on_new) < 25.0 + 0.5  # and from then on
    # the scaler saw it starting: in the width, not among the active
    at_20 = next(s for s in scaler.seen if s.now == pytest.approx(20.0))
    assert at_20.widths == Widths(1, 2) and at_20.active == Widths(1, 1)
    assert sim.fleet.series[0][1:] == (1, 1, 1, 1)


def test_a_draining_instance_gets_no_new_request_and_is_released_only_when_empty():
    # long decodes: decode-1 holds requests when it is drained at 10 s
    trace = steady(2.0, 0.0, 30.0, prompt=200, output=800)
    scaler = Schedule(Widths(1, 2), {10.0: Widths(1, 1)})
    sim, res = run(trace, Topology(1, 2), scaler, startup_s=0.0)
    drained = "decode-1"  # the one holding the fewest requests goes (round robin: as many; then the higher index)
    on_it = [r for r in res.records if r.decode_id == drained]
    assert max(r.arrival_s for r in on_it) < 10.0
    assert all(r.decode_id == "decode-0" for r in res.records if r.arrival_s >= 10.0)
    last = max(finish_time(r) for r in on_it)
    assert last > 10.0 + 1.0  # it still held requests when drained
    # released at its last request's end: provisioned decode width 2 until then, 1 after
    released = next(p[0] for p in sim.fleet.series if p[4] == 1)
    assert released == pytest.approx(last, abs=1e-9)
    a = res.extra["autoscaling"]
    assert a["gpu_seconds"] == pytest.approx(2 * res.makespan_s + last, rel=1e-12)


@pytest.mark.parametrize("steps, startup_s, extra_s", [
    ({10.0: Widths(1, 2), 20.0: Widths(1, 1)}, 5.0, 10.0),  # started at 10, idle when drained at 20
    ({10.0: Widths(1, 2), 12.0: Widths(1, 1)}, 5.0, 2.0),  # cancelled while starting at 12
    ({10.0: Widths(1, 2)}, 5.0, None),  # held to the end
])
def test_gpu_seconds_count_every_instance_from_its_request_to_its_release(steps, startup_s, extra_s):
    trace = steady(1.0, 0.0, 3.0) + steady(1.0, 30.0, 33.0)  # nothing arrives between 3 and 30 s
    sim, res = run(trace, Topology(1, 2), Schedule(Widths(1, 1), steps), startup_s)
    end = res.makespan_s
    assert end > 30.0
    extra = end - 10.0 if extra_s is None else extra_s
    a = res.extra["autoscaling"]
    assert a["gpu_seconds"] == pytest.approx(2 * end + extra, rel=1e-12)
    assert a["gpu_hours"] == pytest.approx(a["gpu_seconds"] / 3600)
    assert a["decode_provisioned_mean"] == pytest.approx((end + extra) / end, rel=1e-12)
    assert a["decode_provisioned_max"] == 2


def test_a_scaler_asking_for_widths_that_do_not_exist_is_refused_by_name():
    with pytest.raises(ValueError, match="schedule.*1..2 decode"):
        run(steady(1.0, 0.0, 5.0), Topology(1, 2), Schedule(Widths(1, 1), {1.0: Widths(1, 3)}), 0.0)
    with pytest.raises(ValueError, match="initial decode width 3"):
        run(steady(1.0, 0.0, 5.0), Topology(1, 2), FixedWidths(Widths(1, 3)), 0.0)


def test_evaluations_and_start_ups_do_not_extend_the_run():
    trace = steady(1.0, 0.0, 3.0)
    _, plain = run(trace, Topology(1, 1), None, 60.0)
    _, scaled = run(trace, Topology(1, 2), Schedule(Widths(1, 1), {1.0: Widths(1, 2)}, 0.5), 60.0)
    assert scaled.makespan_s == plain.makespan_s


# --- fixed widths: the run without a scaler --------------------------------------------------------


@pytest.mark.parametrize("policy", ["slo_goodput", "marginal_cost"])
def test_fixed_widths_inside_a_larger_topology_give_the_fixed_run_record_for_record(policy):
    trace = prepare_trace(generate("mixed_bursty", 600, 20.0, 3), None, 0.5, 3)
    _, res_plain = simulate(trace, CM, Topology(1, 2), policy)
    _, res_fixed = simulate(trace, CM, Topology(4, 8), policy, scaler=FixedWidths(Widths(1, 2)))
    assert res_fixed.records == res_plain.records
    assert res_fixed.makespan_s == res_plain.makespan_s
    a = res_fixed.extra["autoscaling"]
    assert a["gpu_seconds"] == pytest.approx(3 * res_plain.makespan_s)
    assert a["scale_events"] == 0


# --- Ray Serve's default rule ----------------------------------------------------------------------


def test_serve_rule_on_a_hand_case():
    cfg = ServeAutoscaling(target_ongoing_requests=2, min_replicas=1, max_replicas=6,
                           upscale_delay_s=30, downscale_delay_s=600)
    rule = ServeRule(cfg)
    # 9 ongoing over 2 running replicas at 2 each: ceil(9 / 2) = 5, once the wish has lasted 30 s
    assert rule.decide(9.0, 2, 2, now=100.0) == 2
    assert rule.decide(9.0, 2, 2, now=129.9) == 2
    assert rule.decide(9.0, 2, 2, now=130.0) == 5
    # beyond max_replicas: bounded
    assert ServeRule(cfg.model_copy(update={"upscale_delay_s": 0})).decide(40.0, 5, 5, now=0.0) == 6
    # down: 1 ongoing → 1 replica, after 600 s of wishing so; a wish to go up in between restarts the clock
    rule = ServeRule(cfg)
    assert rule.decide(1.0, 5, 5, now=0.0) == 5
    assert rule.decide(30.0, 5, 5, now=300.0) == 5
    assert rule.decide(1.0, 5, 5, now=301.0) == 5
    assert rule.decide(1.0, 5, 5, now=900.0) == 5
    assert rule.decide(1.0, 5, 5, now=901.0) == 1
    # no replica running yet but requests ongoing: the cold-start path, no delay
    assert ServeRule(cfg).decide(3.0, 0, 0, now=0.0) == 1


def test_serve_rule_matches_rays_own_policy_code(monkeypatch):
    """Our rule against Ray 2.60's: `replica_queue_length_autoscaling_policy` wrapped by
    `_apply_autoscaling_config` (as Serve's controller wraps it), then the bounds."""
    asp = pytest.importorskip("ray.serve.autoscaling_policy")
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    ours = ServeAutoscaling(target_ongoing_requests=3, min_replicas=1, max_replicas=7, upscale_delay_s=5,
                            downscale_delay_s=20, upscaling_factor=0.7)
    rays_config = AutoscalingConfig(**ours.model_dump(exclude_none=True))
    rays = asp._apply_autoscaling_config(asp.replica_queue_length_autoscaling_policy)
    clock = {"t": 0.0}
    monkeypatch.setattr(asp.time, "time", lambda: clock["t"])
    rule, state, target, rng = ServeRule(ours), {}, 2, random.Random(1)
    running, targets = target, set()
    for step in range(400):
        now = step * 0.5
        clock["t"] = now
        if step % 25 == 0:  # a level that lasts 12.5 s: long enough for the delays to pass, or not
            total = rng.choice([0.0, 1.0, 2.5, 6.0, 11.0, 25.0])
        ctx = AutoscalingContext(
            deployment_id=DeploymentID(name="d"), deployment_name="d", app_name="a", current_num_replicas=running,
            target_num_replicas=target, running_replicas=[], total_num_requests=total, total_queued_requests=0.0,
            aggregated_metrics={}, raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=7,
            policy_state=state, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
            config=rays_config)
        theirs, state = rays(ctx)
        theirs = max(1, min(7, math.ceil(theirs)))
        assert rule.decide(total, running, target, now) == theirs, (step, total, running, target)
        target = theirs
        targets.add(target)
        running = max(1, min(target, running + rng.choice([-1, 0, 1])))  # replicas come up at their own pace
    assert len(targets) >= 4  # the sequence went up and down


def test_serve_default_averages_each_pools_ongoing_requests_over_its_look_back():
    serve = ServeDefault(ServeAutoscaling(look_back_period_s=30), ServeAutoscaling(look_back_period_s=10),
                         Widths(1, 1), control_interval_s=5.0)
    # 4 ongoing prefills during [0, 20), none after: at 40 s the 30 s look-back holds 10 s of them
    integral = lambda t: 4.0 * min(t, 20.0)
    means = {t: serve.mean_ongoing(Role.PREFILL, t, integral(t)) for t in (5.0 * k for k in range(1, 9))}
    assert means[10.0] == pytest.approx(4.0)
    assert means[40.0] == pytest.approx(4.0 * 10 / 30)
    assert serve.mean_ongoing(Role.DECODE, 5.0, 10.0) == pytest.approx(2.0)  # shorter than its look-back: from 0


# --- the planner in the simulator -------------------------------------------------------------------


def test_the_planner_scales_a_pool_up_under_a_load_step_and_back_down_after_it():
    trace = steady(1.0, 0.0, 60.0, 1000, 200) + steady(25.0, 60.0, 180.0, 1000, 200) \
        + steady(1.0, 180.0, 600.0, 1000, 200)
    trace = [TraceRequest(r.arrival_s, r.prompt_tokens, r.output_tokens, SloClass.TIGHT) for r in trace]
    cfg = PlannerConfig(interval_s=10, min_prefill=1, max_prefill=4, min_decode=1, max_decode=4, down_after=3)
    scaler = PlannerScaler(Planner(CM, cfg), Widths(1, 1))
    sim, res = run(trace, Topology(4, 4), scaler, startup_s=20.0, policy="marginal_cost")
    series = sim.fleet.series
    at = lambda t, col: [p for p in series if p[0] <= t][-1][col]
    assert at(55.0, 2) == 1 and at(55.0, 4) == 1  # quiet: one of each
    assert max(p[2] for p in series if p[0] < 180) > 1  # the step grows the prefill pool
    assert max(p[4] for p in series if p[0] < 180) > 1  # and the decode pool
    assert series[-1][1:] == (1, 1, 1, 1)  # and after it both are back to one
    a = res.extra["autoscaling"]
    assert a["prefill_scale_downs"] >= 1 and a["decode_scale_downs"] >= 1
    assert scaler.plans and all(p["reasons"] for p in scaler.plans)
    # the step's requests met their targets once the new instances served
    late = [r for r in res.records if 120.0 <= r.arrival_s < 180.0]
    assert sum(r.slo_met for r in late) / len(late) > 0.9


def test_an_unattainable_ttft_target_does_not_ask_the_planner_for_every_instance():
    # a lone prefill of 3000 tokens misses the tight target's budget: no width meets it
    p = Planner(CM, PlannerConfig(max_prefill=32, max_decode=32))
    assert CM.engine.prefill_s(3000) > 0.8 * CM.target(SloClass.TIGHT).ttft_s
    light = p.model_widths(Window(10.0, 10, 3000, 40, tight_arrivals=10)).prefill
    heavy = p.model_widths(Window(10.0, 200, 3000, 40, tight_arrivals=200)).prefill
    assert light == 1 and 1 < heavy < 32
    s = CM.engine.prefill_s(3000)
    u = 20 * s / heavy
    assert s * u / (2 * (1 - u)) <= 0.2 * s  # the queue adds at most (1 − headroom) of a prefill
