"""Two router replicas over the same engines do not herd: each sees the other's admitted work.

The routers run in-process (the real `Router` class, its registry, dispatcher and ledger) over
stand-in engine pools that keep an engine's ledger of the calls they serve exactly as
`EngineServer` does (`AdmittedWork`, added when a call arrives, removed when it ends) and report
it in their state. The live proof that two replicas serve and spread traffic is the CPU profile
itself (deployments/local.yaml runs two routers; tests/serve_app/test_serving.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from starlette.requests import Request  # noqa: E402

from disagg.core.ledger import AdmittedWork  # noqa: E402
from disagg.core.types import Role  # noqa: E402
from serve_app.messages import DecodeChunk  # noqa: E402
from factories import StandInPool, idle_state, in_process_router, shipped_args  # noqa: E402
from serve_app.router import Router  # noqa: E402



class _Held:
    """A decode stream that holds after its first token until released, with the engine's ledger
    entry for the call open from the call's arrival until the stream ends (as in EngineServer)."""

    def __init__(self, engines: "_Engines", call, replica: str):
        self.engines, self.call, self.replica, self.i = engines, call, replica, 0
        engines.admitted[replica].add(call.router, call.work_s)
        engines.decoded_on.append(replica)
        engines.changed()  # pushed to the routers watching (when they watch)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.i == 1:
            await self.engines.release.wait()
        if self.i == 2:
            self.engines.admitted[self.replica].remove(self.call.router, self.call.work_s)
            self.engines.changed()
            raise StopAsyncIteration
        self.i += 1
        return DecodeChunk((7,), "a", "length" if self.i == 2 else None,
                           replica=self.replica if self.i == 1 else None, engine_first_token_s=0.001)

    def cancel(self):
        pass


class _Engines(StandInPool):
    """A pool of stand-in engines: each keeps `AdmittedWork` like EngineServer and reports it in its
    state; decodes hold until released."""

    def __init__(self, role: Role, ids: list[str]):
        super().__init__(role, ids)
        self.admitted = {r: AdmittedWork() for r in ids}
        self.release = asyncio.Event()
        self.decoded_on: list[str] = []

    def state(self, replica):
        return idle_state(replica, self.role, self.admitted[replica].totals())

    async def prefill_reply(self, call, replica):
        self.admitted[replica].add(call.router, call.work_s)
        self.admitted[replica].remove(call.router, call.work_s)
        return await super().prefill_reply(call, replica)

    def decode_stream(self, call, replica):
        return _Held(self, call, replica)


def _args() -> dict:
    return shipped_args(policy="marginal_cost")


async def _router(prefill: _Engines, decode: _Engines) -> Router:
    return await in_process_router(prefill, decode, _args())


def _request(i: int) -> Request:
    raw = json.dumps({"model": "tiny-qwen2", "prompt": f"request {i} " * 20, "max_tokens": 200,
                      "ignore_eos": True}).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}, receive)


@pytest.mark.parametrize("engines_report_ledgers, expect_spread", [(True, True), (False, False)])
def test_a_second_router_avoids_the_instance_the_first_one_loaded(engines_report_ledgers, expect_spread):
    """Router A sends a long request to a decode instance; router B, having polled since, sends the
    next one elsewhere. Without the engines' ledgers B sees two idle instances and herds."""

    async def scenario():
        prefill, decode = _Engines(Role.PREFILL, ["p0"]), _Engines(Role.DECODE, ["d0", "d1"])
        a, b = await _router(prefill, decode), await _router(prefill, decode)
        assert a.router_id != b.router_id
        if not engines_report_ledgers:
            decode.admitted = {r: _Blind() for r in decode.ids}
        first = asyncio.create_task(a._handle(_request(0), chat=False))
        while len(decode.decoded_on) < 1:
            await asyncio.sleep(0.001)
        await b.poll_once()  # B's next poll: A's request is on the engine's ledger now
        second = asyncio.create_task(b._handle(_request(1), chat=False))
        while len(decode.decoded_on) < 2:
            await asyncio.sleep(0.001)
        decode.release.set()
        await asyncio.gather(first, second)
        return decode.decoded_on

    on = asyncio.run(scenario())
    assert (on[0] != on[1]) is expect_spread, on


