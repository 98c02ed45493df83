"""An open-loop load generator for the OpenAI-compatible `/v1/completions` endpoint.

Open loop: request i is sent at its scheduled time `t0 + at_s`, whatever happened to the earlier
ones — the dispatcher never waits for a response before sending the next request. A closed-loop
client would slow down when the server does and hide exactly the queueing we want to measure.

Each request streams (SSE) with `ignore_eos`, `temperature 0`, `max_tokens` = the planned output,
`stream_options.include_usage`, an `X-SLO-Class` header and a prompt given as token ids — exactly
`prompt_tokens` ids drawn from 100..999 by a per-request seeded RNG, so prompts differ (no prefix
cache hits) and the token count is exact (no tokenizer in between). A request of a trace with
prefix-block hashes (Mooncake's `hash_ids`, the multi-turn generator's) gets, for each hashed block,
ids drawn from that block's hash instead: requests sharing hashes share those prompt prefixes, and
the engines' prefix caches and the router's prefix index see what the trace says is shared.

Client-side, per request (all on `time.perf_counter`):
* send lag = actual send − scheduled time (how late the generator itself was);
* TTFT = send → first SSE event carrying a choice (a token arrived; its text may be empty when the
  detokenizer holds back part of a multi-byte character);
* TPOT = (last content event − first) / (tokens − 1), tokens from the final `usage` event
  (falling back to the count of content events when the server sends no usage);
* e2e = send → last content event; the `x-disagg-route` header, parsed into a dict.
A request that got a non-200 answer, an error event, no `[DONE]`, a transport error or a timeout
is reported with `error` set; one whose completion token count differs from `max_tokens` too
(`ignore_eos` makes the count exact, so a difference is a contract violation).

Who calls: `disagg.bench.harness` per (policy, trace) run and for its correctness gates. Every
loop is bounded: one task per planned request, each bounded by `timeout_s`, and the final wait by
`timeout_s` plus a slack.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import os
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from disagg.app_client import ROUTE_HEADER, AsyncAppClient, error_message, make_client
from disagg.bench.sse import DONE, SseDecoder
from disagg.core.types import PREFIX_BLOCK_TOKENS
from disagg.stats import percentile

PROMPT_ID_RANGE = (100, 1000)  # token ids drawn from [100, 1000): inside any vocabulary we serve
_HASHED_BLOCK = 0x9E3779B9  # seeds a hashed block's ids: apart from every per-request seed (3 words)


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request to send: when (seconds after the run's start) and what."""

    index: int
    at_s: float
    prompt_tokens: int
    max_tokens: int
    slo_class: str | None = None
    prompt_seed: tuple[int, ...] = (0,)
    prefix_hashes: tuple[int, ...] = ()  # the trace's prefix-block hashes (`PREFIX_BLOCK_TOKENS` each)
    slo_scale: float | None = None  # X-SLO-Scale: its targets, this many times its own unloaded latency


@dataclass(slots=True)
class ClientResult:
    """What the client saw of one request. Times are seconds; offsets are from the run's start."""

    index: int
    scheduled_s: float
    sent_s: float | None = None
    send_lag_s: float | None = None
    status: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    content_events: int = 0
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    max_tokens: int = 0
    prompt_tokens: int = 0
    slo_class: str | None = None
    route: dict[str, str] = field(default_factory=dict)
    text: str = ""
    error: str | None = None

    def as_dict(self, with_text: bool = False) -> dict:
        d = asdict(self)
        if not with_text:
            d.pop("text")
        return d


@dataclass(frozen=True, slots=True)
class LoadStats:
    """The generator's own behaviour during one run."""

    planned: int
    sent: int
    finished: int
    wall_s: float
    send_lag_p50_s: float
    send_lag_p99_s: float
    send_lag_max_s: float
    achieved_rate: float  # sends per second between the first and the last send

    def as_dict(self) -> dict:
        return asdict(self)


def prompt_ids(n: int, seed: tuple[int, ...], prefix_hashes: Sequence[int] = ()) -> list[int]:
    """`n` token ids in PROMPT_ID_RANGE, a pure function of the seed and the prefix hashes: the
    i-th `PREFIX_BLOCK_TOKENS` ids are drawn from the i-th hash (its block; the last may be partial),
    the ids past the hashed blocks from the seed."""
    ids: list[int] = []
    for h in prefix_hashes:
        if len(ids) >= n:
            break
        block = np.random.default_rng([_HASHED_BLOCK, h % 2**64])
        ids += block.integers(*PROMPT_ID_RANGE, size=min(PREFIX_BLOCK_TOKENS, n - len(ids))).tolist()
    if len(ids) < n:
        rng = np.random.default_rng(list(seed))
        ids += rng.integers(*PROMPT_ID_RANGE, size=n - len(ids)).tolist()
    return ids


