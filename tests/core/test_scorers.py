"""Table-driven tests of each policy's choice, with hand-computed prices for the calibrated scorer.

Cost model (tests/factories.py): step_base 0.01 s, τ_pre 0.001 s/token, decode_seq 0.001 s,
KV capacity 10_000 tokens, 256-token step budget, transfer 0.002 s + tokens / 100_000 s.
So τ_dec(b) = 0.01 + 0.001·b and a lone prefill of p tokens costs ceil(p/256)·0.01 + 0.001·p.
"""

from __future__ import annotations

import math

import pytest

from disagg.core.policies import PolicyError, build_policy
from disagg.core.types import CostTerms, Role, SloClass
from factories import engine_dict, make_cost_model, make_instances, make_request

approx = pytest.approx


@pytest.fixture(scope="module")
def cm():
    return make_cost_model()


def mc(cm, **params):
    return build_policy("marginal_cost", cm, params or None)


# --- marginal_cost: the formula, computed by hand -----------------------------------------------


def test_marginal_cost_terms_match_the_formula_by_hand(cm):
    """cost(d) = w_b·backlog·σ + w_s·ô·τ_dec(queued+1)·(1 + ρ·press⁺)·σ + w_q·queued."""
    req = make_request(prompt_tokens=100, predicted_output_tokens=50)  # loose: σ = 1
    prefill = make_instances(Role.PREFILL, backlog_s=[0.3], queued=[2], kv_used=[100])
    decode = make_instances(Role.DECODE, backlog_s=[0.5], queued=[3], kv_used=[200])
    d = mc(cm).choose(req, prefill, decode, now=0.0)

    # decode: τ_dec(4) = 0.01 + 4·0.001 = 0.014; press⁺ = (200 + 100 + 50) / 10_000 = 0.035
    # own = 50 · 0.014 · 1.035 = 0.7245; backlog 0.5; queue 0.002·3 = 0.006; total 1.2305
    assert d.decode_cost.backlog_s == approx(0.5)
    assert d.decode_cost.pressure == approx(0.035)
    assert d.decode_cost.own_work_s == approx(0.7245)
    assert d.decode_cost.queue_s == approx(0.006)
    assert d.decode_cost.transfer_s == 0.0
    assert d.decode_cost.slo_weight == 1.0
    assert d.decode_cost.total_s == approx(1.2305)

    # prefill: prefill_s(100) = 1 chunk · 0.01 + 100 · 0.001 = 0.11; press⁺ = (100 + 100)/10_000 = 0.02
    # own = 0.11 · 1.02 = 0.1122; backlog 0.3; queue 0.004; total 0.4162
    assert d.prefill_cost.backlog_s == approx(0.3)
    assert d.prefill_cost.pressure == approx(0.02)
    assert d.prefill_cost.own_work_s == approx(0.1122)
    assert d.prefill_cost.queue_s == approx(0.004)
    assert d.prefill_cost.total_s == approx(0.4162)

    # the same request in the tight class: σ = 2 scales backlog and own work, not the queue term
    t = mc(cm).choose(make_request(100, 50, SloClass.TIGHT), prefill, decode, now=0.0)
    assert t.decode_cost.backlog_s == approx(1.0)
    assert t.decode_cost.own_work_s == approx(1.449)
    assert t.decode_cost.queue_s == approx(0.006)
    assert t.decode_cost.slo_weight == 2.0
    assert t.prefill_cost.backlog_s == approx(0.6)
    assert t.prefill_cost.own_work_s == approx(0.2244)
    assert t.prefill_cost.queue_s == approx(0.004)


def test_marginal_cost_weights_are_applied(cm):
    req = make_request(prompt_tokens=100, predicted_output_tokens=50)
    prefill = make_instances(Role.PREFILL, backlog_s=[0.3], queued=[2], kv_used=[100])
    decode = make_instances(Role.DECODE, backlog_s=[0.5], queued=[3], kv_used=[200])
    d = mc(cm, w_backlog=3.0, w_service=0.5, w_queue_s=0.1, rho=2.0).choose(req, prefill, decode, 0.0)
    assert d.decode_cost.backlog_s == approx(1.5)
    assert d.decode_cost.own_work_s == approx(0.5 * 50 * 0.014 * (1 + 2 * 0.035))
    assert d.decode_cost.queue_s == approx(0.3)
    assert d.prefill_cost.backlog_s == approx(0.9)
    assert d.prefill_cost.own_work_s == approx(0.5 * 0.11 * (1 + 2 * 0.02))
    assert d.prefill_cost.queue_s == approx(0.2)


