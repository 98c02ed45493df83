"""Simulator invariants and a closed-form check."""

import pytest

from disagg.core.cost_model import load_profile
from disagg.core.policies import Policy, build_policy, known_policies
from disagg.core.types import CostTerms, Decision, SloClass
from disagg.sim.runner import clamp_to_context, compare, prepare_trace, simulate
from disagg.sim.simulator import Simulator, Topology
from disagg.sim.traces import TraceRequest
from disagg.sim.workloads import generate


@pytest.fixture(scope="module")
def cm():
    return load_profile("a40")


def test_topology_parse():
    assert Topology.parse("2P4D") == Topology(2, 4)
    assert Topology.parse("0p1d") == Topology(0, 1)
    for bad in ("2P", "P4D", "2X4D", "2P0D", "", "-1P2D"):
        with pytest.raises(ValueError, match="2P4D"):
            Topology.parse(bad)


def test_single_request_matches_closed_form(cm):
    p, o = 500, 20
    trace = [TraceRequest(0.0, p, o, SloClass.TIGHT)]
    policy = build_policy("round_robin", cm)
    res = Simulator(cm, Topology(1, 1), policy).run(trace)
    (rec,) = res.records
    e = cm.engine
    tau = e.step_base_s + e.decode_seq_s
    expected_ttft = e.prefill_s(p) + cm.transfer_s("prefill-0", "decode-0", p) + tau
    assert rec.ttft_s == pytest.approx(expected_ttft, rel=1e-9)
    assert rec.tpot_s == pytest.approx(tau, rel=1e-9)
    assert rec.e2e_s == pytest.approx(expected_ttft + (o - 1) * tau, rel=1e-9)
    assert rec.slo_met == (expected_ttft <= 0.175 and tau <= 0.0397)


class _CheckedEngine:
    """An engine whose KV is checked after each step and each poke; everything else is the engine's.
    (A wrapper, not patched methods: the compiled engine model's methods cannot be replaced.)"""

    def __init__(self, engine, violations: list) -> None:
        self._engine, self._violations = engine, violations

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _check(self, now: float) -> None:
        e = self._engine
        if not (0 <= e.free_blocks <= e.total_blocks):
            self._violations.append((e.instance_id, now, e.free_blocks))

    def end_step(self, now: float):
        out = self._engine.end_step(now)
        self._check(now)
        return out

    def poke(self, now: float):
        end = self._engine.poke(now)
        self._check(now)
        return end


def _checked_sim(cm, topology, policy_name, trace):
    """Run with every engine checked after each step: KV within capacity, no negative counts."""
    sim = Simulator(cm, topology, build_policy(policy_name, cm))
    violations = []
    sim.engines = {iid: _CheckedEngine(e, violations) for iid, e in sim.engines.items()}
    return sim, sim.run(trace), violations


@pytest.mark.parametrize("policy", known_policies())
def test_no_request_lost_or_duplicated_and_tokens_conserved(cm, policy):
    trace = generate("mixed_bursty", 600, rate=30.0, seed=3)
    trace, _ = clamp_to_context(trace, cm.engine.kv_capacity_tokens)
    sim, res, violations = _checked_sim(cm, Topology(2, 4), policy, trace)
    assert violations == []
    ids = [r.request_id for r in res.records]
    assert sorted(ids) == sorted(f"r{i}" for i in range(len(trace)))
    assert sum(r.output_tokens for r in res.records) == sum(t.output_tokens for t in trace)
    assert sum(res.instance_tokens.values()) == sum(t.output_tokens + t.prompt_tokens for t in trace)
    assert len(sim.ledger) == 0  # every admission was finished
    for e in sim.engines.values():
        assert e.idle() and e.free_blocks == e.total_blocks and e.holding == 0
    assert all(not r.totals() for r in sim.received.values())  # every call the engines counted ended


class _HostEverything(Policy):
    """Serves every request whole on the first prefill instance."""

    name = "host_everything"

    @property
    def may_host(self) -> bool:
        return True

    def choose(self, req, prefill, decode, now):
        return Decision(prefill[0].instance_id, prefill[0].instance_id, self.name, CostTerms(), CostTerms())


