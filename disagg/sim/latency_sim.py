"""Simulator of a heterogeneous multi-model fleet, routed query by query by accuracy, cost and TTFT.

The fleet is a list of colocated instances (each `EngineModel` does a query's prefill and its
decode), each serving one model with its own calibrated constants and prices. Every query is
routed by one of the core's model-level routers (`disagg.core.model_routing`: `latency_aware`,
`accuracy_cost`, `load_balance`, built by name with λ and the accuracy table), the very objects
the live router's alias route runs, called with the same inputs (the router's snapshot of every
instance, the query, `now`).

What the router knows (`RouterSnapshots`): a live router polls each engine every
`poll_interval_s` (50 ms by default, as the P/D router), and adds the queries it has sent there
since, as queued requests. So the simulated router's snapshot is as stale as a live one's: a
request that finished since the poll still counts, decode progress is the poll's, and running
requests' remaining output is the *predicted* one. `poll_interval_s=None` gives the router the
engine's state at the decision itself (only the output predictions are then wrong). Polls are
taken lazily but exactly, as in `disagg.sim.simulator`: an engine changes only at its own events,
so its state at a tick is its state before the first event after it.

Per query the simulator records the estimated TTFT of the chosen instance at routing time (the
router's own, or — for `accuracy_cost`, which does not estimate — the estimator run on the same
snapshot for measurement only) next to the TTFT the query then got: the estimator's error in
closed loop, staleness and output-length prediction error included.

Deterministic: the same trace, fleet, router and predictor give the same records bit for bit.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Sequence

from disagg.core.cost_model import EngineConstants
from disagg.core.engine_model import EngineModel, Job
from disagg.core.latency_routing import ModelInstance
from disagg.core.model_routing import ModelRouter
from disagg.core.predictor import BucketMeanPredictor, OutputLengthPredictor
from disagg.core.ttft_estimator import (
    InstanceSnapshot,
    QueuedRequest,
    RunningRequest,
    estimate_ttft,
)
from disagg.core.types import NoCapacity, SloClass
from disagg.core.utility import ModelPrices
from disagg.sim.traces import TraceRequest

_STEP, _ARRIVAL = 0, 1  # at equal times, finish work before admitting more


# --- what the router knows of each engine --------------------------------------------------------


def _steps_done(e: EngineModel, t: float) -> int:
    """Decode steps of the (macro) step in flight already finished at `t`: a poll sees their tokens.

    Reads the engine model's step plan (start, duration, count), which it keeps for `poke`.
    """
    if not e.busy or e._k <= 1:
        return 0
    return max(0, min(e._k - 1, int((t - e._start) / e._dur + 1e-9)))


def remaining_output(predicted: int, generated: int) -> int:
    """The router's guess of a running request's remaining output: predicted − generated, but never
    below half of max(predicted, generated).

    Output lengths are long-tailed: a request that has run past (or close to) its predicted length
    is not about to end — for a lognormal of the traces' spread the mean residual length stays near
    the mean. Half of it rather than all of it, because the new query's wait is set by the *earliest*
    finishes among the batch (which free KV and slots), and those come before the means. With the
    naive `max(1, predicted − generated)` the estimator believes that every request past its
    prediction frees its KV at the next step: under load it under-estimates TTFT and the router
    over-fills the slow model. The rule was picked by measurement on a generated workload (among
    naive, "another prediction's worth" and this one), not derived; the study's estimator table
    compares it with the naive rule on the trace.
    """
    return max(1, predicted - generated, max(predicted, generated) // 2)


def naive_remaining_output(predicted: int, generated: int) -> int:
    """predicted − generated, at least one token: the estimator's error reference."""
    return max(1, predicted - generated)


def poll_snapshot(e: EngineModel, predicted: Callable[[Job], int], t: float,
                  remaining: Callable[[int, int], int] = remaining_output) -> InstanceSnapshot:
    """What a poll of a colocated engine at `t` tells the router, with output lengths as predicted.

    Queued and running requests as the engine holds them (decode progress up to the last finished
    step), each running request's remaining output `remaining(predicted, generated)`.
    """
    waiting = tuple(
        QueuedRequest(j.prompt, max(predicted(j), j.generated + 1), generated_tokens=j.generated)
        for j in e.waiting
    )
    running = [RunningRequest(j.prompt, j.generated, remaining(predicted(j), j.generated), kv_tokens=j.kvlen,
                              prefilling=True)
               for j in e.prefilling]
    done = e.step + _steps_done(e, t)
    for j in e.decoding.values():
        gen = j.gbase + done
        running.append(RunningRequest(j.prompt, gen, remaining(predicted(j), gen), kv_tokens=j.base + done))
    return InstanceSnapshot(waiting, tuple(running), mid_step=e.busy)  # a poll lands within a step