@pytest.mark.parametrize(
    "backlog, expected",
    [
        ([0.2, 0.0, 1.5], 1),
        ([0.0, 0.2, 1.5], 0),
        ([1.5, 0.2, 0.1], 2),
        ([0.3, 0.3, 0.3], 0),  # ties go to the first candidate
    ],
)
def test_marginal_cost_picks_lower_backlog(cm, backlog, expected):
    prefill = make_instances(Role.PREFILL, backlog_s=backlog)
    decode = make_instances(Role.DECODE, backlog_s=backlog)
    pol = mc(cm)
    for _ in range(3):  # no hidden cursor: the same inputs keep the same answer
        d = pol.choose(make_request(), prefill, decode, now=0.0)
        assert (d.prefill_id, d.decode_id) == (f"p{expected}", f"d{expected}")


@pytest.mark.parametrize(
    "kv_used, rho, expected",
    [
        # d0 has no backlog, d1 has 0.5 s. ô = 200, p = 100, τ_dec(1) = 0.011 → ô·τ = 2.2 s.
        ([0, 0], 1.0, "d0"),  # 2.2·1.03 = 2.266   vs 0.5 + 2.266
        ([9_800, 0], 1.0, "d1"),  # press⁺(d0) = 1.01: 2.2·2.01 = 4.422 vs 0.5 + 2.2·1.03 = 2.766
        ([9_800, 0], 0.0, "d0"),  # pressure not priced: 2.2 vs 2.7
        ([9_800, 0], 0.1, "d0"),  # 2.2·1.101 = 2.4222 vs 0.5 + 2.2·1.003 = 2.7066
    ],
)
def test_marginal_cost_pressure_flips_choice_when_kv_near_full(cm, kv_used, rho, expected):
    decode = make_instances(Role.DECODE, backlog_s=[0.0, 0.5], kv_used=kv_used)
    req = make_request(prompt_tokens=100, predicted_output_tokens=200)
    d = mc(cm, rho=rho).choose(req, make_instances(Role.PREFILL, n=1), decode, now=0.0)
    assert d.decode_id == expected


def test_marginal_cost_pressure_term_value_near_full(cm):
    decode = make_instances(Role.DECODE, backlog_s=[0.0], kv_used=[9_800])
    d = mc(cm).choose(make_request(100, 200), make_instances(Role.PREFILL, n=1), decode, now=0.0)
    assert d.decode_cost.pressure == approx(1.01)
    assert d.decode_cost.own_work_s == approx(4.422)


@pytest.mark.parametrize(
    "slo, sigma, expected",
    [
        # d0: backlog 0.1, queued 0; d1: backlog 0, queued 40; ô = 1 (pressure ≈ 0.0011)
        # loose σ=1: d0 ≈ 0.1 + 0.011 = 0.111; d1 ≈ 0.051 + 0.08 = 0.131 → d0
        (SloClass.LOOSE, None, "d0"),
        # tight σ=2: d0 ≈ 0.222; d1 ≈ 0.102 + 0.08 = 0.182 → d1 (the queue term is not amplified)
        (SloClass.TIGHT, None, "d1"),
        # σ configured flat: the tight request behaves like a loose one
        (SloClass.TIGHT, {"tight": 1.0, "loose": 1.0}, "d0"),
        # σ configured up for loose: the loose request behaves like a tight one
        (SloClass.LOOSE, {"tight": 1.0, "loose": 2.0}, "d1"),
    ],
)
def test_marginal_cost_slo_sigma_scales_backlog_and_own_work(cm, slo, sigma, expected):
    decode = make_instances(Role.DECODE, backlog_s=[0.1, 0.0], queued=[0, 40])
    params = {"sigma": sigma} if sigma else {}
    req = make_request(prompt_tokens=10, predicted_output_tokens=1, slo_class=slo)
    d = mc(cm, **params).choose(req, make_instances(Role.PREFILL, n=1), decode, now=0.0)
    assert d.decode_id == expected


