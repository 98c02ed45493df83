"""Failing over without losing the answer or stranding KV.

- Mid-stream migration: a decode instance that fails after streaming began is replaced by
  another one, which prefills the prompt plus the tokens so far and streams the rest; the client
  gets the whole answer in one stream.
- A prefill's KV that no decode will pull (the client left first, or the decode fell back to a
  local prefill) is released on the prefill engine at once, through the decode engine.

The real `Router` runs in-process over stand-in engines that "decode greedily": each next token
is a function of every token before it (prompt and output alike), as a model's greedy choice is.
So a continuation built from the wrong prompt, or with the tokens so far counted wrong, gives a
different answer than the uninterrupted run. Their text is the served tokenizer's, made as vLLM
makes it (tests/factories.py `vllm_text`), its faults at a migration's seam included. The live
proofs (an EngineCore killed by pid mid-stream; a client leaving before its first token, seen on
the engines' own KV counters) are in tests/serve_app/test_faults.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from starlette.requests import Request  # noqa: E402

from disagg.bench.sse import SseDecoder  # noqa: E402
from serve_app.messages import DecodeChunk  # noqa: E402
from factories import StandInPool, in_process_router, shipped_args, stream_text, stream_token_ids, tiny_tokenizer, vllm_text  # noqa: E402

MAX_TOKENS = 12


def greedy_next(context: list[int]) -> int:
    """The stand-in model's greedy token after `context`."""
    return (sum(context) * 31 + len(context)) % 997 + 3


class _Greedy:
    """A decode stream of `greedy_next` tokens, two per chunk, failing after `fail_after` tokens."""

    def __init__(self, call, replica: str, fail_after: int | None):
        self.prompt = list(call.prompt_token_ids)
        self.context = list(call.prompt_token_ids)
        self.left = call.params.max_tokens
        self.replica, self.fail_after, self.sent, self.cancelled = replica, fail_after, 0, False
        self.text = ""  # what it streamed
        stop = call.params.stop
        self.stop = [stop] if isinstance(stop, str) else list(stop or ())
        self.hold = max(map(len, self.stop)) - 1 if self.stop else 0  # what vLLM holds back for them

    def next_token(self) -> int:
        return greedy_next(self.context)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.left == 0:
            raise StopAsyncIteration
        if self.fail_after is not None and self.sent >= self.fail_after:
            raise RuntimeError("EngineDeadError: EngineCore encountered an issue")
        ids = []
        for _ in range(min(2, self.left)):
            ids.append(self.next_token())
            self.context.append(ids[-1])
        self.left -= len(ids)
        first = self.sent == 0
        self.sent += len(ids)
        text = vllm_text(tiny_tokenizer(), self.prompt, self.context[len(self.prompt):])
        finish = "length" if self.left == 0 else None
        hit = min((text.index(s) for s in self.stop if s in text), default=None)
        if hit is not None:  # as vLLM: the text ends before the stop string, and so does the answer
            text, finish, self.left = text[:hit], "stop", 0
        elif finish is None and self.hold:
            text = text[:max(len(self.text), len(text) - self.hold)]
        chunk, self.text = text[len(self.text):], text
        return DecodeChunk(tuple(ids), chunk, finish,
                           replica=self.replica if first else None, engine_first_token_s=0.001 if first else None)

    def cancel(self):
        self.cancelled = True


class _Decoders(StandInPool):
    """Decode engines; those in `failing` fail after `fail_after` tokens of every stream."""

    def __init__(self, ids, failing=(), fail_after=4):
        super().__init__("decode", ids)
        self.failing, self.fail_after, self.streams = set(failing), fail_after, []

    def decode_stream(self, call, replica):
        s = _Greedy(call, replica, self.fail_after if replica in self.failing else None)
        self.streams.append(s)
        return s


def _request(stream: bool, **extra) -> Request:
    raw = json.dumps({"model": "tiny-qwen2", "prompt": "migrate me", "max_tokens": MAX_TOKENS,
                      "temperature": 0, "stream": stream, **extra}).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}, receive)


