"""`prefix_affinity` and the prefix-cache seam of the policy inputs (InstanceView.cached_prefix_blocks,
RequestFeatures.prefix_hashes), table-driven with hand-built instance views."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.core.policies import PolicyError, build_policy
from disagg.core.types import InstanceView, RequestFeatures, Role
from factories import make_cost_model, make_instances, make_request

HASHES = (11, 12, 13, 14)  # a 4-block prompt


@pytest.fixture(scope="module")
def cm():
    return make_cost_model()


def holding(blocks: int):
    """A lookup for an instance holding the first `blocks` blocks of HASHES."""
    return lambda hashes: sum(1 for _ in zip(hashes, HASHES[:blocks]))


def pool(role: Role, cached: list[int], queued: list[int]) -> list[InstanceView]:
    views = make_instances(role, queued=queued)
    return [replace(v, prefix_lookup=holding(c)) for v, c in zip(views, cached)]


def req(hashes=HASHES) -> RequestFeatures:
    return replace(make_request(prompt_tokens=2000), prefix_hashes=hashes)


CASES = [
    # (cached blocks per instance, queued per instance, params, expected index)
    ([0, 3, 1], [0, 4, 0], {}, 1),  # 3/4 cached ≥ 0.5, 4 more queued than the least loaded ≤ 10
    ([0, 1, 1], [0, 4, 0], {}, 0),  # 1/4 < 0.5: least loaded (first of the idle ones)
    ([0, 1, 1], [0, 4, 0], {"match_threshold": 0.25}, 2),  # 1/4 ≥ 0.25: the less loaded of the two
    ([0, 2, 0], [3, 0, 1], {}, 1),  # exactly at the threshold (2/4) counts
    ([0, 4, 4], [0, 9, 5], {}, 2),  # a tie on the prefix: the fewer queued
    ([0, 4, 0], [0, 10, 0], {}, 1),  # 10 more queued: at the imbalance threshold, still the warm one
    ([0, 4, 0], [0, 11, 0], {}, 0),  # 11 more: too imbalanced, least loaded instead
    ([0, 4, 0], [2, 5, 3], {"imbalance_threshold": 2}, 0),  # 3 above the least loaded > 2
    ([0, 4, 0], [2, 4, 3], {"imbalance_threshold": 2}, 1),
    ([0, 0, 0], [2, 0, 1], {"match_threshold": 0.0}, 1),  # nothing cached anywhere: least loaded
]


@pytest.mark.parametrize("cached,queued,params,expected", CASES)
def test_prefill_choice(cm, cached, queued, params, expected):
    pol = build_policy("prefix_affinity", cm, params)
    d = pol.choose(req(), pool(Role.PREFILL, cached, queued), make_instances(Role.DECODE, n=2), now=0.0)
    assert d.prefill_id == f"p{expected}"


@pytest.mark.parametrize("cached,queued,params,expected", CASES)
def test_decode_choice_follows_the_same_rule(cm, cached, queued, params, expected):
    pol = build_policy("prefix_affinity", cm, params)
    d = pol.choose(req(), make_instances(Role.PREFILL, n=2), pool(Role.DECODE, cached, queued), now=0.0)
    assert d.decode_id == f"d{expected}"


def test_the_pools_are_judged_independently(cm):
    pol = build_policy("prefix_affinity", cm)
    d = pol.choose(req(), pool(Role.PREFILL, [4, 0], [1, 0]), pool(Role.DECODE, [0, 4, 0], [0, 30, 1]), now=0.0)
    assert (d.prefill_id, d.decode_id) == ("p0", "d0")


def _scenario():
    for i in range(10):
        yield (make_request(prompt_tokens=100 + 50 * i, request_id=f"r{i}"),
               make_instances(Role.PREFILL, queued=[i % 3, 1, 2]), make_instances(Role.DECODE, queued=[2, i % 4, 0, 2]))


@pytest.mark.parametrize("case", ["no hashes", "no caches"])
def test_without_prefix_knowledge_it_is_least_loaded(cm, case):
    ours, ref = build_policy("prefix_affinity", cm), build_policy("least_loaded", cm)
    for r, prefill, decode in _scenario():
        if case == "no caches":  # hashes, but views nobody filled (the live router today)
            r = replace(r, prefix_hashes=HASHES)
        a, b = ours.choose(r, prefill, decode, 0.0), ref.choose(r, prefill, decode, 0.0)
        assert (a.prefill_id, a.decode_id) == (b.prefill_id, b.decode_id)


def test_ties_without_a_match_rotate_like_least_loaded(cm):
    pol = build_policy("prefix_affinity", cm)
    idle = pool(Role.PREFILL, [0, 0, 0], [0, 0, 0])
    picks = [pol.choose(req(), idle, make_instances(Role.DECODE, n=1), 0.0).prefill_id for _ in range(3)]
    assert picks == ["p0", "p1", "p2"]


@pytest.mark.parametrize("params,bad", [({"match_threshold": 1.5}, "match_threshold"),
                                        ({"match_threshold": -0.1}, "match_threshold"),
                                        ({"imbalance_threshold": -1}, "imbalance_threshold")])
def test_bad_params_are_refused(cm, params, bad):
    with pytest.raises(PolicyError, match=bad):
        build_policy("prefix_affinity", cm, params)


# --- the seam ------------------------------------------------------------------------------------


def test_views_without_a_cache_report_nothing_cached():
    (v,) = make_instances(n=1)
    assert v.prefix_lookup is None
    assert v.cached_prefix_blocks(HASHES) == 0


def test_a_view_asks_its_lookup_only_for_real_hashes():
    calls = []

    def lookup(hashes):
        calls.append(hashes)
        return 2

    (v,) = make_instances(n=1)
    v = replace(v, prefix_lookup=lookup)
    assert v.cached_prefix_blocks(()) == 0 and calls == []
    assert v.cached_prefix_blocks(HASHES) == 2 and calls == [HASHES]


def test_requests_carry_no_hashes_unless_given():
    assert make_request().prefix_hashes == ()
    assert RequestFeatures("r", 10, 5, prefix_hashes=(1, 2)).prefix_hashes == (1, 2)