@pytest.mark.parametrize(
    "w_queue_s, expected",
    [
        # d0: backlog 0.05, queued 10 → 0.05 + 0.021 + 10·w_q; d1: backlog 0.1, queued 0 → 0.1 + 0.011
        (0.0, "d0"),
        (0.002, "d0"),  # 0.091 vs 0.111
        (0.01, "d1"),  # 0.171 vs 0.111
    ],
)
def test_marginal_cost_w_queue(cm, w_queue_s, expected):
    decode = make_instances(Role.DECODE, backlog_s=[0.05, 0.1], queued=[10, 0])
    req = make_request(prompt_tokens=10, predicted_output_tokens=1)
    d = mc(cm, w_queue_s=w_queue_s).choose(req, make_instances(Role.PREFILL, n=1), decode, now=0.0)
    assert d.decode_id == expected
    if expected == "d0":
        assert d.decode_cost.queue_s == approx(10 * w_queue_s)


@pytest.mark.parametrize("queued", [0, 1, 9, 99])
def test_marginal_cost_decode_tau_uses_concurrency_after_admission(cm, queued):
    decode = make_instances(Role.DECODE, queued=[queued], kv_used=[1_000])
    req = make_request(prompt_tokens=100, predicted_output_tokens=50)
    d = mc(cm).choose(req, make_instances(Role.PREFILL, n=1), decode, now=0.0)
    tau = 0.01 + 0.001 * (queued + 1)
    press = (1_000 + 150) / 10_000
    assert d.decode_cost.own_work_s == approx(50 * tau * (1 + press))


@pytest.mark.parametrize("per_instance", [False, True])
def test_marginal_cost_decode_tau_pays_for_the_context_the_batch_holds(per_instance):
    # 2 µs per token of context: d0's sequences hold 5,000 tokens, d1's 200, so τ_dec is
    # 0.011 + 2e-6·(5,000 + 100 + 25) = 0.02125 s on d0 and 0.01165 s on d1: d1 wins though d0's backlog is smaller
    ctx = engine_dict(decode_context_s=2e-6, kv_capacity_tokens=100_000)  # KV pressure next to nothing
    cm = make_cost_model(instances={"d0": ctx, "d1": ctx}) if per_instance else make_cost_model(engine=ctx)
    decode = make_instances(Role.DECODE, backlog_s=[0.0, 0.2], kv_used=[5_000, 200], capacity=100_000)
    req = make_request(prompt_tokens=100, predicted_output_tokens=50)
    d = mc(cm).choose(req, make_instances(Role.PREFILL, n=1), decode, now=0.0)
    assert d.decode_id == "d1"
    assert d.decode_cost.own_work_s == approx(50 * (0.011 + 2e-6 * (200 + 100 + 25)) * (1 + (200 + 150) / 100_000))
    # without the term d0's smaller backlog wins
    plain = make_cost_model(engine=engine_dict(kv_capacity_tokens=100_000))
    assert mc(plain).choose(req, make_instances(Role.PREFILL, n=1), decode, now=0.0).decode_id == "d0"


@pytest.mark.parametrize(
    "prompt, prefill_s",
    [
        (1, 0.01 + 0.001),
        (256, 0.01 + 0.256),
        (257, 2 * 0.01 + 0.257),  # a second chunk pays a second step base
        (600, 3 * 0.01 + 0.6),
    ],
)
@pytest.mark.parametrize("rho", [0.0, 1.0, 2.5])
def test_marginal_cost_prefill_own_work(cm, prompt, prefill_s, rho):
    prefill = make_instances(Role.PREFILL, kv_used=[1_000])
    d = mc(cm, rho=rho).choose(make_request(prompt_tokens=prompt), prefill, make_instances(n=1), now=0.0)
    press = (1_000 + prompt) / 10_000
    assert d.prefill_cost.pressure == approx(press)
    assert d.prefill_cost.own_work_s == approx(prefill_s * (1 + rho * press))


def test_marginal_cost_uses_per_instance_constants(cm):
    # d0 is a slower engine (per-instance override): 0.05 s base per step
    het = make_cost_model(instances={"d0": engine_dict(step_base_s=0.05)})
    decode = make_instances(Role.DECODE, backlog_s=[0.0, 0.3])
    req = make_request(prompt_tokens=100, predicted_output_tokens=100)
    # homogeneous: d0 = 100·0.011·1.02 = 1.122 vs d1 = 0.3 + 1.122 → d0
    assert mc(cm).choose(req, make_instances(Role.PREFILL, n=1), decode, 0.0).decode_id == "d0"
    # d0 slower: 100·0.051·1.02 = 5.202 vs 1.422 → d1
    d = mc(het).choose(req, make_instances(Role.PREFILL, n=1), decode, 0.0)
    assert d.decode_id == "d1"


