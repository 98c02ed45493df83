"""Engines that share a host: the processor-sharing stretch, in the cost model, the engine model and
the simulator. Each test here fails if the engines' contention term or the serving path's term is
dropped from the model."""

import math

import pytest

from disagg.core.cost_model import CostModel, CostModelError, SharedHost, load_profile, stream_interval
from disagg.core.engine_model import EngineModel, HostShare, Job, JobState, RequestRate
from disagg.sim.runner import prepare_trace, simulate
from disagg.sim.simulator import Topology
from disagg.sim.workloads import generate
from tests.core.test_engine_model import consts, run_until_idle

ONE_CORE = SharedHost(engine_cores=1, cores=2)


def test_stretch_is_one_alone_and_grows_with_busy_engines_past_their_cores():
    assert ONE_CORE.stretch(0) == 1.0
    assert ONE_CORE.stretch(1) == 1.0
    assert ONE_CORE.stretch(3) == 3.0  # three engines time-share one core
    wide = SharedHost(engine_cores=2, cores=2)
    assert wide.stretch(2) == 1.0 and wide.stretch(4) == 2.0


def _fixed_point(b: float, a: float) -> float:
    """σ with σ = b + a / σ."""
    return (b + math.sqrt(b * b + 4 * a)) / 2


def test_serving_path_takes_its_share_of_every_core_the_engines_included():
    host = SharedHost(engine_cores=1, cores=2, token_cpu_s=0.001, request_cpu_s=0.01)
    # one engine streaming 10 tokens every 5 ms at full speed asks 2 cores of the serving path
    serving, relay = host.serving_cores(tokens=10, seconds=0.005)
    assert serving == pytest.approx(2.0) and relay == 0.0
    # ... but the engine runs σ times slower, and so do its tokens: σ = 1 + (2 / σ) / 2
    sigma = host.stretch(1, serving)
    assert sigma == pytest.approx(1 + serving / sigma / 2) and sigma == pytest.approx(_fixed_point(1, 1))
    assert host.request_cores(requests_per_s=50) == pytest.approx(0.5)
    # requests come at their own rate, whatever the engines' speed: their share is not divided by σ
    assert host.stretch(1, 0.0, 0.5) == pytest.approx(1.25)
    # the serving path's threads are not pinned: they take a share of the engine's core even where
    # the host has a core to spare (the form that filled the spare cores first gave 1.0 here)
    assert host.stretch(1, 0.5) == pytest.approx(_fixed_point(1, 0.25)) and host.stretch(1, 0.5) > 1.2
    # and on top of the engines' own sharing (that form gave max(2, 3 / 2) = 2)
    assert host.stretch(2, 1.0) == pytest.approx(_fixed_point(2, 0.5)) and host.stretch(2, 1.0) > 2.2


def test_the_stacks_background_takes_its_share_of_every_core_while_engines_are_busy():
    quiet = SharedHost(engine_cores=1, cores=2)
    background = SharedHost(engine_cores=1, cores=2, idle_cores=0.4)
    assert background.stretch(0) == 1.0  # nothing busy, nothing slowed
    assert background.stretch(1) == pytest.approx(quiet.stretch(1) + 0.2)
    assert background.stretch(2, 1.0) == pytest.approx(_fixed_point(2.2, 0.5))


def test_the_serving_path_streams_at_the_rate_the_stretched_engines_make_tokens():
    # eight streams on each of two engines sharing one core, 3 ms steps, 0.64 ms of CPU a token: at the
    # engines' unstretched rate the serving path would need 3.4 of the host's 2 cores
    host = SharedHost(engine_cores=1, cores=2, token_cpu_s=0.00064)
    at_full_speed = 2 * host.serving_cores(tokens=8, seconds=0.003)[0]
    assert at_full_speed > 3.4
    sigma = host.stretch(2, at_full_speed)
    assert 2 * 8 / (0.003 * sigma) * 0.00064 / 2 == pytest.approx(sigma - 2)  # what it streams at σ fills the rest
    assert sigma < 2 + at_full_speed / 2 - 0.5  # not the 3.7 the unstretched rate priced


STEPS_AND_MESSAGES = SharedHost(engine_cores=1, cores=2, step_cpu_s=0.0006, event_cpu_s=0.0007,
                                stream_interval_s=0.02, stream_interval_max_s=0.08)


def test_the_app_batches_a_streams_tokens_over_an_interval_that_grows_with_its_streams():
    assert [stream_interval(n, 0.02, 0.08) for n in (1, 4, 8, 16, 64)] == pytest.approx([0.02, 0.02, 0.04, 0.08, 0.08])
    assert stream_interval(8, 0.0, 0.08) == 0.0  # no batching: a message per token
    assert stream_interval(8, 0.02, 0.0) == 0.02  # a maximum below the base is the base