class RouterSnapshots:
    """The router's snapshot of every instance: the latest poll plus the queries sent there since."""

    def __init__(self, engines: Sequence[EngineModel], predicted: Callable[[Job], int],
                 poll_interval_s: float | None, remaining: Callable[[int, int], int] = remaining_output) -> None:
        if poll_interval_s is not None and not (poll_interval_s > 0):
            raise ValueError(f"poll_interval_s must be > 0 or None (exact state), got {poll_interval_s!r}")
        self.engines = list(engines)
        self.predicted = predicted
        self.interval = poll_interval_s
        self.remaining = remaining
        self._tick = [0] * len(engines)
        self._polled = [InstanceSnapshot() for _ in engines]
        self._sent: list[list[QueuedRequest]] = [[] for _ in engines]

    def refresh(self, i: int, now: float) -> None:
        """Take the poll of the latest tick if not taken: call before the engine's state changes at `now`."""
        if self.interval is None:
            return
        tick = int(now / self.interval + 1e-9)
        if tick != self._tick[i]:
            self._tick[i] = tick
            self._polled[i] = poll_snapshot(self.engines[i], self.predicted, tick * self.interval, self.remaining)
            self._sent[i].clear()

    def sent(self, i: int, prompt_tokens: int, predicted_output_tokens: int) -> None:
        if self.interval is not None:
            self._sent[i].append(QueuedRequest(prompt_tokens, predicted_output_tokens))

    def view(self, i: int, now: float) -> InstanceSnapshot:
        if self.interval is None:
            return poll_snapshot(self.engines[i], self.predicted, now, self.remaining)
        self.refresh(i, now)
        snap = self._polled[i]
        if not self._sent[i]:
            return snap
        return InstanceSnapshot(snap.waiting + tuple(self._sent[i]), snap.running, mid_step=True)