async def _router(decode: _Decoders, migration_limit: int | None = None, log: Path | None = None):
    router = {"request_log": str(log) if log else None}
    if migration_limit is not None:
        router["migration_limit"] = migration_limit
    return await in_process_router(StandInPool("prefill", ["p0"]), decode, shipped_args(**router))


async def _text(resp, stream: bool) -> tuple[int, str, str | None]:
    """(status, text, the error message if any) of a completion, streamed or not."""
    if not stream:
        body = json.loads(resp.body)
        return resp.status_code, body.get("choices", [{}])[0].get("text", ""), body.get("error", {}).get("message")
    sse = SseDecoder()
    text, errors = stream_text([data async for raw in resp.body_iterator for data in sse.feed(raw)])
    return resp.status_code, text, errors[-1] if errors else None


def _run(decode: _Decoders, stream: bool, **kw):
    async def scenario():
        r = await _router(decode, **{k: v for k, v in kw.items() if k in ("migration_limit", "log")})
        resp = await r._handle(_request(stream, **kw.get("extra", {})), chat=False)
        return (*await _text(resp, stream), r.counters)
    return asyncio.run(scenario())


def _first_fails_after(tokens: int) -> _Decoders:
    """Two decode instances: whichever the policy picks first fails after `tokens` tokens; the
    continuation runs to the end."""
    decode = _Decoders(["d0", "d1"], failing=["d0", "d1"], fail_after=tokens)
    streams = decode.decode_stream

    def first_fails(call, replica):
        s = streams(call, replica)
        if len(decode.streams) > 1:
            s.fail_after = None
        return s
    decode.decode_stream = first_fails
    return decode


@pytest.mark.parametrize("stream", [True, False])
def test_a_decode_failing_mid_stream_is_continued_elsewhere_with_the_same_answer(stream, tmp_path):
    plain = _Decoders(["d0", "d1"])
    status, clean, _, _ = _run(plain, stream)
    assert status == 200 and clean == plain.streams[0].text and plain.streams[0].sent == MAX_TOKENS

    decode = _first_fails_after(4)
    log = tmp_path / "requests.jsonl"
    status, text, error, counters = _run(decode, stream, log=log)

    assert (status, error) == (200, None)
    assert text == clean  # the whole answer, in one stream, as if nothing had failed
    first, second = decode.streams
    assert second.replica != first.replica
    assert first.sent == 4 and first.cancelled
    assert decode.calls[1][2].prompt_token_ids == first.context  # the prompt + the 4 tokens so far
    assert decode.calls[1][2].kv_transfer_params is None  # prefilled there
    assert decode.calls[1][2].params.max_tokens == MAX_TOKENS - 4
    assert counters.migrations == 1 and counters.served == 1 and counters.failed == 0
    record = json.loads(log.read_text().splitlines()[-1])
    assert record["migrated_from"] == [f"decode-{first.replica}"] and record["decode"] == f"decode-{second.replica}"
    assert record["migrated_after_tokens"] == [4]
    assert record["output_tokens"] == MAX_TOKENS and record["error"] is None


@pytest.mark.parametrize("stream", [True, False])
def test_the_token_ids_of_a_migrated_answer_are_the_prompt_and_every_token_once(stream):
    decode = _first_fails_after(4)

    async def scenario():
        r = await _router(decode)
        resp = await r._handle(_request(stream, return_token_ids=True), chat=False)
        if not stream:
            choice = json.loads(resp.body)["choices"][0]
            return choice["prompt_token_ids"], choice["token_ids"]
        sse = SseDecoder()
        return stream_token_ids([data async for raw in resp.body_iterator for data in sse.feed(raw)])
    prompt, output = asyncio.run(scenario())

    first, second = decode.streams
    assert prompt == decode.calls[0][2].prompt_token_ids
    assert output == second.context[len(prompt):]  # the 4 tokens before the failure, then the rest
    assert len(output) == MAX_TOKENS and output[:4] == first.context[len(prompt):]


ANSWER = " café ☕ 中文 naïve, done. Then more"  # characters of 1 to 4 bytes, split across tokens