def test_the_serving_path_works_per_engine_step_and_per_message_not_per_token():
    host = STEPS_AND_MESSAGES
    # a lone stream of 4 ms steps: a step's output processing at the steps' rate; its tokens leave in
    # one message per 20 ms interval, at the interval's rate, however fast the steps run
    assert host.serving_cores(1, 0.004) == pytest.approx((0.0006 / 0.004, 0.0007 / 0.02))
    assert host.serving_cores(1, 0.002) == pytest.approx((0.0006 / 0.002, 0.0007 / 0.02))
    # sixteen streams: one step carries sixteen tokens for the same step's work, and the interval has
    # grown to 80 ms, so the messages a second stay those of four streams at 20 ms
    assert host.serving_cores(16, 0.004) == pytest.approx((0.0006 / 0.004, 16 * 0.0007 / 0.08))
    assert host.serving_cores(16, 0.004)[1] == pytest.approx(host.serving_cores(4, 0.004)[1])
    # steps slower than the interval: a message leaves every step, at the steps' rate
    assert host.serving_cores(2, 0.05) == pytest.approx(((0.0006 + 2 * 0.0007) / 0.05, 0.0))
    # a step with no output (a prompt's chunk before its last) gives the serving path nothing
    assert host.serving_cores(0, 0.004) == (0.0, 0.0)
    # the per-token price of older calibrations still holds where it is set
    old = SharedHost(engine_cores=1, cores=2, token_cpu_s=0.0005)
    assert old.serving_cores(16, 0.004) == pytest.approx((16 * 0.0005 / 0.004, 0.0))


def test_batched_messages_slow_the_host_at_their_own_rate_and_the_steps_work_at_the_steps():
    share = HostShare(STEPS_AND_MESSAGES)
    load, relay = STEPS_AND_MESSAGES.serving_cores(4, 0.004)
    # σ = 1 + relay / 2 + (load / 2) / σ: the messages' share is not divided by the stretch
    assert share.step("a", tokens=4, seconds=0.004, now=0.0) == pytest.approx(_fixed_point(1 + relay / 2, load / 2))
    assert share.relay_total == pytest.approx(relay) and share.total == pytest.approx(load)
    share.step("b", tokens=4, seconds=0.004, now=0.0)
    assert share.relay_total == pytest.approx(2 * relay)
    copy = share.copy()
    share.idle("a")
    assert share.relay_total == pytest.approx(relay) and copy.relay_total == pytest.approx(2 * relay)
    share.idle("b")
    assert share.relay_total == 0.0 and share.total == 0.0
    # without either term the lone engine runs at its own speed
    assert HostShare(SharedHost(engine_cores=1, cores=2)).step("a", 4, 0.004, 0.0) == 1.0


def test_a_host_whose_engines_have_more_cores_than_it_is_refused_by_field():
    with pytest.raises(CostModelError, match="engine_cores"):
        CostModel.from_dict({**load_profile("cpu-tiny").to_dict(), "shared_host": {"engine_cores": 4, "cores": 2}})


def test_host_share_counts_busy_engines_and_their_load():
    share = HostShare(SharedHost(engine_cores=1, cores=4, token_cpu_s=0.001))
    # 1 core of serving at full speed, a quarter of each core: σ = 1 + (1 / 4) / σ
    assert share.step("a", tokens=4, seconds=0.004, now=0.0) == pytest.approx(_fixed_point(1, 0.25))
    # two engines on one core, and 2 cores of serving: σ = 2 + (2 / 4) / σ
    assert share.step("b", tokens=4, seconds=0.004, now=0.0) == pytest.approx(_fixed_point(2, 0.5))
    assert share.busy == 2 and share.total == pytest.approx(2.0)
    changes = share.busy_changes
    share.step("a", tokens=8, seconds=0.004, now=0.0)  # still busy: no change in who is busy
    assert share.busy_changes == changes and share.total == pytest.approx(3.0)
    share.idle("a")
    share.idle("b")
    assert share.busy == 0 and share.total == 0.0 and share.busy_changes == changes + 2


def test_request_rate_counts_arrivals_over_about_the_last_window():
    rate = RequestRate(window_s=1.0)
    assert rate.at(5.0) == 0.0
    for i in range(100):  # 20 a second for 5 s: the rate settles at 20
        rate.arrive(i * 0.05)
    assert rate.at(4.95) == pytest.approx(20.0, rel=0.05)
    assert rate.at(5.95) == pytest.approx(rate.at(4.95) * math.exp(-1.0))  # then decays with the window
    copy = rate.copy()
    copy.arrive(6.0)
    assert rate.at(6.0) < copy.at(6.0)  # a copy is its own


