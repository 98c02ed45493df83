"""Engine state by push: each engine replica streams its load to the routers when it changes.

The engine side (`StatePublisher`) is poked on every change it can see — a scheduler step with
outputs (vLLM's stat logger), a call admitted to or leaving its per-router ledger — waits
`push_interval_s` so that a burst of changes makes one report, reads its state, and publishes a
new version only when a routing signal moved: the running or waiting count, the calls a router has
sent there (their work rides along), or KV use by 1/64 of the cache (at least a block). Every router
keeps one `watch()` stream open per replica and receives each version once; a router that falls
behind gets the latest version, never a backlog. Nothing is sent while nothing changes: an idle
fleet costs no messages.

Freshness is measured where the truth is. Every call a router sends carries the version it decided
on (`state_seq`) and when it decided (`decided_at`, wall clock); the engine knows when its state
first moved past that version, so `age_at_decision` is exactly how long the router's state had
been out of date when it decided (0 when it was current). Ages are kept for the benchmarks, and
those over `age_bound_s` are counted in every report, so no stale decision is silent.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable

from disagg.core.kv_event_fold import KvEventFold
from serve_app.messages import EngineStateReport, PrefixUpdate

KV_STEPS = 64  # KV use is pushed when it moves by 1/64 of the cache (at least a block)
CHANGE_HISTORY = 4096  # versions remembered for ages (a call decided on an older one is counted as old as the oldest)
AGE_SAMPLES = 65536  # ages kept for the benchmarks between two reads
PREFIX_LOG = 256  # prefix deltas kept for the streams; a router further behind gets a snapshot


def moved(a: EngineStateReport | None, b: EngineStateReport, kv_step_tokens: int) -> bool:
    """Did a routing signal move between two reports? KV use counts only by whole steps: it moves
    with every few decode steps, and a router cannot price a difference of one block. A router's
    admitted work counts only with its calls: a call's prefill done here (its first token) takes its
    seconds out and leaves the calls as they were; it rides the next version instead of making one
    (a version of its own cost the 64-engine rig a quarter more state messages)."""
    return (a is None or a.running != b.running or a.waiting != b.waiting
            or _calls(a.admitted) != _calls(b.admitted)
            or abs(a.kv_used_tokens - b.kv_used_tokens) >= kv_step_tokens
            or a.kv_capacity_tokens != b.kv_capacity_tokens or a.block_size != b.block_size
            or a.prefix_seq != b.prefix_seq)


def _calls(admitted: dict[str, tuple[float, int, int]]) -> dict[str, tuple[int, int]]:
    """Each router's calls here and how many of them are hosted, without their work."""
    return {router: (calls, hosted) for router, (_, calls, hosted) in admitted.items()}


