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
the prefill call's reply and the decode call (`handoff_overhead_s`, at the host's stretch) → on the
decode instance, admission (blocks for the prompt) → KV transfer (calibrated latency + tokens /
bandwidth; with `between_prefill_steps`, as NIXL without a progress thread moves it on CPU, a
transfer due while the prefill instance runs a step ends with that step) → the prefill instance
frees its blocks → decode → last token. TTFT is the first token the *client* sees, produced by the
decode instance's first step (as in vLLM's disaggregated flow), plus the serving path's time
outside the engines (`serving_overhead_s`, at the host's stretch when the request came). A
colocated decision runs prefill and decode on the decode instance; a hosted one (`Policy.may_host`)
runs both on the prefill instance, whose ledger view then counts only the request's prefill as
queue, until its first token (`StepOutcome.started`).
A prompt no instance can ever hold is rejected (`NoCapacity`) and counted as a failure.

Several router replicas (`routers=K`, default 1): arrivals go to the routers in turn (as Serve's
proxy spreads requests). Each router has its own `Ledger`, its own policy object
(`Policy.for_replica(k)`: same parameters, its own tie-break seed) and its own output-length
predictor (a copy of the given one, learning only from the requests that router served). Each
engine keeps a ledger of the calls it has *received*, per router, with the work the router priced
at admission (`AdmittedWork`, the live engines' class): the prefill instance counts a request's
prefill work from the prefill call's arrival (the decision: the simulator has no network delay)
until the prefill returns (its first token);
the decode instance counts the decode work from the decode call's arrival (when the prefill has
returned: the router then calls the decode, which pulls the KV) until the last token. A colocated
request's call reaches its decode instance at the decision and counts both parts until its last
token (as the router's own ledger does here). Every router polls every engine every
`poll_interval_s`, router k at phase k/K of the interval (replicas do not poll in step), and its
poll of an instance carries the other routers' received totals (`PolledState.others_backlog_s`,
`others_queued`), which `Ledger.view` adds to the router's own live ledger. So router k sees its
own admissions at once, and the others' only once they have reached the instance and k has polled
since. Polls stay lazy and exact: engine state and received ledgers change only at that engine's
events, before each of which every router's pending poll of it is taken. With K = 1 the run is
the single-router run, decision for decision. `others_totals=False` is the ablation without the
engine ledgers: routers see each other only through the polled KV use.

State by push (`push_s`, off by default), as the live engines now send it
(`serve_app.state_push`): instead of polls, every change of an engine's state (KV use, the
received-call totals) is a version that every router sees `push_s` after it happened (the
engines coalesce changes over 5 ms and the stream takes its share), and a router's own admissions
count until its view of the instance is a newer version. Lazy and exact like the polls: a version
is published at the first touch of the engine after its change, stamped with the change's time.
(The live engines make a version only when a routing signal moves: KV use by 1/64 of the cache,
and a prefill's work leaving at its first token with the next change; here each is one at once.)

Peer notices (`peer_notify_s`, off by default): each router also tells the others of every call it
sends (prefill, decode, or colocated: instance and priced work) at once; a notice is visible to a
peer `peer_notify_s` later and counts in its view of that instance until the peer's next poll of
it, whose totals then include the call. This closes the gap the polls leave — the calls sent since
the last poll — which is what costs goodput with 50 ms polls (docs/multi-router.md).

Output lengths: the router predicts each request's from the predictor, as production requests
carry none; with `known_output` it takes the trace's, as the live router does for the bench's
requests (`ignore_eos` with `max_tokens` = that length, so it predicts `max_tokens`): a simulation
of a bench run sees what the live router saw.

Prefix caches (`PrefixCache`, one per instance): only requests that carry prefix-block hashes
(`TraceRequest.prefix_hashes`) use them; a request without hashes runs exactly as if they did not
exist. When a request's prefill is admitted to an instance, the leading blocks of its prompt cached
there are not computed again (the job starts with their KV; the last prompt token is always
computed, as in vLLM); when the prefill ends its full blocks are cached there, and when its KV has
reached the decode instance, there too. The KV transfer moves only the tokens of the blocks the
decode instance does not already hold. Policies see the caches through
`InstanceView.cached_prefix_blocks` — the engines' true, current caches (as a router fed by the
engines' KV-cache events would), side-effect free.

Pool widths that change (`scaler`, off by default; disagg.sim.autoscaling): the topology is then
the most instances each pool may have. The scaler's initial widths serve from 0, the others are
off; every `scaler.interval_s` the scaler is shown the fleet and what the router saw, and its
widths are applied: a started instance serves `startup_s` later, a drained one leaves the routing
at once and is released when it holds no request. The router's policy sees only the instances
that serve. The scaler's evaluations and the start-ups are merged into the run beside the event
heap, like the arrivals, and never keep it going: the run ends with its last request. Without a
scaler nothing of this runs, and results are what they were.
"""

from __future__ import annotations

import copy
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from disagg.core.cost_model import CostModel, SloTarget
from disagg.core.engine_model import EngineModel, HostShare, Job
from disagg.core.ledger import AdmittedWork, Ledger, PolledState, admission_work, others
from disagg.core.policies import Policy
from disagg.core.predictor import BucketMeanPredictor, OutputLengthPredictor
from disagg.core.planner import Widths
from disagg.core.types import PREFIX_BLOCK_TOKENS, InstanceView, NoCapacity, RequestFeatures, Role, SloClass
from disagg.sim.autoscaling import POOLS, Fleet, FleetState, Scaler, Signals, Started, width_of
from disagg.sim.metrics import RequestRecord
from disagg.core.prefix_cache import PrefixCache
from disagg.sim.traces import TraceRequest

# event priorities at equal times: finish work before admitting more
_STEP, _TRANSFER, _ARRIVAL = 0, 1, 2
# control events (merged in before engine events and arrivals at equal times): an instance that
# is ready serves before the scaler looks at the fleet
_READY, _TICK = 0, 1


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
    router: int = 0
    prefill_work_s: float = 0.0  # priced at admission; the calls carry it to the engines' ledgers
    decode_work_s: float = 0.0
    call_work_s: float = 0.0  # what the call serving its last token carries to that engine's ledger
    call_prefill_s: float = 0.0  # and the prefill it makes there (colocated, hosted): held to its first token
    outside_s: float = 0.0  # its time outside the engines (the serving path), by the host's load at arrival


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    decision_us: list[float]
    instance_tokens: dict[str, int]
    sim_wall_s: float
    preemptions: int
    makespan_s: float
    extra: dict = field(default_factory=dict)
    sim_cpu_s: float = 0.0  # CPU time of the run (its wall time counts other processes' too)


class Simulator:
    def __init__(
        self,
        cost_model: CostModel,
        topology: Topology,
        policy: Policy,
        predictor: OutputLengthPredictor | None = None,
        poll_interval_s: float = 0.05,
        record_decision_time: bool = True,
        routers: int = 1,
        others_totals: bool = True,
        peer_notify_s: float | None = None,
        scaler: Scaler | None = None,
        startup_s: float = 60.0,
        push_s: float | None = None,
        slo_scale: float | None = None,
        known_output: bool = False,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        if push_s is not None and not (push_s >= 0 and math.isfinite(push_s)):
            raise ValueError(f"push_s must be None (polls) or a finite delay >= 0, got {push_s!r}")
        if push_s is not None and peer_notify_s is not None:
            raise ValueError("push_s and peer_notify_s are two ways of seeing the other routers' calls: give one")
        if peer_notify_s is not None and not (peer_notify_s >= 0 and math.isfinite(peer_notify_s)):
            raise ValueError(f"peer_notify_s must be None (off) or a finite delay >= 0, got {peer_notify_s!r}")
        if isinstance(routers, bool) or not isinstance(routers, int) or routers < 1:
            raise ValueError(f"routers must be an integer >= 1, got {routers!r}")
        if slo_scale is not None and not (slo_scale > 0 and math.isfinite(slo_scale)):
            raise ValueError(f"slo_scale must be None (class targets) or a finite number > 0, got {slo_scale!r}")
        self.slo_scale = slo_scale  # targets: this many times each request's own unloaded TTFT and TPOT
        # the requests state their output length (`ignore_eos` with `max_tokens` = it, as the bench
        # sends them): the router takes it as its prediction, as the live one does
        self.known_output = known_output
        self.cm = cost_model
        self.topology = topology
        self.policy = policy
        self.predictor = predictor or BucketMeanPredictor()
        self.poll_interval_s = poll_interval_s
        self.record_decision_time = record_decision_time
        self.routers = routers
        self.others_totals = others_totals
        self.peer_notify_s = peer_notify_s if routers > 1 else None
        # admission notices from the other routers, per router and instance, until a poll covers them:
        # (admitted at, visible from, work seconds)
        self._notices: list[dict[str, deque]] = [{iid: deque() for iid in topology.prefill_ids() + topology.decode_ids()}
                                                 for _ in range(routers)]
        # router k's own policy, predictor and ledger; router 0's are the ones passed in
        self.policies = [policy] + [policy.for_replica(k) for k in range(1, routers)]
        self.predictors = [self.predictor] + [copy.deepcopy(self.predictor) for _ in range(1, routers)]
        self.ledgers = [Ledger() for _ in range(routers)]
        self.ledger = self.ledgers[0]
        self.engines: dict[str, EngineModel] = {}
        self.roles: dict[str, Role] = {}
        # engines on one shared host (the CPU profile) slow each other down; each owns its device otherwise
        self.share = HostShare(cost_model.shared_host) if cost_model.shared_host is not None else None
        if self.share is not None:  # chosen once: the poke of engines that own their devices stays as it was
            self._poke_alone, self._poke = self._poke, self._poke_shared
        for iid in topology.prefill_ids():
            self.engines[iid] = EngineModel(iid, cost_model.for_instance(iid), self.share)
            self.roles[iid] = Role.PREFILL
        for iid in topology.decode_ids():
            self.engines[iid] = EngineModel(iid, cost_model.for_instance(iid), self.share)
            self.roles[iid] = Role.DECODE
        self.prefill_ids = topology.prefill_ids()  # the instances the router may route to
        self._prefill_set = frozenset(self.prefill_ids)  # `_poke`'s test, without an Enum member's slow lookup
        self.decode_ids = topology.decode_ids()
        # changing widths: the fleet's life cycle and what the scaler reads (None: fixed, all serve)
        self.scaler = scaler
        self.fleet: Fleet | None = None
        self.signals: Signals | None = None
        self._control: list = []  # heap of (time, priority, seq, event): start-ups and scaler evaluations
        if scaler is not None:
            if scaler.interval_s is not None and not (scaler.interval_s > 0 and math.isfinite(scaler.interval_s)):
                raise ValueError(f"scaler {scaler.name!r}: interval_s must be None or a finite number > 0, "
                                 f"got {scaler.interval_s!r}")
            self.fleet = Fleet({Role.PREFILL: self.prefill_ids, Role.DECODE: self.decode_ids}, scaler.initial,
                               startup_s)
            self.signals = Signals()
            self._sync_active()
            self._ticks = self._control_seq = 0
        # each engine's own ledger of the calls it is serving, per router (the live engines' class)
        self.router_ids = [f"router-{k}" for k in range(routers)]
        self.received = {iid: AdmittedWork() for iid in self.engines}
        self._received_version = dict.fromkeys(self.engines, 0)
        # router k polls at k/K of the interval; with K = 1 this is the single router's grid
        self._phase = [k * poll_interval_s / routers for k in range(routers)]
        self._polled = [{iid: self._poll_one(iid, k) for iid in self.engines} for k in range(routers)]
        self._tick_seen = [dict.fromkeys(self.engines, self._tick(k, 0.0)) for k in range(routers)]
        self._polled_version = [{iid: self._version(iid) for iid in self.engines} for _ in range(routers)]
        self._polled_free = {iid: e.free_blocks for iid, e in self.engines.items()}  # the single router's snapshots'
        self.push_s = push_s
        if push_s is not None:  # per instance: (visible from, every router's view, version id), oldest first
            self._pushes = {iid: deque([(-math.inf, [self._poll_one(iid, k) for k in range(routers)], 0)])
                            for iid in self.engines}
            self._pushed_version = {iid: self._version(iid) for iid in self.engines}
            self._touched = dict.fromkeys(self.engines, 0.0)  # the latest touch: a change found later happened then
            self._seen_push = [dict.fromkeys(self.engines, 0) for _ in range(routers)]
        self._heap: list = []
        self._seq = 0
        self._step_epoch: dict[str, int] = {iid: 0 for iid in self.engines}
        self.prefix_caches = {iid: PrefixCache(e.c.kv_capacity_tokens // PREFIX_BLOCK_TOKENS)
                              for iid, e in self.engines.items()}
        self._prefix_lookups = {iid: c.leading_hits for iid, c in self.prefix_caches.items()}
        # colocated requests with hashes whose prefill has not ended: their blocks are cached when it does
        self._awaiting_prefill: dict[str, list[_Flight]] = {iid: [] for iid in self.engines}
        self.prefix_stats = dict.fromkeys(
            ("requests", "prompt_tokens", "cached_tokens", "transfer_tokens", "transfer_tokens_saved"), 0)

    # --- event heap ----------------------------------------------------------------------------

    def _push(self, t: float, prio: int, event: tuple) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, prio, self._seq, event))

    # --- polls ---------------------------------------------------------------------------------

    def _tick(self, k: int, now: float) -> int:
        """Router k's latest poll tick at `now` (for k = 0, now ≥ 0: int(now / interval))."""
        return math.floor((now - self._phase[k]) / self.poll_interval_s)

    def _version(self, iid: str) -> int | tuple[int, int]:
        """Changes whenever what a poll of `iid` reads may have changed."""
        if self.routers == 1:  # no other routers' totals to read
            return self.engines[iid].version
        return self.engines[iid].version, self._received_version[iid]

    def _refresh(self, iid: str, now: float) -> None:
        """Take every router's poll of the latest tick if not taken yet (with pushes: publish the
        version the engine changed to at its previous touch): call before touching an engine or
        its received ledger."""
        if self.push_s is not None:
            version = self._version(iid)
            if version != self._pushed_version[iid]:
                self._pushed_version[iid] = version
                q = self._pushes[iid]
                q.append((self._touched[iid] + self.push_s, [self._poll_one(iid, k) for k in range(self.routers)],
                          q[-1][2] + 1))
            self._touched[iid] = now
            return
        if self.routers == 1:  # the hot path of the single-router run
            tick = int(now / self.poll_interval_s)
            if tick != self._tick_seen[0][iid]:
                self._take_poll(iid, tick)
            return
        for k in range(self.routers):
            tick = self._tick(k, now)
            seen = self._tick_seen[k]
            if tick != seen[iid]:
                seen[iid] = tick
                version = self._version(iid)
                if version != self._polled_version[k][iid]:  # unchanged engine: same snapshot
                    self._polled_version[k][iid] = version
                    self._polled[k][iid] = self._poll_one(iid, k)
                self.ledgers[k].polled(iid)

    def _take_poll(self, iid: str, tick: int) -> None:
        """The single router's poll of `iid` at `tick`, not taken yet (`_refresh`)."""
        self._tick_seen[0][iid] = tick
        # a poll shows the KV use alone (`_poll_one`): while the engine's free blocks are what they were
        # at the last snapshot, it is kept, and so are the ledger's views made of it
        free = self.engines[iid].free_blocks
        if free != self._polled_free[iid]:
            self._polled_free[iid] = free
            self._polled[0][iid] = self._poll_one(iid, 0)
        self.ledger.polled(iid)

    def _poke(self, iid: str, now: float) -> None:
        engine = self.engines[iid]
        end = engine.poke(now)
        if end is not None:  # a new step end; a step event of an earlier epoch is now stale
            epoch = self._step_epoch[iid] = self._step_epoch[iid] + 1
            self._seq += 1
            heapq.heappush(self._heap, (end, _STEP, self._seq, ("step", iid, epoch)))
        if iid in self._prefill_set:  # KV is transferred in only by decode instances
            return
        for job in engine.take_transfers():
            f: _Flight = job.payload
            tokens = f.req.prompt_tokens
            if f.req.prefix_hashes:
                tokens = self._tokens_to_transfer(f)
            xfer = self.cm.transfer_s(f.prefill_id, f.decode_id, tokens)
            self._push(now + xfer, _TRANSFER, ("kv", f))

    def _poke_shared(self, iid: str, now: float) -> None:
        """`_poke` on a shared host: when the engine becomes busy or idle, the others re-plan."""
        changes = self.share.busy_changes
        self._poke_alone(iid, now)
        if self.share.busy_changes != changes:
            self._reshare(iid, now)

    def _reshare(self, changed: str, now: float) -> None:
        """An engine of the shared host became busy or idle: the other busy engines' steps change
        speed from the end of their step in flight (their macro steps are cut there, and re-planned
        at the new stretch)."""
        for iid in list(self.share.loads):
            # one between steps is planned by whoever ended its step; a busy one's poke only cuts its
            # macro step (it plans nothing, so it starts no transfer)
            if iid != changed and self.engines[iid].busy:
                self._poke_alone(iid, now)

    def _poll_one(self, iid: str, k: int) -> PolledState:
        """What router k's poll of `iid` reads: the engine's KV use, and the other routers' totals
        from the engine's ledger of received calls. Not its running and waiting counts, which the
        live engines report too: no view is made of them."""
        e = self.engines[iid]
        if self.routers == 1 or not self.others_totals:
            return PolledState(e.kv_used_tokens, e.c.kv_capacity_tokens)
        work, calls, hosted = others(self.received[iid].totals(), self.router_ids[k])
        return PolledState(e.kv_used_tokens, e.c.kv_capacity_tokens, others_backlog_s=work, others_queued=calls,
                           others_hosted=hosted)

    def _call_arrived(self, iid: str, k: int, work_s: float, hosted: bool = False) -> None:
        """A call of router k, carrying its priced work, reached engine `iid` (`hosted`: a prefill
        engine serves it whole)."""
        if self.routers == 1:  # only the other routers' calls are ever read (`_poll_one`)
            return
        self.received[iid].add(self.router_ids[k], work_s, hosted)
        self._received_version[iid] += 1

    def _call_prefilled(self, iid: str, f: "_Flight") -> None:
        """The prefill a call of `f`'s router made on engine `iid` is done: its work leaves the
        engine's ledger, the call stays (`AdmittedWork.release`, as a live engine at the first token)."""
        work, f.call_prefill_s = f.call_prefill_s, 0.0
        if self.routers == 1 or not work:
            return
        self.received[iid].release(self.router_ids[f.router], work)
        self._received_version[iid] += 1

    def _call_ended(self, iid: str, k: int, work_s: float, hosted: bool = False) -> None:
        """A call of router k on engine `iid` ended (a prefill returned, a decode's last token)."""
        if self.routers == 1:
            return
        self.received[iid].remove(self.router_ids[k], work_s, hosted)
        self._received_version[iid] += 1

    def _pushed(self, iid: str, k: int, now: float) -> PolledState:
        """The latest version of `iid` router k has received by `now` (pushes)."""
        q = self._pushes[iid]
        while len(q) > 1 and q[1][0] <= now:  # time only moves on, and every router sees after the same delay
            q.popleft()
        visible, views, version = q[0]
        if version != self._seen_push[k][iid]:  # a newer version: it covers the router's admissions so far
            self._seen_push[k][iid] = version
            self.ledgers[k].polled(iid)
        return views[k]

    def _views(self, ids: Sequence[str], now: float, k: int = 0) -> list[InstanceView]:
        # every router's pending poll is taken, not only k's: the decision is about to change engines
        if self.push_s is not None:
            for i in ids:
                self._refresh(i, now)
            led, roles = self.ledgers[k], self.roles
            return [led.view(i, roles[i], self._pushed(i, k, now)) for i in ids]
        if self.routers == 1:
            tick, seen = int(now / self.poll_interval_s), self._tick_seen[0]
            for i in ids:
                if seen[i] != tick:
                    self._take_poll(i, tick)
        else:
            for i in ids:
                self._refresh(i, now)
        led, pol, roles = self.ledgers[k], self._polled[k], self.roles
        if self.peer_notify_s is not None:
            return [led.view(i, roles[i], self._with_notices(k, i, pol[i], now)) for i in ids]
        return [led.view(i, roles[i], pol[i]) for i in ids]

    def _notify_peers(self, k: int, iid: str, work_s: float, now: float) -> None:
        """Router k tells the other routers what it has just sent to `iid` (the peer-notice mechanism)."""
        visible = now + self.peer_notify_s
        for j in range(self.routers):
            if j != k:
                self._notices[j][iid].append((now, visible, work_s))

    def _with_notices(self, k: int, iid: str, polled: PolledState, now: float) -> PolledState:
        """Router k's poll of `iid` plus the notices it has received of calls its poll cannot show
        yet (sent at or after the poll: the engine got them after it answered)."""
        q = self._notices[k][iid]
        t_poll = self._phase[k] + self._tick(k, now) * self.poll_interval_s
        while q and q[0][0] < t_poll:  # the poll covers it: the engine's totals include it
            q.popleft()
        work, n = 0.0, 0
        for _, visible, w in q:
            if visible > now:
                break
            work += w
            n += 1
        if not n:
            return polled
        return replace(polled, others_backlog_s=polled.others_backlog_s + work, others_queued=polled.others_queued + n)

    # --- the run -------------------------------------------------------------------------------

    def run(self, trace: Sequence[TraceRequest], default_slo: SloClass = SloClass.LOOSE,
            progress: Callable[[int], None] | None = None) -> SimResult:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        records: list[RequestRecord] = []
        decision_us: list[float] = []
        instance_tokens = dict.fromkeys(self.engines, 0)
        # Arrivals are merged in from the trace, in the order the event heap would give them, not pushed
        # onto it: a heap of the few engine events in flight is several times cheaper to push and pop
        # than one holding the whole trace. At equal times an engine event goes first (`_ARRIVAL` is
        # the last priority), and arrivals keep the trace's order among themselves (stable sort).
        order = sorted(range(len(trace)), key=lambda j: trace[j].arrival_s)
        arrivals = [trace[j].arrival_s for j in order]
        n_arrivals, a = len(order), 0
        now = 0.0
        perf = time.perf_counter
        heap = self._heap
        awaiting_prefill = self._awaiting_prefill
        # the loop's most used attributes, as locals (bound methods included: one lookup per run)
        engines, step_epoch, ledgers, predictors = self.engines, self._step_epoch, self.ledgers, self.predictors
        refresh, poke = self._refresh, self._poke
        slo_scale, known_output = self.slo_scale, self.known_output
        fleet, signals, control, share = self.fleet, self.signals, self._control, self.share
        cm = self.cm  # whether any KV moves only between the prefill engine's steps: most models have none
        kv_between_steps = cm.transfer.between_prefill_steps or any(t.between_prefill_steps for t in cm.pairs.values())
        if self.scaler is not None and self.scaler.interval_s is not None:
            self._push_control(self.scaler.interval_s, _TICK, ("tick",))
        while heap or a < n_arrivals:
            if control and (not heap or control[0][0] <= heap[0][0]) and \
                    (a == n_arrivals or control[0][0] <= arrivals[a]):
                now, _, _, ev = heapq.heappop(control)
                self._control_event(ev, now)
                continue
            if heap and (a == n_arrivals or heap[0][0] <= arrivals[a]):
                now, _, _, ev = heapq.heappop(heap)
                kind = ev[0]
            else:
                i = order[a]
                now, kind = arrivals[a], "arrive"
                a += 1
            if kind == "step":
                _, iid, epoch = ev
                if epoch != step_epoch[iid]:
                    continue
                engine = engines[iid]
                refresh(iid, now)
                out = engine.end_step(now)
                if awaiting_prefill[iid]:
                    self._cache_colocated_prefills(iid)
                for job in out.started:  # a colocated or hosted request's first token: its prefill is done,
                    f = job.payload  # as the live router and engine mark it then
                    ledgers[f.router].prefill_done(f.rid)
                    self._call_prefilled(iid, f)
                for job in out.prefilled:
                    f: _Flight = job.payload
                    if f.req.prefix_hashes:
                        self._cache_prompt(iid, f.req)
                    if signals is not None:  # the prefill call returns, the decode call begins
                        signals.ongoing(Role.PREFILL, -1, now)
                        signals.ongoing(Role.DECODE, 1, now)
                    self._call_ended(iid, f.router, f.prefill_work_s)  # the prefill call returns
                    f.decode_job = Job(f.rid, f.req.prompt_tokens, f.req.output_tokens, remote_kv=True, payload=f)
                    hop = self.cm.handoff_overhead_s
                    if hop:  # the reply and the decode call cross the serving path, at the host's stretch
                        self._push(now + hop * (share.stretch_at(now) if share is not None else 1.0), _TRANSFER,
                                   ("call", f))
                    else:
                        self._call_decode(f, now)
                for job in out.finished:
                    f = job.payload
                    self._call_ended(iid, f.router, f.call_work_s + f.call_prefill_s,
                                     f.prefill_id == f.decode_id and self.roles[iid] is Role.PREFILL)
                    ledgers[f.router].finish(f.rid)
                    predictors[f.router].observe(f.req.prompt_tokens, f.slo, f.req.output_tokens)
                    instance_tokens[f.decode_id] += f.req.output_tokens
                    if f.prefill_id != f.decode_id:
                        instance_tokens[f.prefill_id] += f.req.prompt_tokens
                    else:
                        instance_tokens[f.decode_id] += f.req.prompt_tokens
                    rec = self._record(f, job, now)
                    records.append(rec)
                    if fleet is not None:
                        signals.ongoing(self.roles[f.decode_id], -1, now)
                        signals.served(rec, self.cm.target(f.slo), self.cm.engine)
                        fleet.done(f.decode_id, now)
                    if progress:
                        progress(1)
                poke(iid, now)
            elif kind == "call":
                self._call_decode(ev[1], now)
            elif kind == "kv":
                f = ev[1]
                if kv_between_steps and cm.transfer_between(f.prefill_id, f.decode_id).between_prefill_steps:
                    held = engines[f.prefill_id].step_in_flight_end(now)
                    if held is not None:  # the prefill engine's side moves once its step ends
                        self._push(held, _TRANSFER, ("kv", f))
                        continue
                refresh(f.prefill_id, now)
                refresh(f.decode_id, now)
                engines[f.prefill_id].release(f.prefill_job)
                if fleet is not None:  # the prefill instance holds no more of it
                    fleet.done(f.prefill_id, now)
                ledgers[f.router].prefill_done(f.rid)
                engines[f.decode_id].kv_arrived(f.decode_job)
                if f.req.prefix_hashes:
                    self._cache_prompt(f.decode_id, f.req)
                poke(f.decode_id, now)
                poke(f.prefill_id, now)
            else:  # arrival of trace[i], at router i mod K
                r = trace[i]
                k = i % self.routers
                policy = self.policies[k]
                slo = r.slo_class or default_slo
                if signals is not None:
                    signals.arrived(r.prompt_tokens, slo)
                if share is not None:  # the serving path's per-request work starts
                    share.arrive(now)
                predicted = r.output_tokens if known_output else predictors[k].predict(r.prompt_tokens, slo)
                rid = f"r{i}"
                if slo_scale is None:
                    feats = RequestFeatures(rid, r.prompt_tokens, predicted, slo, r.output_tokens, r.prefix_hashes)
                else:
                    own = self._target(r.prompt_tokens, slo)
                    feats = RequestFeatures(rid, r.prompt_tokens, predicted, slo, r.output_tokens, r.prefix_hashes,
                                            ttft_target_s=own.ttft_s, tpot_target_s=own.tpot_s)
                pv, dv = self._views(self.prefill_ids, now, k), self._views(self.decode_ids, now, k)
                if r.prefix_hashes:  # only then: a request without hashes is decided exactly as before
                    pv, dv = self._with_prefix_lookup(pv), self._with_prefix_lookup(dv)
                try:
                    if self.record_decision_time:
                        t0 = perf()
                        d = policy.choose(feats, pv, dv, now)
                        decision_us.append((perf() - t0) * 1e6)
                    else:
                        d = policy.choose(feats, pv, dv, now)
                except NoCapacity as e:
                    records.append(RequestRecord.failure(rid, r, slo, now, str(e)))
                    if progress:
                        progress(1)
                    continue
                f = _Flight(r, rid, slo, predicted, d.prefill_id, d.decode_id, router=k)
                # the serving path's time, taken at the host's stretch as the request comes in
                f.outside_s = self.cm.serving_overhead_s * (share.stretch_at(now) if share is not None else 1.0)
                self._admit(f, now)
        extra = {}
        if fleet is not None:
            extra["autoscaling"] = {"scaler": self.scaler.name, "startup_s": fleet.startup_s, **fleet.summary(now)}
        # what each engine computed (its steps' seconds alone) and how long its steps took on the host
        extra["engine_time"] = {"makespan_s": now, "engines": {
            iid: {"work_s": e.work_s, "stepping_s": e.stepping_s, "steps": e.steps_run}
            for iid, e in self.engines.items()}}
        if self.prefix_stats["requests"]:
            st = self.prefix_stats
            extra["prefix_cache"] = {**st, "hit_rate": st["cached_tokens"] / st["prompt_tokens"]}
        return SimResult(
            records=records,
            decision_us=decision_us,
            instance_tokens=instance_tokens,
            sim_wall_s=time.perf_counter() - wall0,
            preemptions=sum(e.preemptions for e in self.engines.values()),
            makespan_s=now,
            extra=extra,
            sim_cpu_s=time.process_time() - cpu0,
        )

    def _call_decode(self, f: _Flight, now: float) -> None:
        """The decode call of `f`, whose prefill has returned, reaches its decode instance."""
        self._refresh(f.decode_id, now)
        self._call_arrived(f.decode_id, f.router, f.decode_work_s)
        if self.peer_notify_s is not None:
            self._notify_peers(f.router, f.decode_id, f.decode_work_s, now)
        self.engines[f.decode_id].submit(f.decode_job)
        self._poke(f.decode_id, now)

    def _admit(self, f: _Flight, now: float) -> None:
        r = f.req
        ledger = self.ledgers[f.router]
        # priced with the router's constants (which the miscalibration study makes wrong), for the
        # prompt tokens the prefill instance does not hold (what the router's view of it said)
        cached = 0
        if r.prefix_hashes:
            reusable = _reusable_blocks(r.prompt_tokens, r.prefix_hashes)
            cached = self.prefix_caches[f.prefill_id].leading_hits(r.prefix_hashes, reusable) * PREFIX_BLOCK_TOKENS
        prefill_work, decode_work = admission_work(self.policies[f.router].cost_model, f.prefill_id, f.decode_id,
                                                   r.prompt_tokens, f.predicted, ledger.queued(f.decode_id), cached)
        ledger.admit(f.rid, f.prefill_id, f.decode_id, prefill_work, decode_work, r.prompt_tokens)
        f.prefill_work_s, f.decode_work_s = prefill_work, decode_work
        if self.fleet is not None:
            self.fleet.assign(f.decode_id)
            if f.prefill_id != f.decode_id:
                self.fleet.assign(f.prefill_id)
            # ongoing from the call: on the prefill pool, or on the pool of the instance serving a colocated request
            self.signals.ongoing(self.roles[f.decode_id] if f.prefill_id == f.decode_id else Role.PREFILL, 1, now)
            if f.prefill_id == f.decode_id and self.roles[f.decode_id] is Role.PREFILL:
                self.signals.hosted()
        # the call reaches its engine now (its poll was taken in _views, at this same time)
        colocated = f.prefill_id == f.decode_id
        hosted = colocated and self.roles[f.decode_id] is Role.PREFILL
        if colocated:
            # the work the serving engine counts for the call, as a live engine does: its prefill until
            # the first token, then its decode — none on a prefill instance hosting the whole request
            # (the decode runs beside its prefills, not ahead of them)
            f.call_prefill_s, f.call_work_s = prefill_work, 0.0 if hosted else decode_work
        else:
            f.call_work_s = decode_work
        if self.peer_notify_s is not None:
            if colocated:
                self._notify_peers(f.router, f.decode_id, f.call_prefill_s + f.call_work_s, now)
            else:
                self._notify_peers(f.router, f.prefill_id, prefill_work, now)
        if colocated:
            job = Job(f.rid, r.prompt_tokens, r.output_tokens, payload=f)
            f.decode_job = job
            if r.prefix_hashes:
                self._start_from_cache(job, f.decode_id, r.prefix_hashes)
                self._awaiting_prefill[f.decode_id].append(f)
            self._call_arrived(f.decode_id, f.router, f.call_prefill_s + f.call_work_s, hosted)
            self.engines[f.decode_id].submit(job)
            self._poke(f.decode_id, now)
        else:
            job = Job(f.rid, r.prompt_tokens, 1, prefill_only=True, payload=f)
            f.prefill_job = job
            if r.prefix_hashes:
                self._start_from_cache(job, f.prefill_id, r.prefix_hashes)
            self._call_arrived(f.prefill_id, f.router, prefill_work)
            self.engines[f.prefill_id].submit(job)
            self._poke(f.prefill_id, now)

    # --- changing widths (with a scaler only) ---------------------------------------------------------

    def _push_control(self, t: float, prio: int, event: tuple) -> None:
        self._control_seq += 1  # its own sequence: the engine events' stays what it was without a scaler
        heapq.heappush(self._control, (t, prio, self._control_seq, event))

    def _sync_active(self) -> None:
        self.prefill_ids = self.fleet.active(Role.PREFILL)
        self.decode_ids = self.fleet.active(Role.DECODE)

    def _control_event(self, ev: tuple, now: float) -> None:
        if ev[0] == "ready":
            if self.fleet.activate(ev[1], now):
                self._sync_active()
            return
        scaler, fleet = self.scaler, self.fleet
        # the highest KV pressure of a serving decode instance, read from the engines now
        kv = max((self.engines[i].kv_used_tokens / self.engines[i].c.kv_capacity_tokens for i in self.decode_ids),
                 default=0.0)
        state = FleetState(now, fleet.widths(), fleet.serving(), self.signals.take_window(scaler.interval_s, kv),
                           self.signals.ongoing_s(Role.PREFILL, now), self.signals.ongoing_s(Role.DECODE, now))
        want = scaler.decide(state)
        if not (isinstance(want, Widths) and 0 <= want.prefill <= self.topology.prefill
                and 1 <= want.decode <= self.topology.decode):
            raise ValueError(f"scaler {scaler.name!r} asked for {want!r} at t={now:.3f} s; widths must be within "
                             f"0..{self.topology.prefill} prefill and 1..{self.topology.decode} decode instances")
        for role in POOLS:
            started: list[Started] = fleet.resize(role, width_of(want, role), now)
            for s in started:
                self._push_control(s.ready_at, _READY, ("ready", s))
        self._sync_active()
        # the next evaluation on the grid k·interval (not a running sum: no drift over a long run)
        self._ticks += 1
        self._push_control((self._ticks + 1) * scaler.interval_s, _TICK, ("tick",))

    # --- prefix caches (requests with prefix hashes only) ------------------------------------------

    def _with_prefix_lookup(self, views: list[InstanceView]) -> list[InstanceView]:
        # the constructor, not dataclasses.replace (3× slower); a test checks that no field is lost
        lookups = self._prefix_lookups
        return [InstanceView(v.instance_id, v.role, v.backlog_s, v.queued, v.kv_used_tokens, v.kv_capacity_tokens,
                             lookups[v.instance_id], v.hosted) for v in views]

    def _start_from_cache(self, job: Job, iid: str, hashes: tuple[int, ...]) -> None:
        """The job's prompt blocks cached on `iid` are not prefilled again: it starts with their KV
        (blocks for them are still allocated on admission: a cache hit takes KV memory in vLLM too)."""
        cache = self.prefix_caches[iid]
        hits = cache.leading_hits(hashes, _reusable_blocks(job.prompt, hashes))
        st = self.prefix_stats
        st["requests"] += 1
        st["prompt_tokens"] += job.prompt
        if hits:
            cache.touch(hashes, hits)
            # the engine model computes a prompt from `computed` on; it knows nothing of caches
            job.computed = job.kvlen = hits * PREFIX_BLOCK_TOKENS
            st["cached_tokens"] += job.computed

    def _tokens_to_transfer(self, f: _Flight) -> int:
        """The prompt tokens whose KV the decode instance does not already hold."""
        hashes, prompt = f.req.prefix_hashes, f.req.prompt_tokens
        cache = self.prefix_caches[f.decode_id]
        held = cache.leading_hits(hashes, _reusable_blocks(prompt, hashes))
        if held:
            cache.touch(hashes, held)
        held_tokens = held * PREFIX_BLOCK_TOKENS
        self.prefix_stats["transfer_tokens"] += prompt - held_tokens
        self.prefix_stats["transfer_tokens_saved"] += held_tokens
        return prompt - held_tokens

    def _cache_prompt(self, iid: str, req: TraceRequest) -> None:
        """`iid` now holds the KV of the request's prompt: cache its full blocks."""
        hashes = req.prefix_hashes
        self.prefix_caches[iid].touch(hashes, min(len(hashes), req.prompt_tokens // PREFIX_BLOCK_TOKENS))

    def _cache_colocated_prefills(self, iid: str) -> None:
        waiting = []
        for f in self._awaiting_prefill[iid]:
            if f.decode_job.t_first is not None:  # its prefill ended in this step
                self._cache_prompt(iid, f.req)
            else:
                waiting.append(f)
        self._awaiting_prefill[iid] = waiting

    def _target(self, prompt_tokens: int, slo: SloClass) -> SloTarget:
        """A request's targets: its class's, or `slo_scale` times its own unloaded latency."""
        return self.cm.target_for(slo, prompt_tokens, self.slo_scale)

    def _record(self, f: _Flight, job: Job, now: float) -> RequestRecord:
        # the class's targets read directly: this runs once per request
        target = self.cm.slo[f.slo] if self.slo_scale is None else self._target(f.req.prompt_tokens, f.slo)
        # the serving path outside the engines, as a delay of the response stream
        late = f.outside_s
        return RequestRecord.served(
            f.rid, f.req, f.slo, f.prefill_id, f.decode_id, f.predicted,
            t_first=job.t_first + late, t_last=now + late, ttft_target_s=target.ttft_s, tpot_target_s=target.tpot_s,
            preemptions=job.preemptions,
        )


def _reusable_blocks(prompt_tokens: int, hashes: tuple[int, ...]) -> int:
    """Leading full blocks a prefill may take from a cache: not the one holding the last prompt
    token, which is always computed (it yields the first output token), as in vLLM."""
    return min(len(hashes), (prompt_tokens - 1) // PREFIX_BLOCK_TOKENS)
