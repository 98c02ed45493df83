"""Near-tie breaking (`tie_tolerance`, `seed`) of the argmin policies, table-driven.

Cost model (tests/factories.py): τ_dec(b) = 0.01 + 0.001·b, a lone 100-token prefill 0.11 s. A
decode candidate with backlog B, nothing queued, no KV use, for a loose 100-token prompt and 50
predicted tokens costs B + 50·0.011·(1 + 150/10_000) = B + 0.558 s, so backlogs [1.0, 1.03, 1.2]
cost 1.558, 1.588, 1.758: within 1.95 % and 12.9 % of the best.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from disagg.core.policies import PolicyError, build_policy, known_policies, policy_class, replica_seed
from disagg.core.types import Role
from factories import make_cost_model, make_instances, make_request


@pytest.fixture(scope="module")
def cm():
    return make_cost_model()


TIE_POLICIES = [n for n in known_policies() if "tie_tolerance" in policy_class(n).Params.model_fields]


def test_the_argmin_policies_take_the_parameter():
    assert set(TIE_POLICIES) == {"least_loaded", "colocated", "length_heuristic", "marginal_cost", "oracle",
                                 "pair_cost"}
    assert "tie_tolerance" not in policy_class("round_robin").Params.model_fields


def _req(i=0):
    return make_request(prompt_tokens=100, predicted_output_tokens=50, true_output_tokens=50, request_id=f"r{i}")


def _chosen(policy, prefill, decode, n=300):
    return Counter(policy.choose(_req(i), prefill, decode, now=float(i)).decode_id for i in range(n))


DECODE_ROWS = [
    # policy, params, decode backlog_s, decode queued, the decode instances that may be chosen
    ("marginal_cost", {}, [1.0, 1.03, 1.2], None, {"d0"}),
    ("marginal_cost", {"tie_tolerance": 0.01}, [1.0, 1.03, 1.2], None, {"d0"}),
    ("marginal_cost", {"tie_tolerance": 0.05}, [1.0, 1.03, 1.2], None, {"d0", "d1"}),
    ("marginal_cost", {"tie_tolerance": 0.2}, [1.0, 1.03, 1.2], None, {"d0", "d1", "d2"}),
    ("marginal_cost", {"tie_tolerance": 0.05}, [1.2, 1.03, 1.0], None, {"d1", "d2"}),  # order does not matter
    ("marginal_cost", {"tie_tolerance": 0.05}, [1.0, 1.0, 1.0], None, {"d0", "d1", "d2"}),
    ("oracle", {"tie_tolerance": 0.05}, [1.0, 1.03, 1.2], None, {"d0", "d1"}),
    ("pair_cost", {"allow_colocated": False}, [1.0, 1.03, 1.2], None, {"d0"}),
    ("pair_cost", {"allow_colocated": False, "tie_tolerance": 0.05}, [1.0, 1.03, 1.2], None, {"d0", "d1"}),
    ("pair_cost", {"allow_colocated": False, "tie_tolerance": 0.2}, [1.0, 1.03, 1.2], None, {"d0", "d1", "d2"}),
    # queue lengths: 2, 2, 3 → tolerance 0.2 admits ≤ 2.4 (d0, d1), 0.5 admits ≤ 3 (all)
    ("least_loaded", {"tie_tolerance": 0.2}, None, [2, 2, 3], {"d0", "d1"}),
    ("least_loaded", {"tie_tolerance": 0.5}, None, [2, 2, 3], {"d0", "d1", "d2"}),
    ("least_loaded", {"tie_tolerance": 0.5}, None, [0, 1, 1], {"d0"}),  # relative: nothing is near 0
    ("length_heuristic", {"tie_tolerance": 0.5}, None, [2, 2, 3], {"d0", "d1", "d2"}),
    ("colocated", {"tie_tolerance": 0.2}, None, [2, 2, 3], {"d0", "d1"}),
]


@pytest.mark.parametrize("name, params, backlog, queued, allowed", DECODE_ROWS)
def test_near_ties_are_drawn_uniformly_and_nothing_beyond_the_tolerance(cm, name, params, backlog, queued, allowed):
    pol = build_policy(name, cm, params)
    decode = make_instances(Role.DECODE, backlog_s=backlog, queued=queued)
    prefill = make_instances(Role.PREFILL, n=1)
    counts = _chosen(pol, prefill, decode)
    assert set(counts) == allowed
    if params.get("tie_tolerance") and len(allowed) > 1:
        assert min(counts.values()) > 300 / len(allowed) * 0.6  # roughly uniform, not a slight tilt


def test_least_loaded_without_tolerance_keeps_its_round_robin_tie_order(cm):
    pol = build_policy("least_loaded", cm)
    decode = make_instances(Role.DECODE, queued=[2, 2, 3])
    picks = [pol.choose(_req(i), make_instances(Role.PREFILL, n=1), decode, now=0.0).decode_id for i in range(4)]
    # the rotated pool starts at d0, d1, d2, d0: the first of the two shortest queues from there
    assert picks == ["d0", "d1", "d0", "d0"]


def test_pair_cost_prefill_near_ties_are_judged_on_the_prefill_price(cm):
    """Prefill backlogs 0.10 / 0.105 / 0.5: within 5 % on the prefill price only for p0, p1 — a
    tolerance on the pair total (which holds the decode backlog) would admit p2 as well."""
    pol = build_policy("pair_cost", cm, {"allow_colocated": False, "tie_tolerance": 0.05})
    prefill = make_instances(Role.PREFILL, backlog_s=[0.1, 0.105, 0.5])
    decode = make_instances(Role.DECODE, backlog_s=[10.0])
    counts = Counter(pol.choose(_req(i), prefill, decode, now=0.0).prefill_id for i in range(200))
    assert set(counts) == {"p0", "p1"}


def test_marginal_cost_breaks_prefill_ties_too(cm):
    pol = build_policy("marginal_cost", cm, {"tie_tolerance": 0.05})
    prefill = make_instances(Role.PREFILL, backlog_s=[0.2, 0.2, 2.0])
    counts = Counter(pol.choose(_req(i), prefill, make_instances(n=1), now=0.0).prefill_id for i in range(200))
    assert set(counts) == {"p0", "p1"}


@pytest.mark.parametrize("name", TIE_POLICIES)
def test_same_seed_same_draws_other_seed_other_draws(cm, name):
    decode = make_instances(Role.DECODE, backlog_s=[1.0] * 4, queued=[2] * 4)
    prefill = make_instances(Role.PREFILL, backlog_s=[0.5] * 3, queued=[1] * 3)

    def run(seed):
        pol = build_policy(name, cm, {"tie_tolerance": 0.1, "seed": seed})
        return [(d.prefill_id, d.decode_id) for d in (pol.choose(_req(i), prefill, decode, 0.0) for i in range(40))]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("name", TIE_POLICIES)
def test_no_global_rng(cm, name, monkeypatch):
    """The draws come from the policy's own random.Random: the global RNG is neither used nor able
    to change them."""
    decode = make_instances(Role.DECODE, backlog_s=[1.0] * 4, queued=[2] * 4)
    prefill = make_instances(Role.PREFILL, n=3)
    pol = build_policy(name, cm, {"tie_tolerance": 0.1, "seed": 1})
    expected = [pol.choose(_req(i), prefill, decode, 0.0) for i in range(20)]

    def boom(*a, **k):
        raise AssertionError("a policy used the global RNG")

    for fn in ("random", "choice", "choices", "randrange", "randint", "shuffle", "sample", "uniform"):
        monkeypatch.setattr(random, fn, boom)
    pol = build_policy(name, cm, {"tie_tolerance": 0.1, "seed": 1})
    assert [pol.choose(_req(i), prefill, decode, 0.0) for i in range(20)] == expected


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "x"])
def test_bad_tolerance_is_refused_naming_the_parameter(cm, bad):
    with pytest.raises(PolicyError, match="tie_tolerance"):
        build_policy("marginal_cost", cm, {"tie_tolerance": bad})


def test_zero_tolerance_draws_nothing(cm):
    pol = build_policy("marginal_cost", cm, {"seed": 4})
    state = pol._tie.rng.getstate()
    decode = make_instances(Role.DECODE, backlog_s=[1.0, 1.0])
    for i in range(10):
        assert pol.choose(_req(i), make_instances(Role.PREFILL, n=2), decode, 0.0).decode_id == "d0"
    assert pol._tie.rng.getstate() == state


# --- one policy per router replica ------------------------------------------------------------


@pytest.mark.parametrize("name", known_policies())
def test_for_replica_builds_a_fresh_policy_with_the_same_parameters(cm, name):
    pol = build_policy(name, cm)
    rep = pol.for_replica(2)
    assert type(rep) is type(pol) and rep is not pol and rep.cost_model is cm
    fields = type(pol.params).model_fields
    same = {k: getattr(pol.params, k) for k in fields if k != "seed"}
    assert {k: getattr(rep.params, k) for k in fields if k != "seed"} == same
    if "seed" in fields:
        assert rep.params.seed == replica_seed(pol.params.seed, 2) != pol.params.seed
        assert pol.for_replica(0).params == pol.params


def test_replica_seeds_are_distinct_and_stable():
    seeds = {replica_seed(s, i) for s in range(5) for i in range(1, 9)}
    assert len(seeds) == 40
    assert replica_seed(0, 0) == 0 and replica_seed(3, 1) == replica_seed(3, 1)
    with pytest.raises(ValueError, match="index"):
        build_policy("round_robin", make_cost_model()).for_replica(-1)
