"""Exact prefix state on the real stack: the vLLM CPU engines publish their KV-cache events, each
replica folds them, and every router's prefix index follows the engines, evictions included."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

pytestmark = pytest.mark.stack
MODEL = "tiny-qwen2"
VOCAB = 2048  # the tiny model's
PROMPT = 700  # tokens: 5 full blocks of the CPU platform's 128
LOAD_PROMPT = 1900


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.base_url, timeout=httpx.Timeout(120.0)) as c:
        yield c


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def complete(client, ids: list[int], max_tokens: int = 4) -> httpx.Response:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": max_tokens,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r


def route(r: httpx.Response) -> dict:
    return dict(part.split("=", 1) for part in r.headers["x-disagg-route"].split("; "))


def held(client, ids: list[int]) -> dict[str, int]:
    """{instance: cached tokens of `ids`} as the answering router replica's index has it; every
    entry from the engine's events."""
    r = client.post("/admin/prefix", json={"prompt_token_ids": ids})
    assert r.status_code == 200, r.text
    instances = r.json()["instances"]
    assert {v["source"] for v in instances.values()} == {"events"}, instances
    return {k: v["cached_tokens"] for k, v in instances.items()}


def held_by_every_router(client, ids: list[int], expect: dict[str, int], timeout_s: float = 5.0) -> None:
    """Until each router replica (the proxy picks one per call: 8 reads in a row) says `expect`."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = [held(client, ids) for _ in range(8)]
        if all(v == expect for v in views):
            return
        assert time.monotonic() < deadline, f"the routers' indexes never agreed on {expect}: {views}"
        time.sleep(0.05)


def logged(stack, rid: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in (stack.run_dir / "runs" / "requests.jsonl").read_text().splitlines():
            if (d := json.loads(line))["id"] == rid:
                return d
        time.sleep(0.1)
    raise AssertionError(f"request {rid} is not in the request log")


def test_every_instance_follows_its_engines_events_and_none_was_missed(client):
    instances = client.get("/admin/state").json()["instances"]
    assert {v["prefix_source"] for v in instances.values()} == {"events"}
    assert {k: v["kv_events_missed"] for k, v in instances.items()} == {k: 0 for k in instances}


def test_an_eviction_under_load_reaches_every_routers_index_as_vllm_reports_it(client, stack):
    """A prompt is cached where it ran, to the block, on every router replica; then requests whose
    KV is 2.5 times an engine's cache run through: vLLM evicts the prompt to make room, and the
    index says so before the prompt comes back, when vLLM's own count of cached tokens is the
    index's prediction."""
    assert client.post("/admin/reset_prefix_cache").status_code == 200
    rng = random.Random(11)
    ids = random_ids(rng, PROMPT)
    first = route(complete(client, ids))
    full = (PROMPT - 1) // 128 * 128
    where = {first["served_prefill"]: full, first["served_decode"]: full}
    instances = client.get("/admin/state").json()["instances"]
    held_by_every_router(client, ids, {k: where.get(k, 0) for k in instances})
    again = complete(client, ids)
    assert route(again)["served_prefill"] == first["served_prefill"]  # the CPU profile has one prefill engine
    record = logged(stack, again.json()["id"])
    assert record["prefill_cached_tokens"] == record["cached_tokens_predicted"]["prefill"] == full
    # the decode side, against what the decode engine's events said it held when the call came
    assert record["decode_held_tokens"] == record["cached_tokens_predicted"]["decode"]

    capacity = max(v["kv_capacity_tokens"] for v in instances.values())
    n = int(2.5 * capacity / LOAD_PROMPT) + 1
    seen: dict[str, int] = {}  # new prompt tokens through each instance

    async def load() -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=300, trust_env=False) as c:
            gate = asyncio.Semaphore(32)

            async def one(i: int) -> None:
                async with gate:
                    r = await c.post("/v1/completions", json={
                        "model": MODEL, "prompt": random_ids(random.Random(1000 + i), LOAD_PROMPT),
                        "max_tokens": 8, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    for side in ("served_prefill", "served_decode"):
                        iid = route(r)[side]
                        seen[iid] = seen.get(iid, 0) + LOAD_PROMPT
            await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(load())
    evicted = {iid for iid, tokens in seen.items() if tokens > 1.1 * capacity}
    assert first["served_prefill"] in evicted  # every prefill ran on one engine
    after = held(client, ids)
    assert {k: after[k] for k in evicted} == {k: 0 for k in evicted}, after
    back = complete(client, ids)
    assert route(back)["served_prefill"] == first["served_prefill"]
    record = logged(stack, back.json()["id"])
    assert record["prefill_cached_tokens"] == record["cached_tokens_predicted"]["prefill"] == 0
    assert record["decode_held_tokens"] == record["cached_tokens_predicted"]["decode"]
    state = client.get("/admin/state").json()
    assert sum(v["kv_events_missed"] for v in state["instances"].values()) == 0
