"""Engine state by push (`serve_app.state_push`): versions on change only, bursts coalesced, every
watcher current, and the age of the state behind each decision measured exactly."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import replace

import pytest

from disagg.core.kv_event_fold import KvEventFold
from disagg.core.prefix_index import prompt_block_hashes
from serve_app.messages import EngineStateReport, PrefixUpdate
from serve_app.state_push import PREFIX_LOG, StatePublisher, moved
from tests.factories import idle_state


def in_loop(test):
    """Run an async test body in a fresh event loop."""
    @functools.wraps(test)
    def run():
        asyncio.run(asyncio.wait_for(test(), 10))
    return run


class Engine:
    """A replica's readable state; counts the reads."""

    def __init__(self) -> None:
        self.report = idle_state("r1", "decode")
        self.reads = 0

    async def read(self) -> EngineStateReport:
        self.reads += 1
        return self.report


def test_moved_counts_routing_signals_and_whole_kv_steps_only():
    a = idle_state("r1", "decode")
    assert moved(None, a, 16)
    assert not moved(a, replace(a, prefix_cache_hits=5), 16)  # a counter, not a routing signal
    assert not moved(a, replace(a, kv_used_tokens=15), 16)
    assert moved(a, replace(a, kv_used_tokens=16), 16)
    assert moved(a, replace(a, running=1), 16)
    assert moved(a, replace(a, waiting=2), 16)
    calls = replace(a, admitted={"router-a": (0.5, 1, 0)})
    assert moved(a, calls, 16)
    assert moved(calls, replace(a, admitted={"router-a": (0.5, 1, 1)}), 16)  # hosted
    # a prefill done at its first token: its seconds leave, the call stays; the next version takes it
    assert not moved(calls, replace(a, admitted={"router-a": (0.2, 1, 0)}), 16)


@in_loop
async def test_a_burst_of_changes_is_one_version_and_an_idle_engine_sends_nothing():
    e = Engine()
    pub = StatePublisher(e.read, push_interval_s=0.02, block_size=16, kv_capacity_tokens=0, age_bound_s=0.02)
    got: list[EngineStateReport] = []

    async def reader():
        async for r in pub.watch():
            got.append(r)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.05)
    assert [r.seq for r in got] == [1]  # the current version at once
    e.report = replace(e.report, running=3, kv_used_tokens=480)
    for _ in range(10):  # ten steps within one push interval
        pub.poke()
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.06)
    assert [r.seq for r in got] == [1, 2] and got[-1].running == 3
    reads = e.reads
    pub.poke()  # nothing moved: no new version
    await asyncio.sleep(0.05)
    assert len(got) == 2 and e.reads == reads + 1
    await asyncio.sleep(0.1)  # idle: no read, no message
    assert len(got) == 2 and e.reads == reads + 1
    task.cancel()
    pub.close()


@in_loop
async def test_a_change_below_the_kv_step_is_published_only_when_asked_for_exactly():
    e = Engine()
    pub = StatePublisher(e.read, push_interval_s=0.0, block_size=16, kv_capacity_tokens=128 * 64, age_bound_s=0.02)
    await pub.publish()
    e.report = replace(e.report, kv_used_tokens=16, prefix_cache_hits=3)
    assert (await pub.publish()).seq == 1  # a block and a counter: no routing signal moved
    exact = await pub.publish(exact=True)  # `/admin/state`: the state as it is now
    assert exact.seq == 2 and exact.kv_used_tokens == 16 and exact.prefix_cache_hits == 3
    assert (await pub.publish(exact=True)).seq == 2  # nothing more moved
    pub.close()


@in_loop
async def test_every_watcher_gets_the_latest_version_and_a_slow_one_skips_to_it():
    e = Engine()
    pub = StatePublisher(e.read, push_interval_s=0.0, block_size=16, kv_capacity_tokens=0, age_bound_s=0.02)
    await pub.publish()
    fast = pub.watch()
    assert (await anext(fast)).seq == 1
    slow = pub.watch()
    for running in (1, 2, 3):
        e.report = replace(e.report, running=running)
        await pub.publish()
    assert (await anext(slow)).running == 3  # not a backlog of versions
    assert (await anext(fast)).running == 3
    pub.close()


@in_loop
async def test_the_age_of_a_decision_is_how_long_its_version_had_been_superseded():
    e = Engine()
    pub = StatePublisher(e.read, push_interval_s=0.0, block_size=16, kv_capacity_tokens=0, age_bound_s=0.02)
    await pub.publish()
    now = time.time()
    assert pub.age_at_decision(1, now) == 0.0  # current
    pub.poke()  # the change happens now ...
    changed = time.time()
    e.report = replace(e.report, running=1)
    await pub.publish()  # ... and makes version 2
    assert pub.age_at_decision(1, changed + 0.005) == pytest.approx(0.005, abs=0.002)
    assert pub.stale_decisions == 0
    assert pub.age_at_decision(1, changed + 0.5) == pytest.approx(0.5, abs=0.002)
    assert pub.stale_decisions == 1  # over the 20 ms bound: counted ...
    e.report = replace(e.report, running=2)
    assert (await pub.publish()).stale_decisions == 1  # ... and reported
    assert pub.age_at_decision(0, now) == 0.0  # a call naming no version is not measured
    assert len(pub.take_ages()) == 3 and pub.take_ages() == []
    pub.close()