def test_a_request_hosted_on_a_prefill_instance_runs_there_whole_without_a_transfer(cm):
    p, o = 500, 20
    sim = Simulator(cm, Topology(1, 1), _HostEverything(cm))
    res = sim.run([TraceRequest(0.0, p, o, SloClass.TIGHT)])
    (rec,) = res.records
    e = cm.engine
    assert (rec.prefill_id, rec.decode_id) == ("prefill-0", "prefill-0")
    assert rec.ttft_s == pytest.approx(e.prefill_s(p), rel=1e-9)  # its own last prefill chunk: no transfer
    assert rec.tpot_s == pytest.approx(e.step_base_s + e.decode_seq_s, rel=1e-9)
    assert res.instance_tokens == {"prefill-0": p + o, "decode-0": 0}
    assert len(sim.ledger) == 0 and not sim.received["prefill-0"].totals()


def test_a_prefill_instance_hosting_decodes_shows_only_its_prefills_as_queue(cm):
    """Once a hosted request has its first token, the router's view of that prefill instance has
    no work of it left in the backlog, though it still counts it as hosted."""
    sim = Simulator(cm, Topology(1, 1), _HostEverything(cm))
    seen = []
    choose = sim.policy.choose

    def spy(req, prefill, decode, now):
        seen.append((now, prefill[0].backlog_s, prefill[0].hosted))
        return choose(req, prefill, decode, now)
    sim.policy.choose = spy
    sim.run([TraceRequest(0.0, 500, 400, SloClass.LOOSE), TraceRequest(1.0, 100, 5, SloClass.LOOSE)])
    assert seen[0] == (0.0, 0.0, 0)
    assert seen[1] == (1.0, 0.0, 1)  # the first one decodes there (400 tokens take ~4 s); its prefill is done


def test_kv_pressure_forces_preemption_but_loses_nothing(cm):
    tight = cm.model_copy(update={"engine": cm.engine.model_copy(update={"kv_capacity_tokens": 4096})})
    trace = generate("short_prompt_long_generation", 300, rate=50.0, seed=1)
    trace, _ = clamp_to_context(trace, 4096)
    sim, res, violations = _checked_sim(tight, Topology(1, 2), "least_loaded", trace)
    assert violations == []
    assert res.preemptions > 0
    assert len(res.records) == len(trace) and all(r.error is None for r in res.records)


def test_same_seed_same_result_and_other_seed_differs(cm):
    trace = generate("mixed_bursty", 400, rate=25.0, seed=7)
    a = compare(trace, cm, Topology(2, 4), ["marginal_cost"], rate=None, tight_share=0.5, seed=11)
    b = compare(trace, cm, Topology(2, 4), ["marginal_cost"], rate=None, tight_share=0.5, seed=11)
    c = compare(trace, cm, Topology(2, 4), ["marginal_cost"], rate=None, tight_share=0.5, seed=12)
    strip = lambda r: {k: v for k, v in r["marginal_cost"].items() if "wall" not in k and "per_s" not in k and "decision_us" not in k}  # noqa: E731
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)  # the seed draws the SLO classes


def test_known_output_lengths_are_what_the_router_prices_with(cm):
    """With `known_output` the router predicts each request's true output length (the bench's
    requests state it, as the live router sees), else the predictor's bucket means."""
    trace = prepare_trace(generate("short_chat", 60, rate=8.0, seed=3), None, 0.5, 3)
    _, told = simulate(trace, cm, Topology(1, 2), "marginal_cost", known_output=True)
    _, guessed = simulate(trace, cm, Topology(1, 2), "marginal_cost")
    assert all(r.predicted_output_tokens == r.output_tokens for r in told.records)
    assert sum(r.predicted_output_tokens != r.output_tokens for r in guessed.records) > 30


def test_prompt_beyond_every_kv_capacity_is_a_counted_failure(cm):
    huge = cm.engine.kv_capacity_tokens + 10
    trace = [TraceRequest(0.0, 100, 5), TraceRequest(0.1, huge, 5), TraceRequest(0.2, 100, 5)]
    summary, res = simulate(trace, cm, Topology(1, 1), "marginal_cost")
    assert summary["requests"] == 3 and summary["failed"] == 1
    failed = [r for r in res.records if r.error]
    assert failed[0].prompt_tokens == huge and "KV capacity" in failed[0].error
    assert summary["goodput"] <= 2 / 3