@pytest.mark.parametrize("name", ["marginal_cost", "oracle"])
def test_chosen_candidates_have_the_least_explained_cost(name):
    """The argmin and the explanation must price alike: the chosen candidate's CostTerms total is
    the minimum of the per-candidate CostTerms totals (ties: the first such candidate)."""
    import random

    rng = random.Random(11)
    cm = make_cost_model(instances={"d2": engine_dict(step_base_s=0.03, decode_seq_s=0.002),
                                    "p1": engine_dict(prefill_token_s=0.0004, max_batched_tokens=128)})
    pol = build_policy(name, cm, {"rho": 1.7, "w_queue_s": 0.01, "w_backlog": 0.8})
    for i in range(200):
        prefill = make_instances(Role.PREFILL, backlog_s=[rng.uniform(0, 2) for _ in range(3)],
                                 queued=[rng.randrange(20) for _ in range(3)],
                                 kv_used=[rng.randrange(9_000) for _ in range(3)])
        decode = make_instances(Role.DECODE, backlog_s=[rng.uniform(0, 5) for _ in range(4)],
                                queued=[rng.randrange(60) for _ in range(4)],
                                kv_used=[rng.randrange(9_500) for _ in range(4)])
        req = make_request(prompt_tokens=rng.randrange(1, 2_000), predicted_output_tokens=rng.randrange(1, 800),
                           slo_class=rng.choice(list(SloClass)), true_output_tokens=rng.randrange(1, 800))
        d = pol.choose(req, prefill, decode, 0.0)
        sigma = pol.params.sigma[req.slo_class]
        out = pol.output_tokens(req)
        p_tot = [pol.prefill_terms(v, req, sigma).total_s for v in prefill]
        d_tot = [pol.decode_terms(v, req, sigma, out).total_s for v in decode]
        assert d.prefill_cost.total_s == approx(min(p_tot))
        assert d.decode_cost.total_s == approx(min(d_tot))
        assert d.prefill_id == prefill[p_tot.index(min(p_tot))].instance_id
        assert d.decode_id == decode[d_tot.index(min(d_tot))].instance_id


# --- baselines ----------------------------------------------------------------------------------


def test_round_robin_cycles_each_pool_independently(cm):
    pol = build_policy("round_robin", cm)
    prefill = make_instances(Role.PREFILL, n=3)
    decode = make_instances(Role.DECODE, backlog_s=[100.0, 0.0])  # load is ignored
    got = [pol.choose(make_request(request_id=f"r{i}"), prefill, decode, 0.0) for i in range(6)]
    assert [d.prefill_id for d in got] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [d.decode_id for d in got] == ["d0", "d1", "d0", "d1", "d0", "d1"]
    assert all(d.prefill_cost == CostTerms() and d.decode_cost == CostTerms() for d in got)


def test_round_robin_skips_instances_that_cannot_hold_the_prompt(cm):
    pol = build_policy("round_robin", cm)
    decode = make_instances(Role.DECODE, capacity=[10_000, 100, 10_000])
    got = [pol.choose(make_request(prompt_tokens=500), make_instances(Role.PREFILL, n=1), decode, 0.0).decode_id
           for _ in range(4)]
    assert got == ["d0", "d2", "d0", "d2"]


@pytest.mark.parametrize(
    "queued, expected",
    [
        ([3, 1, 2], 1),
        ([0, 5, 5], 0),
        ([7, 7, 6], 2),
    ],
)
def test_least_loaded_picks_min_queued(cm, queued, expected):
    pol = build_policy("least_loaded", cm)
    # backlog seconds disagree with queue length: JSQ must look only at the count
    prefill = make_instances(Role.PREFILL, queued=queued, backlog_s=[0.0, 9.0, 0.0])
    decode = make_instances(Role.DECODE, queued=queued, backlog_s=[0.0, 9.0, 0.0])
    for _ in range(3):
        d = pol.choose(make_request(), prefill, decode, 0.0)
        assert (d.prefill_id, d.decode_id) == (f"p{expected}", f"d{expected}")