def prompt_seed(seed: int, stream: str, index: int) -> tuple[int, int, int]:
    """A stable per-request seed from the run seed, a stream name (e.g. the trace) and the index.

    crc32, not hash(): Python's string hash changes from process to process, and a resumed run
    must send the very prompts it would have sent."""
    return (seed & 0xFFFFFFFF, zlib.crc32(stream.encode()), index)


def parse_route(value: str | None) -> dict[str, str]:
    """`x-disagg-route: prefill=a; decode=b; ...` → {"prefill": "a", "decode": "b", ...}."""
    if not value:
        return {}
    out = {}
    for part in value.split(";"):
        k, sep, v = part.strip().partition("=")
        if sep:
            out[k] = v
    return out


def request_body(model: str, req: PlannedRequest) -> bytes:
    return json.dumps({
        "model": model, "prompt": prompt_ids(req.prompt_tokens, req.prompt_seed, req.prefix_hashes), "max_tokens": req.max_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }, separators=(",", ":")).encode()


class ClientShards:
    """Several pooled clients, request i on client i mod k: together a pool of `max_connections`.

    Why not one big pool: httpcore's connection pool (1.0.x) rescans its connection list for every
    connection on each request it admits or releases, a cost quadratic in the connections it holds.
    Measured against the stub at 500 arrivals/s with 0.3 s answers (~150 in flight): one client
    burnt 34 ms of CPU per request and fell to 350 sends/s; sharded it stays near 1 ms. With the
    shards, every request in flight gets its own connection (the pool never queues a send).
    An async context manager; `app` is the app's API on the first shard (admin calls, gates)."""

    def __init__(self, base_url: str, *, timeout_s: float, max_connections: int = 4096, shards: int = 32) -> None:
        per = max(8, -(-max_connections // shards))
        self.clients = [make_client(base_url, timeout_s=timeout_s, max_connections=per) for _ in range(shards)]
        self.app = AsyncAppClient(base_url, http=self.clients[0])

    def pick(self, index: int) -> httpx.AsyncClient:
        return self.clients[index % len(self.clients)]

    async def __aenter__(self) -> "ClientShards":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)


class _Stream:
    """What one response's events say (parsed by `SseDecoder`); timestamps the content events."""

    __slots__ = ("sse", "t_first", "t_last", "events", "usage", "done", "error", "parts")

    def __init__(self) -> None:
        self.sse = SseDecoder()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.events = 0
        self.usage: dict | None = None
        self.done = False
        self.error: str | None = None
        self.parts: list[str] = []

    def feed(self, chunk: bytes, now: float) -> None:
        for payload in self.sse.feed(chunk):
            self._data(payload, now)

    def _data(self, payload: str, now: float) -> None:
        if payload == DONE:
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = f"unparseable SSE event {payload[:120]!r}"
            return
        if "error" in obj:
            err = obj["error"]
            self.error = f"error event: {err.get('message', err) if isinstance(err, dict) else err}"
            return
        choices = obj.get("choices")
        if choices:
            if self.t_first is None:
                self.t_first = now
            self.t_last = now
            self.events += 1
            c = choices[0]
            text = c.get("text")
            if text is None:
                text = (c.get("delta") or {}).get("content") or ""
            self.parts.append(text)
        if obj.get("usage"):
            self.usage = obj["usage"]


async def send_one(client: httpx.AsyncClient, model: str, req: PlannedRequest, body: bytes | None = None, *,
                   t_sched: float | None = None, t0: float | None = None, timeout_s: float = 300.0,
                   clock: Callable[[], float] = time.perf_counter) -> ClientResult:
    """Send one streaming completion now and measure it. `t_sched`/`t0` (clock values) give the
    send lag and the offsets; without them the request counts as sent on time at offset 0."""
    t_send = clock()
    t0 = t_send if t0 is None else t0
    res = ClientResult(index=req.index, scheduled_s=req.at_s, sent_s=t_send - t0,
                       send_lag_s=t_send - (t_sched if t_sched is not None else t_send),
                       max_tokens=req.max_tokens, prompt_tokens=req.prompt_tokens, slo_class=req.slo_class)
    body = body if body is not None else request_body(model, req)
    headers = {"content-type": "application/json"}
    if req.slo_class:
        headers["x-slo-class"] = req.slo_class
    if req.slo_scale is not None:
        headers["x-slo-scale"] = repr(req.slo_scale)
    s = _Stream()
    try:
        await asyncio.wait_for(_exchange(client, body, headers, res, s, clock), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"client timeout after {timeout_s:g} s"
    except httpx.HTTPError as e:
        res.error = f"transport error: {type(e).__name__}: {e}"[:300]
    res.content_events = s.events
    res.text = "".join(s.parts)
    if s.usage:
        res.usage_completion_tokens = s.usage.get("completion_tokens")
        res.usage_prompt_tokens = s.usage.get("prompt_tokens")
    res.tokens = res.usage_completion_tokens if res.usage_completion_tokens is not None else s.events
    if s.t_first is not None:
        res.ttft_s = s.t_first - t_send
        res.e2e_s = s.t_last - t_send
        if res.tokens > 1:
            res.tpot_s = (s.t_last - s.t_first) / (res.tokens - 1)
    if res.error is None:
        if s.error:
            res.error = s.error
        elif res.status == 200 and not s.done:
            res.error = "stream ended without [DONE]"
        elif res.status == 200 and res.tokens != req.max_tokens:
            res.error = (f"received {res.tokens} completion tokens, asked for exactly {req.max_tokens} "
                         "(ignore_eos)")
    return res


async def _exchange(client, body, headers, res: ClientResult, s: _Stream, clock) -> None:
    async with client.stream("POST", "/v1/completions", content=body, headers=headers) as resp:
        res.status = resp.status_code
        res.route = parse_route(resp.headers.get(ROUTE_HEADER))
        if resp.status_code != 200:
            await resp.aread()
            res.error = f"HTTP {resp.status_code}: {error_message(resp)}"
            return
        async for chunk in resp.aiter_raw():
            s.feed(chunk, clock())


async def run_open_loop(
    client: httpx.AsyncClient | ClientShards,
    model: str,
    requests: Sequence[PlannedRequest],
    *,
    on_result: Callable[[ClientResult], Any] | None = None,
    timeout_s: float = 300.0,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[ClientResult], LoadStats]:
    """Send every request at `t0 + at_s` (t0 = now) without waiting for answers; return them all.

    `on_result` is called in the event loop as each request finishes (the harness writes its JSON
    line there), never for a request cancelled because the run itself was interrupted. A request's
    body is built before the dispatcher sleeps until its time, so that work stays off the lag."""
    reqs = sorted(requests, key=lambda r: (r.at_s, r.index))
    pick = client.pick if isinstance(client, ClientShards) else (lambda i: client)
    results: list[ClientResult] = []
    tasks: list[asyncio.Task] = []

    async def one(req: PlannedRequest, body: bytes, t_sched: float, t0: float) -> None:
        res = await send_one(pick(req.index), model, req, body, t_sched=t_sched, t0=t0, timeout_s=timeout_s,
                             clock=clock)
        results.append(res)
        if on_result is not None:
            on_result(res)

    # Objects alive now (the caller's, the test runner's) need never be scanned again: a full
    # collection of them took up to 70 ms under pytest, all of it added to the send lag.
    gc.freeze()
    t0 = clock()
    try:
        for req in reqs:
            body = request_body(model, req)
            t_sched = t0 + req.at_s
            delay = t_sched - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, body, t_sched, t0)))
        if tasks:
            # every task is bounded by timeout_s itself; the slack covers the event loop's own delays
            done, pending = await asyncio.wait(tasks, timeout=timeout_s + 30.0)
            for t in pending:
                t.cancel()
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        gc.unfreeze()
    wall = clock() - t0
    lags = [r.send_lag_s for r in results if r.send_lag_s is not None]
    sends = sorted(r.sent_s for r in results if r.sent_s is not None)
    span = sends[-1] - sends[0] if len(sends) > 1 else 0.0
    stats = LoadStats(
        planned=len(reqs), sent=len(sends), finished=len(results), wall_s=wall,
        send_lag_p50_s=percentile(lags, 50), send_lag_p99_s=percentile(lags, 99),
        send_lag_max_s=max(lags) if lags else math.nan,
        achieved_rate=(len(sends) - 1) / span if span > 0 else math.nan,
    )
    return results, stats


