"""Several router replicas in the simulator (`Simulator(routers=K)`): one router is the old path,
K routers lose no request, runs are deterministic under a seed, and what each router can see of
the others (the engines' received-call totals at its polls, the peers' notices) is what decides
whether they herd."""

from __future__ import annotations

import hashlib
import json

import pytest

from disagg.cli import main
from disagg.core.cost_model import load_profile
from disagg.core.policies import build_policy
from disagg.sim.runner import clamp_to_context, prepare_trace, simulate
from disagg.sim.simulator import Simulator, Topology
from disagg.sim.traces import TraceRequest, write_native
from disagg.sim.workloads import generate


@pytest.fixture(scope="module")
def cm():
    return load_profile("a40")


def _fingerprint(records) -> str:
    rows = [(r.request_id, r.prefill_id, r.decode_id, round(r.ttft_s, 9), round(r.e2e_s, 9)) for r in records]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


# Digests of the same runs by the simulator as it was before router replicas existed (commit
# 499203b, computed with that code): one router must reproduce it decision for decision. If the
# engine model or a policy changes on purpose, recompute them with `_fingerprint` on that code.
# pair_cost's moved on 2026-12-07: a colocated prefill leaves the router's ledger at its first token,
# as it does live, not at the request's end (computed with that commit's one-router path).
OLD_PATH = {"marginal_cost": "14896d328d135b20", "pair_cost": "f39e870c2924f257", "least_loaded": "bfc94c5f6bf58218"}


@pytest.mark.parametrize("policy", sorted(OLD_PATH))
def test_one_router_is_the_old_path_bit_for_bit(cm, policy):
    trace = prepare_trace(generate("mixed_bursty", 400, 12.0, 5), None, 0.5, 3)
    _, res = simulate(trace, cm, Topology.parse("2P4D"), policy, seed=3)
    assert _fingerprint(res.records) == OLD_PATH[policy]


@pytest.mark.parametrize("options", [{}, {"others_totals": False}, {"peer_notify_s": 0.002}])
def test_multi_router_options_are_no_ops_with_one_router(cm, options):
    trace = prepare_trace(generate("short_chat", 300, 40.0, 2), None, 0.5, 1)
    _, base = simulate(trace, cm, Topology.parse("2P4D"), "marginal_cost", seed=1)
    _, one = simulate(trace, cm, Topology.parse("2P4D"), "marginal_cost", seed=1, routers=1, **options)
    assert _fingerprint(one.records) == _fingerprint(base.records)


@pytest.mark.parametrize("routers", [2, 3, 4])
@pytest.mark.parametrize("policy, params", [
    ("marginal_cost", None), ("marginal_cost", {"tie_tolerance": 0.05, "seed": 3}), ("pair_cost", None),
    ("least_loaded", None), ("round_robin", None), ("oracle", None),
])
def test_every_request_accounted_for(cm, routers, policy, params):
    trace = generate("mixed_bursty", 500, rate=30.0, seed=3)
    trace, _ = clamp_to_context(trace, cm.engine.kv_capacity_tokens)
    sim = Simulator(cm, Topology(2, 4), build_policy(policy, cm, params), routers=routers)
    calls = [0] * routers
    for k, pol in enumerate(sim.policies):  # count each router's decisions
        def choose(*a, _orig=pol.choose, _k=k):
            calls[_k] += 1
            return _orig(*a)
        pol.choose = choose
    res = sim.run(trace)
    assert sorted(r.request_id for r in res.records) == sorted(f"r{i}" for i in range(len(trace)))
    assert all(r.error is None for r in res.records)
    assert sum(r.output_tokens for r in res.records) == sum(t.output_tokens for t in trace)
    assert sum(res.instance_tokens.values()) == sum(t.output_tokens + t.prompt_tokens for t in trace)
    # arrivals go to the routers in turn
    assert calls == [len(range(k, len(trace), routers)) for k in range(routers)]
    # every router's ledger and every engine's ledger of received calls is empty at the end
    assert all(len(led) == 0 for led in sim.ledgers)
    assert all(led.totals() == {} for led in sim.received.values())
    for e in sim.engines.values():
        assert e.idle() and e.free_blocks == e.total_blocks