def test_a_policy_named_with_parameters_runs_as_with_them_given_apart(cm):
    trace = prepare_trace(generate("short_prompt_long_generation", 300, rate=30.0, seed=4), None, 0.5, 4)
    spec, _ = simulate(trace, cm, Topology(4, 3), "slo_goodput:allow_hosted=false")
    apart, _ = simulate(trace, cm, Topology(4, 3), "slo_goodput", policy_params={"allow_hosted": False})
    hosting, _ = simulate(trace, cm, Topology(4, 3), "slo_goodput")
    drop = ("sim_wall_s", "sim_requests_per_s", "decision_us_p50", "decision_us_p99")
    assert {k: v for k, v in spec.items() if k not in drop} == {k: v for k, v in apart.items() if k not in drop}
    assert spec["load_balance"] != hosting["load_balance"]  # the parameter changed what ran


def test_colocated_decisions_run_prefill_on_the_decode_instance(cm):
    trace = generate("short_chat", 200, rate=10.0, seed=2)
    summary, res = simulate(trace, cm, Topology(0, 2), "pair_cost")
    assert summary["failed"] == 0
    assert all(r.prefill_id == r.decode_id for r in res.records)


def test_empty_prefill_pool_fails_requests_for_disaggregated_policies(cm):
    trace = generate("short_chat", 20, rate=10.0, seed=2)
    summary, _ = simulate(trace, cm, Topology(0, 2), "round_robin")
    assert summary["failed"] == 20 and summary["goodput"] == 0.0


def test_outputs_capped_to_the_context():
    capped, n = clamp_to_context([TraceRequest(0.0, 90, 50), TraceRequest(0.0, 10, 5)], 100)
    assert n == 1 and capped[0].output_tokens == 10 and capped[1].output_tokens == 5


def test_overload_hurts_goodput_and_ttft(cm):
    trace = generate("short_chat", 800, rate=1.0, seed=5)
    light = compare(trace, cm, Topology(1, 2), ["round_robin"], rate=2.0, tight_share=0.0, seed=0)["round_robin"]
    heavy = compare(trace, cm, Topology(1, 2), ["round_robin"], rate=200.0, tight_share=0.0, seed=0)["round_robin"]
    assert light["goodput"] > 0.95
    assert heavy["goodput"] < light["goodput"]
    assert heavy["ttft_p99_s"] > 5 * light["ttft_p99_s"]


def test_stale_polls_are_modelled(cm):
    """The poll interval changes what the router sees, and so its decisions."""
    trace = generate("mixed_bursty", 500, rate=40.0, seed=4)
    fast, r1 = simulate(trace, cm, Topology(2, 4), "marginal_cost", poll_interval_s=0.001)
    slow, r2 = simulate(trace, cm, Topology(2, 4), "marginal_cost", poll_interval_s=2.0)
    assert [r.decode_id for r in r1.records] != [r.decode_id for r in r2.records]


def test_the_serving_overhead_delays_every_response_and_changes_nothing_else(cm):
    trace = generate("mixed_bursty", 150, 8.0, 3)
    late = cm.model_copy(update={"serving_overhead_s": 0.04})
    _, base = simulate(trace, cm, Topology.parse("1P2D"), "marginal_cost", seed=1)
    _, slow = simulate(trace, late, Topology.parse("1P2D"), "marginal_cost", seed=1)
    a = {r.request_id: r for r in base.records}
    b = {r.request_id: r for r in slow.records}
    assert a.keys() == b.keys() and len(a) == 150
    for rid, r in a.items():
        assert (b[rid].prefill_id, b[rid].decode_id) == (r.prefill_id, r.decode_id)  # the same decisions
        if r.ttft_s is not None:
            assert b[rid].ttft_s == pytest.approx(r.ttft_s + 0.04)
            assert b[rid].e2e_s == pytest.approx(r.e2e_s + 0.04)
            assert b[rid].tpot_s == pytest.approx(r.tpot_s) if r.tpot_s is not None else b[rid].tpot_s is None
