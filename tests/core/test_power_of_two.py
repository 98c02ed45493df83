"""`power_of_two` (Ray Serve LLM's default): of two random candidates, the one with fewer in-flight
requests. The shared contract suite (test_policy_contract.py) covers it as a registered policy;
these check its own rule."""

from __future__ import annotations

from collections import Counter

import pytest

from disagg.core.policies import build_policy, known_policies
from disagg.core.types import Role
from factories import make_cost_model, make_instances, make_request


class ScriptedRng:
    """Stands in for the policy's RNG: `sample` returns the scripted index pairs in turn."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def sample(self, population, k):
        assert k == 2
        i, j = self.pairs.pop(0)
        assert i in population and j in population and i != j
        return [i, j]


def _policy(**params):
    return build_policy("power_of_two", make_cost_model(), params or None)


def test_registered_and_selectable_live():
    assert "power_of_two" in known_policies(include_simulator_only=False)


@pytest.mark.parametrize("prefill_pair, decode_pair, prefill_id, decode_id", [
    ((0, 2), (1, 3), "p2", "d3"),   # the lower queue of each sampled pair
    ((2, 0), (3, 1), "p2", "d3"),   # whatever order they were sampled in
    ((0, 1), (0, 1), "p0", "d1"),   # p1 is busier than p0; d0 busier than d1
    ((1, 3), (0, 2), "p1", "d0"),   # p1 == p3 (a tie): the first sampled; d0 beats d2
    ((3, 1), (2, 0), "p3", "d0"),   # the tie the other way round
])
def test_takes_the_less_loaded_of_its_two_samples(prefill_pair, decode_pair, prefill_id, decode_id):
    pol = _policy()
    pol._rng = ScriptedRng([prefill_pair, decode_pair])  # prefill is drawn before decode
    prefill = make_instances(Role.PREFILL, queued=[3, 5, 0, 5])
    decode = make_instances(Role.DECODE, queued=[4, 2, 9, 1])
    d = pol.choose(make_request(), prefill, decode, now=0.0)
    assert (d.prefill_id, d.decode_id) == (prefill_id, decode_id)


def test_load_signal_is_queued_not_backlog():
    pol = _policy()
    pol._rng = ScriptedRng([(0, 1)])
    prefill = make_instances(Role.PREFILL, n=1)
    decode = make_instances(Role.DECODE, queued=[1, 2], backlog_s=[50.0, 0.0])
    assert pol.choose(make_request(), prefill, decode, now=0.0).decode_id == "d0"  # as least_loaded would


def test_a_pool_of_one_draws_nothing():
    pol = _policy()
    pol._rng = ScriptedRng([])  # any draw would fail
    d = pol.choose(make_request(), make_instances(Role.PREFILL, n=1), make_instances(Role.DECODE, n=1), now=0.0)
    assert (d.prefill_id, d.decode_id) == ("p0", "d0")


def test_infeasible_candidates_are_never_sampled():
    pol = _policy()
    decode = make_instances(Role.DECODE, queued=[0, 7, 0], capacity=[500, 5000, 500])
    for i in range(20):
        d = pol.choose(make_request(prompt_tokens=1000, request_id=f"r{i}"),
                       make_instances(Role.PREFILL, n=2, capacity=5000), decode, now=0.0)
        assert d.decode_id == "d1"  # the only one that holds the prompt, busy as it is


def test_choices_follow_the_power_of_two_distribution():
    """Four decode candidates with distinct loads: the busiest never wins, and the others win with
    the two-choice probabilities (least loaded 1/2, second 1/3, third 1/6) — not least_loaded's 1."""
    pol = _policy(seed=7)
    prefill = make_instances(Role.PREFILL, n=1)
    decode = make_instances(Role.DECODE, queued=[6, 1, 9, 3])
    n = 3000
    wins = Counter(pol.choose(make_request(request_id=f"r{i}"), prefill, decode, now=0.0).decode_id
                   for i in range(n))
    assert wins["d2"] == 0
    assert wins["d1"] / n == pytest.approx(1 / 2, abs=0.04)
    assert wins["d3"] / n == pytest.approx(1 / 3, abs=0.04)
    assert wins["d0"] / n == pytest.approx(1 / 6, abs=0.04)


def _decisions(pol, n=40):
    prefill = make_instances(Role.PREFILL, queued=[0, 0, 0])
    decode = make_instances(Role.DECODE, queued=[0, 0, 0, 0, 0])
    return [pol.choose(make_request(request_id=f"r{i}"), prefill, decode, now=float(i)) for i in range(n)]


def test_seeded_same_seed_same_choices_other_seed_or_replica_differs():
    assert _decisions(_policy(seed=1)) == _decisions(_policy(seed=1))
    assert _decisions(_policy(seed=1)) != _decisions(_policy(seed=2))
    base = _policy(seed=1)
    assert _decisions(base.for_replica(0)) == _decisions(_policy(seed=1))  # replica 0 keeps the seed
    assert _decisions(base.for_replica(1)) != _decisions(_policy(seed=1))


def test_bad_params_are_refused():
    from disagg.core.policies import PolicyError

    with pytest.raises(PolicyError, match="tie_tolerance"):
        _policy(tie_tolerance=0.1)
