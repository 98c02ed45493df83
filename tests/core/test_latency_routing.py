"""route_by_latency: the estimators wired into the constrained choice, on hand-built instance states.

Two models: `small` (fast, cheap, less accurate) and `large` (4× slower steps, 5× the price, more
accurate). The TTFT of every instance is checked against `estimate_ttft` itself, so these tests
pin the wiring (which estimate, which horizon, which fallback), not the estimator.
"""

from __future__ import annotations

import math

import pytest

from disagg.core.cost_model import EngineConstants
from disagg.core.latency_routing import ModelInstance, can_ever_hold, route_by_latency
from disagg.core.ttft_estimator import InstanceSnapshot, QueuedRequest, RunningRequest, estimate_ttft
from disagg.core.types import NoCapacity
from disagg.core.utility import AccuracyTable, ModelPrices, cost_estimate


def consts(scale: float = 1.0, **kw) -> EngineConstants:
    base = dict(step_base_s=0.01 * scale, prefill_token_s=0.0002 * scale, decode_seq_s=0.001 * scale,
                prefill_overhead_s=0.003, kv_capacity_tokens=8192, block_size=16, max_num_seqs=32,
                max_batched_tokens=512)
    base.update(kw)
    return EngineConstants(**base)


SMALL_PRICES = ModelPrices(input_per_token=1e-6, output_per_token=2e-6)
LARGE_PRICES = ModelPrices(input_per_token=5e-6, output_per_token=10e-6)


def small(iid: str = "s0", **kw) -> ModelInstance:
    return ModelInstance(iid, "small", consts(1.0, **kw), SMALL_PRICES)


def large(iid: str = "l0", **kw) -> ModelInstance:
    return ModelInstance(iid, "large", consts(4.0, **kw), LARGE_PRICES)


def accuracy() -> AccuracyTable:
    # large answers 0.9, small 0.6, at every prompt length (priors only: no history needed here)
    return AccuracyTable(priors={"small": 0.6, "large": 0.9})


IDLE = InstanceSnapshot()


def busy(n_waiting: int, prompt: int = 400) -> InstanceSnapshot:
    """A queue of `n_waiting` prompts ahead of the query, plus four decoding requests."""
    running = tuple(RunningRequest(200, 5, 100) for _ in range(4))
    return InstanceSnapshot(waiting=tuple(QueuedRequest(prompt, 50) for _ in range(n_waiting)), running=running)


def route(instances, prompt=200, out=100.0, limit=1.0, lam=0.0, now=0.0):
    return route_by_latency(instances, prompt, out, limit, lam, accuracy(), now)


# --- the objective -------------------------------------------------------------------------------


def test_lambda_zero_picks_the_most_accurate_instance_within_the_limit():
    c = route([(small(), IDLE), (large(), IDLE)], lam=0.0, limit=5.0)
    assert (c.instance_id, c.model, c.feasible) == ("l0", "large", True)
    assert c.utility == pytest.approx(0.9)


def test_large_lambda_picks_the_cheapest_instance():
    # cost: small 200·1e-6 + 100·2e-6 = 4e-4, large 2e-3; at λ = 1000 the 0.3 accuracy gap is outweighed
    c = route([(small(), IDLE), (large(), IDLE)], lam=1000.0, limit=5.0)
    assert c.model == "small"
    assert c.utility == pytest.approx(0.6 - 1000 * 4e-4)
    large_terms = c.terms[1]
    assert large_terms.utility == pytest.approx(0.9 - 1000 * 2e-3)
    assert large_terms.feasible


def test_the_lambda_where_the_choice_flips_is_where_the_utilities_cross():
    # indifference: 0.3 = λ·(2e-3 − 4e-4) → λ* = 187.5
    below = route([(small(), IDLE), (large(), IDLE)], lam=180.0, limit=5.0)
    above = route([(small(), IDLE), (large(), IDLE)], lam=195.0, limit=5.0)
    assert (below.model, above.model) == ("large", "small")


def test_a_binding_limit_sends_the_query_to_the_fast_model_even_at_lambda_zero():
    insts = [(small(), IDLE), (large(), IDLE)]
    unconstrained = route(insts, limit=5.0)
    assert unconstrained.model == "large"
    t_large = estimate_ttft(large().constants, IDLE, 200).ttft_s
    t_small = estimate_ttft(small().constants, IDLE, 200).ttft_s
    assert t_small < t_large
    limit = (t_small + t_large) / 2  # between the two: only the small model meets it
    c = route(insts, limit=limit)
    assert (c.model, c.feasible) == ("small", True)
    assert c.terms[1].feasible is False


def test_load_moves_the_query_to_another_instance_of_the_same_model():
    loaded, idle = large("l0"), large("l1")
    c = route([(loaded, busy(6)), (idle, IDLE), (small(), IDLE)], limit=1.0)
    assert c.instance_id == "l1"
    assert c.terms[0].feasible is False


