"""The model-level routers, built through the registry: the registry's errors, one contract every
registered router keeps, each router's own rule, and the explanation (`ModelRouter.explain`).

Two models as in test_latency_routing.py: `small` (fast, cheap, accuracy 0.6) and `large` (4×
slower steps, 5× the price, accuracy 0.9).
"""

from __future__ import annotations

import copy
import math

import pytest

from disagg.core.cost_model import EngineConstants
from disagg.core.latency_routing import ModelInstance, can_ever_hold, route_by_latency
from disagg.core.model_routing import (
    LatencyAware,
    ModelRouterError,
    Routed,
    build_model_router,
    known_model_routers,
    register,
)
from disagg.core.ttft_estimator import (
    InstanceSnapshot,
    QueuedRequest,
    RunningRequest,
    estimate_ttft,
)
from disagg.core.types import NoCapacity
from disagg.core.utility import AccuracyTable, ModelPrices, cost_estimate

ALL = known_model_routers()
ACC = AccuracyTable(priors={"small": 0.6, "large": 0.9})
IDLE = InstanceSnapshot()


def consts(scale: float = 1.0, **kw) -> EngineConstants:
    base = dict(step_base_s=0.01 * scale, prefill_token_s=0.0002 * scale, decode_seq_s=0.001 * scale,
                prefill_overhead_s=0.003, kv_capacity_tokens=8192, block_size=16, max_num_seqs=32,
                max_batched_tokens=512)
    return EngineConstants(**{**base, **kw})


def small(iid: str = "s0", **kw) -> ModelInstance:
    return ModelInstance(iid, "small", consts(1.0, **kw), ModelPrices(1e-6, 2e-6))


def large(iid: str = "l0", **kw) -> ModelInstance:
    return ModelInstance(iid, "large", consts(4.0, **kw), ModelPrices(5e-6, 10e-6))


def busy(n_waiting: int, prompt: int = 400) -> InstanceSnapshot:
    """A queue of `n_waiting` prompts ahead of the query, plus four decoding requests."""
    running = tuple(RunningRequest(200, 5, 100) for _ in range(4))
    return InstanceSnapshot(waiting=tuple(QueuedRequest(prompt, 50) for _ in range(n_waiting)), running=running)


def mixed_fleet():
    """Busy and idle instances of both models, and one whose KV cache cannot hold a 300-token prompt."""
    return [(small("s-tiny-kv", kv_capacity_tokens=256), IDLE), (large("l0"), busy(3)), (small("s0"), busy(6)),
            (large("l1"), IDLE), (small("s1"), busy(1))]


# --- the registry --------------------------------------------------------------------------------


def test_the_registry_lists_the_paper_router_then_the_baselines():
    assert ALL == ["latency_aware", "accuracy_cost", "load_balance"]  # registration order: the study's too


def test_an_unknown_router_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ModelRouterError, match="unknown model-level router 'fastest'; known: latency_aware, "
                                               "accuracy_cost, load_balance"):
        build_model_router("fastest", 0.0, ACC)


def test_a_duplicate_name_is_refused_and_the_registry_keeps_the_first():
    class Again(LatencyAware):
        name = "latency_aware"

    with pytest.raises(ModelRouterError, match="registered twice"):
        register(Again)
    assert type(build_model_router("latency_aware", 0.0, ACC)) is LatencyAware


@pytest.mark.parametrize("name", ALL)
def test_unknown_parameters_are_refused_naming_them_and_the_allowed_ones(name):
    with pytest.raises(ModelRouterError, match=rf"'{name}': bad parameters: 'horizon'.*Allowed parameters"):
        build_model_router(name, 0.0, ACC, {"horizon": 1.0})


@pytest.mark.parametrize("lam", [-1.0, math.nan, math.inf, True, "0"])
def test_a_bad_lambda_is_refused_at_build_time(lam):
    with pytest.raises(ModelRouterError, match="lambda"):
        build_model_router("latency_aware", lam, ACC)


# --- the contract of every registered router ------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("lam", [0.0, 200.0, 1e5])
@pytest.mark.parametrize("limit", [0.05, 0.5, 5.0])
def test_picks_an_instance_that_holds_the_prompt_deterministically_without_touching_its_inputs(name, lam, limit):
    fleet = mixed_fleet()
    before = copy.deepcopy(fleet)
    router = build_model_router(name, lam, ACC)
    a = router.choose(fleet, 300, 80.0, limit, 2.0)
    b = build_model_router(name, lam, ACC).choose(fleet, 300, 80.0, limit, 2.0)
    assert a == b and isinstance(a, Routed)
    assert 0 <= a.index < len(fleet) and can_ever_hold(fleet[a.index][0].constants, 300)
    assert fleet == before