def test_request_cpu_is_a_demand_at_the_arrival_rate_not_a_burst_in_the_prefill_step():
    host = SharedHost(engine_cores=1, cores=2, request_cpu_s=0.02)
    share = HostShare(host)
    # one request in a quiet host: 20 ms of CPU over its life, not 20 ms inside its 5 ms prefill step
    # (the burst form asked 4 cores of that step: a stretch of 3)
    share.arrive(0.0)
    assert share.step("a", tokens=1, seconds=0.005, now=0.0) == pytest.approx(1.0 + 0.02 / 2)
    # 50 requests a second keep one core of the serving path busy: half of each of the two cores
    for i in range(200):
        share.arrive(i * 0.02)
    assert share.step("a", tokens=1, seconds=0.005, now=4.0) == pytest.approx(1.5, rel=0.03)
    # and it fades once they stop
    assert share.step("a", tokens=1, seconds=0.005, now=9.0) == pytest.approx(1.0, abs=0.01)


def _decode_on(host: SharedHost, n: int) -> tuple[list[EngineModel], list[float]]:
    """`n` engines of `host` each decoding 20 tokens from time 0, driven in lockstep (identical work,
    so their steps end together): the engines, and when each went idle."""
    c = consts(max_batched_tokens=256)
    share = HostShare(host)
    engines = [EngineModel(f"e{i}", c, share) for i in range(n)]
    for e in engines:
        e.submit(Job("x", prompt=16, target=20))
    ends, idle_from = [e.poke(0.0) for e in engines], [0.0] * n
    while any(t is not None for t in ends):
        now = min(t for t in ends if t is not None)
        for i, e in enumerate(engines):
            if ends[i] is not None and ends[i] <= now:
                e.end_step(now)
                ends[i] = e.poke(now)
                idle_from[i] = now
    return engines, idle_from


def _decode_alone_and_together(host: SharedHost) -> tuple[float, float]:
    """The time to decode 20 tokens on one engine alone, and on two engines of `host` at once."""
    _, [t_alone] = _decode_on(host, 1)
    return t_alone, max(_decode_on(host, 2)[1])


def test_two_engines_on_one_core_take_twice_as_long_as_one():
    t_alone, t_together = _decode_alone_and_together(ONE_CORE)
    assert t_together == pytest.approx(2 * t_alone, rel=0.05)


def test_the_serving_path_slows_an_engine_that_is_alone():
    host = SharedHost(engine_cores=1, cores=2, token_cpu_s=0.04)  # 1 token per 12 ms step asks 3.3 cores
    t_alone, _ = _decode_alone_and_together(host)
    t_free, _ = _decode_alone_and_together(SharedHost(engine_cores=1, cores=2))
    assert t_alone > 1.8 * t_free  # decode steps at 1 + 3.3 / 2


def test_an_engine_counts_its_steps_seconds_alone_and_as_the_host_stretched_them():
    [alone], [t_alone] = _decode_on(ONE_CORE, 1)
    assert alone.work_s == pytest.approx(t_alone) and alone.stepping_s == pytest.approx(t_alone)
    pair, idle_from = _decode_on(ONE_CORE, 2)
    for e, t in zip(pair, idle_from):  # the same compute, its steps about twice as long on the one core
        assert e.work_s == pytest.approx(t_alone)
        assert e.stepping_s == pytest.approx(t)  # stepping from the start until it went idle
        assert e.stepping_s == pytest.approx(2 * t_alone, rel=0.06)


def test_without_a_shared_host_the_engine_model_is_unchanged():
    c = consts()
    e = EngineModel("a", c)
    e.submit(Job("x", prompt=40, target=10))
    finished, _, t = run_until_idle(e)
    assert t == pytest.approx(c.prefill_s(40) + 9 * c.decode_token_s(1))


@pytest.fixture(scope="module")
def trace():
    return prepare_trace(generate("short_chat", 300, 4.0, 0), 4.0, 0.5, 0)


def _sim(trace, host: SharedHost | None, topology: str = "1P2D") -> dict:
    cm = load_profile("cpu-tiny").model_copy(update={"shared_host": host})
    summary, _ = simulate(trace, cm, Topology.parse(topology), "round_robin")
    return summary


def test_simulated_engines_on_one_core_are_slower_than_engines_on_their_own_devices(trace):
    own, shared = _sim(trace, None), _sim(trace, ONE_CORE)
    assert shared["tpot_p50_s"] > 1.5 * own["tpot_p50_s"]
    assert shared["ttft_p50_s"] > 1.5 * own["ttft_p50_s"]


def test_simulated_serving_path_cpu_slows_the_fleet_further(trace):
    base = _sim(trace, ONE_CORE)
    busy_path = _sim(trace, SharedHost(engine_cores=1, cores=2, token_cpu_s=0.0015, request_cpu_s=0.02))
    assert busy_path["tpot_p50_s"] > 1.1 * base["tpot_p50_s"]
    assert busy_path["ttft_p50_s"] > base["ttft_p50_s"]