def test_no_feasible_instance_falls_back_to_the_smallest_estimated_ttft():
    insts = [(large("l0"), busy(8)), (small("s0"), busy(12)), (small("s1"), busy(3))]
    full = [estimate_ttft(i.constants, s, 200).ttft_s for i, s in insts]
    limit = min(full) / 2
    c = route(insts, limit=limit)
    assert c.feasible is False
    assert c.index == full.index(min(full))
    # every estimate is complete in the fallback, and exactly the estimator's
    assert [t.ttft_s for t in c.terms] == full


# --- the TTFT it reports -------------------------------------------------------------------------


@pytest.mark.parametrize("now", [0.0, 12.5])
def test_reported_ttft_is_exactly_the_estimators_within_the_limit_and_inf_beyond(now):
    insts = [(small("s0"), busy(2)), (large("l0"), busy(1)), (small("s1"), busy(9)), (large("l1"), IDLE)]
    limit = 0.5
    c = route(insts, limit=limit, now=now)
    for (inst, snap), terms in zip(insts, c.terms):
        full = estimate_ttft(inst.constants, snap, 200, now).ttft_s
        if full <= limit:
            assert terms.ttft_s == full and terms.feasible
        else:
            assert math.isinf(terms.ttft_s) and not terms.feasible
    assert any(t.feasible for t in c.terms) and any(not t.feasible for t in c.terms)
    assert c.chosen.ttft_s == estimate_ttft(insts[c.index][0].constants, insts[c.index][1], 200, now).ttft_s


def test_cost_and_accuracy_terms_come_from_the_prices_and_the_table():
    table = AccuracyTable().train([(200, "small", 0.5)] * 20 + [(200, "large", 1.0)] * 20)
    c = route_by_latency([(small(), IDLE), (large(), IDLE)], 200, 37.5, 5.0, 3.0, table, 0.0)
    for terms, inst in zip(c.terms, (small(), large())):
        assert terms.accuracy == table.predict(inst.model, 200)
        assert terms.cost == cost_estimate(inst.prices, 200, 37.5)
        assert terms.utility == terms.accuracy - 3.0 * terms.cost


def test_same_inputs_same_choice():
    insts = [(small("s0"), busy(3)), (large("l0"), busy(1)), (small("s1"), busy(3))]
    a = route(insts, limit=0.4, lam=50.0, now=3.0)
    b = route(insts, limit=0.4, lam=50.0, now=3.0)
    assert a == b


def test_ties_go_to_the_first_instance():
    c = route([(small("s0"), IDLE), (small("s1"), IDLE)], limit=5.0)
    assert c.instance_id == "s0"


# --- capacity and bad input ----------------------------------------------------------------------


def test_an_instance_that_can_never_hold_the_prompt_is_never_chosen():
    tiny_kv = small("s-tiny", kv_capacity_tokens=256)
    assert not can_ever_hold(tiny_kv.constants, 300) and can_ever_hold(large().constants, 300)
    c = route([(tiny_kv, IDLE), (large(), IDLE)], prompt=300, lam=1e6, limit=5.0)
    assert c.instance_id == "l0"
    assert math.isinf(c.terms[0].ttft_s) and not c.terms[0].feasible


def test_a_prompt_no_instance_can_hold_raises_no_capacity():
    with pytest.raises(NoCapacity):
        route([(small(), IDLE), (large(), IDLE)], prompt=9000)
    with pytest.raises(NoCapacity):
        route([])


@pytest.mark.parametrize("kw,field", [
    ({"lam": -1.0}, "lambda"), ({"lam": math.nan}, "lambda"), ({"lam": math.inf}, "lambda"),
    ({"limit": 0.0}, "ttft_limit"), ({"limit": -0.1}, "ttft_limit"), ({"limit": math.inf}, "ttft_limit"),
    ({"prompt": 0}, "prompt_tokens"), ({"prompt": 12.0}, "prompt_tokens"),
])
def test_bad_input_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        route([(small(), IDLE)], **kw)


def test_on_a_shared_host_the_estimate_runs_at_the_stretch_the_busy_peers_give():
    import dataclasses

    from disagg.core.cost_model import SharedHost
    from disagg.core.ttft_estimator import estimate_ttft, peer_share

    host = SharedHost(engine_cores=1, cores=2)  # every engine's compute on one core
    inst = small()
    alone = route([(inst, IDLE)], limit=10.0).chosen.ttft_s
    assert alone == estimate_ttft(inst.constants, IDLE, 200).ttft_s
    shared = dataclasses.replace(inst, host=peer_share(host, [(inst.constants, busy(2)), (inst.constants, busy(0))]))
    assert route([(shared, IDLE)], limit=10.0).chosen.ttft_s == pytest.approx(3 * alone)  # three engines, one core
    # a limit the instance meets alone it misses on the crowded host
    assert route([(inst, IDLE)], limit=2 * alone).feasible
    assert not route([(shared, IDLE)], limit=2 * alone).feasible