def test_routers_have_their_own_policy_predictor_and_ledger(cm):
    pol = build_policy("marginal_cost", cm, {"tie_tolerance": 0.1, "seed": 5})
    sim = Simulator(cm, Topology(1, 2), pol, routers=3)
    assert sim.policies[0] is pol and sim.ledgers[0] is sim.ledger
    assert len({id(p) for p in sim.policies}) == 3 and len({id(p) for p in sim.predictors}) == 3
    assert len({id(x) for x in sim.ledgers}) == 3
    assert all(p.params.tie_tolerance == 0.1 for p in sim.policies)
    assert len({p.params.seed for p in sim.policies}) == 3  # no tie-breaking in lockstep


@pytest.mark.parametrize("routers", [2, 4])
def test_deterministic_under_a_seed(cm, routers):
    trace = prepare_trace(generate("mixed_bursty", 400, 20.0, 7), None, 0.5, 11)

    def run(seed):
        _, res = simulate(trace, cm, Topology(2, 4), "marginal_cost", routers=routers, seed=seed,
                          policy_params={"tie_tolerance": 0.2, "seed": seed})
        return _fingerprint(res.records)

    assert run(1) == run(1)
    assert run(1) != run(2)  # the tie-break seeds draw differently


def test_more_routers_change_decisions(cm):
    """The routers' views really are partial: K = 2 does not reproduce one router's decisions."""
    trace = prepare_trace(generate("short_chat", 400, 60.0, 4), None, 0.5, 0)
    _, one = simulate(trace, cm, Topology(2, 4), "marginal_cost")
    _, two = simulate(trace, cm, Topology(2, 4), "marginal_cost", routers=2)
    assert [(r.prefill_id, r.decode_id) for r in one.records] != [(r.prefill_id, r.decode_id) for r in two.records]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_router_count_is_refused(cm, bad):
    with pytest.raises(ValueError, match="routers"):
        Simulator(cm, Topology(1, 1), build_policy("round_robin", cm), routers=bad)


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf")])
def test_bad_notice_delay_is_refused(cm, bad):
    with pytest.raises(ValueError, match="peer_notify_s"):
        Simulator(cm, Topology(1, 1), build_policy("round_robin", cm), routers=2, peer_notify_s=bad)


# --- herding: who sees what ------------------------------------------------------------------
#
# Two routers, two prefill instances. Router 0 routes a long prefill (8000 tokens, ~0.6 s) at t=0
# to prefill-0 (both idle: the first wins). Router 1 routes a short one `gap` seconds later: does it
# pile onto the busy prefill-0 ("herd") or take the idle prefill-1? Router 1 polls at 25, 75, ... ms.
# rho = 0 removes the KV-pressure term, which otherwise leaks the other router's work through the
# polled KV use (the last two rows).

HERD_ROWS = [
    # gap s, others' totals, peer notice s, rho, router 1's prefill
    (0.005, True, None, 0.0, "prefill-0"),    # before router 1's next poll: nothing can show it — herds
    (0.020, True, None, 0.0, "prefill-0"),
    (0.005, False, None, 0.0, "prefill-0"),
    (0.005, True, 0.002, 0.0, "prefill-1"),   # a peer notice (2 ms) arrives before the decision
    (0.100, True, None, 0.0, "prefill-1"),    # after a poll: the engine reports router 0's call
    (0.100, False, None, 0.0, "prefill-0"),   # without the engines' totals: blind, herds
    (0.100, False, 0.002, 0.0, "prefill-0"),  # notices last only until the poll that should cover them
    (0.100, False, None, 1.0, "prefill-1"),   # KV pressure alone leaks it here (long prompt, chunked)
    (0.005, False, None, 1.0, "prefill-0"),   # ... but not before a poll
]


