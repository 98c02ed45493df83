"""TTFT estimator: run one instance's continuous batching forward, from what the router knows of it.

The second routing mode ("Beyond accuracy and cost: latency-aware LLM query routing") needs, for
every candidate instance, the time a new query would wait for its first token there. This module
answers it by *simulating the serving framework*: it builds an `EngineModel` — the very class the
simulator runs for every instance, so there is one engine model, not two — in the state an
`InstanceSnapshot` describes, submits the new query at the back of its queue, and drives the model
exactly as the simulator drives an engine until the new query's first token.

Who calls, when, what holds:
- the router (or a policy in the simulator), once per candidate instance per query, with that
  instance's calibrated `EngineConstants` and the snapshot it keeps of the instance;
- pure: no I/O, no clock reads (`now` comes in), never mutates the snapshot (frozen records); the
  engine model it builds is private to the call and thrown away;
- deterministic: the same inputs give the same estimate bit for bit.

How the model is driven (the simulator's rules for one engine): step ends come before KV-transfer
ends at the same instant; after every step end and every transfer end the engine is poked and the
transfers it started are scheduled. A decode-side request whose KV arrives by transfer
(`remote_kv`) is admitted with blocks for its whole prompt and its KV lands `transfer_s` later; a
prefill-only request (a disaggregated prefill) holds its blocks for `transfer_s` after its first
token — as if the decode side admitted it at once — and then frees them. Requests of the snapshot
that finish before the new query starts free their KV as in the simulator, and KV pressure
preempts (recompute) as in the simulator.

What the estimate measures (`TtftEstimate`), all from `now`:
- `ttft_s`: the new query's first token;
- `wait_s`: until the model first admits the query — the start of the step that holds its first
  prefill chunk, or, for a `remote_kv` query, the moment its blocks are allocated and its KV
  transfer starts. It is the queue ahead of it, the wait for free KV blocks, the step token budget
  and the `max_num_seqs` cap;
- `prefill_s = ttft_s − wait_s`: its prefill chunks (and the steps they share with the batch), the
  per-prefill overhead and the first token; for a `remote_kv` query, the KV transfer plus the
  decode step that yields its first token. A preemption after admission (recompute) lands here too.

Timing: by default a snapshot describes the instance at a step boundary at `now` — no step is in
flight, and the engine's next step is planned at `now` with the new query already queued.
`snapshot_of` reads an engine model at a boundary, which is how the tests check that estimator and
simulator agree exactly. A live router does not see step boundaries: its snapshots are `mid_step`,
and the step the running requests make (an arrival cuts a macro step of decodes at the step in
flight: one decode step, or one step with a chunk of a prefill in progress) is taken as half done
at `now` — the remainder a query arriving at a random moment waits for, which a boundary would
leave out (on a busy CPU engine, a third of a short prompt's TTFT). Queued requests are not in it:
the router may have sent one a moment ago, and taking its prefill as half done under-estimates by
half a prefill (in the simulator's closed loop that cost 7 points of TTFT attainment).

The new query's own output length cannot change its first token (it only joins the decode batch
*with* its first token), so it is not an input: the model gives it one output token. Its first
token then always ends the step that yields it (a `remote_kv` query's first decode step is never
folded into a macro step), which is what lets `horizon_s` cut a run short exactly.

Speed: building the model is O(requests) (no copies of anything but small ints), and the engine's
macro steps make stretches of pure decoding O(1) per event, so an estimate at 64 requests in flight
takes tens of µs (benchmarks/ttft_estimator_speed.py).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Iterable

from disagg.core.cost_model import EngineConstants, SharedHost
from disagg.core.engine_model import EngineModel, HostShare, Job, JobState, RequestRate, prefill_part_s

DEFAULT_MAX_STEPS = 100_000


class TtftEstimateError(RuntimeError):
    """The model did not reach the new query's first token within the step limit."""


