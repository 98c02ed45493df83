"""The contract every registered routing policy must keep (disagg.core.policies module docstring).

One suite, parametrised over `known_policies()`: candidate ids, purity, determinism, NoCapacity,
busy-but-only candidates, pools that change size between calls, the explanation header.
"""

from __future__ import annotations

import copy
import time

import pytest

from disagg.core.policies import build_policy, known_policies, policy_class
from disagg.core.types import Decision, NoCapacity, Role, SloClass
from factories import make_cost_model, make_instances, make_request

ALL = known_policies()


def test_registry_is_not_empty_and_has_the_paper_baselines():
    for name in ("round_robin", "least_loaded", "length_heuristic", "marginal_cost", "oracle", "pair_cost"):
        assert name in ALL


@pytest.fixture(scope="module")
def cm():
    return make_cost_model()


def _policy(name, cm, **params):
    return build_policy(name, cm, params or None)


def _req(i: int = 0, prompt: int = 100, out: int = 50, slo: SloClass = SloClass.LOOSE):
    # true_output_tokens is set on every request so the simulator-only oracle can run here
    return make_request(prompt_tokens=prompt, predicted_output_tokens=out, slo_class=slo,
                        true_output_tokens=out * 2 + i, request_id=f"r{i}")


def _scenario():
    """A varied call sequence: (request, prefill pool, decode pool)."""
    calls = []
    for i in range(12):
        prefill = make_instances(Role.PREFILL, backlog_s=[0.1 * (i % 3), 0.3, 0.05 * i],
                                 queued=[i % 4, 2, 1], kv_used=[100 * i, 0, 500])
        decode = make_instances(Role.DECODE, backlog_s=[0.2, 0.0, 1.5, 0.4],
                                queued=[3, i % 5, 0, 2], kv_used=[9000, 200 * i, 100, 4000])
        calls.append((_req(i, prompt=50 + 37 * i, out=10 + 60 * (i % 6),
                           slo=SloClass.TIGHT if i % 2 else SloClass.LOOSE), prefill, decode))
    return calls


def _placed(pol, d: Decision, prefill_ids, decode_ids) -> bool:
    """`d` is one of the placements `pol` may make: a prefill and a decode candidate, a decode
    candidate alone if `pol` colocates, a prefill candidate alone if it hosts."""
    if d.decode_id in decode_ids:
        return d.prefill_id in prefill_ids or (pol.may_colocate and d.prefill_id == d.decode_id)
    return pol.may_host and d.prefill_id == d.decode_id and d.prefill_id in prefill_ids


def _assert_ids_from_candidates(name, d: Decision, prefill, decode):
    p_ids = {v.instance_id for v in prefill}
    d_ids = {v.instance_id for v in decode}
    pol = build_policy(name, make_cost_model())
    if pol.may_host and d.decode_id not in d_ids:
        # a hosting policy may serve the request whole on a prefill instance, never elsewhere
        assert d.prefill_id == d.decode_id and d.decode_id in p_ids
        return
    assert d.decode_id in d_ids
    if pol.may_colocate:
        # a colocating policy may prefill on the chosen decode instance, never elsewhere
        assert d.prefill_id in p_ids or d.prefill_id == d.decode_id
    else:
        assert d.prefill_id in p_ids
    assert d.policy == name


@pytest.mark.parametrize("name", ALL)
def test_returns_ids_drawn_from_the_candidates(name, cm):
    pol = _policy(name, cm)
    for req, prefill, decode in _scenario():
        _assert_ids_from_candidates(name, pol.choose(req, prefill, decode, now=1.0), prefill, decode)


@pytest.mark.parametrize("name", ALL)
def test_pure_arguments_unchanged(name, cm):
    pol = _policy(name, cm)
    for req, prefill, decode in _scenario():
        req0, p0, d0 = copy.deepcopy(req), list(prefill), list(decode)
        ids_p = [id(v) for v in prefill]
        ids_d = [id(v) for v in decode]
        pol.choose(req, prefill, decode, now=3.0)
        assert req == req0
        assert prefill == p0 and decode == d0  # same order, same values
        assert [id(v) for v in prefill] == ids_p and [id(v) for v in decode] == ids_d