@contextlib.contextmanager
def realtime_priority(enabled: bool = True):
    """Run the block under SCHED_FIFO (priority 1) in this thread; yields None or why it could not.

    Why: on a small machine the app under test saturates every core, and a load generator in the
    normal scheduling class then sleeps through its own timers. Measured on the 2-core reference
    VM with the CPU stack busy: the generator's event loop woke up to 1.2 s late (send lag P99
    0.3–1.5 s, client CPU ~0 during the stalls), `nice -20` did not help (autogroup scheduling),
    SCHED_FIFO brought the P99 to 4 ms. The generator needs little CPU and mostly waits in epoll,
    and the kernel's RT throttling (sched_rt_runtime_us, 95% by default) keeps other work
    running even so. Threads started inside the block inherit the policy; the previous policy
    is restored on exit."""
    if not enabled:
        yield None
        return
    try:
        old_policy, old_param = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError) as e:  # not root / no CAP_SYS_NICE, or not Linux
        yield f"could not switch the generator to SCHED_FIFO: {e}"
        return
    try:
        yield None
    finally:
        os.sched_setscheduler(0, old_policy, old_param)


def event_loop_runner():
    """uvloop's runner when it is installed (less per-request CPU in the generator), else asyncio's."""
    try:
        import uvloop

        return uvloop.run
    except ImportError:  # pragma: no cover - uvloop ships with ray[serve]'s uvicorn[standard]
        return asyncio.run