def test_least_loaded_spreads_ties(cm):
    pol = build_policy("least_loaded", cm)
    prefill = make_instances(Role.PREFILL, queued=[0, 0, 0])
    decode = make_instances(Role.DECODE, queued=[2, 0, 0, 0])  # tie among d1..d3 only
    got = [pol.choose(make_request(), prefill, decode, 0.0) for _ in range(6)]
    assert sorted(d.prefill_id for d in got) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert "d0" not in {d.decode_id for d in got}
    assert {d.decode_id for d in got} == {"d1", "d2", "d3"}


@pytest.mark.parametrize(
    "out, params, expected",
    [
        # d0: queued 0 but KV nearly full; d1: queued 5, KV almost empty
        (256, {}, "d1"),  # long (≥ 256 by default): lowest pressure after admission
        (5000, {}, "d1"),
        (255, {}, "d0"),  # short: shortest queue
        (1, {}, "d0"),
        (256, {"long_output_tokens": 1000}, "d0"),  # threshold moved: now short
        (1000, {"long_output_tokens": 1000}, "d1"),
    ],
)
def test_length_heuristic(cm, out, params, expected):
    pol = build_policy("length_heuristic", cm, params)
    prefill = make_instances(Role.PREFILL, queued=[4, 1, 3])
    decode = make_instances(Role.DECODE, queued=[0, 5], kv_used=[9_000, 100])
    d = pol.choose(make_request(prompt_tokens=100, predicted_output_tokens=out), prefill, decode, 0.0)
    assert d.decode_id == expected
    assert d.prefill_id == "p1"  # prefill: shortest queue


def test_length_heuristic_pressure_includes_this_request():
    # d0 has less KV in use but cannot fit this long request without exceeding a smaller capacity
    cm = make_cost_model()
    pol = build_policy("length_heuristic", cm)
    decode = make_instances(Role.DECODE, kv_used=[1_000, 2_000], capacity=[2_000, 20_000])
    # press⁺: d0 = (1000 + 100 + 900)/2000 = 1.0; d1 = (2000 + 1000)/20000 = 0.15
    d = pol.choose(make_request(prompt_tokens=100, predicted_output_tokens=900), make_instances(Role.PREFILL, n=1),
                   decode, 0.0)
    assert d.decode_id == "d1"


# --- oracle -------------------------------------------------------------------------------------


def test_oracle_prices_the_true_length(cm):
    # d0: idle but KV 80% full; d1: 0.3 s backlog, empty KV. p = 100.
    decode = make_instances(Role.DECODE, backlog_s=[0.0, 0.3], kv_used=[8_000, 0])
    prefill = make_instances(Role.PREFILL, n=1)
    req = make_request(prompt_tokens=100, predicted_output_tokens=10, true_output_tokens=2_000)
    # predicted ô=10: d0 = 10·0.011·1.811 = 0.199 vs d1 = 0.3 + 0.11·1.011 = 0.411 → d0
    assert mc(cm).choose(req, prefill, decode, 0.0).decode_id == "d0"
    # true 2000: d0 = 2000·0.011·2.01 = 44.22 vs d1 = 0.3 + 22·1.21 = 26.92 → d1
    d = build_policy("oracle", cm).choose(req, prefill, decode, 0.0)
    assert d.decode_id == "d1"
    assert d.decode_cost.own_work_s == approx(2_000 * 0.011 * 1.21)


def test_oracle_refuses_requests_without_true_length(cm):
    with pytest.raises(PolicyError, match="true output length"):
        build_policy("oracle", cm).choose(make_request(), make_instances(Role.PREFILL, n=1),
                                          make_instances(n=1), 0.0)


# --- pair_cost ----------------------------------------------------------------------------------


def pc(cm, **params):
    return build_policy("pair_cost", cm, params or None)


def test_pair_cost_colocates_when_prefill_pool_is_backlogged_and_decode_idle(cm):
    prefill = make_instances(Role.PREFILL, backlog_s=[10.0, 12.0], queued=[30, 40])
    decode = make_instances(Role.DECODE, backlog_s=[0.2, 0.0], queued=[1, 0])
    d = pc(cm).choose(make_request(prompt_tokens=100, predicted_output_tokens=50), prefill, decode, 0.0)
    assert d.colocated and d.decode_id == "d1" and d.prefill_id == "d1"
    # colocated prefill: own work = prefill_s(100) = 0.11 s, no stall (queued 0), no transfer
    assert d.prefill_cost.own_work_s == approx(0.11)
    assert d.decode_cost.transfer_s == 0.0


