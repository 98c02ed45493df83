"""`slo_goodput`: placement by expected SLO misses, prefix-cache aware, colocation included.

Hand-built views on the small test cost model with a faster prefill (0.1 ms per prompt token), so
that prompts of a few 512-token prefix blocks fit the targets: a lone prefill of n tokens takes
0.0001·n + 0.01 per 256-token chunk; tight TTFT 0.2 s, loose 0.6 s.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from disagg.core.policies import build_policy
from disagg.core.types import InstanceView, RequestFeatures, Role, SloClass
from factories import engine_dict, make_cost_model, make_instances, make_request

HASHES = (11, 12, 13, 14)  # a 4-block prompt; a 2000-token prompt may reuse 3 blocks (1536 tokens)


@pytest.fixture(scope="module")
def cm():
    return make_cost_model(engine=engine_dict(prefill_token_s=0.0001))


def holding(blocks: int):
    """A prefix lookup for an instance holding the first `blocks` blocks of HASHES."""
    return lambda hashes: sum(1 for _ in zip(hashes, HASHES[:blocks]))


def with_caches(views: list[InstanceView], cached: list[int]) -> list[InstanceView]:
    return [replace(v, prefix_lookup=holding(c)) for v, c in zip(views, cached)]


def req(prompt: int = 2000, slo: SloClass = SloClass.LOOSE, out: int = 100, hashes=HASHES) -> RequestFeatures:
    return replace(make_request(prompt_tokens=prompt, predicted_output_tokens=out, slo_class=slo),
                   prefix_hashes=hashes)


@pytest.mark.parametrize("cached, expected", [([0, 4], "p1"), ([4, 0], "p0")])
def test_a_cached_prefill_instance_beats_an_equally_loaded_uncached_one(cm, cached, expected):
    prefill = with_caches(make_instances(Role.PREFILL, backlog_s=[0.1, 0.1], queued=[1, 1]), cached)
    d = build_policy("slo_goodput", cm).choose(req(), prefill, make_instances(Role.DECODE, n=2), now=0.0)
    assert (d.prefill_id, d.colocated) == (expected, False)
    assert d.prefill_cost.own_work_s == pytest.approx(cm.engine.prefill_s(2000 - 1536))


def test_a_decode_instance_holding_the_prefix_prefills_it_itself(cm):
    # uncached on the prefill pool (0.28 s of prefill), cached on d1 (464 tokens, 0.066 s): no transfer either
    decode = with_caches(make_instances(Role.DECODE, n=3), [0, 4, 0])
    d = build_policy("slo_goodput", cm).choose(req(), make_instances(Role.PREFILL, n=2), decode, now=0.0)
    assert (d.prefill_id, d.decode_id) == ("d1", "d1")


@pytest.mark.parametrize("slo", list(SloClass))
def test_colocates_when_the_prefill_pool_is_far_behind_and_a_decode_instance_is_idle(cm, slo):
    prefill = make_instances(Role.PREFILL, backlog_s=[5.0, 6.0], queued=[30, 35])
    decode = make_instances(Role.DECODE, backlog_s=[3.0, 0.0], queued=[20, 0], kv_used=[4000, 0])
    d = build_policy("slo_goodput", cm).choose(req(200, slo), prefill, decode, now=0.0)
    assert (d.prefill_id, d.decode_id) == ("d1", "d1")


def test_disaggregates_when_the_prefill_pool_keeps_up(cm):
    # the same fleet with an idle prefill pool: both placements meet the targets; the decode
    # instance's time is kept for decoding
    decode = make_instances(Role.DECODE, backlog_s=[3.0, 0.0], queued=[20, 0], kv_used=[4000, 0])
    d = build_policy("slo_goodput", cm).choose(req(200), make_instances(Role.PREFILL, n=2), decode, now=0.0)
    assert not d.colocated and d.prefill_id == "p0"


def test_without_colocation_it_stays_in_the_prefill_pool(cm):
    prefill = make_instances(Role.PREFILL, backlog_s=[5.0, 6.0], queued=[30, 35])
    decode = make_instances(Role.DECODE, backlog_s=[3.0, 0.0], queued=[20, 0])
    d = build_policy("slo_goodput", cm, {"allow_colocated": False}).choose(req(200), prefill, decode, now=0.0)
    assert d.prefill_id == "p0" and not d.colocated


@pytest.mark.parametrize("backlog, expected", [
    (0.7, "p1"),  # the cached p0 would miss the 0.6 s target (0.72 s); the uncached p1 meets it (0.18 s)
    (0.1, "p0"),  # both meet: the cached one, sooner and less work
])
def test_avoids_a_candidate_whose_ttft_would_miss_when_another_meets(cm, backlog, expected):
    # 1100 tokens: p0 holds 2 reusable blocks (76 tokens to compute), p1 nothing
    prefill = with_caches(make_instances(Role.PREFILL, backlog_s=[backlog, 0.0], queued=[3, 0]), [4, 0])
    decode = make_instances(Role.DECODE, n=2)
    d = build_policy("slo_goodput", cm).choose(req(1100), prefill, decode, now=0.0)
    assert (d.prefill_id, d.colocated) == (expected, False)


def test_meets_the_ttft_by_colocating_although_that_takes_more_work(cm):
    # 3000 tokens, nothing cached: the prefill pool (0.3 s queued) would answer in 0.76 s, past the
    # 0.6 s loose target; prefilling on the idle decode instance answers in 0.42 s but costs that
    # instance 0.42 s of work: by latency and work alone the prefill pool would win
    prefill = make_instances(Role.PREFILL, backlog_s=[0.3], queued=[2])
    d = build_policy("slo_goodput", cm).choose(req(3000, hashes=()), prefill, make_instances(Role.DECODE, n=1), now=0.0)
    assert d.colocated


def test_a_tight_request_avoids_the_decode_instance_where_its_tpot_would_miss(cm):
    # slow KV links (10k tokens/s): d0 holds the prefix, so its transfer is short and its TTFT the
    # smaller, but with 45 sequences running, τ_dec(46) = 0.056 s > the 0.05 s tight TPOT target
    slow = make_cost_model(engine=engine_dict(prefill_token_s=0.0001),
                           transfer={"latency_s": 0.002, "tokens_per_s": 10_000.0})
    prefill = with_caches(make_instances(Role.PREFILL, n=1), [4])
    decode = with_caches(make_instances(Role.DECODE, backlog_s=[0.5, 0.5], queued=[45, 10]), [4, 0])
    pol = build_policy("slo_goodput", slow, {"allow_colocated": False, "allow_hosted": False})
    assert pol.choose(req(1100, SloClass.TIGHT), prefill, decode, now=0.0).decode_id == "d1"


@pytest.mark.parametrize("context_s, expected", [(0.0, "d0"), (4e-6, "d1")])
def test_a_tight_request_avoids_the_decode_instance_whose_long_contexts_would_make_it_miss(context_s, expected):
    # d0 holds 1,024 tokens of the prompt (a shorter transfer) and runs as many sequences as d1, but
    # they hold 8x the context: at 4 µs per token of context a step there takes 0.031 + 0.037 s with
    # the request, past the 0.05 s tight TPOT target; d1's 0.040 s is within it. KV is ample on both.
    slow = make_cost_model(engine=engine_dict(prefill_token_s=0.0001, decode_context_s=context_s,
                                              kv_capacity_tokens=100_000),
                           transfer={"latency_s": 0.002, "tokens_per_s": 50_000.0})
    prefill = with_caches(make_instances(Role.PREFILL, n=1, capacity=100_000), [4])
    decode = with_caches(make_instances(Role.DECODE, backlog_s=[0.2, 0.2], queued=[20, 20], kv_used=[8000, 1000],
                                        capacity=100_000), [4, 0])
    pol = build_policy("slo_goodput", slow, {"allow_colocated": False, "allow_hosted": False})
    d = pol.choose(req(1100, SloClass.TIGHT, out=100), prefill, decode, now=0.0)
    assert d.decode_id == expected
    # the explanation's TPOT is the step with the request's own context: its prompt and half its output
    kv = 8000 if expected == "d0" else 1000
    assert d.decode_cost.own_work_s == pytest.approx(100 * (0.01 + 0.021 + context_s * (kv + 1100 + 50)))


def test_live_views_without_a_prefix_lookup_price_every_prompt_uncached(cm):
    # live views carry no cache and live requests no hashes: the policy still decides, the same way
    # whether the request carries hashes or not
    prefill = make_instances(Role.PREFILL, backlog_s=[0.4, 0.05, 0.2], queued=[3, 1, 2])
    decode = make_instances(Role.DECODE, backlog_s=[1.0, 0.2], queued=[8, 2])
    assert all(v.prefix_lookup is None for v in (*prefill, *decode))
    a, b = build_policy("slo_goodput", cm), build_policy("slo_goodput", cm)
    for i in range(6):
        with_hashes, plain = req(300 + 400 * i), req(300 + 400 * i, hashes=())
        da, db = a.choose(with_hashes, prefill, decode, now=float(i)), b.choose(plain, prefill, decode, now=float(i))
        assert da == db
        assert da.prefill_id in {"p1", da.decode_id}  # the shortest prefill queue, or colocated
        if not da.colocated:
            assert da.prefill_cost.own_work_s == pytest.approx(cm.engine.prefill_s(300 + 400 * i))


def test_its_own_colocated_prefills_count_as_a_queue_on_the_decode_instance(cm):
    # two requests at once onto a fleet whose prefill pool is far behind: the second sees the
    # first's prefill on d0 (the ledger shows its work in d0's backlog) and goes to d1
    # (d1 runs two sequences, d0 none: on the views alone d0 stays the cheaper)
    pol = build_policy("slo_goodput", cm)
    prefill = make_instances(Role.PREFILL, backlog_s=[5.0], queued=[30])
    decode = make_instances(Role.DECODE, backlog_s=[0.0, 0.5], queued=[0, 2])
    first = pol.choose(req(1800, hashes=()), prefill, decode, now=0.0)
    assert first.colocated and first.decode_id == "d0"
    decode[0] = replace(decode[0], backlog_s=1.0, queued=1)
    second = pol.choose(req(1800, hashes=()), prefill, decode, now=0.0)
    assert (second.prefill_id, second.decode_id) == ("d1", "d1")


def test_does_not_colocate_onto_a_decode_instance_whose_kv_is_full(cm):
    # the prefill pool is far behind, but d0's KV is full: a colocated prefill would preempt a running
    # sequence (it takes blocks chunk by chunk), a transferred prompt waits for blocks instead
    prefill = make_instances(Role.PREFILL, backlog_s=[2.0], queued=[10])
    full = make_instances(Role.DECODE, backlog_s=[1.0], queued=[5], kv_used=[10_000])
    d = build_policy("slo_goodput", cm).choose(req(200, hashes=()), prefill, full, now=0.0)
    assert (d.prefill_id, d.decode_id) == ("p0", "d0")
    # with room in its KV, the same instance takes the prefill itself
    roomy = [replace(full[0], kv_used_tokens=2_000)]
    assert build_policy("slo_goodput", cm).choose(req(200, hashes=()), prefill, roomy, now=0.0).colocated


def test_the_attention_term_prices_the_uncached_rest_against_the_cached_prefix():
    """With `prefill_attention_s`, a prefill of the uncached tokens also attends to the cached
    prefix: both placements' work includes c·(k + c/2) token pairs (k cached, c computed)."""
    cm = make_cost_model(engine=engine_dict(prefill_token_s=0.0001, prefill_attention_s=2e-8))
    ec = cm.engine
    prefill = with_caches(make_instances(Role.PREFILL, n=1), [3])
    decode = make_instances(Role.DECODE, n=1)
    d = build_policy("slo_goodput", cm, {"allow_colocated": False}).choose(req(), prefill, decode, now=0.0)
    assert d.prefill_cost.own_work_s == pytest.approx(ec.prefill_s(464, 1536))
    assert ec.prefill_s(464, 1536) - ec.prefill_s(464) == pytest.approx(2e-8 * 464 * 1536)
    d = build_policy("slo_goodput", cm).choose(req(), [], with_caches(make_instances(Role.DECODE, n=1), [3]), now=0.0)
    assert d.colocated
    chunks = -(-464 // ec.max_batched_tokens)
    assert d.prefill_cost.own_work_s == pytest.approx(
        ec.prefill_overhead_s + chunks * ec.step_base_s + ec.prefill_token_s * 464 + 2e-8 * 464 * (1536 + 464 / 2))


def test_hosts_on_a_prefill_instance_when_the_decode_pools_kv_is_full(cm):
    # both decode instances would overflow (9,900 of 10,000 tokens used); the prefill instance's KV is free
    decode = make_instances(Role.DECODE, backlog_s=[2.0, 2.0], queued=[20, 20], kv_used=[9_900, 9_900])
    d = build_policy("slo_goodput", cm).choose(req(500, hashes=()), make_instances(Role.PREFILL, n=2), decode, 0.0)
    assert (d.prefill_id, d.decode_id) == ("p0", "p0")
    no_hosting = build_policy("slo_goodput", cm, {"allow_hosted": False})
    assert no_hosting.choose(req(500, hashes=()), make_instances(Role.PREFILL, n=2), decode, 0.0).decode_id in {"d0", "d1"}


def test_keeps_prefill_instances_to_prefilling_while_the_decode_pool_has_room(cm):
    # all idle, everything meets its targets: hosting would save the transfer and a decode step
    # (0.018 s) but take 100 decode steps of the prefill instance's time (0.1 s)
    d = build_policy("slo_goodput", cm).choose(req(500, hashes=()), make_instances(Role.PREFILL, n=2),
                                               make_instances(Role.DECODE, n=2), 0.0)
    assert d.prefill_id in {"p0", "p1"} and d.decode_id in {"d0", "d1"}


def test_a_prefill_keeps_away_from_the_instance_whose_hosted_decodes_it_would_stall(cm):
    # p0 hosts 38 decodes at τ_dec(38) = 0.048 s, just inside the 0.05 s tight TPOT target: a
    # 0.07 s prefill there adds 3.5 ms to each of their next 20 tokens. p1 is as idle and hosts none.
    prefill = make_instances(Role.PREFILL, queued=[38, 0])
    prefill = [replace(prefill[0], hosted=38), prefill[1]]
    d = build_policy("slo_goodput", cm).choose(req(500, SloClass.TIGHT, out=20, hashes=()), prefill,
                                               make_instances(Role.DECODE, n=2), 0.0)
    assert d.prefill_id == "p1"
    plain = [replace(prefill[0], hosted=0), prefill[1]]  # the same queue, but nothing decoding there
    d = build_policy("slo_goodput", cm).choose(req(500, SloClass.TIGHT, out=20, hashes=()), plain,
                                               make_instances(Role.DECODE, n=2), 0.0)
    assert d.prefill_id == "p0"


def test_a_hosted_decode_gets_the_time_its_instances_prefills_leave(cm):
    """The hosted TPOT is τ_dec(h + 1)/(1 − u), u being the share of the instance's time the policy's
    own prefills took over the last `utilization_window_s` (an exponential average)."""
    decode = make_instances(Role.DECODE, backlog_s=[2.0], queued=[20], kv_used=[9_900])
    prefill = make_instances(Role.PREFILL, n=1)
    pol = build_policy("slo_goodput", cm, {"utilization_window_s": 2.0})
    first = pol.choose(req(2000, out=100, hashes=()), prefill, decode, 0.0)
    assert (first.prefill_id, first.decode_id) == ("p0", "p0")
    work = first.prefill_cost.own_work_s
    assert first.decode_cost.own_work_s == pytest.approx(100 * cm.engine.decode_token_s(1))
    second = pol.choose(req(2000, out=100, hashes=()), prefill, decode, 1.0)  # the same view: h = 0
    u = work / 2.0 * math.exp(-1.0 / 2.0)
    assert second.decode_id == "p0"
    assert second.decode_cost.own_work_s == pytest.approx(100 * cm.engine.decode_token_s(1) / (1 - u))


# --- engines that share a host (the CPU profile: every engine's steps on one core) ----------------

CPU_ENGINE = engine_dict(step_base_s=0.0026, prefill_token_s=1.5e-5, decode_seq_s=5e-5, prefill_overhead_s=0.003)
CPU_SLO = {"tight": {"ttft_s": 0.105, "tpot_s": 0.0068}, "loose": {"ttft_s": 0.316, "tpot_s": 0.0203}}
ONE_CORE = {"engine_cores": 1.0, "cores": 2.0, "token_cpu_s": 0.0007}


def _cpu_fleet(host: dict | None):
    return make_cost_model(engine=CPU_ENGINE, slo=CPU_SLO, **({"shared_host": host} if host else {}))


def _place(cm, decode_queued: list[int], slo: SloClass):
    prefill = make_instances(Role.PREFILL, n=1)
    decode = make_instances(Role.DECODE, backlog_s=[0.5 if b else 0.0 for b in decode_queued], queued=decode_queued)
    r = make_request(prompt_tokens=400, predicted_output_tokens=200, slo_class=slo)
    return build_policy("slo_goodput", cm, {"allow_hosted": False}).choose(r, prefill, decode, now=0.0)


@pytest.mark.parametrize("slo", list(SloClass))
def test_on_one_shared_core_decodes_gather_on_the_busy_engine(slo):
    # engines that own their devices: the idle decode engine is the faster one
    assert _place(_cpu_fleet(None), [4, 0], slo).decode_id == "d1"
    # on one core, a second busy decode engine makes every step on the host slower (σ 1.5 → 2.5),
    # where one more sequence in d0's batch costs it 0.05 ms a step
    assert _place(_cpu_fleet(ONE_CORE), [4, 0], slo).decode_id == "d0"
    # cores enough for every engine and no serving CPU: as if each owned its device
    roomy = _cpu_fleet({"engine_cores": 3.0, "cores": 4.0})
    assert _place(roomy, [4, 0], slo).decode_id == "d1"


@pytest.mark.parametrize("slo", list(SloClass))
def test_on_one_shared_core_a_prefill_that_would_stall_every_decode_runs_beside_its_own(slo):
    # with 7 sequences running, a prefill on the idle prefill engine takes its time from all of them;
    # colocated on d0 it delays d0's one sequence only (and moves no KV)
    own = _place(_cpu_fleet(None), [1, 6], slo)
    assert (own.prefill_id, own.decode_id) == ("p0", "d0")
    shared = _place(_cpu_fleet(ONE_CORE), [1, 6], slo)
    assert (shared.prefill_id, shared.decode_id) == ("d0", "d0")


def test_a_prefill_stalls_the_other_engines_sequences_not_again_those_its_own_engine_hosts():
    from disagg.core.policies.slo_goodput import _HostLoad

    cm = _cpu_fleet(ONE_CORE)
    prefill = [replace(make_instances(Role.PREFILL, backlog_s=[0.01], queued=[6])[0], hosted=6)]
    idle = make_instances(Role.DECODE, n=1)
    busy = make_instances(Role.DECODE, backlog_s=[0.5], queued=[6])
    p = prefill[0]
    # the decodes p hosts wait for the whole prefill: priced with p (`_stall`), not as the host's
    alone = _HostLoad(cm, cm.shared_host, prefill, idle, 0.15, 0.0068, 0.0)
    assert alone.prefill_stall(0.05, p, out=50) == 0.0
    beside = _HostLoad(cm, cm.shared_host, prefill, busy, 0.15, 0.0068, 0.0)
    assert beside.prefill_stall(0.05, p, out=50) > 0.0  # the decode engine's six are slowed
    # with a core for every engine the prefill takes nothing from the others
    roomy = _cpu_fleet({"engine_cores": 2.0, "cores": 4.0})
    assert _HostLoad(roomy, roomy.shared_host, prefill, busy, 0.15, 0.0068, 0.0).prefill_stall(0.05, p, out=50) == 0.0


@pytest.mark.parametrize("slo", list(SloClass))
def test_past_capacity_where_every_sequence_misses_anyway_decodes_still_gather(slo):
    # three decode engines with 24 sequences each on one core: every token takes ~12 ms, past even the
    # loose class's (strictest) 6.8 ms floor, so a fourth busy engine adds no miss the model can see.
    # It still makes each of the 72 sequences' remaining tokens a third slower: those seconds count
    cm = _cpu_fleet(ONE_CORE)
    d = _place(cm, [24, 24, 24, 0], slo)
    assert d.decode_id != "d3"
    # the misses alone see nothing left to lose in waking d3; the seconds it adds are most of a miss
    from disagg.core.policies.slo_goodput import _HostLoad

    busy = make_instances(Role.DECODE, backlog_s=[0.5, 0.5, 0.5, 0.0], queued=[24, 24, 24, 0])
    saturated = _HostLoad(cm, cm.shared_host, make_instances(Role.PREFILL, n=1), busy, 0.15, 0.0068, 0.0)
    assert saturated.harm_up() < 1e-3  # the misses alone: nothing left to add
    assert _HostLoad(cm, cm.shared_host, make_instances(Role.PREFILL, n=1), busy, 0.15, 0.0068, 0.0,
                     per_s=0.02 / 0.316, remaining=100).harm_up() > 1.0
