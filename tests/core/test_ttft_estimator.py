"""The TTFT estimator against the engine model it runs: exact agreement, closed forms, bad inputs.

The exactness suite drives a real `EngineModel` through seeded random arrivals by the simulator's
rules for one engine (`OneEngine` below mirrors disagg/sim/simulator.py: step ends before KV
transfer ends before arrivals at equal times; poke after each; transfers as scheduled events),
stops at a step boundary, snapshots the engine with `snapshot_of`, then queues a probe on the
real engine and runs it to the probe's first token. `estimate_ttft` on the snapshot must give the
same TTFT and wait to 1e-9 s.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import pytest

from disagg.core.cost_model import EngineConstants
from disagg.core.engine_model import EngineModel, Job, JobState
from disagg.core.ttft_estimator import (
    InstanceSnapshot,
    KvTransfer,
    QueuedRequest,
    RunningRequest,
    TtftEstimateError,
    estimate_ttft,
    snapshot_of,
)


def consts(**kw) -> EngineConstants:
    base = dict(step_base_s=0.01, prefill_token_s=0.0002, decode_seq_s=0.001, prefill_overhead_s=0.003,
                kv_capacity_tokens=8192, block_size=16, max_num_seqs=32, max_batched_tokens=512)
    base.update(kw)
    return EngineConstants(**base)


# --- a real engine, driven as the simulator drives one ------------------------------------------

_STEP, _KV, _ARRIVAL = 0, 1, 2


class OneEngine:
    """One EngineModel driven by the simulator's event rules. A job's payload is its transfer time:
    a remote-KV job's KV lands that long after admission; a prefill-only job's blocks are freed that
    long after its first token (as if its decode instance admitted it at once)."""

    def __init__(self, c: EngineConstants) -> None:
        self.e = EngineModel("real", c)
        self.heap: list = []
        self.seq = 0
        self.epoch = 0
        self.now = 0.0

    def push(self, t: float, prio: int, ev: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, prio, self.seq, ev))

    def poke(self, now: float) -> None:
        end = self.e.poke(now)
        if end is not None:
            self.epoch += 1
            self.push(end, _STEP, ("step", self.epoch))
        for job in self.e.take_transfers():
            self.push(now + job.payload, _KV, ("kv", job))

    def end_step(self, now: float) -> None:
        out = self.e.end_step(now)
        for job in out.prefilled:
            self.push(now + job.payload, _KV, ("kv", job))

    def handle(self, now: float, ev: tuple) -> None:
        kind = ev[0]
        if kind == "step":
            self.end_step(now)
        elif kind == "kv":
            job = ev[1]
            if job.state is JobState.TRANSFER_IN:
                self.e.kv_arrived(job)
            else:
                self.e.release(job)
        else:
            self.e.submit(ev[1])
        self.poke(now)

    def _stale(self, ev: tuple) -> bool:
        return ev[0] == "step" and ev[1] != self.epoch

    def run_to_boundary(self, t_snap: float) -> float:
        """Process events until a step boundary at or after t_snap; returns its time. The engine is
        left after `end_step`, before its next `poke` (or idle)."""
        while self.heap:
            t, _, _, ev = self.heap[0]
            if self._stale(ev):
                heapq.heappop(self.heap)
                continue
            if t >= t_snap and not self.e.busy:
                return max(t_snap, self.now)
            heapq.heappop(self.heap)
            self.now = t
            if t >= t_snap and ev[0] == "step":
                self.end_step(t)
                return t
            self.handle(t, ev)
        return max(t_snap, self.now)

    def in_flight(self, now: float) -> list[tuple[Job, float]]:
        """Pending KV transfers in the order they will end, with seconds left."""
        return [(ev[1], t - now) for t, _, _, ev in sorted(self.heap) if ev[0] == "kv"]

    def drop_arrivals(self) -> None:
        self.heap = [x for x in self.heap if x[3][0] != "arrive" and not self._stale(x[3])]
        heapq.heapify(self.heap)

    def run_probe(self, probe: Job, now: float, limit: int = 1_000_000) -> tuple[float, float]:
        """Queue `probe` at the boundary `now`, run to its first token: (wait, ttft)."""
        self.e.submit(probe)
        self.poke(now)
        wait = None if probe.state is JobState.WAITING else 0.0
        for _ in range(limit):
            if probe.t_first is not None:
                return wait, probe.t_first - now
            t, _, _, ev = heapq.heappop(self.heap)
            if self._stale(ev):
                continue
            self.handle(t, ev)
            if wait is None and probe.state is not JobState.WAITING:
                wait = t - now
        raise AssertionError("probe never got its first token")


@dataclass(frozen=True)
class Case:
    seed: int
    role: str  # colocated | decode | prefill | mixed: which kinds of jobs arrive
    rate: float  # arrivals per second
    prompts: tuple[int, int]
    outputs: tuple[int, int]
    n_arrivals: int = 80
    probe_prompt: int = 300
    transfer: tuple[float, float] = (0.01, 0.3)
    engine: tuple = ()  # EngineConstants overrides as (key, value) pairs

    def constants(self) -> EngineConstants:
        return consts(**dict(self.engine))


KV_TIGHT = (("kv_capacity_tokens", 1024),)
KV_VERY_TIGHT = (("kv_capacity_tokens", 512), ("max_batched_tokens", 256))
FEW_SEQS = (("max_num_seqs", 4),)
SLOW_STEPS = (("step_base_s", 0.05), ("decode_seq_s", 0.004))
ATTENTION = (("prefill_attention_s", 2e-7),)  # a 1,500-token prompt: 0.3 s linear + 0.225 s attention

CASES = [
    # light load, short prompts: mostly no wait
    *[Case(s, "colocated", 5.0, (8, 200), (5, 60)) for s in range(3)],
    # moderate and heavy load: queues build up
    *[Case(s, "colocated", 15.0, (8, 400), (5, 100)) for s in range(3, 6)],
    *[Case(s, "colocated", 60.0, (8, 400), (5, 200)) for s in range(6, 8)],
    # long prompts: chunked prefills spanning several steps
    *[Case(s, "colocated", 2.5, (600, 3000), (5, 80), probe_prompt=1500) for s in range(8, 11)],
    # decode side fed by KV transfers (plus some local prefills)
    *[Case(s, "decode", 6.0, (16, 800), (20, 300)) for s in range(11, 14)],
    # prefill side: KV held until the hand-off ends
    *[Case(s, "prefill", 4.0, (100, 2000), (1, 1), transfer=(0.05, 0.6)) for s in range(14, 17)],
    # every kind on one engine
    *[Case(s, "mixed", 8.0, (8, 1000), (5, 200)) for s in range(17, 20)],
    # KV pressure: preemption by recompute
    *[Case(s, "colocated", 10.0, (16, 200), (50, 300), engine=KV_TIGHT) for s in range(20, 23)],
    *[Case(s, "mixed", 12.0, (16, 150), (30, 200), engine=KV_VERY_TIGHT, probe_prompt=100) for s in range(23, 26)],
    *[Case(s, "decode", 15.0, (16, 120), (50, 250), engine=KV_TIGHT, probe_prompt=64) for s in range(26, 29)],
    # slow steps: KV lands mid-step and waits for the next one (READY at the boundary)
    *[Case(s, "decode", 25.0, (16, 400), (5, 60), transfer=(0.001, 0.05), engine=SLOW_STEPS) for s in range(32, 36)],
    # the max_num_seqs cap binds
    *[Case(s, "colocated", 6.0, (8, 100), (20, 100), engine=FEW_SEQS) for s in range(29, 32)],
    # prefill time quadratic in the prompt: chunks attend to their context, partial prefills and
    # recomputes included
    *[Case(s, "colocated", 2.5, (600, 3000), (5, 80), probe_prompt=1500, engine=ATTENTION) for s in range(36, 38)],
    *[Case(s, "mixed", 8.0, (8, 1000), (5, 200), engine=ATTENTION) for s in range(38, 40)],
    *[Case(s, "mixed", 12.0, (16, 150), (30, 200), engine=KV_VERY_TIGHT + ATTENTION, probe_prompt=100)
      for s in range(40, 42)],
]


def _job(i: int, case: Case, rng: random.Random) -> Job:
    kind = case.role
    if kind == "mixed":
        kind = rng.choice(["colocated", "decode", "prefill"])
    elif kind == "decode" and rng.random() < 0.2:
        kind = "colocated"
    prompt = rng.randint(*case.prompts)
    out = rng.randint(*case.outputs)
    xfer = rng.uniform(*case.transfer)
    return Job(i, prompt, out, remote_kv=kind == "decode", prefill_only=kind == "prefill", payload=xfer)


def _probe(case: Case, rng: random.Random, kind: str) -> tuple[Job, dict]:
    xfer = rng.uniform(*case.transfer)
    job = Job("probe", case.probe_prompt, rng.randint(1, 400), remote_kv=kind == "decode",
              prefill_only=kind == "prefill", payload=xfer)
    return job, dict(remote_kv=kind == "decode", prefill_only=kind == "prefill", transfer_s=xfer)


def _real_vs_estimate(case: Case, probe_kind: str, snap_fraction: float):
    rng = random.Random(case.seed)
    c = case.constants()
    sim = OneEngine(c)
    t = 0.0
    for i in range(case.n_arrivals):
        t += rng.expovariate(case.rate)
        sim.push(t, _ARRIVAL, ("arrive", _job(i, case, rng)))
    t_snap = t * snap_fraction
    now = sim.run_to_boundary(t_snap)
    sim.drop_arrivals()
    snap = snapshot_of(sim.e, sim.in_flight(now), transfer_s=lambda j: j.payload)
    probe, kw = _probe(case, rng, probe_kind)
    est = estimate_ttft(c, snap, case.probe_prompt, now, **kw)
    wait, ttft = sim.run_probe(probe, now)
    return snap, est, wait, ttft, sim


_PROBE_KIND = {"colocated": "colocated", "decode": "decode", "prefill": "prefill", "mixed": "colocated"}


@pytest.mark.parametrize("frac", [0.3, 0.7])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c.seed}-{c.role}")
def test_estimate_equals_the_engine_model_run(case, frac):
    snap, est, wait, ttft, _ = _real_vs_estimate(case, _PROBE_KIND[case.role], frac)
    assert est.ttft_s == pytest.approx(ttft, abs=1e-9, rel=0)
    assert est.wait_s == pytest.approx(wait, abs=1e-9, rel=0)
    assert est.prefill_s == pytest.approx(ttft - wait, abs=1e-9, rel=0)


@pytest.mark.parametrize("kind", ["colocated", "decode", "prefill"])
@pytest.mark.parametrize("seed", [40, 41, 42])
def test_any_probe_kind_on_a_mixed_engine(kind, seed):
    case = Case(seed, "mixed", 250.0, (8, 600), (5, 200), engine=KV_TIGHT, probe_prompt=200)
    _, est, wait, ttft, _ = _real_vs_estimate(case, kind, 0.5)
    assert (est.ttft_s, est.wait_s) == pytest.approx((ttft, wait), abs=1e-9, rel=0)


def test_the_suite_reaches_the_interesting_states():
    """The exactness table is only as good as the states it covers: busy queues, partial
    prefills, transfers in flight and preemptions must all occur in it."""
    seen = dict(waiting=0, prefilling=0, transfers=0, landed=0, outgoing=0, preempted=0, waited=0)
    for case in CASES:
        for frac in (0.3, 0.7):
            snap, est, _, _, sim = _real_vs_estimate(case, _PROBE_KIND[case.role], frac)
            seen["waiting"] += bool(snap.waiting)
            seen["prefilling"] += any(r.prefilling for r in snap.running)
            seen["transfers"] += any(not t.outgoing and t.ends_in_s is not None for t in snap.transfers)
            seen["landed"] += any(t.ends_in_s is None for t in snap.transfers)
            seen["outgoing"] += any(t.outgoing for t in snap.transfers)
            seen["preempted"] += sim.e.preemptions > 0
            seen["waited"] += est.wait_s > 0
    assert all(v >= 3 for v in seen.values()), seen


@pytest.mark.parametrize("case", CASES[6:12] + CASES[20:26], ids=lambda c: f"s{c.seed}-{c.role}")
def test_horizon_cuts_exactly(case):
    """Below the true TTFT the run is censored; at or above it, the estimate is unchanged."""
    snap, est, _, ttft, _ = _real_vs_estimate(case, _PROBE_KIND[case.role], 0.5)
    c, kw = case.constants(), dict(remote_kv=_PROBE_KIND[case.role] == "decode",
                                  prefill_only=_PROBE_KIND[case.role] == "prefill")
    kw["transfer_s"] = 0.0
    full = estimate_ttft(c, snap, case.probe_prompt, 0.0, **kw)
    assert not full.censored
    assert estimate_ttft(c, snap, case.probe_prompt, 0.0, horizon_s=full.ttft_s, **kw) == full
    assert estimate_ttft(c, snap, case.probe_prompt, 0.0, horizon_s=full.ttft_s * 2, **kw) == full
    cut = estimate_ttft(c, snap, case.probe_prompt, 0.0, horizon_s=full.ttft_s * 0.999, **kw)
    assert cut.censored and cut.ttft_s == cut.prefill_s == float("inf")
    assert cut.steps <= full.steps
    if full.wait_s < full.ttft_s * 0.999:
        assert cut.wait_s == full.wait_s or cut.wait_s == float("inf")
    else:
        assert cut.wait_s == float("inf")


def test_horizon_zero_on_an_idle_engine_is_censored():
    est = estimate_ttft(consts(), InstanceSnapshot(), 100, horizon_s=0.0)
    assert est.censored and est.wait_s == 0.0 and est.steps == 0


def test_estimate_is_pure_and_deterministic():
    case = CASES[4]
    snap, est, _, _, _ = _real_vs_estimate(case, "colocated", 0.5)
    again = estimate_ttft(case.constants(), snap, case.probe_prompt, 0.0)
    assert again == estimate_ttft(case.constants(), snap, case.probe_prompt, 0.0)
    assert again.ttft_s == pytest.approx(est.ttft_s, abs=1e-9)  # same state, any clock origin


# --- closed forms -------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [1, 16, 100, 512, 513, 2000])
@pytest.mark.parametrize("prefill_only", [False, True])
def test_idle_engine_ttft_is_the_lone_prefill_time(prompt, prefill_only):
    c = consts()
    est = estimate_ttft(c, InstanceSnapshot(), prompt, 5.0, prefill_only=prefill_only)
    assert est.wait_s == 0.0
    assert est.ttft_s == pytest.approx(c.prefill_s(prompt), abs=1e-12)
    assert est.prefill_s == est.ttft_s
    assert est.steps == -(-prompt // c.max_batched_tokens)


@pytest.mark.parametrize("prompt", [1, 100, 512, 513, 2000])
def test_idle_engine_ttft_with_attention_is_quadratic_in_the_prompt(prompt):
    c, linear = consts(prefill_attention_s=2e-7), consts()
    est = estimate_ttft(c, InstanceSnapshot(), prompt)
    # however the prompt is chunked, its chunks attend to p²/2 (token, context token) pairs
    assert est.ttft_s == pytest.approx(linear.prefill_s(prompt) + 2e-7 * prompt * prompt / 2, abs=1e-12)
    assert est.ttft_s == pytest.approx(c.prefill_s(prompt), abs=1e-12)


def test_a_partial_prefill_ahead_attends_to_what_it_has_computed():
    c = consts(prefill_attention_s=1e-6, max_batched_tokens=64)
    snap = InstanceSnapshot(running=(RunningRequest(100, 0, 1, kv_tokens=40, prefilling=True),))
    est = estimate_ttft(c, snap, 20)
    # its last 60 tokens over 40 computed (60·70 pairs) and 4 of ours (4·2); then our last 16 over 4
    step1 = c.step_s(64, 0) + c.prefill_overhead_s + 1e-6 * (60 * 70 + 4 * 2)
    step2 = c.step_s(16, 0) + c.prefill_overhead_s + 1e-6 * 16 * (4 + 8)
    assert est.wait_s == 0.0
    assert est.ttft_s == pytest.approx(step1 + step2, abs=1e-12)


def test_idle_decode_engine_remote_kv_is_transfer_plus_one_decode_step():
    c = consts()
    est = estimate_ttft(c, InstanceSnapshot(), 300, remote_kv=True, transfer_s=0.05)
    assert est.wait_s == 0.0
    assert est.ttft_s == pytest.approx(0.05 + c.decode_token_s(1), abs=1e-12)


def test_prefill_joins_the_running_decode_batch():
    c = consts()
    snap = InstanceSnapshot(running=tuple(RunningRequest(100, 5, 50) for _ in range(6)))
    est = estimate_ttft(c, snap, 200)
    # one step: 6 decodes plus the 200-token prefill, which finishes there
    assert est.wait_s == 0.0
    assert est.ttft_s == pytest.approx(c.step_s(200, 6) + c.prefill_overhead_s, abs=1e-12)


def test_fcfs_queue_ahead_shares_the_token_budget():
    c = consts(max_batched_tokens=64)
    snap = InstanceSnapshot(waiting=(QueuedRequest(100, 10),))
    est = estimate_ttft(c, snap, 20)
    step1 = c.step_s(64, 0)  # the queued request's first chunk fills the budget
    step2 = c.step_s(36 + 20, 0) + 2 * c.prefill_overhead_s  # its last 36 tokens and all 20 of ours
    assert est.wait_s == pytest.approx(step1, abs=1e-12)
    assert est.ttft_s == pytest.approx(step1 + step2, abs=1e-12)


def test_full_batch_waits_for_the_first_finish():
    c = consts(max_num_seqs=2)
    snap = InstanceSnapshot(running=(RunningRequest(50, 3, 10), RunningRequest(50, 3, 5)))
    est = estimate_ttft(c, snap, 40)
    wait = 5 * c.decode_token_s(2)  # one macro step of 5 decodes; then a seat is free
    assert est.wait_s == pytest.approx(wait, abs=1e-12)
    assert est.ttft_s == pytest.approx(wait + c.step_s(40, 1) + c.prefill_overhead_s, abs=1e-12)


def test_remote_kv_waits_for_blocks_then_transfers():
    c = consts(kv_capacity_tokens=128)  # 8 blocks
    snap = InstanceSnapshot(running=(RunningRequest(95, 5, 3),))  # 100 tokens: 7 blocks, 1 free
    est = estimate_ttft(c, snap, 40, remote_kv=True, transfer_s=0.02)  # needs 3 blocks
    wait = 3 * c.decode_token_s(1)  # the running request's last 3 tokens free its blocks
    assert est.wait_s == pytest.approx(wait, abs=1e-12)
    assert est.ttft_s == pytest.approx(wait + 0.02 + c.decode_token_s(1), abs=1e-12)


def test_outgoing_transfer_frees_blocks_when_it_ends():
    c = consts(kv_capacity_tokens=128)
    snap = InstanceSnapshot(transfers=(KvTransfer(120, 0.3, outgoing=True),))  # 8 of 8 blocks held
    est = estimate_ttft(c, snap, 50, prefill_only=True)
    assert est.wait_s == pytest.approx(0.3, abs=1e-12)
    assert est.ttft_s == pytest.approx(0.3 + c.prefill_s(50), abs=1e-12)


def test_kv_implied_by_the_snapshot():
    snap = InstanceSnapshot(
        waiting=(QueuedRequest(1000, 5),),
        running=(RunningRequest(30, 2, 5), RunningRequest(100, 0, 1, kv_tokens=40, prefilling=True)),
        transfers=(KvTransfer(17, 0.1), KvTransfer(16, None)),
    )
    assert snap.kv_blocks(16) == 2 + 3 + 2 + 1
    assert snap.in_flight == 5


# --- bad inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [0, -5, 1.5, True, "100"])
def test_bad_prompt_names_it(prompt):
    with pytest.raises(ValueError, match="new_prompt_tokens"):
        estimate_ttft(consts(), InstanceSnapshot(), prompt)


def test_prompt_beyond_capacity_is_refused():
    with pytest.raises(ValueError, match="never fit"):
        estimate_ttft(consts(kv_capacity_tokens=256), InstanceSnapshot(), 256)


def test_snapshot_beyond_capacity_is_refused():
    snap = InstanceSnapshot(running=tuple(RunningRequest(200, 1, 5) for _ in range(3)))
    with pytest.raises(ValueError, match="KV blocks"):
        estimate_ttft(consts(kv_capacity_tokens=512), snap, 10)


@pytest.mark.parametrize("kw,match", [
    (dict(transfer_s=-0.1), "transfer_s"),
    (dict(transfer_s=float("nan")), "transfer_s"),
    (dict(remote_kv=True, prefill_only=True), "exclusive"),
    (dict(horizon_s=-1.0), "horizon_s"),
    (dict(horizon_s=float("nan")), "horizon_s"),
])
def test_bad_keywords(kw, match):
    with pytest.raises(ValueError, match=match):
        estimate_ttft(consts(), InstanceSnapshot(), 10, **kw)


def test_step_limit_raises():
    snap = InstanceSnapshot(waiting=tuple(QueuedRequest(500, 5) for _ in range(20)))
    with pytest.raises(TtftEstimateError, match="max_steps=5"):
        estimate_ttft(consts(), snap, 10, max_steps=5)


@pytest.mark.parametrize("make,match", [
    (lambda: RunningRequest(10, 2, 0), "remaining_tokens"),
    (lambda: RunningRequest(10, -1, 3), "decoded_tokens"),
    (lambda: RunningRequest(10, 0, 1, kv_tokens=10, prefilling=True), "kv_tokens"),
    (lambda: RunningRequest(10, 0, 1, prefill_only=True), "prefill_only"),
    (lambda: QueuedRequest(10, 5, remote_kv=True, generated_tokens=3), "remote_kv"),
    (lambda: QueuedRequest(10, 5, remote_kv=True, prefill_only=True), "not both"),
    (lambda: QueuedRequest(10, 5, transfer_s=-1.0), "transfer_s"),
    (lambda: KvTransfer(10, None, outgoing=True), "ends_in_s"),
    (lambda: KvTransfer(10, float("inf")), "ends_in_s"),
])
def test_bad_snapshot_records(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_snapshot_of_refuses_a_busy_engine_and_missing_transfers():
    e = EngineModel("e", consts())
    e.submit(Job("a", 100, 5))
    e.poke(0.0)
    with pytest.raises(ValueError, match="mid-step"):
        snapshot_of(e)
    d = EngineModel("d", consts())
    d.submit(Job("b", 100, 5, remote_kv=True))
    d.poke(0.0)
    moving = d.take_transfers()
    with pytest.raises(ValueError, match="1 incoming"):
        snapshot_of(d)
    snap = snapshot_of(d, [(moving[0], 0.01)])
    assert snap.transfers == (KvTransfer(100, 0.01, output_tokens=5),)


def test_a_snapshot_read_mid_step_waits_the_rest_of_the_step_in_flight():
    c = consts()
    decoding = (RunningRequest(100, 5, 40), RunningRequest(80, 3, 40))
    at_boundary = estimate_ttft(c, InstanceSnapshot(running=decoding), 64, now=2.0)
    mid = estimate_ttft(c, InstanceSnapshot(running=decoding, mid_step=True), 64, now=2.0)
    half_a_decode_step = c.step_s(0, 2) / 2  # the step in flight decodes the two running requests
    assert mid.wait_s == pytest.approx(at_boundary.wait_s + half_a_decode_step)
    assert mid.ttft_s == pytest.approx(at_boundary.ttft_s + half_a_decode_step)
    # a queued prompt is not in the step in flight (the router may have sent it a moment ago): it
    # waits for that step's end too, and alone it is planned from `now` as at a boundary
    queued = (QueuedRequest(300, 10),)
    both = estimate_ttft(c, InstanceSnapshot(waiting=queued, running=decoding, mid_step=True), 64, now=2.0)
    assert both.ttft_s == pytest.approx(
        estimate_ttft(c, InstanceSnapshot(waiting=queued, running=decoding), 64, now=2.0).ttft_s + half_a_decode_step)
    alone = estimate_ttft(c, InstanceSnapshot(waiting=queued, mid_step=True), 64)
    assert alone == estimate_ttft(c, InstanceSnapshot(waiting=queued), 64)
    # an idle instance has no step in flight
    assert estimate_ttft(c, InstanceSnapshot(mid_step=True), 64) == estimate_ttft(c, InstanceSnapshot(), 64)