def test_pair_cost_does_not_colocate_on_busy_decode_instances(cm):
    prefill = make_instances(Role.PREFILL, backlog_s=[0.0])
    decode = make_instances(Role.DECODE, queued=[40, 40])
    req = make_request(prompt_tokens=1_000, predicted_output_tokens=50)
    # colocated: prefill_s(1000) = 4·0.01 + 1.0 = 1.04, stall 1.04·40 = 41.6 → 42.64 on the prefill side
    # remote:   1.04·(1 + 0.1) = 1.144 plus transfer 0.002 + 1000/100_000 = 0.012
    d = pc(cm).choose(req, prefill, decode, 0.0)
    assert not d.colocated
    assert d.prefill_id == "p0"
    assert d.prefill_cost.own_work_s == approx(1.144)
    assert d.decode_cost.transfer_s == approx(0.012)
    # the stall is what made the difference: without interference the idle-prefill win is gone
    d0 = pc(cm, interference=0.0).choose(req, prefill, decode, 0.0)
    assert d0.colocated
    assert d0.prefill_cost.own_work_s == approx(1.04)


def test_pair_cost_transfer_is_weighted_by_sigma(cm):
    prefill = make_instances(Role.PREFILL, n=1)
    decode = make_instances(Role.DECODE, queued=[40])
    for slo, sigma in ((SloClass.LOOSE, 1.0), (SloClass.TIGHT, 2.0)):
        d = pc(cm).choose(make_request(1_000, 50, slo), prefill, decode, 0.0)
        assert not d.colocated
        assert d.decode_cost.transfer_s == approx(0.012 * sigma)


SLOW_LINK = {"latency_s": 0.5, "tokens_per_s": 100_000}  # 0.501 s for 100 tokens
FAST_LINK = {"latency_s": 0.0, "tokens_per_s": 1e12}


@pytest.mark.parametrize(
    "default_link, pairs, expected",
    [
        # prefill totals: p0 0.1111, p1 0.2111; decode totals: d0 0.55825, d1 0.75825
        (None, {}, ("p0", "d0")),
        # the cheapest pair's link is slow: next best is p1 (+0.1) rather than d1 (+0.2)
        (None, {"p0->d0": SLOW_LINK}, ("p1", "d0")),
        (None, {"p0->d0": SLOW_LINK, "p1->d0": SLOW_LINK}, ("p0", "d1")),
        # every link slow except a fast one: the otherwise dearest pair wins (0.9694 vs 1.1704)
        (SLOW_LINK, {"p1->d1": FAST_LINK}, ("p1", "d1")),
    ],
)
def test_pair_cost_per_pair_transfer_changes_the_pair(default_link, pairs, expected):
    cm = make_cost_model(pairs=pairs, **({"transfer": default_link} if default_link else {}))
    prefill = make_instances(Role.PREFILL, backlog_s=[0.0, 0.1])
    decode = make_instances(Role.DECODE, backlog_s=[0.0, 0.2])
    d = pc(cm, allow_colocated=False).choose(make_request(), prefill, decode, 0.0)
    assert (d.prefill_id, d.decode_id) == expected
    assert d.decode_cost.transfer_s == approx(cm.transfer_s(*expected, 100))
    assert d.prefill_cost.total_s + d.decode_cost.total_s == approx(
        {"p0": 0.1111, "p1": 0.2111}[expected[0]] + {"d0": 0.55825, "d1": 0.75825}[expected[1]]
        + cm.transfer_s(*expected, 100))


def test_pair_cost_without_pairs_agrees_with_marginal_cost(cm):
    """With default transfer constants the pair argmin decomposes into the two independent ones."""
    pair, marg = pc(cm, allow_colocated=False), mc(cm)
    for i in range(10):
        prefill = make_instances(Role.PREFILL, backlog_s=[0.3 * (i % 3), 0.4, 0.1 * i], queued=[i, 2, 1])
        decode = make_instances(Role.DECODE, backlog_s=[0.2, 0.05 * i, 1.0], kv_used=[9_000, 100 * i, 0],
                                queued=[1, i % 4, 0])
        req = make_request(prompt_tokens=40 + 50 * i, predicted_output_tokens=5 + 90 * i)
        a, b = pair.choose(req, prefill, decode, 0.0), marg.choose(req, prefill, decode, 0.0)
        assert (a.prefill_id, a.decode_id) == (b.prefill_id, b.decode_id)
        assert a.prefill_cost == b.prefill_cost
        assert a.decode_cost.total_s - b.decode_cost.total_s == approx(cm.transfer_s("x", "y", req.prompt_tokens))


