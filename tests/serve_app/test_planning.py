"""The planner's live wiring: the config (`autoscaling.policy: planner`, `router.planner`), Serve's
custom policy function (serve_app.autoscale) and the window counter (serve_app.planning)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from disagg.core.cost_model import SloTarget, load_profile
from disagg.core.types import SloClass
from serve_app.app import _pool_options
from serve_app.autoscale import PLANNED_WIDTH, planned_replicas
from serve_app.config import PLANNER_POLICY, AppConfig, ConfigError, parse_args
from disagg.core.planner import WindowCounter, merge_window
from serve_app.planning import count_served

ROOT = Path(__file__).resolve().parents[2]


def _args(name: str) -> dict:
    return yaml.safe_load((ROOT / "deployments" / name).read_text())["applications"][0]["args"]


def test_the_shipped_autoscale_profile_hands_its_decode_pool_to_the_planner():
    cfg = parse_args(_args("local-autoscale.yaml"))
    assert isinstance(cfg, AppConfig) and cfg.router.planned_pools(cfg.pools()) == ["decode"]
    serve = _pool_options("decode", cfg.decode, False, cfg.router.num_replicas)["autoscaling_config"]
    assert serve["policy"] == {"policy_function": PLANNER_POLICY}
    assert (serve["min_replicas"], serve["max_replicas"]) == (1, 3)
    assert "policy" not in _pool_options("prefill", cfg.prefill, False, cfg.router.num_replicas).get(
        "autoscaling_config", {})
    assert cfg.router.planner.interval_s == 5
    again = parse_args(cfg.model_dump(mode="json"))  # Serve hands the router the dumped config
    assert again.router.planner == cfg.router.planner


@pytest.mark.parametrize("change, field", [
    (lambda a: a["router"].update(planner={"max_decode": 4}), "max_decode"),
    (lambda a: a["decode"]["autoscaling"].update(policy="magic"), "policy"),
    (lambda a: a["router"].update(planner={"headroom": 1.5}), "headroom"),
])
def test_bad_planner_settings_name_the_field(change, field):
    args = _args("local-autoscale.yaml")
    change(args)
    with pytest.raises(ConfigError, match=field):
        parse_args(args)


def test_a_colocated_pool_cannot_be_planned():
    args = _args("local-autoscale.yaml")
    pool = args.pop("decode")
    args.pop("prefill")
    args["colocated"] = pool
    args["router"]["policy"] = "colocated"
    with pytest.raises(ConfigError, match="colocated.autoscaling.policy"):
        parse_args(args)


@dataclass
class _Sample:
    timestamp: float
    value: float


class _Ctx:
    def __init__(self, raw, target=2):
        self.raw_metrics, self.target_num_replicas = raw, target


def test_serve_takes_the_newest_planned_width_any_replica_reported():
    raw = {PLANNED_WIDTH: {"r1": [_Sample(1.0, 3), _Sample(5.0, 2)], "r2": [_Sample(4.0, 3)], "r3": []}}
    assert planned_replicas(_Ctx(raw)) == (2, {})
    # before any plan the pool keeps its target: a router that has not planned must not shrink it
    assert planned_replicas(_Ctx({}, target=3)) == (3, {})
    assert planned_replicas(_Ctx(None, target=1)) == (1, {})


def test_the_window_counts_arrivals_and_attainment_and_merges_router_replicas():
    target = SloTarget(ttft_s=0.1, tpot_s=0.01)
    a, b = WindowCounter(), WindowCounter()
    a.admitted(1000, SloClass.TIGHT)
    a.admitted(500, SloClass.LOOSE)
    b.admitted(300, SloClass.LOOSE)
    engine = load_profile("a40").engine
    count_served(a, {"ttft_s": 0.05, "e2e_s": 0.05 + 0.005 * 9, "output_tokens": 10}, target, engine)  # meets both
    count_served(a, {"ttft_s": 0.20, "e2e_s": 0.20 + 0.02 * 9, "output_tokens": 10,
                     "prompt_tokens": 100}, target, engine)  # misses both
    count_served(b, {"ttft_s": 0.05, "e2e_s": 0.05 + 0.02 * 19, "output_tokens": 20}, target, engine)  # misses TPOT
    count_served(b, {"ttft_s": None, "e2e_s": None, "output_tokens": 0}, target, engine)  # never started: not counted
    long = 1 + next(n for n in range(1, 1 << 20, 64) if engine.prefill_s(n) > target.ttft_s)
    count_served(b, {"ttft_s": 0.30, "e2e_s": 0.31, "output_tokens": 1,  # a miss no width fixes
                     "prompt_tokens": long}, target, engine)
    w = merge_window([a.take(), b.take()], seconds=10.0, kv_pressure=0.4)
    assert (w.arrivals, w.rate, w.tight_arrivals, w.finished) == (3, 0.3, 1, 4)
    assert w.mean_prompt_tokens == pytest.approx(600) and w.mean_output_tokens == pytest.approx(41 / 4)
    assert w.ttft_met == pytest.approx(2 / 4) and w.tpot_met == pytest.approx(2 / 4) and w.kv_pressure == 0.4
    assert w.ttft_unfixable == 1 and w.ttft_met_fixable == pytest.approx(2 / 3)
    assert a.take() == WindowCounter().take()  # taken counts start again from zero
    idle = merge_window([], seconds=5.0, kv_pressure=0.0)
    assert (idle.arrivals, idle.ttft_met, idle.tpot_met) == (0, 1.0, 1.0)


def test_the_router_plans_from_its_window_and_sends_the_planned_pool_its_width():
    """The real Router in-process (rank 0, no peers) over stand-in pools, with local-autoscale.yaml's
    settings and a 0.2 s planning interval: a window of requests that missed their TPOT target makes
    the planner widen the decode pool, and the decode replicas are told the new width; the fixed
    prefill pool is never told anything."""
    import asyncio
    import copy

    from factories import StandInPool, in_process_router

    async def scenario():
        args = copy.deepcopy(_args("local-autoscale.yaml"))
        args["router"].update(request_log=None, planner={"interval_s": 0.2, "down_after": 4})
        prefill, decode = StandInPool("prefill", ["p0"]), StandInPool("decode", ["d0"])
        r = await in_process_router(prefill, decode, args, background=True)  # the planner's loop runs
        try:
            target = r.served["tiny-qwen2"].cost_model.target(SloClass.LOOSE)
            r.dispatcher.window.admitted(300, SloClass.LOOSE)  # 5 req/s over the 0.2 s window: 1P1D by the model
            for _ in range(20):  # ... but every request finished met its TTFT and missed its TPOT target
                count_served(r.dispatcher.window, {"ttft_s": 0.01, "e2e_s": 0.01 + 99 * 2 * target.tpot_s,
                                                                   "output_tokens": 100}, target,
                             r.served["tiny-qwen2"].cost_model.engine)
            for _ in range(50):  # bounded: 5 s
                if decode.broadcasts:
                    break
                await asyncio.sleep(0.1)
            return r.last_plan, prefill.broadcasts, decode.broadcasts
        finally:
            r.stop_background()

    plan, to_prefill, to_decode = asyncio.run(scenario())
    assert to_decode and to_decode[0] == ("set_planned_width", (2,))
    assert to_prefill == []
    assert (plan["prefill"], plan["decode"]) == (1, 2) and plan["model"] == {"prefill": 1, "decode": 1}
    assert plan["window"]["tpot_met"] == 0.0
    assert any("TPOT attainment" in reason for reason in plan["reasons"])