def test_simulated_serving_path_work_per_step_and_per_message_each_slow_the_fleet(trace):
    base = _sim(trace, ONE_CORE)
    steps = _sim(trace, ONE_CORE.model_copy(update={"step_cpu_s": 0.002}))
    messages = _sim(trace, ONE_CORE.model_copy(update={"event_cpu_s": 0.003, "stream_interval_s": 0.02,
                                                       "stream_interval_max_s": 0.08}))
    for slowed in (steps, messages):
        assert slowed["tpot_p50_s"] > 1.05 * base["tpot_p50_s"]
        assert slowed["ttft_p50_s"] > base["ttft_p50_s"]


def test_simulated_request_cpu_slows_the_fleet_at_the_rate_requests_come(trace):
    base = _sim(trace, ONE_CORE)
    busy_path = _sim(trace, SharedHost(engine_cores=1, cores=2, request_cpu_s=0.1))  # 4 req/s: 0.4 cores
    assert busy_path["tpot_p50_s"] > 1.1 * base["tpot_p50_s"]
    assert busy_path["ttft_p50_s"] > 1.05 * base["ttft_p50_s"]  # its KV transfers are not stretched


def test_a_lone_request_pays_its_own_cpu_over_its_life_not_in_its_prefill_step():
    from disagg.sim.traces import TraceRequest

    lone = prepare_trace([TraceRequest(0.0, 200, 4)], None, 0.5, 0)
    cm = load_profile("cpu-tiny")
    free, _ = simulate(lone, cm.model_copy(update={"shared_host": ONE_CORE}), Topology.parse("1P1D"), "colocated")
    host = SharedHost(engine_cores=1, cores=2, request_cpu_s=0.05)
    paid, _ = simulate(lone, cm.model_copy(update={"shared_host": host}), Topology.parse("1P1D"), "colocated")
    # 1 request a second asks 0.05 cores: a stretch of 1.025; charged to its ~10 ms prefill step it
    # asked 5 cores of that step, a stretch of 3.5
    assert paid["ttft_p50_s"] == pytest.approx(free["ttft_p50_s"] * 1.025, rel=0.01)