class _Blind(AdmittedWork):
    """An engine that does not report its ledger (what one router alone would see of the other)."""

    def totals(self):
        return {}


def test_a_second_router_learns_of_the_first_ones_request_by_push_without_a_poll():
    """The engines push their ledgers as they change: router B, which never polls after start,
    sends the second request away from the instance router A just loaded."""

    async def scenario():
        prefill, decode = _Engines(Role.PREFILL, ["p0"]), _Engines(Role.DECODE, ["d0", "d1"])
        a, b = await _router(prefill, decode), await _router(prefill, decode)
        for r in (a, b):
            r.registry.push = True
            await r.poll_once()  # the start-up poll: finds the replicas and opens their streams
        await asyncio.sleep(0.01)
        pushed_before = b.registry.pushes
        first = asyncio.create_task(a._handle(_request(0), chat=False))
        while len(decode.decoded_on) < 1:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the push's one hop (in-process: one loop turn)
        assert b.registry.pushes > pushed_before
        second = asyncio.create_task(b._handle(_request(1), chat=False))
        while len(decode.decoded_on) < 2:
            await asyncio.sleep(0.001)
        decode.release.set()
        await asyncio.gather(first, second)
        seen = [c.state_seq for name, _, c in decode.calls if name == "decode"]
        for r in (a, b):
            r.stop_background()
        return decode.decoded_on, seen

    on, seen = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert on[0] != on[1], on
    assert all(s >= 1 for s in seen), seen  # each call names the state version it was decided on


def test_a_replica_whose_stream_breaks_and_misses_the_next_poll_is_dropped_at_once():
    async def scenario():
        prefill, decode = _Engines(Role.PREFILL, ["p0"]), _Engines(Role.DECODE, ["d0", "d1"])
        a = await _router(prefill, decode)
        a.registry.push = True
        await a.poll_once()
        await asyncio.sleep(0.01)
        decode.ids.remove("d1")  # the replica goes away: its stream breaks at the next push
        decode.changed()
        await asyncio.sleep(0.01)
        assert a.registry._poll_now.is_set()  # the poller is woken rather than waiting its period
        await a.poll_once()
        a.stop_background()
        return sorted(i.instance_id for i in a.registry.instances.values()), a.counters.instances_lost

    ids, lost = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert lost == 1 and not any(i.endswith("d1") for i in ids), ids


class _Peers:
    """Serve's `DeploymentHandle.broadcast(method).results_async(...)` over in-process routers."""

    def __init__(self, routers: list[Router]):
        self.routers = routers

    def broadcast(self, method: str, *args):
        routers = self.routers

        class _Replies:
            async def results_async(self, timeout_s: float, return_exceptions: bool):
                return [await getattr(r, method)(*args) for r in routers]
        return _Replies()


def test_a_replica_starting_beside_others_routes_by_their_admin_changes():
    """Serve replaces a router replica (or adds one): it starts from the config, then takes the
    policy and cost model its peers were switched to since, so no replica routes by older rules.
    Each kind of change is kept once, the latest."""

    async def scenario():
        prefill, decode = _Engines(Role.PREFILL, ["p0"]), _Engines(Role.DECODE, ["d0", "d1"])
        old = await _router(prefill, decode)
        for name in ("least_loaded", "slo_goodput", "round_robin"):
            reply = await old._admin_change("set_policy", json.dumps({"name": name}).encode())
            assert reply.status_code == 200, reply.body
        await old._admin_change("set_cost_model", json.dumps({"cost_model": "a40"}).encode())
        new = await _router(prefill, decode)
        assert new.admin.state()["policy"] == "marginal_cost"  # the config's
        new._peers = _Peers([old, new])
        await new._adopt_admin_changes()
        kept = (await old.admin_changes())[1]
        return new.admin.state(), old.admin.state(), kept

    new, old, kept = asyncio.run(scenario())
    assert (new["policy"], new["cost_model"]) == (old["policy"], old["cost_model"]) == ("round_robin", "a40-qwen2.5-3b")
    assert [op for op, _ in kept] == ["set_policy", "set_cost_model"]
