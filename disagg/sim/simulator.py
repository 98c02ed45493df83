"""Discrete-event simulator of disaggregated serving, running the live router's policy code.

One event heap of `(time, priority, seq, event)`: `seq` breaks ties deterministically, so the same
inputs and seed give the same result bit for bit. Every instance is an `EngineModel` with its own
calibrated constants. The router side is the same code the live router runs: the policy object,
the `Ledger` (admit at routing, prefill_done when the KV has left the prefill instance, finish at
the last token) and the output-length predictor (predict at admission, observe at finish).
The router sees engine KV use through a poll every `poll_interval_s` (50 ms by default, as in the
paper), so its view is as stale as a live router's. Polls are taken lazily but exactly: an
engine's state only changes at its own events, so the state at the latest poll tick is the state
just before the first event after that tick; the simulator snapshots it then (and on each
decision), which gives the same views as polling every tick at a fraction of the cost.

A request's life: arrival → policy → prefill-only job on the prefill instance → first token there →
on the decode instance, admission (blocks for the prompt) → KV transfer (calibrated latency +
tokens / bandwidth) → the prefill instance frees its blocks → decode → last token. TTFT is the
first token the *client* sees, produced by the decode instance's first step (as in vLLM's
disaggregated flow). A colocated decision runs prefill and decode on the decode instance.
A prompt no instance can ever hold is rejected (`NoCapacity`) and counted as a failure.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from disagg.core.cost_model import CostModel
from disagg.core.engine_model import EngineModel, Job
from disagg.core.ledger import Ledger, PolledState, admission_work
from disagg.core.policies import Policy
from disagg.core.predictor import BucketMeanPredictor, OutputLengthPredictor
from disagg.core.types import InstanceView, NoCapacity, RequestFeatures, Role, SloClass
from disagg.sim.metrics import RequestRecord
from disagg.sim.traces import TraceRequest

# event priorities at equal times: finish work before admitting more
_STEP, _TRANSFER, _ARRIVAL = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Topology:
    prefill: int
    decode: int

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """'2P4D' → 2 prefill, 4 decode instances."""
        t = text.strip().upper()
        try:
            p, rest = t.split("P", 1)
            d = rest.rstrip("D") if rest.endswith("D") else None
            topo = cls(int(p), int(d)) if d is not None else None
        except ValueError:
            topo = None
        if topo is None or topo.prefill < 0 or topo.decode < 1:
            raise ValueError(f"topology {text!r} must look like '2P4D' (prefill count ≥ 0, decode count ≥ 1)")
        return topo

    def prefill_ids(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.prefill)]

    def decode_ids(self) -> list[str]:
        return [f"decode-{i}" for i in range(self.decode)]

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(slots=True)
class _Flight:
    """Router-side bookkeeping of one request in the simulation."""

    req: TraceRequest
    rid: str
    slo: SloClass
    predicted: int
    prefill_id: str
    decode_id: str
    prefill_job: Job | None = None
    decode_job: Job | None = None
    t_first: float | None = None


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    decision_us: list[float]
    instance_tokens: dict[str, int]
    sim_wall_s: float
    preemptions: int
    makespan_s: float
    extra: dict = field(default_factory=dict)


class Simulator:
    def __init__(
        self,
        cost_model: CostModel,
        topology: Topology,
        policy: Policy,
        predictor: OutputLengthPredictor | None = None,
        poll_interval_s: float = 0.05,
        record_decision_time: bool = True,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self.cm = cost_model
        self.topology = topology
        self.policy = policy
        self.predictor = predictor or BucketMeanPredictor()
        self.poll_interval_s = poll_interval_s
        self.record_decision_time = record_decision_time
        self.engines: dict[str, EngineModel] = {}
        self.roles: dict[str, Role] = {}
        for iid in topology.prefill_ids():
            self.engines[iid] = EngineModel(iid, cost_model.for_instance(iid))
            self.roles[iid] = Role.PREFILL
        for iid in topology.decode_ids():
            self.engines[iid] = EngineModel(iid, cost_model.for_instance(iid))
            self.roles[iid] = Role.DECODE
        self.prefill_ids = topology.prefill_ids()
        self.decode_ids = topology.decode_ids()
        self.ledger = Ledger()
        self._polled = {iid: self._poll_one(e) for iid, e in self.engines.items()}
        self._tick_seen = dict.fromkeys(self.engines, 0)
        self._polled_version = {iid: e.version for iid, e in self.engines.items()}
        self._heap: list = []
        self._seq = 0
        self._step_epoch: dict[str, int] = {iid: 0 for iid in self.engines}

    # --- event heap ----------------------------------------------------------------------------

    def _push(self, t: float, prio: int, event: tuple) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, prio, self._seq, event))

    def _schedule_step(self, iid: str, end: float | None) -> None:
        if end is None:
            return
        self._step_epoch[iid] += 1
        self._push(end, _STEP, ("step", iid, self._step_epoch[iid]))

    def _refresh(self, iid: str, now: float) -> None:
        """Take the poll of the latest tick if it has not been taken: call before touching an engine."""
        tick = int(now / self.poll_interval_s)
        if tick != self._tick_seen[iid]:
            self._tick_seen[iid] = tick
            e = self.engines[iid]
            if e.version != self._polled_version[iid]:  # unchanged engine: same snapshot
                self._polled_version[iid] = e.version
                self._polled[iid] = self._poll_one(e)
            self.ledger.polled(iid)

    def _poke(self, iid: str, now: float) -> None:
        engine = self.engines[iid]
        self._schedule_step(iid, engine.poke(now))
        for job in engine.take_transfers():
            f: _Flight = job.payload
            xfer = self.cm.transfer_s(f.prefill_id, f.decode_id, f.req.prompt_tokens)
            self._push(now + xfer, _TRANSFER, ("kv", f))

    @staticmethod
    def _poll_one(e: EngineModel) -> PolledState:
        return PolledState(e.kv_used_tokens, e.c.kv_capacity_tokens, e.running, e.num_waiting)

    def _views(self, ids: Sequence[str], now: float) -> list[InstanceView]:
        tick, seen = int(now / self.poll_interval_s), self._tick_seen
        for i in ids:
            if seen[i] != tick:
                self._refresh(i, now)
        led, pol, roles = self.ledger, self._polled, self.roles
        return [led.view(i, roles[i], pol[i]) for i in ids]

    # --- the run -------------------------------------------------------------------------------

    def run(self, trace: Sequence[TraceRequest], default_slo: SloClass = SloClass.LOOSE,
            progress: Callable[[int], None] | None = None) -> SimResult:
        wall0 = time.perf_counter()
        records: list[RequestRecord] = []
        decision_us: list[float] = []
        instance_tokens = dict.fromkeys(self.engines, 0)
        for i, r in enumerate(trace):
            self._push(r.arrival_s, _ARRIVAL, ("arrive", i, r))
        now = 0.0
        perf = time.perf_counter
        heap = self._heap
        while heap:
            now, _, _, ev = heapq.heappop(heap)
            kind = ev[0]
            if kind == "step":
                _, iid, epoch = ev
                if epoch != self._step_epoch[iid]:
                    continue
                engine = self.engines[iid]
                self._refresh(iid, now)
                out = engine.end_step(now)
                for job in out.prefilled:
                    f: _Flight = job.payload
                    dj = Job(f.rid, f.req.prompt_tokens, f.req.output_tokens, remote_kv=True, payload=f)
                    f.decode_job = dj
                    self._refresh(f.decode_id, now)
                    self.engines[f.decode_id].submit(dj)
                    self._poke(f.decode_id, now)
                for job in out.finished:
                    f = job.payload
                    self.ledger.finish(f.rid)
                    self.predictor.observe(f.req.prompt_tokens, f.slo, f.req.output_tokens)
                    instance_tokens[f.decode_id] += f.req.output_tokens
                    if f.prefill_id != f.decode_id:
                        instance_tokens[f.prefill_id] += f.req.prompt_tokens
                    else:
                        instance_tokens[f.decode_id] += f.req.prompt_tokens
                    records.append(self._record(f, job, now))
                    if progress:
                        progress(1)
                self._poke(iid, now)
            elif kind == "kv":
                f = ev[1]
                self._refresh(f.prefill_id, now)
                self._refresh(f.decode_id, now)
                self.engines[f.prefill_id].release(f.prefill_job)
                self.ledger.prefill_done(f.rid)
                self.engines[f.decode_id].kv_arrived(f.decode_job)
                self._poke(f.decode_id, now)
                self._poke(f.prefill_id, now)
            else:  # arrival
                _, i, r = ev
                slo = r.slo_class or default_slo
                predicted = self.predictor.predict(r.prompt_tokens, slo)
                feats = RequestFeatures(f"r{i}", r.prompt_tokens, predicted, slo, r.output_tokens)
                pv, dv = self._views(self.prefill_ids, now), self._views(self.decode_ids, now)
                try:
                    if self.record_decision_time:
                        t0 = perf()
                        d = self.policy.choose(feats, pv, dv, now)
                        decision_us.append((perf() - t0) * 1e6)
                    else:
                        d = self.policy.choose(feats, pv, dv, now)
                except NoCapacity as e:
                    records.append(RequestRecord.failure(f"r{i}", r, slo, now, str(e)))
                    if progress:
                        progress(1)
                    continue
                f = _Flight(r, f"r{i}", slo, predicted, d.prefill_id, d.decode_id)
                self._admit(f, now)
        return SimResult(
            records=records,
            decision_us=decision_us,
            instance_tokens=instance_tokens,
            sim_wall_s=time.perf_counter() - wall0,
            preemptions=sum(e.preemptions for e in self.engines.values()),
            makespan_s=now,
        )

    def _admit(self, f: _Flight, now: float) -> None:
        r = f.req
        # priced with the router's constants (which the miscalibration study makes wrong)
        prefill_work, decode_work = admission_work(self.policy.cost_model, f.prefill_id, f.decode_id, r.prompt_tokens,
                                                   f.predicted, self.ledger.queued(f.decode_id))
        self.ledger.admit(f.rid, f.prefill_id, f.decode_id, prefill_work, decode_work, r.prompt_tokens)
        if f.prefill_id == f.decode_id:
            job = Job(f.rid, r.prompt_tokens, r.output_tokens, payload=f)
            f.decode_job = job
            self.engines[f.decode_id].submit(job)
            self._poke(f.decode_id, now)
        else:
            job = Job(f.rid, r.prompt_tokens, 1, prefill_only=True, payload=f)
            f.prefill_job = job
            self.engines[f.prefill_id].submit(job)
            self._poke(f.prefill_id, now)

    def _record(self, f: _Flight, job: Job, now: float) -> RequestRecord:
        target = self.cm.target(f.slo)
        # the serving path outside the engines, as a fixed delay of the response stream
        late = self.cm.serving_overhead_s
        return RequestRecord.served(
            f.rid, f.req, f.slo, f.prefill_id, f.decode_id, f.predicted,
            t_first=job.t_first + late, t_last=now + late, ttft_target_s=target.ttft_s, tpot_target_s=target.tpot_s,
            preemptions=job.preemptions,
        )