# --- the snapshot --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A request admitted to the instance and not yet running, in FCFS order.

    `output_tokens` is its (predicted) total output length. `remote_kv`: decode side, its KV
    arrives by transfer (no prefill here). `prefill_only`: a disaggregated prefill (first token,
    then its KV is held for `transfer_s` and freed). `generated_tokens` > 0 marks a preempted
    request: it recomputes prompt + those tokens locally (so it cannot be `remote_kv`).
    `transfer_s`: for `remote_kv`, admission → KV arrival; for `prefill_only`, first token → KV freed.
    """

    prompt_tokens: int
    output_tokens: int = 1
    remote_kv: bool = False
    prefill_only: bool = False
    transfer_s: float = 0.0
    generated_tokens: int = 0

    def __post_init__(self) -> None:
        if self.generated_tokens and self.remote_kv:
            raise ValueError("a preempted request (generated_tokens > 0) recomputes locally: remote_kv must be False")
        if self.remote_kv and self.prefill_only:
            raise ValueError("a request is remote_kv (decode side) or prefill_only (prefill side), not both")
        _check_transfer(self.transfer_s)


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request in the running batch, oldest admission first (the newest is preempted first).

    Decoding (the default): `decoded_tokens` generated so far, `remaining_tokens` (≥ 1) still to
    come — predicted by the router, exact in tests — and `kv_tokens` whose KV it holds (None:
    prompt + decoded, as on a decode instance fed by transfer).
    Prefilling (`prefilling=True`): a chunked prefill in progress; `kv_tokens` (None: 0) of its
    prefill target (prompt + `decoded_tokens`, the latter > 0 only when recomputing after a
    preemption) are computed; `remaining_tokens` counts its first token.
    """

    prompt_tokens: int
    decoded_tokens: int
    remaining_tokens: int
    kv_tokens: int | None = None
    prefilling: bool = False
    prefill_only: bool = False
    transfer_s: float = 0.0

    def __post_init__(self) -> None:
        if self.remaining_tokens < 1:
            raise ValueError(f"remaining_tokens must be >= 1 (clamp predictions), got {self.remaining_tokens}")
        if self.decoded_tokens < 0:
            raise ValueError(f"decoded_tokens must be >= 0, got {self.decoded_tokens}")
        if self.prefill_only and not self.prefilling:
            raise ValueError("a prefill_only request runs only while prefilling (after that its KV is a KvTransfer)")
        if self.prefilling and self.kv_tokens is not None and not (
                0 <= self.kv_tokens < self.prompt_tokens + self.decoded_tokens):
            raise ValueError(f"a prefilling request has computed 0 <= kv_tokens < prompt + decoded tokens, "
                             f"got {self.kv_tokens}")
        _check_transfer(self.transfer_s)


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """A KV transfer in flight, listed in the order the transfers end.

    Incoming (decode side): the request holds blocks for its prompt and decodes `output_tokens`
    once its KV lands, `ends_in_s` after the snapshot (None: already landed, it joins the batch at
    the next step). Outgoing (`outgoing=True`, prefill side): a finished prefill whose blocks are
    freed when the transfer ends.
    """

    prompt_tokens: int
    ends_in_s: float | None
    outgoing: bool = False
    output_tokens: int = 1

    def __post_init__(self) -> None:
        if self.ends_in_s is None:
            if self.outgoing:
                raise ValueError("an outgoing transfer needs ends_in_s (when its blocks are freed)")
        else:
            _check_transfer(self.ends_in_s, "ends_in_s")


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """One instance's state as the router knows it, at a step boundary (see the module docstring).

    KV use is implied: a request holds ceil(tokens / block_size) blocks for the tokens whose KV it
    holds (queued requests none; incoming and outgoing transfers their prompt).
    """

    waiting: tuple[QueuedRequest, ...] = ()
    running: tuple[RunningRequest, ...] = ()
    transfers: tuple[KvTransfer, ...] = ()
    # read at a random moment of the engine's steps (a router's view), not at a step boundary: the
    # step the running requests make is taken as half done, and the queued ones wait for its end
    # (`EngineModel.mid_step`)
    mid_step: bool = False

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.transfers)

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks held, as the engine model counts them."""
        total = 0
        for r in self.running:
            kv = r.kv_tokens if r.kv_tokens is not None else (0 if r.prefilling else r.prompt_tokens + r.decoded_tokens)
            total += -(-kv // block_size)
        for t in self.transfers:
            total += -(-t.prompt_tokens // block_size)
        return total


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """Seconds from `now`: ttft_s = wait_s + prefill_s (see the module docstring for each term)."""

    wait_s: float
    prefill_s: float
    ttft_s: float
    steps: int  # events the model processed (step ends and transfer ends): the estimate's own cost

    @property
    def censored(self) -> bool:
        """True when the run stopped at its horizon: the first token comes later than that."""
        return math.isinf(self.ttft_s)


def _check_transfer(value: float, name: str = "transfer_s") -> None:
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


# --- the estimate --------------------------------------------------------------------------------

_PROBE = object()  # the new query's rid: unique, never equal to a snapshot rid
_ESTIMATED = "ttft-estimate"  # the estimated instance's name on the host it shares (`_build`)


def _build(c: EngineConstants, snap: InstanceSnapshot, now: float,
           share: HostShare | None = None) -> tuple[EngineModel, list]:
    """An engine model in the snapshot's state at `now`, plus its heap of transfer ends.

    Jobs are placed in the engine's own queues as the engine itself leaves them at a step boundary;
    decoding jobs join through the engine's `_join`, so their step bookkeeping is the engine's.
    A job's `payload` is its transfer time (the model never reads payloads).
    """
    e = EngineModel(_ESTIMATED, c, share)
    bs = e.bs
    used = 0
    rid = 0
    # read mid-step, the queued requests wait for the step in flight, which the running ones make
    waiting = [] if snap.mid_step else e.waiting
    for q in snap.waiting:
        j = Job(rid, q.prompt_tokens, q.output_tokens, remote_kv=q.remote_kv, prefill_only=q.prefill_only,
                payload=q.transfer_s)
        g = q.generated_tokens
        if g:
            j.generated = g
            j.prefill_goal = q.prompt_tokens + g
        waiting.append(j)
        rid += 1
    prefilling, join, PREFILLING = e.prefilling, e._join, JobState.PREFILLING
    for r in snap.running:
        p, d, kv = r.prompt_tokens, r.decoded_tokens, r.kv_tokens
        if r.prefilling:
            j = Job(rid, p, d + r.remaining_tokens, prefill_only=r.prefill_only, payload=r.transfer_s)
            if kv is None:
                kv = 0
            j.generated = d
            j.prefill_goal = p + d
            j.computed = j.kvlen = kv
            j.state = PREFILLING
            prefilling.append(j)
        else:  # the hot path: most requests in flight are decoding
            j = Job(rid, p, d + r.remaining_tokens)
            if kv is None:
                kv = p + d
            j.kvlen = kv
            j.t_first = now  # it has had its first token: keep it off the engine's first-token list
            join(j, d)
        rid += 1
        j.blocks = b = -(-kv // bs)
        used += b
    events: list = []
    seq = 0
    for t in snap.transfers:
        if t.outgoing:
            j = Job(rid, t.prompt_tokens, 1, prefill_only=True)
            j.generated = 1
            j.state = JobState.HOLDING
            e.holding += 1
        else:
            j = Job(rid, t.prompt_tokens, t.output_tokens, remote_kv=True)
            if t.ends_in_s is None:
                j.state = JobState.READY
                e.ready.append(j)
            else:
                j.state = JobState.TRANSFER_IN
                e.transferring += 1
        rid += 1
        j.kvlen = j.computed = t.prompt_tokens
        j.blocks = b = -(-t.prompt_tokens // bs)
        used += b
        if t.ends_in_s is not None:
            seq += 1
            events.append((now + t.ends_in_s, seq, j))  # ties end in snapshot order (seq)
    if used > e.total_blocks:
        raise ValueError(f"the snapshot holds {used} KV blocks; the instance has {e.total_blocks} "
                         f"({c.kv_capacity_tokens} tokens / block_size {bs})")
    e.free_blocks = e.total_blocks - used
    heapq.heapify(events)
    if snap.mid_step:
        e.mid_step(now)
        e.waiting.extend(waiting)
    return e, events


def estimate_ttft(
    constants: EngineConstants,
    snapshot: InstanceSnapshot,
    new_prompt_tokens: int,
    now: float = 0.0,
    *,
    remote_kv: bool = False,
    prefill_only: bool = False,
    transfer_s: float = 0.0,
    horizon_s: float | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    host: HostShare | None = None,
) -> TtftEstimate:
    """The new query's TTFT on the instance `snapshot` describes, if it were queued there at `now`.

    `remote_kv`: the query's KV comes from a prefill instance and lands `transfer_s` after this
    (decode) instance admits it. `prefill_only`: the instance is its prefill instance (TTFT is the
    first token there). Neither: a colocated prefill + decode.

    `horizon_s` bounds the work: once the model's clock would pass `now + horizon_s` without the
    first token, it stops and returns a censored estimate (`ttft_s = prefill_s = inf`; `wait_s` is
    inf too unless the query was already admitted). A router that only needs to know whether a
    candidate meets a TTFT limit passes the limit; an estimate that is not censored is exactly
    the one without a horizon.

    `host`: the instance shares its host with other engines (`CostModel.shared_host`): what
    `peer_share` makes of the other instances' snapshots, each busy until its own work drains; each
    of this instance's steps runs at the stretch they and it give as it is planned. The estimate copies
    it, so one share serves every estimate of a decision.

    Raises ValueError for a query this instance can never hold (or a snapshot beyond its KV
    cache), and TtftEstimateError when `max_steps` events pass without the first token (a snapshot
    whose requests can never all fit cycles through preemptions forever).
    """
    if isinstance(new_prompt_tokens, bool) or not isinstance(new_prompt_tokens, int) or new_prompt_tokens < 1:
        raise ValueError(f"new_prompt_tokens must be an integer >= 1, got {new_prompt_tokens!r}")
    if remote_kv and prefill_only:
        raise ValueError("remote_kv and prefill_only are exclusive (decode side vs prefill side)")
    _check_transfer(transfer_s)
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now!r}")
    if horizon_s is not None and not (horizon_s >= 0.0):
        raise ValueError(f"horizon_s must be >= 0 or None, got {horizon_s!r}")
    until = math.inf if horizon_s is None else now + horizon_s
    e, events = _build(constants, snapshot, now, None if host is None else host.copy())
    if not e.can_ever_fit(new_prompt_tokens):
        raise ValueError(f"new_prompt_tokens={new_prompt_tokens} can never fit this instance's KV cache "
                         f"({constants.kv_capacity_tokens} tokens)")
    probe = Job(_PROBE, new_prompt_tokens, 1, remote_kv=remote_kv, prefill_only=prefill_only, payload=transfer_s)
    e.submit(probe)
    seq = len(events)
    push, pop = heapq.heappush, heapq.heappop
    WAITING, TRANSFER_IN = JobState.WAITING, JobState.TRANSFER_IN

    t = now
    e.poke(t)
    for j in e.take_transfers():
        seq += 1
        push(events, (t + j.payload, seq, j))
    wait = None if probe.state is WAITING else 0.0
    for n in range(1, max_steps + 1):
        if e.busy and (not events or e.step_end <= events[0][0]):
            t = e.step_end
            if t > until:  # the first token, at a step end, would come after the horizon
                return TtftEstimate(math.inf if wait is None else wait, math.inf, math.inf, n - 1)
            out = e.end_step(t)
            if probe.t_first is not None:
                ttft = probe.t_first - now
                return TtftEstimate(wait, ttft - wait, ttft, n)
            for j in out.prefilled:  # prefill side: the hand-off frees the blocks transfer_s later
                seq += 1
                push(events, (t + j.payload, seq, j))
        elif events:
            if events[0][0] > until:
                return TtftEstimate(math.inf if wait is None else wait, math.inf, math.inf, n - 1)
            t, _, j = pop(events)
            if j.state is TRANSFER_IN:
                e.kv_arrived(j)
            else:
                e.release(j)
        else:  # pragma: no cover - the engine model always makes progress on a queued job
            raise TtftEstimateError("the engine model went idle with the new query unserved")
        e.poke(t)
        for j in e.take_transfers():
            seq += 1
            push(events, (t + j.payload, seq, j))
        if wait is None and probe.state is not WAITING:
            wait = t - now
    raise TtftEstimateError(
        f"no first token for the new query within max_steps={max_steps} events "
        f"(snapshot of {snapshot.in_flight} requests; can they all fit {constants.kv_capacity_tokens} KV tokens?)"
    )


def drain_s(constants: EngineConstants, snapshot: InstanceSnapshot, max_steps: int = DEFAULT_MAX_STEPS) -> float:
    """Seconds until the instance `snapshot` describes has nothing left to do, run alone by the
    engine model with nothing new arriving: its queue prefilled, its batch decoded (to the
    predicted lengths), its KV transfers ended. 0 for an idle instance."""
    if not snapshot.in_flight:
        return 0.0
    e, events = _build(constants, snapshot, 0.0)
    seq = len(events)
    push, pop = heapq.heappush, heapq.heappop
    t = 0.0
    for _ in range(max_steps):
        e.poke(t)
        for j in e.take_transfers():
            seq += 1
            push(events, (t + j.payload, seq, j))
        if e.busy and (not events or e.step_end <= events[0][0]):
            t = e.step_end
            for j in e.end_step(t).prefilled:
                seq += 1
                push(events, (t + j.payload, seq, j))
        elif events:
            t, _, j = pop(events)
            if j.state is JobState.TRANSFER_IN:
                e.kv_arrived(j)
            else:
                e.release(j)
        else:
            return t
    raise TtftEstimateError(f"the snapshot of {snapshot.in_flight} requests did not drain within {max_steps} events")


def peer_share(host: SharedHost, peers: Iterable[tuple[EngineConstants, InstanceSnapshot]],
               requests: RequestRate | None = None, now: float = 0.0) -> HostShare:
    """The share of `host` that the given other instances take from `now` on: an instance with
    requests in flight is busy until its snapshot's work drains (`drain_s`, stretched as a step
    planned beside them all and the estimated instance would be; new arrivals are not foreseen, as
    for the estimated instance itself), and its decoding batch streams a token per sequence every
    decode step (the serving path's CPU follows its steps and the messages they make). `requests`:
    the rate requests arrive at the host (its serving path's per-request CPU), as the caller has
    seen it; none if omitted."""
    return _share_of(host, [(c, snap, drain_s(c, snap)) for c, snap in peers], requests, now)


def peer_shares(host: SharedHost, instances: list[tuple[EngineConstants, InstanceSnapshot]],
                requests: RequestRate | None = None, now: float = 0.0) -> list[HostShare]:
    """For each of `instances` on one host, the `peer_share` of all the others: one decision's
    shares, each instance's drain run once."""
    drained = [(c, snap, drain_s(c, snap)) for c, snap in instances]
    return [_share_of(host, drained[:i] + drained[i + 1:], requests, now) for i in range(len(drained))]


def _share_of(host: SharedHost, peers: list[tuple[EngineConstants, InstanceSnapshot, float]],
              requests: RequestRate | None, now: float) -> HostShare:
    share = HostShare(host, None if requests is None else requests.copy())
    busy = []
    for k, (c, snap, seconds) in enumerate(peers):
        if snap.in_flight:
            decoding = sum(not r.prefilling for r in snap.running)
            chunk = min(_prefill_left(snap), max(0, c.max_batched_tokens - decoding))
            step = c.step_s(chunk, decoding)  # its next step: its prefill weighs its share of the host
            share.step(f"peer-{k}", decoding, step, now, prefill_part_s(c, step, decoding) if chunk else 0.0)
            busy.append((f"peer-{k}", seconds))
    if busy:
        share.step(_ESTIMATED, 0, 1.0, now, 1.0)  # the estimated instance prefills beside them
        stretch = share.stretch_at(now)
        share.idle(_ESTIMATED)
        for peer, seconds in busy:
            share.release_at(peer, now + seconds * stretch)
    return share


def _prefill_left(snap: InstanceSnapshot) -> int:
    """Prompt tokens the snapshot has still to prefill: running prefills' rest and the queue's prompts."""
    left = sum(r.prompt_tokens + r.decoded_tokens - (r.kv_tokens or 0) for r in snap.running if r.prefilling)
    return left + sum(q.prompt_tokens + q.generated_tokens for q in snap.waiting if not q.remote_kv)


# --- reading an engine model ---------------------------------------------------------------------


def snapshot_of(
    engine: EngineModel,
    transfers: Iterable[tuple[Job, float]] = (),
    transfer_s: float | Callable[[Job], float] = 0.0,
) -> InstanceSnapshot:
    """The snapshot of an engine model at a step boundary (after `end_step`, before the next `poke`,
    or while it is idle), with true output lengths.

    The engine does not track KV transfers in flight: pass them as `transfers`, (job, seconds until
    the transfer ends) in the order they end — every TRANSFER_IN job (decode side) and every
    HOLDING job (prefill side). `transfer_s` gives the transfer time of queued and running
    remote-KV / prefill-only jobs (a number, or a function of the job). Raises ValueError when the
    engine is mid-step or its KV accounting disagrees with the snapshot's.
    """
    if engine.busy:
        raise ValueError(f"engine {engine.instance_id!r} is mid-step: snapshot at a step boundary "
                         "(after end_step, before poke)")
    if engine._transfers:
        raise ValueError(f"engine {engine.instance_id!r} has undrained transfers: call take_transfers() first")
    xfer = transfer_s if callable(transfer_s) else (lambda job, v=float(transfer_s): v)
    waiting = []
    for j in engine.waiting:
        if j.computed or j.prefill_goal != j.prompt + j.generated:
            raise ValueError(f"job {j.rid!r}: waiting with inconsistent progress")
        local = j.prefill_only or j.remote_kv
        waiting.append(QueuedRequest(j.prompt, j.target, remote_kv=j.remote_kv, prefill_only=j.prefill_only,
                                     transfer_s=xfer(j) if local else 0.0, generated_tokens=j.generated))
    running = []
    for j in engine.prefilling:
        if j.prefill_goal != j.prompt + j.generated:
            raise ValueError(f"job {j.rid!r}: prefill target {j.prefill_goal} != prompt + generated")
        running.append(RunningRequest(j.prompt, j.generated, j.target - j.generated, kv_tokens=j.kvlen,
                                      prefilling=True, prefill_only=j.prefill_only,
                                      transfer_s=xfer(j) if j.prefill_only else 0.0))
    step = engine.step
    for j in engine.decoding.values():
        gen = j.gbase + step
        running.append(RunningRequest(j.prompt, gen, j.target - gen, kv_tokens=j.base + step))
    moving = [KvTransfer(j.prompt, None, output_tokens=j.target) for j in engine.ready]
    n_in = n_out = 0
    for j, left in transfers:
        if j.state is JobState.TRANSFER_IN:
            n_in += 1
            moving.append(KvTransfer(j.prompt, left, output_tokens=j.target))
        elif j.state is JobState.HOLDING:
            n_out += 1
            moving.append(KvTransfer(j.prompt, left, outgoing=True))
        else:
            raise ValueError(f"job {j.rid!r} is {j.state.name}, not a KV transfer in flight")
    if (n_in, n_out) != (engine.transferring, engine.holding):
        raise ValueError(f"engine {engine.instance_id!r} has {engine.transferring} incoming and {engine.holding} "
                         f"outgoing transfers in flight; {n_in} and {n_out} were given")
    snap = InstanceSnapshot(tuple(waiting), tuple(running), tuple(moving))
    held = engine.total_blocks - engine.free_blocks
    if snap.kv_blocks(engine.bs) != held:
        raise ValueError(f"engine {engine.instance_id!r} holds {held} KV blocks; its snapshot implies "
                         f"{snap.kv_blocks(engine.bs)}")
    return snap
