"""Per-instance prefix caches in the simulator: what a cached prefix saves, and that requests without
prefix hashes run exactly as before.

Cost model (tests/factories.py): step base 0.01 s, τ_pre 0.001 s/token, decode_seq 0.001 s, 256-token
step budget, KV 10,000 tokens (19 prefix blocks of 512), transfer 0.002 s + tokens / 100,000 tok/s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.core.cost_model import load_profile
from disagg.core.policies import LeastLoaded, build_policy
from disagg.core.types import SloClass
from disagg.sim.runner import prepare_trace, simulate
from disagg.sim.simulator import Simulator, Topology
from disagg.sim.traces import TraceRequest
from disagg.sim.workloads import generate
from factories import make_cost_model

approx = pytest.approx


@pytest.fixture(scope="module")
def cm():
    return make_cost_model()


# A: 1100 tokens = 2 full blocks (1, 2) + a partial one (3). B, long after A: the same 2 full blocks,
# then 276 tokens of its own (4): 1300 tokens, of which 1024 are cached once A has been prefilled.
A = TraceRequest(0.0, 1100, 2, SloClass.LOOSE, prefix_hashes=(1, 2, 3))
B = TraceRequest(100.0, 1300, 2, SloClass.LOOSE, prefix_hashes=(1, 2, 4))


def _run(cm, topology, policy, trace):
    sim = Simulator(cm, topology, build_policy(policy, cm))
    res = sim.run(trace)
    return sim, res, {r.request_id: r for r in res.records}


def test_a_cached_prefix_shortens_the_prefill_and_the_transfer_by_the_cost_model(cm):
    sim, res, rec = _run(cm, Topology(1, 1), "round_robin", [A, B])
    e, tau = cm.engine, cm.engine.step_base_s + cm.engine.decode_seq_s
    # A: nothing cached: prefill 1100 tokens (5 chunks: 0.05 + 1.1 s), transfer 1100 tokens, one decode step
    assert rec["r0"].ttft_s == approx(e.prefill_s(1100) + cm.transfer_s("prefill-0", "decode-0", 1100) + tau, rel=1e-12)
    assert rec["r0"].ttft_s == approx(1.15 + 0.013 + 0.011)
    # B: 1024 tokens cached on prefill-0 and held by decode-0: 276 computed (2 chunks: 0.02 + 0.276 s)
    # and 276 transferred (0.002 + 0.00276 s) instead of 1300 (1.36 s) and 1300 (0.015 s)
    assert rec["r1"].ttft_s == approx(e.prefill_s(276) + cm.transfer_s("prefill-0", "decode-0", 276) + tau, rel=1e-12)
    assert rec["r1"].ttft_s == approx(0.296 + 0.00476 + 0.011)
    assert res.extra["prefix_cache"] == {"requests": 2, "prompt_tokens": 2400, "cached_tokens": 1024,
                                         "transfer_tokens": 1376, "transfer_tokens_saved": 1024,
                                         "hit_rate": 1024 / 2400}
    # both instances now hold the full blocks of both prompts; partial blocks are never cached
    for iid in ("prefill-0", "decode-0"):
        assert sorted(sim.prefix_caches[iid].lru_order()) == [1, 2]


def test_the_transfer_moves_what_the_decode_instance_does_not_hold(cm):
    # round robin sends B to decode-1, which never saw A: the prefill is cached, the transfer is whole
    _, res, rec = _run(cm, Topology(1, 2), "round_robin", [A, B])
    e, tau = cm.engine, cm.engine.step_base_s + cm.engine.decode_seq_s
    assert rec["r1"].decode_id == "decode-1"
    assert rec["r1"].ttft_s == approx(e.prefill_s(276) + cm.transfer_s("prefill-0", "decode-1", 1300) + tau, rel=1e-12)
    assert res.extra["prefix_cache"]["transfer_tokens_saved"] == 0


def test_the_last_prompt_token_is_always_computed(cm):
    # C repeats A's first two blocks exactly (1024 tokens): its last block holds its last token,
    # so only the first block is reused and 512 tokens are computed
    c = TraceRequest(100.0, 1024, 2, prefix_hashes=(1, 2))
    _, res, rec = _run(cm, Topology(1, 1), "round_robin", [A, c])
    tau = cm.engine.step_base_s + cm.engine.decode_seq_s
    assert rec["r1"].ttft_s == approx(cm.engine.prefill_s(512) + cm.transfer_s("prefill-0", "decode-0", 512) + tau,
                                      rel=1e-12)


def test_a_colocated_prefill_caches_its_prefix_when_it_ends_not_when_the_request_does(cm):
    # A decodes for ~5.5 s; B arrives at 3 s, after A's prefill (1.15 s) and before A's last token
    long_a = replace(A, output_tokens=500)
    b = replace(B, arrival_s=3.0)
    _, res, rec = _run(cm, Topology(0, 1), "colocated", [long_a, b])
    assert res.extra["prefix_cache"]["cached_tokens"] == 1024
    assert rec["r0"].e2e_s > 3.0
    # B's 276 tokens take two steps beside A's decode (+0.001 s each); it may wait for the step in flight
    step = cm.engine.step_s(0, 1)
    own = cm.engine.step_s(256, 1) + cm.engine.step_s(20, 1)
    assert own <= rec["r1"].ttft_s <= own + step + 1e-9


# --- requests without hashes -------------------------------------------------------------------------

POLICIES = ["round_robin", "least_loaded", "marginal_cost", "pair_cost", "colocated", "prefix_affinity", "slo_goodput"]


def _unique_hashes(trace):
    """The same requests with hashes that never repeat: nothing can ever be reused."""
    out, nxt = [], 10**6
    for r in trace:
        k = -(-r.prompt_tokens // 512)
        out.append(replace(r, prefix_hashes=tuple(range(nxt, nxt + k))))
        nxt += k
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_hashes_that_never_repeat_change_nothing(cm, policy):
    trace = prepare_trace(generate("mixed_bursty", 300, 20.0, 3), None, 0.5, 1)
    plain, _ = simulate(trace, cm, Topology(2, 3), policy)
    _, a = simulate(trace, cm, Topology(2, 3), policy)
    _, b = simulate(_unique_hashes(trace), cm, Topology(2, 3), policy)
    key = [(r.request_id, r.prefill_id, r.decode_id, r.ttft_s, r.tpot_s, r.e2e_s) for r in a.records]
    assert key == [(r.request_id, r.prefill_id, r.decode_id, r.ttft_s, r.tpot_s, r.e2e_s) for r in b.records]
    assert b.extra["prefix_cache"]["cached_tokens"] == 0
    assert "prefix_cache" not in a.extra and "prefix_cache" not in plain


def test_without_hashes_the_caches_stay_empty_and_the_views_carry_none(cm):
    seen = []

    class Spy(LeastLoaded):
        def choose(self, req, prefill, decode, now):
            seen.append((req.prefix_hashes, [v.prefix_lookup for v in (*prefill, *decode)]))
            return super().choose(req, prefill, decode, now)

    sim = Simulator(cm, Topology(2, 2), Spy(cm))
    sim.run(generate("short_chat", 50, 10.0, 0))
    assert all(len(c) == 0 for c in sim.prefix_caches.values())
    assert seen and all(h == () and set(lookups) == {None} for h, lookups in seen)


def test_a_request_with_hashes_sees_the_same_views_plus_the_caches(cm):
    # the simulator rebuilds the views with the caches attached: no other field may change
    trace = prepare_trace(generate("short_chat", 80, 30.0, 0), None, 0.5, 0)
    views = {}

    def spy(cm):
        class Spy(LeastLoaded):
            def choose(self, req, prefill, decode, now):
                views.setdefault(bool(req.prefix_hashes), []).append([*prefill, *decode])
                return super().choose(req, prefill, decode, now)
        return Spy(cm)

    Simulator(cm, Topology(2, 2), spy(cm)).run(trace)
    Simulator(cm, Topology(2, 2), spy(cm)).run(_unique_hashes(trace))
    assert all(v.prefix_lookup is not None for vs in views[True] for v in vs)
    assert [[replace(v, prefix_lookup=None) for v in vs] for vs in views[True]] == views[False]


def test_prefix_affinity_reuses_more_than_least_loaded_on_multi_turn_chat(cm):
    a40 = load_profile("a40")
    trace = prepare_trace(generate("multi_turn_chat", 1200, 6.0, 0), None, 0.5, 0)
    hit = {p: simulate(trace, a40, Topology(2, 4), p)[0]["prefix_cache"]["hit_rate"]
           for p in ("least_loaded", "prefix_affinity")}
    assert hit["prefix_affinity"] > hit["least_loaded"] + 0.05


def test_slo_goodput_reuses_the_caches_and_meets_more_slos_than_the_cache_blind_on_multi_turn_chat():
    # 1,200 multi-turn requests at 8 req/s, 2P4D, a40: past the cache-blind policies' plateau
    a40 = load_profile("a40")
    trace = prepare_trace(generate("multi_turn_chat", 1200, 8.0, 0), None, 0.5, 0)
    runs = {p: simulate(trace, a40, Topology(2, 4), p)[0] for p in ("least_loaded", "pair_cost", "slo_goodput")}
    hit = {p: s["prefix_cache"]["hit_rate"] for p, s in runs.items()}
    assert hit["slo_goodput"] > hit["least_loaded"] + 0.05
    assert runs["slo_goodput"]["goodput"] > max(runs["least_loaded"]["goodput"], runs["pair_cost"]["goodput"]) + 0.02
