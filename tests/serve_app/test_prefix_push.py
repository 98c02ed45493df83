"""The router's prefix index fed by the engines' pushed KV events, in process: the real `Router`
over stand-in pools whose state stream carries prefix updates (the live proof, with vLLM's own
events, is tests/serve_app/test_kv_events.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

pytest.importorskip("ray.serve")

from disagg.core.prefix_index import prompt_block_hashes  # noqa: E402
from disagg.core.types import Role  # noqa: E402
from factories import StandInPool, in_process_router, shipped_args  # noqa: E402
from serve_app.messages import PrefixUpdate  # noqa: E402

PROMPT = list(range(100, 100 + 700))


class _EnginesWithEvents(StandInPool):
    """Stand-in engines with 128-token KV blocks whose stream carries prefix updates: a snapshot of
    `held[replica]` first, then whatever a test pushes."""

    def __init__(self, role, ids):
        super().__init__(role, ids)
        self.held: dict[str, frozenset[int]] = {i: frozenset() for i in ids}
        self.pending: dict[str, list[PrefixUpdate]] = {i: [] for i in ids}

    def state(self, replica):
        return replace(super().state(replica), block_size=128)

    async def watch_stream(self, router, replica):
        seq = 1
        first = True
        async for r in super().watch_stream(router, replica):
            if first:
                first = False
                yield replace(r, prefixes=PrefixUpdate(seq, 0, self.held[replica], snapshot=True))
            elif self.pending[replica]:
                yield replace(r, prefixes=self.pending[replica].pop(0))
            else:
                yield r

    def push(self, replica: str, update: PrefixUpdate) -> None:
        self.pending[replica].append(update)
        self.changed()


async def _router(prefix_index: str):
    prefill = _EnginesWithEvents(Role.PREFILL, ["p0"])
    decode = _EnginesWithEvents(Role.DECODE, ["d0", "d1"])
    hashes = prompt_block_hashes(PROMPT, 128)
    decode.held["d1"] = frozenset(hashes)
    r = await in_process_router(prefill, decode, shipped_args(prefix_index=prefix_index), poll=False)
    r.registry.push = True
    await r.poll_once()  # finds the replicas and opens their streams: each sends its snapshot
    await asyncio.sleep(0.02)
    return r, decode, hashes


def _held(r) -> dict[str, int]:
    body = json.dumps({"prompt_token_ids": PROMPT}).encode()
    return {k.split("-")[-1]: (v["cached_tokens"], v["source"]) for k, v in r.admin.prefix(body)["instances"].items()}


def test_the_index_is_what_each_engine_pushed_and_follows_its_evictions():
    async def scenario():
        r, decode, hashes = await _router("events")
        before = _held(r)
        decode.push("d1", PrefixUpdate(2, 1, frozenset(), frozenset(hashes[2:])))  # evicted from the tail
        await asyncio.sleep(0.02)
        after = _held(r)
        r.stop_background()
        return before, after

    before, after = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert before == {"p0": (0, "events"), "d0": (0, "events"), "d1": (640, "events")}
    assert after["d1"] == (256, "events")


def test_a_router_told_to_model_the_caches_ignores_the_pushed_prefixes():
    async def scenario():
        r, _, _ = await _router("model")
        held = _held(r)
        r.stop_background()
        return held

    held = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert {k: source for k, (_, source) in held.items()} == {"p0": "none", "d0": "none", "d1": "none"}


def test_a_bad_prefix_query_is_a_400_naming_the_field():
    from serve_app.openai_api import ApiError

    async def scenario():
        r, _, _ = await _router("events")
        r.stop_background()
        errors = []
        for body in (b"[1]", b'{"prompt_token_ids": []}', b'{"prompt_token_ids": [1, "a"]}', b"{"):
            with pytest.raises(ApiError) as e:
                r.admin.prefix(body)
            errors.append((e.value.status, e.value.param))
        return errors

    assert asyncio.run(scenario()) == [(400, "prompt_token_ids")] * 4
