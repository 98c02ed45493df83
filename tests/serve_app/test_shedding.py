"""Overload: the real Router refuses at once with 429 + Retry-After, loose before tight, before
tokenizing, and serves again once the queue drains. In-process, over stand-in engine pools whose
decode engines report work that another router sent them (the engines' own ledgers)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from starlette.requests import Request  # noqa: E402

from serve_app.messages import DecodeChunk  # noqa: E402
from serve_app.router import Router  # noqa: E402
from factories import StandInPool, idle_state, in_process_router, shipped_args  # noqa: E402

MAX_NUM_SEQS = 64  # deployments/local.yaml


class _OneToken:
    """A decode stream of one token."""

    def __init__(self, replica):
        self.replica, self.sent = replica, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.sent:
            raise StopAsyncIteration
        self.sent = True
        return DecodeChunk((7,), "a", "length", replica=self.replica, engine_first_token_s=0.001)

    def cancel(self):
        pass


class _Pool(StandInPool):
    """Every engine holds `queued` calls of 2 s each from another router (its own ledger says so)."""

    queued = 0

    def state(self, replica):
        return idle_state(replica, self.role, {"other": (2.0 * self.queued, self.queued, 0)} if self.queued else None)

    def decode_stream(self, call, replica):
        return _OneToken(replica)


def _request(slo: str) -> Request:
    raw = json.dumps({"model": "tiny-qwen2", "prompt": "overload " * 50, "max_tokens": 1}).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(b"x-slo-class", slo.encode()), (b"content-type", b"application/json")]}, receive)


async def _router(prefill: _Pool, decode: _Pool) -> Router:
    """The real Router in-process over the stand-in pools, with the CPU profile's settings; the tests poll."""
    return await in_process_router(prefill, decode, shipped_args(), poll=False)


def test_overload_is_refused_fast_loose_first_and_served_again_after_the_drain():
    async def scenario():
        prefill, decode = _Pool("prefill", ["p0"]), _Pool("decode", ["d0", "d1"])
        r = await _router(prefill, decode)
        tokenized = []
        for m in r.served.values():  # count renderings: a shed request must not reach vLLM's renderer
            online = m.surface.completion.online_renderer
            render = online.render_completion
            online.render_completion = lambda *a, _r=render, **k: tokenized.append(1) or _r(*a, **k)

        out = []
        for queued in (0, 2 * MAX_NUM_SEQS, 4 * MAX_NUM_SEQS, 0):  # idle, loaded, overloaded, drained
            out.append([])
            decode.queued = queued
            await r.poll_once()
            for slo in ("loose", "tight"):
                before, calls, t0 = len(tokenized), len(prefill.calls) + len(decode.calls), time.perf_counter()
                resp = await r._handle(_request(slo), chat=False)
                out[-1].append(
                    (slo, resp.status_code, resp.headers.get("retry-after"), time.perf_counter() - t0,
                     len(tokenized) - before, len(prefill.calls) + len(decode.calls) - calls))
        return out, r.counters

    (idle, loaded, overloaded, drained), counters = asyncio.run(scenario())
    assert [(s, code) for s, code, *_ in idle] == [("loose", 200), ("tight", 200)]
    assert all(n_tok >= 1 and n_calls == 2 for *_, n_tok, n_calls in idle)  # served: tokenized, prefill + decode
    loose, tight = loaded
    assert loose[1] == 429 and tight[1] == 200  # loose goes first
    # 128 queued, bound 128: one request beyond, 64 at a time, 2 s each → 1 s
    assert loose[2] == "1" and loose[4] == 0 and loose[5] == 0 and loose[3] < 0.05
    assert [c for _, c, *_ in overloaded] == [429, 429]
    assert [int(ra) for _, _, ra, *_ in overloaded] == [5, 1]  # (256−128+1)·2/64 → 5 s; tight: (256−256+1)·2/64 → 1 s
    assert [(s, code) for s, code, *_ in drained] == [("loose", 200), ("tight", 200)]
    assert counters.shed_429 == 3 and counters.rejected_400 == 0


def test_a_router_whose_loop_is_behind_refuses_before_reading_the_body_loose_first():
    async def scenario():
        prefill, decode = _Pool("prefill", ["p0"]), _Pool("decode", ["d0", "d1"])
        r = await _router(prefill, decode)
        await r.poll_once()
        bound = r.loop_lag_bound_s
        out = []
        for lag in (0.0, 1.5 * bound, 3 * bound, 0.0):  # idle, behind, far behind, caught up
            r.loop_lag = SimpleNamespace(lag_s=lag, peak_s=lag)  # as measured
            for slo in ("loose", "tight"):
                read = []
                req = _request(slo)
                receive = req._receive

                async def counting_receive(_receive=receive):
                    read.append(1)
                    return await _receive()
                req._receive = counting_receive
                t0 = time.perf_counter()
                resp = await r._handle(req, chat=False)
                out.append((lag, slo, resp.status_code, resp.headers.get("retry-after"), bool(read),
                            time.perf_counter() - t0))
        return out, r.counters
    out, counters = asyncio.run(scenario())
    codes = [(slo, code) for _, slo, code, *_ in out]
    assert codes == [("loose", 200), ("tight", 200), ("loose", 429), ("tight", 200),
                     ("loose", 429), ("tight", 429), ("loose", 200), ("tight", 200)]
    for _, _, code, retry_after, read, elapsed in out:
        if code == 429:  # refused without reading the body, at once, with a hint
            assert retry_after == "1" and not read and elapsed < 0.05
        else:
            assert read
    assert counters.shed_429 == counters.shed_router_busy == 3 and counters.rejected_400 == 0