@pytest.mark.parametrize("gap, totals, notice, rho, expected", HERD_ROWS)
def test_stale_views_herd_unless_the_others_work_is_visible(cm, gap, totals, notice, rho, expected):
    trace = [TraceRequest(0.0, 8000, 10), TraceRequest(gap, 100, 10)]
    sim = Simulator(cm, Topology(2, 1), build_policy("marginal_cost", cm, {"rho": rho}), routers=2,
                    others_totals=totals, peer_notify_s=notice)
    rec = {r.request_id: r for r in sim.run(trace).records}
    assert rec["r0"].prefill_id == "prefill-0"
    assert rec["r1"].prefill_id == expected


# With pushes (`push_s`) router 1 sees router 0's call `push_s` after it reached the engine, at
# whatever phase: no poll to wait for.
PUSH_ROWS = [
    # gap s, push delay s, router 1's prefill
    (0.005, 0.002, "prefill-1"),  # pushed before the decision
    (0.005, 0.010, "prefill-0"),  # still on its way: herds
    (0.020, 0.010, "prefill-1"),  # before router 1's first poll (at 25 ms): polls would herd here
    (0.005, 0.0, "prefill-1"),
]


@pytest.mark.parametrize("gap, push, expected", PUSH_ROWS)
def test_pushed_state_shows_the_others_work_after_the_push_delay(cm, gap, push, expected):
    trace = [TraceRequest(0.0, 8000, 10), TraceRequest(gap, 100, 10)]
    sim = Simulator(cm, Topology(2, 1), build_policy("marginal_cost", cm, {"rho": 0.0}), routers=2, push_s=push)
    rec = {r.request_id: r for r in sim.run(trace).records}
    assert rec["r0"].prefill_id == "prefill-0"
    assert rec["r1"].prefill_id == expected


def test_a_pushed_version_is_visible_exactly_push_s_after_the_change(cm):
    sim = Simulator(cm, Topology(1, 1), build_policy("marginal_cost", cm), routers=2, push_s=0.01)
    sim._refresh("decode-0", 1.0)  # touched at 1.0 ...
    sim._call_arrived("decode-0", 0, 0.5)  # ... where router 0's call arrives
    sim._refresh("decode-0", 1.004)  # the next touch publishes the version of 1.0
    assert sim._pushed("decode-0", 1, 1.0099).others_backlog_s == 0.0
    assert sim._pushed("decode-0", 1, 1.0101).others_backlog_s == 0.5
    assert sim._pushed("decode-0", 0, 1.0101).others_backlog_s == 0.0  # its own call is in its own ledger


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf")])
def test_bad_push_delay_is_refused(cm, bad):
    with pytest.raises(ValueError, match="push_s"):
        Simulator(cm, Topology(1, 1), build_policy("round_robin", cm), routers=2, push_s=bad)
    with pytest.raises(ValueError, match="give one"):
        Simulator(cm, Topology(1, 1), build_policy("round_robin", cm), routers=2, push_s=0.005, peer_notify_s=0.002)


def test_decode_work_reaches_the_others_only_when_the_decode_call_does(cm):
    """Router 0's request r0 is prefilling: router 1's views show its prefill work, not its decode
    work (the decode engine has not received the decode call yet). After the prefill they do."""
    trace = [TraceRequest(0.0, 8000, 200), TraceRequest(0.3, 50, 5), TraceRequest(0.31, 50, 5),
             TraceRequest(1.5, 50, 5)]
    sim = Simulator(cm, Topology(1, 1), build_policy("marginal_cost", cm), routers=2)
    seen: dict[tuple[float, int], dict] = {}
    orig = sim._views

    def views(ids, now, k=0):
        out = orig(ids, now, k)
        seen.setdefault((round(now, 2), k), {}).update({v.instance_id: (v.backlog_s, v.queued) for v in out})
        return out

    sim._views = views
    sim.run(trace)
    assert set(seen) == {(0.0, 0), (0.3, 1), (0.31, 0), (1.5, 1)}  # arrivals alternate between the routers
    own = seen[(0.31, 0)]  # router 0 sees its own r0 at once, both parts
    assert own["prefill-0"][0] > 0 and own["decode-0"][0] > 0
    other = seen[(0.3, 1)]  # router 1 during r0's prefill: the prefill work only
    assert other["prefill-0"][0] > 0 and other["decode-0"] == (0.0, 0)
    late = seen[(1.5, 1)]  # router 1 after r0's prefill: the decode call has arrived, the prefill returned
    assert late["decode-0"][0] > 0 and late["decode-0"][1] == 1
    assert late["prefill-0"] == (0.0, 0)