# --- the run -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueryRecord:
    """One query's outcome. `ttft_s` None: it could not be served (no instance holds its prompt)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    predicted_output_tokens: int
    slo_class: str
    ttft_limit_s: float
    instance_id: str | None
    model: str | None
    ttft_s: float | None
    estimated_ttft_s: float | None  # of the chosen instance at routing time (see module docstring)
    router_feasible: bool | None  # the router's own belief that the limit would be met, if it had one
    error: str | None = None

    @property
    def met_limit(self) -> bool:
        return self.ttft_s is not None and self.ttft_s <= self.ttft_limit_s


@dataclass(slots=True)
class FleetResult:
    records: list[QueryRecord]
    preemptions: int
    makespan_s: float
    queries_per_instance: dict[str, int]
    decision_us: list[float]  # wall time of each router.choose call (the whole decision, all candidates)


class _Flight:
    __slots__ = ("i", "req", "rid", "slo", "limit", "predicted", "inst", "estimate", "feasible")

    def __init__(self, i, req, rid, slo, limit, predicted, inst, estimate, feasible):
        self.i, self.req, self.rid, self.slo, self.limit = i, req, rid, slo, limit
        self.predicted, self.inst, self.estimate, self.feasible = predicted, inst, estimate, feasible


def simulate_fleet(
    trace: Sequence[TraceRequest],
    fleet: Sequence[ModelInstance],
    router: ModelRouter,
    ttft_limit_s: Callable[[TraceRequest], float],
    *,
    predictor: OutputLengthPredictor | None = None,
    poll_interval_s: float | None = 0.05,
    default_slo: SloClass = SloClass.LOOSE,
    remaining: Callable[[int, int], int] = remaining_output,
    true_outputs: bool = False,
) -> FleetResult:
    """Run the trace through the fleet, each query routed by `router` with its own TTFT limit.

    `ttft_limit_s(request)` gives a query's limit (for example its SLO class's target). The
    output-length predictor predicts at arrival and learns at the last token, as in the P/D
    simulator; the router prices cost and remaining decode work with the prediction, while the
    engines run the true output length. `remaining(predicted, generated)` is the router's guess of a
    running request's remaining output (see `remaining_output`). `true_outputs=True` tells the router
    every query's true output length instead of the prediction (an upper bound, for the estimator's
    error breakdown).
    """
    if not fleet:
        raise ValueError("the fleet has no instances")
    ids = [m.instance_id for m in fleet]
    if len(set(ids)) != len(ids):
        raise ValueError(f"instance ids must be unique, got {ids}")
    predictor = predictor or BucketMeanPredictor()
    engines = [EngineModel(m.instance_id, m.constants) for m in fleet]
    snaps = RouterSnapshots(engines, lambda j: j.payload.predicted, poll_interval_s, remaining)
    heap: list = []
    seq = 0
    epoch = [0] * len(engines)

    def push(t: float, prio: int, ev: tuple) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, prio, seq, ev))

    def poke(k: int, now: float) -> None:
        end = engines[k].poke(now)
        if end is not None:
            epoch[k] += 1
            push(end, _STEP, ("step", k, epoch[k]))

    for i, r in enumerate(trace):
        push(r.arrival_s, _ARRIVAL, ("arrive", i, r))
    records: list[QueryRecord] = []
    per_instance = dict.fromkeys(ids, 0)
    decision_us: list[float] = []
    now = 0.0
    while heap:
        now, _, _, ev = heapq.heappop(heap)
        if ev[0] == "step":
            _, k, ep = ev
            if ep != epoch[k]:
                continue
            snaps.refresh(k, now)
            out = engines[k].end_step(now)
            for job in out.finished:
                f: _Flight = job.payload
                predictor.observe(f.req.prompt_tokens, f.slo, f.req.output_tokens)
                records.append(_record(f, fleet[f.inst], job.t_first))
            poke(k, now)
            continue
        _, i, r = ev
        slo = r.slo_class or default_slo
        limit = ttft_limit_s(r)
        predicted = r.output_tokens if true_outputs else predictor.predict(r.prompt_tokens, slo)
        view = [(m, snaps.view(k, now)) for k, m in enumerate(fleet)]
        try:
            t0 = perf_counter()
            routed = router.choose(view, r.prompt_tokens, predicted, limit, now)
            decision_us.append((perf_counter() - t0) * 1e6)
        except NoCapacity as e:
            records.append(QueryRecord(f"r{i}", r.arrival_s, r.prompt_tokens, r.output_tokens, predicted, slo.value,
                                       limit, None, None, None, None, None, str(e)))
            continue
        k = routed.index
        est = routed.estimated_ttft_s
        if est is None:  # measurement only: the estimator on the snapshot the router had
            est = estimate_ttft(fleet[k].constants, view[k][1], r.prompt_tokens, now).ttft_s
        f = _Flight(i, r, f"r{i}", slo, limit, predicted, k, est, routed.feasible)
        snaps.refresh(k, now)
        engines[k].submit(Job(f.rid, r.prompt_tokens, r.output_tokens, payload=f))
        snaps.sent(k, r.prompt_tokens, predicted)
        per_instance[fleet[k].instance_id] += 1
        poke(k, now)
    records.sort(key=lambda rec: int(rec.request_id[1:]))
    return FleetResult(records, sum(e.preemptions for e in engines), now, per_instance, decision_us)


def _record(f: _Flight, inst: ModelInstance, t_first: float) -> QueryRecord:
    r = f.req
    return QueryRecord(f.rid, r.arrival_s, r.prompt_tokens, r.output_tokens, f.predicted, f.slo.value, f.limit,
                       inst.instance_id, inst.model, t_first - r.arrival_s, f.estimate, f.feasible)


# --- fleets --------------------------------------------------------------------------------------


def make_fleet(counts: Sequence[tuple[str, int]],
               models: dict[str, tuple[EngineConstants, ModelPrices]]) -> list[ModelInstance]:
    """Instances `<model>-<n>` for each (model, count), in the order given; `models[name] = (constants, prices)`."""
    fleet = []
    for name, n in counts:
        if name not in models:
            raise ValueError(f"unknown model {name!r} in the fleet; known: {', '.join(sorted(models))}")
        if n < 1:
            raise ValueError(f"model {name!r}: instance count must be >= 1, got {n}")
        c, prices = models[name]
        fleet += [ModelInstance(f"{name}-{k}", name, c, prices) for k in range(n)]
    return fleet


def parse_fleet(text: str) -> list[tuple[str, int]]:
    """'small:2,large:2' → [('small', 2), ('large', 2)]."""
    out = []
    for part in text.split(","):
        name, sep, n = part.strip().partition(":")
        if not sep or not name.strip() or not n.strip().isdigit():
            raise ValueError(f"fleet {text!r} must look like 'small:2,large:2' (model:count, comma-separated)")
        out.append((name.strip(), int(n)))
    return out


__all__ = ["FleetResult", "QueryRecord", "RouterSnapshots", "make_fleet", "naive_remaining_output", "parse_fleet",
           "poll_snapshot", "remaining_output", "simulate_fleet"]