def test_engines_with_cores_enough_run_as_if_each_owned_its_device(trace):
    own = _sim(trace, None, "1P1D")
    roomy = _sim(trace, SharedHost(engine_cores=2, cores=4), "1P1D")  # two engines, two cores of their own
    for key in ("goodput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        assert roomy[key] == pytest.approx(own[key], rel=1e-9), key  # macro steps cut at other ways: rounding


def test_the_estimator_prices_a_query_at_the_stretch_its_busy_peers_give():
    from disagg.core.ttft_estimator import InstanceSnapshot, RunningRequest, estimate_ttft, peer_share

    c = consts(max_batched_tokens=256)
    busy = InstanceSnapshot(running=(RunningRequest(prompt_tokens=32, decoded_tokens=2, remaining_tokens=50),))
    alone = estimate_ttft(c, InstanceSnapshot(), 100).ttft_s
    assert alone == pytest.approx(c.prefill_s(100))
    idle_peers = peer_share(ONE_CORE, [(c, InstanceSnapshot()), (c, InstanceSnapshot())])
    assert estimate_ttft(c, InstanceSnapshot(), 100, host=idle_peers).ttft_s == pytest.approx(alone)
    two_busy = peer_share(ONE_CORE, [(c, busy), (c, busy)])
    assert two_busy.busy == 2
    assert estimate_ttft(c, InstanceSnapshot(), 100, host=two_busy).ttft_s == pytest.approx(3 * alone)
    assert two_busy.busy == 2  # the estimate worked on a copy: one share serves every estimate of a decision
    # the peers' streams take the host's other core and more: a stretch beyond the engines' own
    streaming = SharedHost(engine_cores=1, cores=2, token_cpu_s=0.05)  # the peer streams a token per 12 ms
    assert estimate_ttft(c, InstanceSnapshot(), 100, host=peer_share(streaming, [(c, busy)])).ttft_s > 2.5 * alone
    # requests arriving at 50 a second, 20 ms of CPU each, take one core: half of the engines'
    handling = SharedHost(engine_cores=1, cores=2, request_cpu_s=0.02)
    arriving = peer_share(handling, [], RequestRate(rate=50.0, at=0.0))
    assert estimate_ttft(c, InstanceSnapshot(), 100, host=arriving).ttft_s == pytest.approx(1.5 * alone, rel=0.01)


def test_a_peer_shares_the_host_only_until_its_own_work_drains():
    """The estimator's peers are busy until what their snapshots hold is done (`drain_s`), not for
    ever: a long prefill beside a peer with one token left to decode runs its first chunk at the
    stretch of two engines on one core, the rest alone."""
    from disagg.core.cost_model import attention_pairs
    from disagg.core.ttft_estimator import (
        InstanceSnapshot, RunningRequest, drain_s, estimate_ttft, peer_share, peer_shares,
    )

    c = consts(max_batched_tokens=256, kv_capacity_tokens=4096)
    last_token = InstanceSnapshot(running=(RunningRequest(prompt_tokens=32, decoded_tokens=9, remaining_tokens=1),))
    assert drain_s(c, last_token) == pytest.approx(c.decode_token_s(1))
    share = peer_share(ONE_CORE, [(c, last_token)], now=5.0)
    assert share.releases == [(pytest.approx(5.0 + 2 * c.decode_token_s(1)), "peer-0")]  # at two engines' stretch
    alone = estimate_ttft(c, InstanceSnapshot(), 1000, now=5.0).ttft_s
    first_chunk = c.step_s(256, 0, attention_pairs(256, 0))
    assert estimate_ttft(c, InstanceSnapshot(), 1000, now=5.0, host=share).ttft_s == pytest.approx(alone + first_chunk)
    # a peer whose batch outlasts the prefill shares every step of it
    long_batch = InstanceSnapshot(running=(RunningRequest(prompt_tokens=32, decoded_tokens=9, remaining_tokens=500),))
    busy = peer_share(ONE_CORE, [(c, long_batch)], now=5.0)
    assert estimate_ttft(c, InstanceSnapshot(), 1000, now=5.0, host=busy).ttft_s == pytest.approx(2 * alone)
    # one decision's shares, each instance's drain run once: each is the share of all the others
    shares = peer_shares(ONE_CORE, [(c, last_token), (c, long_batch), (c, InstanceSnapshot())], now=5.0)
    assert [s.releases for s in shares] == [busy.releases, share.releases,
                                            peer_share(ONE_CORE, [(c, last_token), (c, long_batch)], now=5.0).releases]


def test_an_idle_snapshot_drains_at_once_and_a_busy_one_as_the_engine_model_runs_it():
    from disagg.core.ttft_estimator import InstanceSnapshot, KvTransfer, QueuedRequest, drain_s

    c = consts(max_batched_tokens=256, kv_capacity_tokens=4096)
    assert drain_s(c, InstanceSnapshot()) == 0.0
    # a queued request: its prefill (the first token with it), then 3 decode steps alone
    queued = InstanceSnapshot(waiting=(QueuedRequest(prompt_tokens=100, output_tokens=4),))
    assert drain_s(c, queued) == pytest.approx(c.prefill_s(100) + 3 * c.decode_token_s(1))
    # a finished prefill holding its KV for a pull: busy (spinning) until the transfer ends
    holding = InstanceSnapshot(transfers=(KvTransfer(prompt_tokens=100, ends_in_s=0.25, outgoing=True),))
    assert drain_s(c, holding) == pytest.approx(0.25)
    # KV arriving later, then two tokens decoded
    incoming = InstanceSnapshot(transfers=(KvTransfer(prompt_tokens=100, ends_in_s=0.1, output_tokens=2),))
    assert drain_s(c, incoming) == pytest.approx(0.1 + 2 * c.decode_token_s(1))


def test_a_release_idles_the_engine_for_steps_planned_from_then_on():
    share = HostShare(ONE_CORE)
    share.step("a", 0, 0.01, 0.0)
    share.release_at("a", 1.0)
    assert share.step("b", 0, 0.01, 0.5) == 2.0  # "a" still busy
    copied = share.copy()
    assert share.step("b", 0, 0.01, 1.0) == 1.0 and share.busy == 1  # "a" idle from 1.0 on
    assert copied.releases == [(1.0, "a")] and copied.busy == 2  # a copy keeps its own schedule


# --- the KV hand-off on a shared host -------------------------------------------------------------


def test_an_engine_holding_or_awaiting_kv_is_busy_on_the_host_though_it_computes_nothing():
    """vLLM's engine loop keeps stepping while a KV transfer it is part of is pending, so such an
    engine takes its share of the host like any busy one."""
    share = HostShare(ONE_CORE)
    prefill, decode = EngineModel("p", consts(), share), EngineModel("d", consts(), share)
    job = Job("x", prompt=40, target=3, prefill_only=True)
    prefill.submit(job)
    prefill.end_step(prefill.poke(0.0))
    assert prefill.poke(1.0) is None and job.state is JobState.HOLDING
    assert share.busy == 1  # nothing to compute, its KV awaiting the pull
    pulled = Job("x", prompt=40, target=3, remote_kv=True)
    decode.submit(pulled)
    assert decode.poke(1.0) is None and decode.take_transfers() == [pulled]
    assert share.busy == 2  # nothing to compute, its KV on the way
    assert share.total == 0.0  # and neither streams a token
    prefill.release(job)
    prefill.poke(1.01)
    decode.kv_arrived(pulled)
    decode.poke(1.01)  # now decoding: busy with steps
    assert share.busy == 1 and "p" not in share.loads


def test_the_step_in_flight_is_found_within_a_macro_step():
    e = EngineModel("d", consts())
    assert e.step_in_flight_end(0.0) is None  # idle
    e.submit(Job("a", prompt=16, target=5))
    e.end_step(e.poke(0.0))
    end = e.poke(0.026)  # a macro step of 4 decode steps of 12 ms from 26 ms
    assert end == pytest.approx(0.026 + 4 * 0.012)
    assert e.step_in_flight_end(0.030) == pytest.approx(0.038)
    assert e.step_in_flight_end(0.045) == pytest.approx(0.050)
    assert e.step_in_flight_end(0.050) is None  # at a boundary: between steps
    assert e.step_in_flight_end(0.026) is None  # a step begun at `t` is not in flight at `t`


def _lone_then_long(between_steps: bool, hop: float = 0.0):
    """A short prompt, then a long one on the same prefill engine 1 ms later: the first's KV is
    due while the prefill engine runs the second's prefill. Records by request, 1P1D, no shared host."""
    from disagg.sim.traces import TraceRequest

    cm = load_profile("cpu-tiny")
    cm = cm.model_copy(update={"transfer": cm.transfer.model_copy(update={"between_prefill_steps": between_steps}),
                               "handoff_overhead_s": hop})
    trace = prepare_trace([TraceRequest(0.0, 64, 4), TraceRequest(0.001, 2000, 4)], None, 0.5, 0)
    _, result = simulate(trace, cm, Topology.parse("1P1D"), "round_robin")
    return cm, sorted(result.records, key=lambda r: r.arrival_s)


def test_a_transfer_due_while_the_prefill_engine_runs_a_step_ends_with_that_step():
    cm, (free, _) = _lone_then_long(between_steps=False)
    _, (gated, _) = _lone_then_long(between_steps=True)
    e = cm.engine
    short_prefill = e.prefill_s(64)
    long_step = e.prefill_s(2000)  # one step: 2,000 tokens fit the 2,048-token budget
    # free: the KV lands a transfer after the short prefill, then one decode step
    assert free.ttft_s == pytest.approx(short_prefill + cm.transfer.transfer_s(64) + e.step_s(0, 1))
    # gated: the prefill engine started the long prompt at once, and the KV moves when that step ends
    assert gated.ttft_s == pytest.approx(short_prefill + long_step + e.step_s(0, 1))


def test_a_hand_off_crosses_the_serving_path_once_more_before_the_decode_engine_sees_it():
    from disagg.sim.traces import TraceRequest

    _, (base, _) = _lone_then_long(between_steps=False)
    _, (crossed, _) = _lone_then_long(between_steps=False, hop=0.007)
    assert crossed.ttft_s == pytest.approx(base.ttft_s + 0.007)  # no shared host: its unloaded time
    cm = load_profile("cpu-tiny").model_copy(update={"handoff_overhead_s": 0.007})
    lone = prepare_trace([TraceRequest(0.0, 64, 4)], None, 0.5, 0)
    with_hop, _ = simulate(lone, cm, Topology.parse("1P1D"), "colocated")
    without, _ = simulate(lone, load_profile("cpu-tiny"), Topology.parse("1P1D"), "colocated")
    assert with_hop["ttft_p50_s"] == without["ttft_p50_s"]  # a request served on one engine makes no hand-off


def test_the_serving_paths_time_runs_at_the_hosts_stretch(trace):
    """The time outside the engines is CPU work on the shared host too: under load it stretches
    as the engines' steps do; on engines that own their devices it is the unloaded constant."""
    base = load_profile("cpu-tiny")
    runs = {}
    for name, host in (("own", None), ("shared", ONE_CORE)):
        for overhead in (0.0, 0.02):
            cm = base.model_copy(update={"shared_host": host, "serving_overhead_s": overhead})
            _, result = simulate(trace, cm, Topology.parse("1P2D"), "colocated")
            runs[name, overhead] = {r.request_id: r.ttft_s for r in result.records}
    own = [runs["own", 0.02][k] - runs["own", 0.0][k] for k in runs["own", 0.0]]
    shared = sorted(runs["shared", 0.02][k] - runs["shared", 0.0][k] for k in runs["shared", 0.0])
    assert own == pytest.approx([0.02] * len(own))
    assert shared[0] >= 0.02 - 1e-9 and shared[len(shared) // 2] > 1.5 * 0.02


def test_a_hosts_stretch_now_counts_its_busy_engines_and_the_requests_coming():
    host = SharedHost(engine_cores=1, cores=2, request_cpu_s=0.05)
    share = HostShare(host)
    assert share.stretch_at(0.0) == 1.0  # nothing busy
    share.step("a", tokens=0, seconds=0.01, now=0.0)
    share.step("b", tokens=0, seconds=0.01, now=0.0)
    assert share.stretch_at(0.0) == pytest.approx(2.0)
    for i in range(100):  # 20 requests a second for 5 s: one core of the serving path, half of each
        share.arrive(i * 0.05)
    assert share.stretch_at(4.95) == pytest.approx(2.5, rel=0.02)


# --- uneven sharing: a prefill claims more of a shared core than a decode step (`prefill_weight`) ---

UNEVEN = SharedHost(engine_cores=1, cores=2, prefill_weight=2.0)


def test_a_prefill_beside_a_decode_takes_its_weight_of_the_core():
    # one core, a prefill of weight 2 beside a decode of weight 1: shares 2/3 and 1/3
    assert UNEVEN.stretch(2, own=2.0, weights=3.0) == pytest.approx(1.5)
    assert UNEVEN.stretch(2, own=1.0, weights=3.0) == pytest.approx(3.0)
    # even weights are the fair sharing of before, whichever way they are passed
    assert UNEVEN.stretch(2, own=1.0, weights=2.0) == ONE_CORE.stretch(2) == 2.0
    # with a core each, nobody waits, whatever the weights
    assert SharedHost(engine_cores=2, cores=2, prefill_weight=2.0).stretch(2, own=1.0, weights=3.0) == 1.0


def test_a_steps_weight_follows_the_prefill_share_of_its_time():
    assert UNEVEN.step_weight(0.0, 0.01) == 1.0  # a decode step
    assert UNEVEN.step_weight(0.01, 0.01) == 2.0  # all prefill
    assert UNEVEN.step_weight(0.0075, 0.01) == pytest.approx(1.75)
    assert ONE_CORE.step_weight(0.01, 0.01) == 1.0  # the default weighs every step alike


def test_host_share_weighs_each_busy_engines_step():
    share = HostShare(UNEVEN)
    assert share.step("d", 4, 0.003, 0.0) == 1.0  # alone
    changes = share.busy_changes
    assert share.step("p", 1, 0.05, 0.0, prefill_s=0.05) == pytest.approx(1.5)  # the prefill, beside the decode
    assert share.stretch_at(0.0) == pytest.approx(3.0)  # what a decode step planned now gets
    assert share.busy_changes == changes + 1
    # the decode engine turns to a step all prefill: the others' shares move, so they re-plan
    assert share.step("d", 4, 0.05, 0.0, prefill_s=0.05) == pytest.approx(2.0)
    assert share.busy_changes == changes + 2
    copy = share.copy()
    share.idle("p")
    assert share.weight == pytest.approx(2.0) and share.stretch_at(0.0, 2.0) == 1.0
    assert copy.weight == pytest.approx(4.0) and copy.stretch_at(0.0) == pytest.approx(4.0)


def test_an_engine_prefills_faster_and_a_neighbour_decodes_slower_than_even_sharing_says():
    def run(host: SharedHost) -> tuple[float, float]:
        c = consts()
        share = HostShare(host)
        decoder, prefiller = EngineModel("d", c, share), EngineModel("p", c, share)
        decoder.submit(Job("x", prompt=8, target=400))
        t0 = decoder.poke(0.0)
        decoder.end_step(t0)  # its prefill done: it decodes from here on, a macro step planned alone
        decoder.poke(t0)
        prefiller.submit(Job("y", prompt=1000, target=1))
        prefill_s = prefiller.poke(t0) - t0  # planned beside the decoding engine
        cut = decoder.poke(t0)  # its macro step ends with the step in flight
        decoder.end_step(cut)
        decoder.poke(cut)
        return prefill_s, decoder.poke(cut) - cut  # its next step, planned beside the prefill

    c = consts()
    even_prefill, even_step = run(ONE_CORE)
    prefill, step = run(UNEVEN)
    assert even_step == pytest.approx(2 * c.decode_token_s(1)) and step == pytest.approx(3 * c.decode_token_s(1))
    assert prefill == pytest.approx(0.75 * even_prefill)  # 1.5× alone, not 2×


def test_the_estimator_prices_a_prefill_at_its_weight_beside_busy_peers():
    from disagg.core.ttft_estimator import InstanceSnapshot, RunningRequest, estimate_ttft, peer_share

    c = consts(max_batched_tokens=256)
    decoding = InstanceSnapshot(running=(RunningRequest(prompt_tokens=32, decoded_tokens=2, remaining_tokens=50),))
    prefilling = InstanceSnapshot(running=(RunningRequest(prompt_tokens=600, decoded_tokens=0, remaining_tokens=1,
                                                          prefilling=True, kv_tokens=256),))
    alone = estimate_ttft(c, InstanceSnapshot(), 100).ttft_s
    # a prefill beside a decoding peer gets 2 parts of the core in 3
    assert estimate_ttft(c, InstanceSnapshot(), 100, host=peer_share(UNEVEN, [(c, decoding)])).ttft_s == \
        pytest.approx(1.5 * alone)
    # beside a peer that prefills too, the two weigh alike: half each
    share = peer_share(UNEVEN, [(c, prefilling)])
    assert share.weights["peer-0"] == pytest.approx(UNEVEN.step_weight(1.0, 1.0))
    assert estimate_ttft(c, InstanceSnapshot(), 100, host=share).ttft_s == pytest.approx(2 * alone)


def test_slo_goodput_prices_a_prefill_at_its_weight_and_a_decode_beside_a_prefilling_engine_at_its_own():
    from disagg.core.policies.slo_goodput import _HostLoad
    from disagg.core.types import InstanceView, Role

    cm = load_profile("cpu-tiny").model_copy(update={"shared_host": UNEVEN})

    def view(iid: str, role: Role, queued: int = 0, backlog_s: float = 0.0) -> InstanceView:
        return InstanceView(instance_id=iid, role=role, kv_used_tokens=0, kv_capacity_tokens=100_000,
                            queued=queued, backlog_s=backlog_s)

    p, d = view("p", Role.PREFILL, backlog_s=0.2), view("d", Role.DECODE, queued=4)
    load = _HostLoad(cm, UNEVEN, [p], [d], spread=0.1, floor=0.01, requests_per_s=0.0)
    assert load.sigma == pytest.approx(3.0)  # the decodes, beside a prefill of weight 2
    assert load.prefill_sigma(p) == pytest.approx(1.5)
    idle_p = view("p", Role.PREFILL)
    load = _HostLoad(cm, UNEVEN, [idle_p], [d], spread=0.1, floor=0.01, requests_per_s=0.0)
    assert load.sigma == 1.0 and load.prefill_sigma(idle_p) == pytest.approx(1.5)  # it would join the decodes


def test_the_cores_shared_move_from_decodes_to_a_prefills_as_its_weight_joins():
    host = SharedHost(engine_cores=0.8, cores=2, prefill_weight=2.0, mixed_cores=1.0)
    assert host.stretch(2, own=1.0, weights=2.0) == pytest.approx(2 / 0.8)  # two decode steps lose a fifth
    assert host.stretch(2, own=1.0, weights=3.0) == pytest.approx(3.0)  # beside a prefill, none
    assert host.stretch(2, own=2.0, weights=3.0) == pytest.approx(1.5)
    assert host.stretch(2, own=1.0, weights=2.5) == pytest.approx(2.5 / 0.9)  # a step half prefill: between
    assert SharedHost(engine_cores=0.8, cores=2, prefill_weight=2.0).stretch(2, own=1.0, weights=3.0) == \
        pytest.approx(3 / 0.8)  # unmeasured: the decodes' cores
    with pytest.raises(ValueError, match="mixed_cores"):
        SharedHost(engine_cores=1, cores=2, mixed_cores=3)


def test_several_measurements_of_one_host_pool_to_the_median_of_each_term():
    a = SharedHost(engine_cores=1.19, cores=2.0, token_cpu_s=182e-6, prefill_weight=1.05, mixed_cores=1.09,
                   step_cpu_s=400e-6, event_cpu_s=900e-6, stream_interval_s=0.02, stream_interval_max_s=0.08,
                   measured_at="2026-12-06T09:18:24+00:00")
    b = SharedHost(engine_cores=0.97, cores=2.0, token_cpu_s=573e-6, prefill_weight=1.89, mixed_cores=0.94,
                   step_cpu_s=600e-6, event_cpu_s=700e-6, stream_interval_s=0.02, stream_interval_max_s=0.08,
                   measured_at="2026-12-06T09:18:46+00:00")
    c = SharedHost(engine_cores=1.05, cores=2.0, token_cpu_s=300e-6, prefill_weight=1.5)  # no mixed_cores
    two = SharedHost.pooled([a, b])
    assert two.engine_cores == pytest.approx(1.08) and two.prefill_weight == pytest.approx(1.47)
    assert two.token_cpu_s == pytest.approx(377.5e-6) and two.mixed_cores == pytest.approx(1.015)
    assert (two.step_cpu_s, two.event_cpu_s) == pytest.approx((500e-6, 800e-6))
    assert (two.stream_interval_s, two.stream_interval_max_s) == (0.02, 0.08)  # the app's, as measured
    assert two.measured_at == b.measured_at  # the latest
    three = SharedHost.pooled([a, b, c])  # the median, not the mean: one odd calibration moves nothing
    assert three.engine_cores == 1.05 and three.prefill_weight == 1.5 and three.token_cpu_s == 300e-6
    assert three.mixed_cores == 1.05  # c's host shares its engine_cores while a prefill runs
    assert SharedHost.pooled([a]) is a
    assert SharedHost.pooled([c, c]).mixed_cores is None


def test_measurements_of_hosts_of_different_sizes_do_not_pool():
    with pytest.raises(ValueError, match="different hosts"):
        SharedHost.pooled([SharedHost(engine_cores=1.0, cores=2.0), SharedHost(engine_cores=1.0, cores=4.0)])
    with pytest.raises(ValueError, match="at least one"):
        SharedHost.pooled([])