@pytest.mark.parametrize("name", ALL)
def test_no_instance_that_can_hold_the_prompt_raises_no_capacity(name):
    router = build_model_router(name, 0.0, ACC)
    with pytest.raises(NoCapacity):
        router.choose([(small(), IDLE), (large(), IDLE)], 9000, 10.0, 1.0, 0.0)
    with pytest.raises(NoCapacity):
        router.choose([], 100, 10.0, 1.0, 0.0)


@pytest.mark.parametrize("name", ALL)
def test_with_lambda_is_the_same_router_at_another_lambda(name):
    router = build_model_router(name, 10.0, ACC)
    other = router.with_lambda(1e5)
    assert type(other) is type(router) and other.accuracy is ACC and other.params == router.params
    assert (router.lam, other.lam) == (10.0, 1e5)
    fleet = mixed_fleet()
    assert other.choose(fleet, 300, 80.0, 0.5, 0.0) == build_model_router(name, 1e5, ACC).choose(
        fleet, 300, 80.0, 0.5, 0.0)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("lam", [0.0, 300.0])
def test_the_explanation_names_the_chosen_instance_with_its_estimate_and_every_candidates_terms(name, lam):
    fleet, now, limit = mixed_fleet(), 1.5, 0.5
    router = build_model_router(name, lam, ACC)
    routed = router.choose(fleet, 300, 80.0, limit, now)
    c = router.explain(routed, fleet, 300, 80.0, limit, now)
    inst, snap = fleet[routed.index]
    assert (c.index, c.instance_id, c.model) == (routed.index, inst.instance_id, inst.model)
    assert (c.lam, c.ttft_limit_s, len(c.terms)) == (lam, limit, len(fleet))
    assert c.chosen.ttft_s == estimate_ttft(inst.constants, snap, 300, now).ttft_s  # exact, whoever estimated
    assert c.feasible == (c.chosen.ttft_s <= limit)
    for (m, _), t in zip(fleet, c.terms):
        assert t.instance_id == m.instance_id
        assert t.accuracy == ACC.predict(m.model, 300) and t.cost == cost_estimate(m.prices, 300, 80.0)
        assert t.utility == t.accuracy - lam * t.cost


# --- each router's own rule ----------------------------------------------------------------------


def test_latency_aware_is_route_by_latency_and_carries_its_choice():
    fleet = mixed_fleet()
    routed = build_model_router("latency_aware", 50.0, ACC).choose(fleet, 300, 80.0, 0.5, 1.0)
    choice = route_by_latency(fleet, 300, 80.0, 0.5, 50.0, ACC, 1.0)
    assert routed == Routed(choice.index, choice.chosen.ttft_s, choice.feasible, choice)
    assert build_model_router("latency_aware", 50.0, ACC).explain(routed, fleet, 300, 80.0, 0.5, 1.0) is routed.choice


def test_accuracy_cost_takes_the_least_loaded_instance_of_its_model_whatever_the_limit():
    fleet = [(small(), IDLE), (large("l0"), busy(3)), (large("l1"), IDLE)]
    routed = build_model_router("accuracy_cost", 0.0, ACC).choose(fleet, 200, 50, 1e-3, 0.0)
    assert routed == Routed(2)  # the accurate model; it makes no estimate
    c = build_model_router("accuracy_cost", 0.0, ACC).explain(routed, fleet, 200, 50, 1e-3, 0.0)
    assert not c.feasible and [math.isinf(t.ttft_s) for t in c.terms] == [True, True, False]


def test_accuracy_cost_follows_lambda_to_the_cheap_model():
    fleet = [(large(), IDLE), (small(), busy(8))]
    assert build_model_router("accuracy_cost", 1e5, ACC).choose(fleet, 200, 50, 1.0, 0.0).index == 1


def test_load_balance_returns_the_exact_smallest_estimate_whatever_lambda_and_accuracy():
    fleet = [(small("s0"), busy(4)), (small("s1"), IDLE), (large("l0"), IDLE)]
    full = [estimate_ttft(m.constants, s, 300).ttft_s for m, s in fleet]
    for lam in (0.0, 1e5):
        routed = build_model_router("load_balance", lam, ACC).choose(fleet, 300, 50, 0.5, 0.0)
        assert routed.index == full.index(min(full)) == 1
        assert routed.estimated_ttft_s == min(full) and routed.feasible == (min(full) <= 0.5)