@pytest.mark.parametrize("name", ALL)
def test_accepts_tuples_as_pools(name, cm):
    pol = _policy(name, cm)
    req, prefill, decode = _scenario()[0]
    d = pol.choose(req, tuple(prefill), tuple(decode), now=0.0)
    _assert_ids_from_candidates(name, d, prefill, decode)


@pytest.mark.parametrize("name", ALL)
def test_no_clock_reads(name, cm, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a policy read the clock")

    for fn in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"):
        monkeypatch.setattr(time, fn, boom)
    pol = _policy(name, cm)
    for req, prefill, decode in _scenario()[:3]:
        pol.choose(req, prefill, decode, now=0.0)


@pytest.mark.parametrize("name", ALL)
def test_deterministic_for_fresh_instances(name, cm):
    a, b = _policy(name, cm), _policy(name, cm)
    da = [a.choose(r, p, d, now=float(i)) for i, (r, p, d) in enumerate(_scenario())]
    db = [b.choose(r, p, d, now=float(i)) for i, (r, p, d) in enumerate(_scenario())]
    assert da == db
    # and the decisions are not all the same pair, so the comparison means something
    assert len({(x.prefill_id, x.decode_id) for x in da}) > 1


# Policies that break near-ties at random keep the contract with a tolerance too: candidate ids,
# purity, and the same decisions from the same seed (their RNG is their own, seeded by `seed`).
TIE_BREAKING = [n for n in ALL if "tie_tolerance" in policy_class(n).Params.model_fields]


@pytest.mark.parametrize("name", TIE_BREAKING)
def test_random_tie_breaking_keeps_the_contract(name, cm):
    a = _policy(name, cm, tie_tolerance=0.3, seed=5)
    b = _policy(name, cm, tie_tolerance=0.3, seed=5)
    for i, (req, prefill, decode) in enumerate(_scenario()):
        p0, d0 = list(prefill), list(decode)
        da, db = a.choose(req, prefill, decode, now=float(i)), b.choose(req, prefill, decode, now=float(i))
        assert da == db
        _assert_ids_from_candidates(name, da, prefill, decode)
        assert prefill == p0 and decode == d0


@pytest.mark.parametrize("name", ALL)
def test_replicas_are_fresh_policies_of_the_same_kind(name, cm):
    pol = _policy(name, cm)
    rep = pol.for_replica(1)
    assert type(rep) is type(pol) and rep is not pol
    req, prefill, decode = _scenario()[0]
    _assert_ids_from_candidates(name, rep.choose(req, prefill, decode, now=0.0), prefill, decode)


@pytest.mark.parametrize("name", ALL)
def test_empty_decode_pool_raises(name, cm):
    pol = _policy(name, cm)
    with pytest.raises(NoCapacity, match="decode"):
        pol.choose(_req(), make_instances(Role.PREFILL, n=2), [], now=0.0)


@pytest.mark.parametrize("name", ALL)
def test_empty_prefill_pool(name, cm):
    pol = _policy(name, cm)
    decode = make_instances(Role.DECODE, backlog_s=[0.5, 0.1])
    if pol.may_colocate:
        # a colocating policy prefills on a decode instance: both ids are that instance
        d = pol.choose(_req(), [], decode, now=0.0)
        assert d.colocated and d.decode_id in {"d0", "d1"}
    else:
        with pytest.raises(NoCapacity, match="prefill"):
            pol.choose(_req(), [], decode, now=0.0)


def test_pair_cost_without_colocation_raises_on_empty_prefill_pool(cm):
    pol = _policy("pair_cost", cm, allow_colocated=False)
    with pytest.raises(NoCapacity, match="prefill"):
        pol.choose(_req(), [], make_instances(Role.DECODE, n=2), now=0.0)


def test_pair_cost_without_colocation_raises_when_prompt_fits_no_prefill(cm):
    pol = _policy("pair_cost", cm, allow_colocated=False)
    prefill = make_instances(Role.PREFILL, capacity=[500, 500])
    decode = make_instances(Role.DECODE, capacity=[20_000, 20_000])
    with pytest.raises(NoCapacity, match="prefill"):
        pol.choose(_req(prompt=1000), prefill, decode, now=0.0)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("prompt", [1000, 5000])  # capacity 1000 must hold prompt + first token
def test_prompt_beyond_every_kv_capacity_raises(name, cm, prompt):
    pol = _policy(name, cm)
    prefill = make_instances(Role.PREFILL, capacity=[1000, 800])
    decode = make_instances(Role.DECODE, capacity=[1000, 900, 1000])
    with pytest.raises(NoCapacity, match=str(prompt)):
        pol.choose(_req(prompt=prompt), prefill, decode, now=0.0)


@pytest.mark.parametrize("name", ALL)
def test_prompt_plus_first_token_exactly_at_capacity_fits(name, cm):
    pol = _policy(name, cm)
    prefill = make_instances(Role.PREFILL, capacity=[1000, 800])
    decode = make_instances(Role.DECODE, capacity=[1000, 900, 1000])
    d = pol.choose(_req(prompt=999), prefill, decode, now=0.0)
    assert _placed(pol, d, {"p0"}, {"d0", "d2"}), d


@pytest.mark.parametrize("name", ALL)
def test_prompt_that_fits_only_one_instance_goes_there(name, cm):
    pol = _policy(name, cm)
    prefill = make_instances(Role.PREFILL, capacity=[500, 5000, 500])
    decode = make_instances(Role.DECODE, capacity=[500, 500, 5000])
    for i in range(4):  # cursors move; feasibility must still hold every time
        d = pol.choose(_req(i, prompt=1500), prefill, decode, now=0.0)
        assert _placed(pol, d, {"p1"}, {"d2"}), d


@pytest.mark.parametrize("name", ALL)
def test_busy_only_instance_is_still_chosen(name, cm):
    pol = _policy(name, cm)
    prefill = make_instances(Role.PREFILL, backlog_s=[120.0], queued=[500], kv_used=[9_990])
    decode = make_instances(Role.DECODE, backlog_s=[300.0], queued=[1000], kv_used=[12_000])  # over-full
    d = pol.choose(_req(), prefill, decode, now=0.0)
    assert _placed(pol, d, {"p0"}, {"d0"}), d


@pytest.mark.parametrize("name", ALL)
def test_pool_size_changes_between_calls(name, cm):
    pol = _policy(name, cm)
    sizes = [(3, 4), (1, 1), (5, 2), (2, 6), (1, 3), (4, 1)]
    seen_decode = set()
    for i, (np_, nd) in enumerate(sizes * 2):
        prefill = make_instances(Role.PREFILL, backlog_s=[0.01 * k for k in range(np_)])
        decode = make_instances(Role.DECODE, backlog_s=[0.01 * k for k in range(nd)])
        d = pol.choose(_req(i), prefill, decode, now=float(i))
        _assert_ids_from_candidates(name, d, prefill, decode)
        seen_decode.add(d.decode_id)
    assert seen_decode  # at least made decisions through every resize


@pytest.mark.parametrize("name", ALL)
def test_header_value_explains_the_choice(name, cm):
    pol = _policy(name, cm)
    req, prefill, decode = _scenario()[1]
    d = pol.choose(req, prefill, decode, now=0.0)
    h = d.header_value()
    assert f"prefill={d.prefill_id}" in h
    assert f"decode={d.decode_id}" in h
    assert f"policy={name}" in h
    assert d.as_dict()["policy"] == name


# --- the registry -------------------------------------------------------------------------------

from disagg.core.policies import base as policies_mod  # noqa: E402  (the registry lives there)
from disagg.core.policies import Policy, PolicyError, parse_policy_spec, policy_class, register  # noqa: E402


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry for tests that register classes; the real one is restored after."""
    reg = dict(policies_mod._REGISTRY)
    monkeypatch.setattr(policies_mod, "_REGISTRY", reg)
    return reg


def test_unknown_policy_lists_the_known_ones(cm):
    with pytest.raises(PolicyError) as e:
        build_policy("no_such_policy", cm)
    msg = str(e.value)
    assert "no_such_policy" in msg
    for name in ALL:
        assert name in msg


@pytest.mark.parametrize(
    "name, params, bad",
    [
        ("marginal_cost", {"w_bogus": 1.0}, "w_bogus"),
        ("marginal_cost", {"rho": -1.0}, "rho"),
        ("pair_cost", {"interference": -2}, "interference"),
        ("length_heuristic", {"long_output_tokens": 0}, "long_output_tokens"),
        ("round_robin", {"anything": 1}, "anything"),
    ],
)
def test_bad_params_name_the_param_and_list_allowed(cm, name, params, bad):
    with pytest.raises(PolicyError) as e:
        build_policy(name, cm, params)
    msg = str(e.value)
    assert bad in msg and name in msg
    allowed = list(policy_class(name).Params.model_fields)
    assert "Allowed parameters" in msg
    for p in allowed:
        assert p in msg
    if not allowed:
        assert "(none)" in msg


def test_params_reach_the_policy(cm):
    pol = build_policy("pair_cost", cm, {"interference": 0.25, "allow_colocated": False, "rho": 3.0})
    assert pol.params.interference == 0.25 and pol.params.allow_colocated is False and pol.params.rho == 3.0
    assert pol.cost_model is cm


def test_a_policy_spec_carries_parameters_checked_as_build_policy_checks_them():
    assert parse_policy_spec("marginal_cost") == ("marginal_cost", {})
    assert parse_policy_spec("slo_goodput:allow_hosted=false:latency_error=0.3") == \
        ("slo_goodput", {"allow_hosted": False, "latency_error": 0.3})
    assert parse_policy_spec("pair_cost:interference=0.25") == ("pair_cost", {"interference": 0.25})
    for bad, says in [("slo_goodput:allow_hosted", "key=value"), ("slo_goodput:=1", "key=value"),
                      ("slo_goodput:hosting=false", "Allowed parameters"),
                      ("slo_goodput:latency_error=fast", "latency_error"), ("fastest_ever:x=1", "unknown policy")]:
        with pytest.raises(PolicyError, match=says):
            parse_policy_spec(bad)


def test_duplicate_registration_raises_and_keeps_the_original(scratch_registry):
    original = scratch_registry["round_robin"]

    class Impostor(Policy):
        name = "round_robin"

    with pytest.raises(PolicyError, match="round_robin"):
        register(Impostor)
    assert scratch_registry["round_robin"] is original


def test_new_policy_registers_and_builds(cm, scratch_registry):
    @register
    class Always0(Policy):
        name = "_test_always_first"

        def choose(self, req, prefill, decode, now):
            return Decision(prefill[0].instance_id, decode[0].instance_id, self.name)

    assert "_test_always_first" in known_policies()
    pol = build_policy("_test_always_first", cm)
    assert pol.choose(_req(), make_instances(Role.PREFILL, n=2), make_instances(n=2), 0.0).decode_id == "d0"


def test_scratch_registry_did_not_leak():
    assert "_test_always_first" not in known_policies()
    assert policy_class("round_robin").__name__ == "RoundRobin"


def test_simulator_only_policies_can_be_excluded():
    live = known_policies(include_simulator_only=False)
    assert "oracle" not in live
    assert set(live) | {"oracle"} == set(ALL)