class StatePublisher:
    """One engine replica's state versions, and the streams that push them (see the module docstring).

    `read`: the replica's current report (its `seq`, `decisions`, `stale_decisions` and `prefix_seq`
    are filled in here). `prefixes`: the engine's prefix cache from its KV events, if they are on;
    each stream then carries what changed in it since that stream's previous version (a snapshot
    first). Runs on the replica's event loop; `poke` may be called from any code on that loop."""

    def __init__(self, read: Callable[[], Awaitable[EngineStateReport]], push_interval_s: float,
                 block_size: int, kv_capacity_tokens: int, age_bound_s: float,
                 prefixes: KvEventFold | None = None) -> None:
        self._read = read
        self.push_interval_s = push_interval_s
        self.kv_step_tokens = max(1, block_size, kv_capacity_tokens // KV_STEPS)
        self.age_bound_s = age_bound_s
        self.latest: EngineStateReport | None = None
        self.seq = 0
        self._dirty_since: float | None = None  # wall time of the first change not yet published
        self._poked = asyncio.Event()
        self._published: asyncio.Future = asyncio.get_running_loop().create_future()
        self._superseded: deque[tuple[int, float]] = deque(maxlen=CHANGE_HISTORY)  # (seq, when it went out of date)
        self.ages: deque[float] = deque(maxlen=AGE_SAMPLES)
        self.decisions = 0
        self.stale_decisions = 0
        self.prefixes = prefixes
        self.prefix_seq = 0
        self._prefix_log: deque[tuple[int, frozenset[int], frozenset[int]]] = deque(maxlen=PREFIX_LOG)
        self._task = asyncio.create_task(self._run())

    def poke(self) -> None:
        """Something that may move the state happened (cheap: called on every engine step)."""
        if self._dirty_since is None:
            self._dirty_since = time.time()
        self._poked.set()

    async def _run(self) -> None:
        await self.publish()
        while True:
            await self._poked.wait()
            await asyncio.sleep(self.push_interval_s)  # coalesce a burst into one version
            self._poked.clear()
            await self.publish()

    async def publish(self, exact: bool = False) -> EngineStateReport:
        """Read the state now and publish it if a routing signal moved (`exact`: if anything did, KV
        use by a single token or a counter: what a caller asking for the state now is owed); the
        latest version either way."""
        changed_at, self._dirty_since = self._dirty_since, None
        r = await self._read()
        if self.prefixes is not None:
            self._version_prefixes()
            r = replace(r, prefix_seq=self.prefix_seq)
        if self.latest is not None and not (
                moved(self.latest, r, self.kv_step_tokens) or exact and r != self._unversioned(self.latest)):
            return self.latest
        if self.latest is not None:
            self._superseded.append((self.seq, changed_at if changed_at is not None else time.time()))
        self.seq += 1
        self.latest = replace(r, seq=self.seq, decisions=self.decisions, stale_decisions=self.stale_decisions)
        done, self._published = self._published, asyncio.get_running_loop().create_future()
        done.set_result(None)
        return self.latest

    @staticmethod
    def _unversioned(r: EngineStateReport) -> EngineStateReport:
        """`r` as `read` gives it (without what `publish` adds), for comparing."""
        return replace(r, seq=0, decisions=0, stale_decisions=0)

    async def watch(self) -> AsyncIterator[EngineStateReport]:
        """Every version from the current one on, each once; the latest when the reader falls behind.
        With prefixes, each carries the change since the reader's previous one (a snapshot first)."""
        if self.latest is None:
            await self.publish()
        seen, prefixes_seen = 0, None
        while True:
            if self.seq != seen:
                seen = self.seq
                update = self._prefix_update(prefixes_seen)
                if update is None:
                    yield self.latest
                else:
                    prefixes_seen = update.seq
                    yield replace(self.latest, prefixes=update)
                continue  # newer versions may have come while the reader was away
            await asyncio.shield(self._published)

    def _version_prefixes(self) -> None:
        """The fold's changes since the last version make a new one (if there are any)."""
        added, removed = self.prefixes.take_delta()
        if added or removed:
            self.prefix_seq += 1
            self._prefix_log.append((self.prefix_seq, added, removed))

    def _prefix_update(self, seen: int | None) -> PrefixUpdate | None:
        """What a reader that has prefix version `seen` (None: none yet) is owed: nothing, the deltas
        since, or a snapshot when the deltas it misses are no longer kept."""
        if self.prefixes is None or seen == self.prefix_seq:
            return None
        log = self._prefix_log
        if seen is None or not log or log[0][0] > seen + 1:
            self._version_prefixes()  # a snapshot is the fold as of a version: later deltas apply to it exactly
            return PrefixUpdate(self.prefix_seq, 0, self.prefixes.held, snapshot=True)
        added: set[int] = set()
        removed: set[int] = set()
        for s, a, r in log:
            if s > seen:
                added.difference_update(r)
                added.update(a)
                removed.difference_update(a)
                removed.update(r)
        return PrefixUpdate(self.prefix_seq, seen, frozenset(added), frozenset(removed))

    def call_arrived(self, state_seq: int, decided_at: float) -> None:
        """A router's call reached the engine (its ledger moved): measure the age of the state it was
        decided on, and push the change."""
        self.age_at_decision(state_seq, decided_at)
        self.poke()

    def age_at_decision(self, state_seq: int, decided_at: float) -> float:
        """How long the state a router decided on (`state_seq`, at `decided_at`) had been out of date;
        recorded, and counted when over the bound. 0 for a call that names no version."""
        if state_seq <= 0:
            return 0.0
        age = 0.0
        if state_seq < self.seq:
            oldest = self._superseded[0][0] if self._superseded else self.seq
            # versions are consecutive: the one decided on is at its offset (older than the history:
            # as old as the oldest version remembered)
            went_stale = self._superseded[max(0, state_seq - oldest)][1] if self._superseded else decided_at
            age = max(0.0, decided_at - went_stale)
        self.ages.append(age)
        self.decisions += 1
        if age > self.age_bound_s:
            self.stale_decisions += 1
        return age

    def take_ages(self) -> list[float]:
        """The ages recorded since the previous call (for the benchmarks)."""
        out = list(self.ages)
        self.ages.clear()
        return out

    def close(self) -> None:
        self._task.cancel()
