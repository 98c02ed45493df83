"""The instance registry: which engine instances exist, and what each of them last reported.

Engine state is pushed (`serve_app.state_push`): the router keeps one `watch` stream open per
engine replica, and each replica sends a new version of its state when a routing signal moves, so
the state a decision sees is as fresh as the last change plus one push, and an idle fleet sends
nothing. A slow liveness poll (`broadcast("state")` every `poll_interval_s`, 5 s by default)
finds new replicas and opens their streams. A replica is an instance, named
`<model prefix><role>-<replica id>`, from its first report on; one that stops answering, or
disappears when its pool scales down, is dropped and its ledger entries are released: at once
when its stream broke and it missed the poll that follows, else after `stale_after_s`.

What the policy sees of an instance (`views`) merges the router's in-flight ledger (committed
work, queue, prompts admitted since the last report) with the instance's latest report (KV use,
and the work the *other* router replicas have sent there, from the engine's own per-router
ledger), and
the prefixes the model's `PrefixIndex` holds for it (hashed in multiples of the KV block size the
engines report): exact where the engine pushes its KV events with its state, a model elsewhere.
A poll or stream failure is logged once per distinct failure; a pool with no running replica yet
(start-up) is simply empty.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Mapping

from ray.serve.exceptions import DeploymentUnavailableError

from disagg.core.cost_model import EngineConstants
from disagg.core.ledger import Ledger, PolledState, others
from disagg.core.prefix_index import PrefixIndex, index_block_tokens
from disagg.core.types import InstanceView, Role
from serve_app.config import POOL_ROLES, PoolConfig
from serve_app.messages import EngineStateReport
from serve_app.request_log import Counters
from serve_app.served_model import ServedModel

logger = logging.getLogger("ray.serve")
STALE_AFTER_S = 5.0  # a replica silent this long (at least 2.5 liveness polls) is no longer routed to
POLL_TIMEOUT_S = 2.0  # a replica slower than this to answer misses the poll



@dataclass(slots=True)
class Instance:
    """One engine replica of one served model, as of its latest poll."""

    instance_id: str
    role: Role
    model: str  # the served model's name
    replica: str  # Serve's replica id: calls are pinned to it
    report: EngineStateReport  # its latest state (pushed, or the liveness poll's answer): `report.seq` is its version
    polled: PolledState  # the load signals the ledger merges into its view
    last_seen: float  # monotonic time of the latest word from it


class InstanceRegistry:
    """The live instances of every served model, kept current by `poll_forever`."""

    def __init__(self, models: Mapping[str, ServedModel], ledger: Ledger, counters: Counters,
                 poll_interval_s: float, router_id: str = "", kv_events: bool = True) -> None:
        self.models = models
        self.router_id = router_id
        self.ledger = ledger
        self.counters = counters
        self.poll_interval_s = poll_interval_s
        self.stale_after_s = max(STALE_AFTER_S, 2.5 * poll_interval_s)
        self.instances: dict[str, Instance] = {}
        self._watches: dict[str, asyncio.Task] = {}  # instance id → its state stream's reader
        self._broken: set[str] = set()  # instances whose stream broke since the last poll
        self._poll_now = asyncio.Event()  # a stream broke: poll at once rather than at the next period
        self.pushes = 0  # versions received by push
        self.push = True  # open state streams (in-process tests turn it off and poll by hand)
        self.kv_events = kv_events  # take the prefix updates the engines push (else the index models the caches)
        self._constants: dict[tuple, EngineConstants] = {}
        self._warned: set[str] = set()

    async def poll_forever(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.poll_once()
            except Exception as e:  # never let the poller die: routing would go stale silently
                self._warn_once(f"engine state poll failed: {type(e).__name__}: {e}")
            wait = max(0.0, self.poll_interval_s - (time.monotonic() - t0))
            try:
                await asyncio.wait_for(self._poll_now.wait(), wait)
            except asyncio.TimeoutError:
                pass
            self._poll_now.clear()

    def stop(self) -> None:
        """Close every state stream and open no more (the router replica is stopping, or a test polls by hand)."""
        self.push = False
        for task in self._watches.values():
            task.cancel()
        self._watches.clear()

    async def poll_once(self, exact: bool = False) -> None:
        """Ask every replica for its state: finds new replicas, opens their streams, drops the gone.
        `exact`: each replica publishes its state as it is now, KV use to the token (`/admin/state`),
        not only when a routing signal moved."""
        now = time.monotonic()
        broken, self._broken = self._broken, set()
        pools = [(m, role, h) for m in self.models.values() for role, h in m.handles.items()]
        results = await asyncio.gather(*(
            h.broadcast("state", exact).results_async(timeout_s=POLL_TIMEOUT_S, return_exceptions=True)
            for _, _, h in pools), return_exceptions=True)
        for (model, role, _), reports in zip(pools, results):
            if isinstance(reports, DeploymentUnavailableError):
                continue  # no replica of this pool is running yet (start-up, or all replaced): nothing to see
            if isinstance(reports, BaseException):
                self._warn_once(f"polling {model.name}'s {role.value} pool failed: {type(reports).__name__}: "
                                f"{reports}")
                continue
            for r in reports:
                if isinstance(r, EngineStateReport):  # else the replica failed or timed out this time
                    iid = self._seen(model, role, r, now)
                    broken.discard(iid)
                    self._stream(model, role, iid)
        for iid in [i for i, inst in self.instances.items()
                    if i in broken or now - inst.last_seen > self.stale_after_s]:
            self._drop(iid, "its state stream broke and it missed the poll" if iid in broken
                       else f"silent {self.stale_after_s:.0f} s")

    def _drop(self, iid: str, why: str) -> None:
        lost = self.ledger.forget_instance(iid)
        if (index := self.models[self.instances[iid].model].prefix_index) is not None:
            index.forget(iid)
        del self.instances[iid]
        if (task := self._watches.pop(iid, None)) is not None:
            task.cancel()
        self.counters.instances_lost += 1
        logger.warning("router: instance %s left (%s); %d in-flight requests released", iid, why, len(lost))

    def _stream(self, model: ServedModel, role: Role, iid: str) -> None:
        """Keep the instance's state stream open (opened on its first report, reopened after a break)."""
        task = self._watches.get(iid)
        if self.push and (task is None or task.done()):
            # a fresh context: Serve must not route this call by the poller's request id
            self._watches[iid] = contextvars.Context().run(
                asyncio.create_task, self._read_stream(model, role, iid, self.instances[iid].replica))

    async def _read_stream(self, model: ServedModel, role: Role, iid: str, replica: str) -> None:
        try:
            async for r in model.streams[role].watch.remote(self.router_id, replica=replica):
                if r.replica != replica:  # the replica went away and Serve offered another: not its state
                    raise RuntimeError(f"the stream of {replica} is served by {r.replica}")
                self.pushes += 1
                self._seen(model, role, r, time.monotonic())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._warn_once(f"the state stream of {model.name}'s {role.value} replica failed: {type(e).__name__}: {e}")
        if iid in self.instances:  # it broke (or ended): poll now, and drop the replica if it does not answer
            self._broken.add(iid)
            self._poll_now.set()

    def _seen(self, model: ServedModel, role: Role, r: EngineStateReport, now: float) -> str:
        """Take a report (pushed or polled); the instance's id."""
        iid = f"{model.id_prefix}{role.value}-{r.replica}"
        if model.prefix_index is None and r.block_size > 0:  # one model's engines share one block size
            model.prefix_index = PrefixIndex(index_block_tokens(r.block_size))
        if (p := r.prefixes) is not None and model.prefix_index is not None and self.kv_events:  # whatever its seq
            model.prefix_index.apply(iid, seq=p.seq, since=p.since, added=p.added, removed=p.removed,
                                     snapshot=p.snapshot, now=now)
        inst = self.instances.get(iid)
        if inst is not None and r.seq and r.seq <= inst.report.seq:  # a poll's answer no newer than the push
            inst.last_seen = now
            return iid
        others_s, others_n, others_h = others(r.admitted, self.router_id)  # what the other router replicas sent there
        polled = PolledState(r.kv_used_tokens, r.kv_capacity_tokens, r.running, r.waiting, others_s, others_n, others_h)
        if inst is None:
            self.instances[iid] = Instance(iid, role, model.name, r.replica, r, polled, now)
            logger.info("router: instance %s joined", iid)
        else:
            inst.report, inst.polled, inst.last_seen = r, polled, now
        self.ledger.polled(iid)
        return iid

    def _warn_once(self, message: str) -> None:
        """A poll failure is logged the first time it happens, not 20 times a second."""
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("router: %s (further identical failures are not logged)", message)

    def versions(self, *instance_ids: str) -> dict[str, int]:
        """The state version the router holds of each instance (what a decision on them is based on)."""
        return {i: inst.report.seq for i in instance_ids if (inst := self.instances.get(i)) is not None}

    def get(self, instance_id: str) -> Instance | None:
        return self.instances.get(instance_id)

    def pool(self, model: ServedModel, role: Role) -> list[Instance]:
        """The model's live instances of this role."""
        return [i for i in self.instances.values() if i.role is role and i.model == model.name]

    def views(self, model: ServedModel, role: Role) -> list[InstanceView]:
        """The policy's view of each of the model's live instances of this role."""
        index = model.prefix_index
        return [self.ledger.view(i.instance_id, role, i.polled, index.lookup(i.instance_id) if index else None)
                for i in self.pool(model, role)]

    def constants(self, model: ServedModel, inst: Instance) -> EngineConstants:
        """The model's calibrated constants for this instance, with the KV capacity the engine reports."""
        c = model.cost_model.for_instance(inst.instance_id)
        cap = inst.polled.kv_capacity_tokens
        key = (id(c), inst.instance_id, cap)
        hit = self._constants.get(key)
        if hit is None:
            hit = c if cap <= 0 or cap == c.kv_capacity_tokens else c.model_copy(update={"kv_capacity_tokens": cap})
            if len(self._constants) > 1024:  # cost-model reloads and scaling churn the keys
                self._constants.clear()
            self._constants[key] = hit
        return hit

    def health(self) -> tuple[bool, dict]:
        """(every pool has at least its minimum width, the `/health` body)."""
        expected = {(m.name, POOL_ROLES[name]): _min_width(pool)
                    for m in self.models.values() for name, pool in m.cfg.pools().items()}
        have = {(m, r): len(self.pool(self.models[m], r)) for m, r in expected}
        ok = all(have[k] >= n for k, n in expected.items())
        counts: dict[str, int] = {}
        want: dict[str, int] = {}
        for (m, r), n in expected.items():
            counts[r.value] = counts.get(r.value, 0) + have[(m, r)]
            want[r.value] = want.get(r.value, 0) + n
        per_model = {m: {r.value: have[(mm, r)] for (mm, r) in expected if mm == m} for m in self.models}
        return ok, {"status": "ok" if ok else "starting", "instances": counts, "expected": want,
                    "models": per_model}


def _min_width(pool: PoolConfig) -> int:
    return max(1, pool.autoscaling.min_replicas if pool.autoscaling else pool.num_replicas)