# --- parameter validation that routing depends on -------------------------------------------------


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_sigma_must_be_a_non_negative_number(cm, bad):
    """σ amplifies strict classes; a negative σ would turn the argmin into an argmax of backlog."""
    with pytest.raises(PolicyError, match="sigma"):
        build_policy("marginal_cost", cm, {"sigma": {"tight": bad, "loose": 1.0}})


@pytest.mark.parametrize("param", ["w_backlog", "w_service", "w_queue_s", "rho"])
@pytest.mark.parametrize("bad", [-0.5, math.nan])
def test_weights_must_be_non_negative_numbers(cm, param, bad):
    with pytest.raises(PolicyError, match=param):
        build_policy("marginal_cost", cm, {param: bad})


# --- the cached part of the prompt -------------------------------------------------------------

BLOCK = 16
HASHES = tuple(range(1, 64))  # 63 blocks: a 1,008-token prefix


def holding(views, blocks):
    """The views, each holding its first `blocks[i]` blocks of HASHES cached."""
    from dataclasses import replace

    return [replace(v, prefix_lookup=lambda h, b=b: sum(1 for _ in zip(h, HASHES[:b]))) for v, b in zip(views, blocks)]


def cached_request(prompt=1_000, out=50):
    from dataclasses import replace

    return replace(make_request(prompt_tokens=prompt, predicted_output_tokens=out), prefix_hashes=HASHES,
                   prefix_block_tokens=BLOCK)


def test_marginal_cost_prices_a_prefill_at_the_part_its_candidate_does_not_hold(cm):
    # p0 holds 50 blocks (800 tokens) but has 0.15 s more backlog: 1,000 uncached tokens cost
    # 4·0.01 + 1.0 = 1.04 s, the 200 others 0.01 + 0.2 = 0.21 s (plus pressure): p0 wins
    prefill = holding(make_instances(Role.PREFILL, backlog_s=[0.15, 0.0]), [50, 0])
    d = mc(cm).choose(cached_request(), prefill, make_instances(n=1), now=0.0)
    assert d.prefill_id == "p0"
    press = 200 / 10_000
    assert d.prefill_cost.pressure == approx(press)
    assert d.prefill_cost.own_work_s == approx(cm.engine.prefill_s(200, 800) * (1 + press))
    # the paper's scorer prices the whole prompt everywhere: the backlog decides
    assert mc(cm, cached_prefix=False).choose(cached_request(), prefill, make_instances(n=1), 0.0).prefill_id == "p1"


def test_marginal_cost_never_counts_the_last_prompt_block_as_cached(cm):
    # a prompt of exactly 63 blocks, all held: the last block is computed anyway (as vLLM does)
    prefill = holding(make_instances(Role.PREFILL, n=1), [63])
    d = mc(cm, rho=0.0).choose(cached_request(prompt=63 * BLOCK), prefill, make_instances(n=1), now=0.0)
    assert d.prefill_cost.own_work_s == approx(cm.engine.prefill_s(BLOCK, 62 * BLOCK))


def test_pair_cost_moves_only_the_kv_its_decode_instance_lacks(cm):
    # equal decode instances but d1 holds 800 tokens of the prompt: its transfer is of 200 tokens
    decode = holding(make_instances(Role.DECODE, n=2), [0, 50])
    p = build_policy("pair_cost", cm, {"allow_colocated": False})
    d = p.choose(cached_request(), make_instances(Role.PREFILL, n=1), decode, now=0.0)
    assert d.decode_id == "d1"
    assert d.decode_cost.transfer_s == approx(cm.transfer.transfer_s(200))


def test_pair_cost_colocates_on_the_decode_instance_that_holds_the_prompt(cm):
    # the prefill pool is backlogged; d1 holds the prompt, so its own prefill is of 200 tokens only
    decode = holding(make_instances(Role.DECODE, n=2), [0, 50])
    prefill = make_instances(Role.PREFILL, backlog_s=[5.0])
    d = build_policy("pair_cost", cm).choose(cached_request(), prefill, decode, now=0.0)
    assert (d.prefill_id, d.decode_id) == ("d1", "d1")
    assert d.prefill_cost.own_work_s == approx(cm.engine.prefill_s(200, 800))