class _Scripted(_Greedy):
    """Streams the tokens of ANSWER, going on from wherever the prompt left it (after the request's
    own prompt of `origin` tokens), so a continuation gives the rest."""
    origin = 0

    def next_token(self) -> int:
        return tiny_tokenizer().encode(ANSWER)[len(self.context) - self.origin]


class _ScriptedDecoders(_Decoders):
    def decode_stream(self, call, replica):
        if not self.streams:
            _Scripted.origin = len(call.prompt_token_ids)
        s = _Scripted(call, replica, self.fail_after if not self.streams else None)
        self.streams.append(s)
        return s


@pytest.mark.parametrize("stop", [None, ". Then"])
def test_a_migration_splitting_a_character_or_a_stop_string_loses_and_repeats_no_text(stop):
    """vLLM's own text would repeat the prompt after a seam inside a character, and lose what it held
    back for a stop string: the router's is the uninterrupted text, the stop string applied."""
    n = len(tiny_tokenizer().encode(ANSWER))
    want = ANSWER[:ANSWER.index(stop)] if stop else ANSWER
    migrated = 0
    for fail_after in range(1, n - 1):
        decode = _ScriptedDecoders(["d0", "d1"], failing=["d0", "d1"], fail_after=fail_after)
        status, text, error, counters = _run(decode, True, extra={"max_tokens": n, "stop": stop})
        assert (status, error, text) == (200, None, want), fail_after
        if len(decode.streams) == 1:
            continue  # the engine found the stop string before it was to fail
        first, second = decode.streams
        assert counters.migrations == 1 and not decode.calls[1][2].params.stop
        assert second.cancelled == bool(stop)  # the router found the stop string; the engine would go on
        migrated += 1
    assert migrated >= n // 2 - 4


@pytest.mark.parametrize("stream", [True, False])
def test_without_migration_the_failure_is_a_clean_error(stream):
    decode = _Decoders(["d0", "d1"], failing=["d0", "d1"])
    status, text, error, counters = _run(decode, stream, migration_limit=0)
    assert error is not None and "decode failed after 4 tokens" in error
    if stream:  # the tokens so far were sent; the stream ends with an error event
        assert status == 200 and text == decode.streams[0].text and decode.streams[0].sent == 4
    else:
        assert status == 502
    assert counters.migrations == 0 and counters.failed == 1 and counters.served == 0


def test_the_migration_limit_bounds_the_attempts():
    decode = _Decoders(["d0", "d1", "d2"], failing=["d0", "d1", "d2"], fail_after=2)
    status, text, error, counters = _run(decode, True, migration_limit=1)
    assert "decode failed after 4 tokens" in error  # 2 tokens on each of two instances, then no third
    first, second = decode.streams
    assert text == vllm_text(tiny_tokenizer(), first.prompt, second.context[len(first.prompt):])
    assert counters.migrations == 1 and counters.failed == 1


def test_structured_output_is_not_migrated():
    # its grammar would restart mid-answer: an error is honest, a continuation would not be
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    status, _, error, counters = _run(_Decoders(["d0", "d1"], failing=["d0", "d1"]), False,
                                      extra={"response_format": fmt})
    assert status == 502 and "structured-output request is not migrated" in error
    assert counters.migrations == 0


class _Stalled(_Greedy):
    """A decode stream that never gives its first token (its engine waits for KV that is slow to come)."""

    async def __anext__(self):
        await asyncio.sleep(3600)


def test_a_request_that_goes_away_before_its_pull_releases_the_prefills_kv():
    # the prefill engine would otherwise hold the prompt's blocks until their lease runs out
    decode = _Decoders(["d0", "d1"])
    decode.decode_stream = lambda call, replica: decode.streams.append(_Stalled(call, replica, None)) or decode.streams[-1]

    async def scenario():
        r = await _router(decode)
        task = asyncio.get_running_loop().create_task(r._handle(_request(True), chat=False))
        for _ in range(100):  # until the decode call is waiting for its first token
            await asyncio.sleep(0.01)
            if decode.streams:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)  # the release runs in the background
        return r.counters
    counters = asyncio.run(scenario())
    (_, pinned, call), = [c for c in decode.calls if c[0] == "decode"]
    releases = [c for c in decode.calls if c[0] == "release_kv"]
    assert decode.streams[0].cancelled and counters.cancelled == 1
    # on the decode engine the pull was meant for, with the prefill's transfer params
    assert [(replica, kv) for _, replica, (_, kv) in releases] == [(pinned, call.kv_transfer_params)]


