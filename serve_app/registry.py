"""The instance registry: which engine instances exist, and what each of them last reported.

The router finds engine replicas by polling: every `poll_interval_s` (50 ms by default) it calls
`broadcast("state")` on every pool of every served model. A replica is an instance, named
`<model prefix><role>-<replica id>`, from its first answer on, and new replicas are routed to
from then; a replica that stops answering, or disappears when its pool scales down, is dropped
after `STALE_AFTER_S` and its ledger entries are released.

What the policy sees of an instance (`views`) merges the router's in-flight ledger (committed
work, queue, prompts admitted since the poll) with the instance's latest poll (KV use, and the
work the *other* router replicas have sent there, from the engine's own per-router ledger), and
the prefixes the model's `PrefixIndex` believes it holds (hashed in multiples of the KV block size
the engines report).
A poll failure is logged once per distinct failure, not every 50 ms; a pool with no running
replica yet (start-up) is simply empty.
"""

from __future__ import annotations

import asyncio
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
STALE_AFTER_S = 5.0  # a replica silent this long is no longer routed to
POLL_TIMEOUT_S = 2.0  # a replica slower than this to answer misses the poll



@dataclass(slots=True)
class Instance:
    """One engine replica of one served model, as of its latest poll."""

    instance_id: str
    role: Role
    model: str  # the served model's name
    replica: str  # Serve's replica id: calls are pinned to it
    report: EngineStateReport  # its latest answer to `state()`
    polled: PolledState  # the load signals the ledger merges into its view
    last_seen: float  # monotonic time of that answer


class InstanceRegistry:
    """The live instances of every served model, kept current by `poll_forever`."""

    def __init__(self, models: Mapping[str, ServedModel], ledger: Ledger, counters: Counters,
                 poll_interval_s: float, router_id: str = "") -> None:
        self.models = models
        self.router_id = router_id
        self.ledger = ledger
        self.counters = counters
        self.poll_interval_s = poll_interval_s
        self.instances: dict[str, Instance] = {}
        self._constants: dict[tuple, EngineConstants] = {}
        self._warned: set[str] = set()

    async def poll_forever(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.poll_once()
            except Exception as e:  # never let the poller die: routing would go stale silently
                self._warn_once(f"engine state poll failed: {type(e).__name__}: {e}")
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - t0)))

    async def poll_once(self) -> None:
        now = time.monotonic()
        pools = [(m, role, h) for m in self.models.values() for role, h in m.handles.items()]
        results = await asyncio.gather(*(
            h.broadcast("state").results_async(timeout_s=POLL_TIMEOUT_S, return_exceptions=True)
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
                    self._seen(model, role, r, now)
        for iid in [i for i, inst in self.instances.items() if now - inst.last_seen > STALE_AFTER_S]:
            lost = self.ledger.forget_instance(iid)
            if (index := self.models[self.instances[iid].model].prefix_index) is not None:
                index.forget(iid)
            del self.instances[iid]
            self.counters.instances_lost += 1
            logger.warning("router: instance %s left (silent %.0f s); %d in-flight requests released",
                           iid, STALE_AFTER_S, len(lost))

    def _seen(self, model: ServedModel, role: Role, r: EngineStateReport, now: float) -> None:
        iid = f"{model.id_prefix}{role.value}-{r.replica}"
        others_s, others_n = others(r.admitted, self.router_id)  # what the other router replicas sent there
        polled = PolledState(r.kv_used_tokens, r.kv_capacity_tokens, r.running, r.waiting, others_s, others_n)
        if model.prefix_index is None and r.block_size > 0:  # one model's engines share one block size
            model.prefix_index = PrefixIndex(index_block_tokens(r.block_size))
        inst = self.instances.get(iid)
        if inst is None:
            self.instances[iid] = Instance(iid, role, model.name, r.replica, r, polled, now)
            logger.info("router: instance %s joined", iid)
        else:
            inst.report, inst.polled, inst.last_seen = r, polled, now
        self.ledger.polled(iid)

    def _warn_once(self, message: str) -> None:
        """A poll failure is logged the first time it happens, not 20 times a second."""
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("router: %s (further identical failures are not logged)", message)

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