def _store(fold: KvEventFold, tokens: list[int]) -> tuple[int, ...]:
    """The engine stored `tokens` (one event per 16-token block); the router's hashes of its prefixes."""
    parent = None
    for i in range(0, len(tokens), 16):
        fold.stored(parent, [("b", i, tokens[0])], tokens[i:i + 16], 16)
        parent = ("b", i, tokens[0])
    return prompt_block_hashes(tokens, fold.index_block_tokens)


def _with_prefixes() -> tuple[Engine, KvEventFold, StatePublisher]:
    """An engine, its fold of KV events (64-token index blocks) and a publisher that pushes both."""
    e, fold = Engine(), KvEventFold(64)
    return e, fold, StatePublisher(e.read, push_interval_s=0.0, block_size=16, kv_capacity_tokens=0,
                                   age_bound_s=0.02, prefixes=fold)


@in_loop
async def test_each_watcher_gets_a_snapshot_of_the_prefixes_then_the_net_change_since_its_last_version():
    e, fold, pub = _with_prefixes()
    a = _store(fold, list(range(128)))
    await pub.publish()
    early = pub.watch()
    first = (await anext(early)).prefixes
    assert first.snapshot and first.added == frozenset(a) and first.seq == 1
    b = _store(fold, list(range(500, 564)))
    await pub.publish()
    fold.removed([("b", 112, 0)])  # the tail block of `a` is evicted
    r = await pub.publish()
    assert r.prefix_seq == 3
    update = (await anext(early)).prefixes  # one read for two versions: their net change
    assert (update.snapshot, update.since, update.seq) == (False, 1, 3)
    assert update.added == frozenset(b) and update.removed == frozenset(a[1:])
    late = pub.watch()  # a router that joins now starts from everything held
    assert (await anext(late)).prefixes == PrefixUpdate(3, 0, frozenset(a[:1] + b), snapshot=True)
    e.report = replace(e.report, running=1)  # a version in which the prefixes did not move
    await pub.publish()
    assert (await anext(early)).prefixes is None and (await anext(late)).prefixes is None
    pub.close()


@in_loop
async def test_a_snapshot_is_a_version_so_a_change_undone_after_it_still_reaches_its_reader():
    e, fold, pub = _with_prefixes()
    await pub.publish()
    a = _store(fold, list(range(64)))  # stored after the last version ...
    w = pub.watch()
    first = (await anext(w)).prefixes
    assert first.snapshot and first.added == frozenset(a)  # ... and in the joining reader's snapshot
    fold.removed([("b", 48, 0)])  # then evicted before any publish
    await pub.publish()
    update = (await anext(w)).prefixes
    assert update.since == first.seq and update.removed == frozenset(a)  # the reader hears of it
    pub.close()


@in_loop
async def test_a_watcher_behind_the_kept_deltas_gets_a_snapshot():
    e, fold, pub = _with_prefixes()
    await pub.publish()
    w = pub.watch()
    assert (await anext(w)).prefixes.snapshot
    held = set()
    for i in range(PREFIX_LOG + 2):
        held |= set(_store(fold, [7, i] * 32))
        await pub.publish()
    update = (await anext(w)).prefixes
    assert update.snapshot and update.added == frozenset(held) and update.seq == PREFIX_LOG + 2
    pub.close()


@pytest.mark.stack
def test_live_engines_push_state_only_when_it_moves_and_routers_decide_on_fresh_state(stack):
    """The CPU profile: no state message while idle; under load every call names the version it
    was decided on, and none was older than the engines' bound (deployments/local.yaml)."""
    import httpx

    from disagg.app_client import AppClient

    app = AppClient(stack.base_url, timeout_s=60)

    def totals(state: dict) -> tuple[int, int, int]:
        pushes = sum(r["state_pushes"] for r in state["routers"].values())
        decisions = sum(i["decisions"] for i in state["instances"].values())
        stale = sum(i["stale_decisions"] for i in state["instances"].values())
        return pushes, decisions, stale

    time.sleep(1.0)  # what earlier tests left moving settles
    idle_before = totals(app.state())
    time.sleep(3.0)
    assert totals(app.state()) == idle_before  # idle: nothing sent, nothing decided

    async def load() -> list[int]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120, trust_env=False) as client:
            async def one(i: int) -> int:
                await asyncio.sleep(0.1 * i)  # 10 requests/s for 2.4 s
                r = await client.post("/v1/completions", json={
                    "model": "tiny-qwen2", "prompt": f"request {i} " * (10 + 7 * i), "max_tokens": 8,
                    "ignore_eos": True})
                return r.status_code
            return await asyncio.gather(*(one(i) for i in range(24)))

    assert asyncio.run(load()) == [200] * 24
    pushes, decisions, stale = totals(app.state())
    assert pushes > idle_before[0]
    assert decisions - idle_before[1] >= 48  # a prefill and a decode call each
    assert stale == idle_before[2], f"{stale - idle_before[2]} calls were decided on state older than the bound"


def test_every_engine_method_the_router_pins_takes_the_replica_it_is_pinned_to():
    """The router calls these with `replica=<id>` (`pinned_router`): Serve passes it on to the method."""
    import inspect

    from serve_app.engine_server import EngineServer
    from tests.factories import StandInPool

    pinned = [n for n, v in vars(StandInPool).items() if isinstance(v, property)]
    assert {"prefill", "generate", "watch", "abort", "release_kv", "probe"} <= set(pinned)
    for name in pinned:
        assert "replica" in inspect.signature(getattr(EngineServer, name)).parameters, name