def test_a_decode_retried_with_a_local_prefill_releases_the_prefills_kv():
    class _FailsOnKv(_Decoders):
        def decode_stream(self, call, replica):
            s = super().decode_stream(call, replica)
            s.fail_after = 0 if call.kv_transfer_params else None  # the pull fails; a local prefill works
            return s
    decode = _FailsOnKv(["d0", "d1"])
    status, text, error, counters = _run(decode, False)
    assert (status, error) == (200, None) and text == decode.streams[-1].text and decode.streams[-1].sent == MAX_TOKENS
    first, retry = [c for c in decode.calls if c[0] == "decode"]
    assert first[2].kv_transfer_params and retry[2].kv_transfer_params is None
    releases = [c for c in decode.calls if c[0] == "release_kv"]
    # through the engine now serving it (the one the pull was meant for may be dead)
    assert [(replica, kv) for _, replica, (_, kv) in releases] == [(retry[1], first[2].kv_transfer_params)]
    assert counters.decode_retries == 1


def test_a_request_cancelled_during_its_prefill_aborts_it_and_releases_kv_it_finished_with():
    # the engine finishes the prefill as the cancellation arrives: its KV must not wait for a pull
    class _SlowPrefill(StandInPool):
        done = None

        async def prefill_reply(self, call, replica):
            await self.done.wait()
            return await super().prefill_reply(call, replica)
    prefill, decode = _SlowPrefill("prefill", ["p0"]), _Decoders(["d0", "d1"])

    async def scenario():
        prefill.done = asyncio.Event()
        r = await _router(decode)
        r.served["tiny-qwen2"].handles[r.served["tiny-qwen2"].start_role] = prefill
        task = asyncio.get_running_loop().create_task(r._handle(_request(True), chat=False))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if prefill.calls:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.01)
        aborted_while_running = [c for c in prefill.calls if c[0] == "abort"]
        prefill.done.set()  # ... but it had finished all the same
        await asyncio.sleep(0.05)
        return aborted_while_running
    aborted = asyncio.run(scenario())
    (_, pinned, call), = [c for c in prefill.calls if c[0] == "prefill"]
    assert [(replica, rid) for _, replica, rid in aborted] == [(pinned, call.request_id)]
    assert not [c for c in decode.calls if c[0] == "decode"]
    releases = [c for c in decode.calls if c[0] == "release_kv"]
    assert [kv for _, _, (_, kv) in releases] == [{"remote": pinned}]


def test_with_no_prefill_instance_up_the_decode_instances_prefill_for_themselves():
    # the whole prefill pool is being replaced: serve, do not 503 for the minute it takes
    decode = _Decoders(["d0", "d1"])

    async def scenario():
        r = await in_process_router(StandInPool("prefill", []), decode, shipped_args())
        resp = await r._handle(_request(False), chat=False)
        return resp, r.counters
    resp, counters = asyncio.run(scenario())
    status, text, error = asyncio.run(_text(resp, False))
    assert (status, error) == (200, None) and text == decode.streams[0].text and decode.streams[0].sent == MAX_TOKENS
    (_, replica, call), = decode.calls
    assert call.kv_transfer_params is None  # prefilled on the decode instance itself
    r = route(resp)
    assert r["prefill"] == r["decode"] == f"decode-{replica}" and r["fallback"] == "no_prefill_instance"
    assert counters.local_prefill_fallbacks == 1 and counters.served == 1


def route(resp) -> dict:
    return dict(part.split("=", 1) for part in resp.headers["x-disagg-route"].split("; ") if "=" in part)