# --- the CLI --------------------------------------------------------------------------------


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "t.csv"
    write_native(path, generate("short_chat", 60, 20.0, 1))
    return path


def test_cli_sim_records_the_router_count(small_trace, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["sim", "--trace", str(small_trace), "--policies", "marginal_cost", "--routers", "3",
                 "--json", str(out)]) == 0
    assert "routers=3" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["routers"] == 3 and data["policies"]["marginal_cost"]["requests"] == 60


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_cli_sim_refuses_a_bad_router_count(small_trace, tmp_path, capsys, bad):
    out = tmp_path / "r.json"
    assert main(["sim", "--trace", str(small_trace), "--routers", bad, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--routers" in err and bad in err
    assert not out.exists()


# The CPU profile as one 2-core host fitted it (`make run`, 2026-12-07): every engine on one core,
# where serving a request whole on a prefill instance (hosting) is what pays
CPU_HOST = {
    "name": "cpu-host-fitted",
    "engine": {"step_base_s": 0.0023, "prefill_token_s": 1.43e-5, "decode_seq_s": 4.8e-5, "prefill_overhead_s": 0.0021,
               "prefill_attention_s": 1.26e-8, "kv_capacity_tokens": 131072, "block_size": 16, "max_num_seqs": 64,
               "max_batched_tokens": 2048},
    "transfer": {"latency_s": 0.0124, "tokens_per_s": 2.0e6, "between_prefill_steps": True},
    "slo": {"tight": {"ttft_s": 0.105, "tpot_s": 0.00615}, "loose": {"ttft_s": 0.315, "tpot_s": 0.0184}},
    "serving_overhead_s": 0.0088, "handoff_overhead_s": 0.0029,
    "shared_host": {"engine_cores": 0.89, "cores": 2.0, "token_cpu_s": 0.000332, "request_cpu_s": 0.0113,
                    "idle_cores": 0.19, "prefill_weight": 1.83, "mixed_cores": 0.99},
}


def test_two_routers_host_as_well_as_one_when_each_sees_the_others_hosted_decodes():
    """Routers that host decodes on the same prefill instances see each other's as their own: the
    engines count hosted calls apart, and hold a hosted call's prefill only until its first token,
    as the sending router's ledger does (`serve_app.call_ledger`). Blind to them (the others' hosted
    decodes unseen, their prefills' work held to the decodes' end), two routers met 0.85 of these
    requests where one router met all of them."""
    from disagg.core.cost_model import CostModel

    host = CostModel.model_validate(CPU_HOST)
    trace = prepare_trace(generate("multi_turn_chat", 600, 4.0, 0, max_context_tokens=2048), 3.0, 0.5, 0)
    one, res1 = simulate(trace, host, Topology.parse("2P2D"), "slo_goodput", routers=1)
    two, res2 = simulate(trace, host, Topology.parse("2P2D"), "slo_goodput", routers=2)
    hosted = sum(r.prefill_id == r.decode_id and r.prefill_id.startswith("prefill") for r in res2.records)
    assert hosted > len(trace) // 2  # the case in question: most requests hosted
    assert one["goodput"] > 0.95 and two["goodput"] > one["goodput"] - 0.05, (one["goodput"], two["goodput"])
