"""Client errors are client errors: the real Router in-process, with stand-in engine handles.

- a seeded generator of 1,200+ bad requests, each answered 400 in the OpenAI error shape naming the
  right field, none reaching an engine;
- an engine's own validation error (`InvalidRequest`, delivered by Ray as a `RayTaskError`) is a 400
  naming the field, tried on no other instance and counted as no failure or retry;
- body-size limit (413), an oversize prompt refused fast, pathological JSON, 404/405 in the OpenAI shape;
- the full sampling surface reaches the engine's sampling dict, and logprobs come back in the
  OpenAI shapes, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict

import pytest

pytest.importorskip("ray.serve")
from ray.exceptions import RayTaskError  # noqa: E402
from starlette.requests import Request  # noqa: E402

from disagg.bench.sse import DONE, SseDecoder  # noqa: E402
from serve_app.messages import DecodeChunk, InvalidRequest, TokenLogprob  # noqa: E402
from factories import StandInPool, in_process_router, shipped_args  # noqa: E402
from serve_app.router import Router, fastapi_app  # noqa: E402

MODEL = "tiny-qwen2"
VOCAB = 2048  # the tiny model's tokenizer
N_GENERATED = 1200


# --- stand-in engines ------------------------------------------------------------------------------

def _ray_error(cause: Exception) -> Exception:
    """What a replica's exception looks like to the caller: a RayTaskError that is also the cause."""
    return RayTaskError("EngineServer.decode", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


class _Stream:
    """A decode stream of `n` one-token chunks, with logprobs when the sampling dict asks; or an error."""

    def __init__(self, replica: str, params, error: Exception | None):
        self.replica, self.n, self.i, self.error = replica, params.max_tokens, 0, error
        self.top = params.logprobs

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.error is not None:
            raise self.error
        if self.i >= self.n:
            raise StopAsyncIteration
        self.i += 1
        token = "ab"[self.i % 2]
        lps = None
        if self.top is not None:
            alternatives = (("a", -0.25), ("b", -1.5), ("c", float("-inf")))[:self.top]
            lps = (TokenLogprob(token, -0.25 if token == "a" else -1.5, alternatives),)
        first = self.i == 1
        return DecodeChunk((7,), token, "length" if self.i == self.n else None, replica=self.replica if first else None,
                           engine_first_token_s=0.001 if first else None, logprobs=lps)

    def cancel(self):
        pass


class _Pool(StandInPool):
    """Replicas `ids`. `error`: what every prefill or decode call raises (None: they work)."""

    def __init__(self, role: str, ids: list[str], error: Exception | None = None):
        super().__init__(role, ids)
        self.error = error

    async def prefill_reply(self, call, replica):
        if self.error is not None:
            raise self.error
        return await super().prefill_reply(call, replica)

    def decode_stream(self, call, replica):
        return _Stream(replica, call.params, self.error)


def _args(**router) -> dict:
    return shipped_args(num_replicas=1, **router)


def _request(raw: bytes, path: str = "/v1/completions", headers: dict | None = None) -> Request:
    chunks = [raw[i:i + 65536] for i in range(0, len(raw), 65536)] or [b""]

    async def receive():
        body = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}
    return Request({"type": "http", "method": "POST", "path": path,
                    "headers": [(k.lower().encode(), v.encode()) for k, v in {"content-type": "application/json", **(headers or {})}.items()]}, receive)


async def _router(prefill: _Pool, decode: _Pool, **router) -> Router:
    return await in_process_router(prefill, decode, _args(**router))


async def _post(r, body, chat: bool = False):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = await r._handle(_request(raw, path), chat=chat)
    if getattr(resp, "body_iterator", None) is not None:
        return resp, [line async for line in resp.body_iterator]
    return resp, json.loads(resp.body)


def _assert_openai_error(resp, body, status: int, param) -> None:
    """The OpenAI error shape: the router's own errors carry OpenAI's type names and no code, those of
    vLLM's layer vLLM's type names and the status as the code (what `vllm serve` answers)."""
    assert resp.status_code == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param, body
    assert body["error"]["message"] and body["error"]["type"] and body["error"]["code"] in (None, status)


# --- the generator -----------------------------------------------------------------------------------

FLOAT_RANGES = {"temperature": (0.0, 2.0, True), "top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, True),
                "frequency_penalty": (-2.0, 2.0, True), "presence_penalty": (-2.0, 2.0, True),
                "repetition_penalty": (0.0, None, False)}  # (low, high or None, low inclusive)
INT_FIELDS = {"top_k": -1, "min_tokens": 0, "max_tokens": 1, "seed": -(2**63)}  # the smallest valid value
BOOL_FIELDS = ["stream", "ignore_eos", "echo", "include_stop_str_in_output"]


def _pick(rng, values):
    return values[rng.randrange(len(values))]


def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 4)
    leaves = (lambda: rng.randint(-5, 5), rng.random, lambda: "s" * rng.randrange(4), lambda: None,
              lambda: [_json_value(rng, depth + 1)], lambda: {"k": _json_value(rng, depth + 1)})
    return leaves[kind]()


def _base(rng: random.Random, chat: bool) -> dict:
    body = {"model": MODEL, "max_tokens": rng.randint(1, 16)}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi " * rng.randint(1, 5)}]
    else:
        body["prompt"] = rng.choice(["hello", "the router", [1, 2, 3]])
    for k, v in (("temperature", 0.5), ("seed", 3), ("user", "u1"), ("top_k", 5), ("store", False)):
        if rng.random() < 0.3:
            body[k] = v
    return body


def _mutation(rng: random.Random, chat: bool):
    """(field → bad value updates, fields to drop, the param the 400 must name)."""
    kind = rng.randrange(1, 16)
    if kind == 1:  # floats: wrong type or out of range
        name = _pick(rng, list(FLOAT_RANGES))
        lo, hi, lo_incl = FLOAT_RANGES[name]
        bad = _pick(rng, ["x", [1.0], {"v": 1}, lo - rng.uniform(1e-6, 100)] + ([] if lo_incl else [lo]) +
                    ([] if hi is None else [hi + rng.uniform(1e-6, 100)]))
        return {name: bad}, (), name
    if kind == 2:  # ints: wrong type or below the minimum
        name = _pick(rng, list(INT_FIELDS))
        bad = _pick(rng, ["x", [1], {"v": 1}, rng.randint(1, 9) + 0.5, INT_FIELDS[name] - rng.randint(1, 99)])
        if name == "seed" and rng.random() < 0.5:
            bad = 2**64 + rng.randrange(10**6)
        return {name: bad}, (), name
    if kind == 3:  # bools
        name = _pick(rng, BOOL_FIELDS + (["logprobs"] if chat else []))
        return {name: _pick(rng, ["maybe", [], {}, 0.5])}, (), name
    if kind == 4:  # n
        return {"n": _pick(rng, [0, -rng.randint(1, 99), "x", 1.5, [1]])}, (), "n"
    if kind == 5:  # logprobs / top_logprobs
        if chat:
            return {"logprobs": True, "top_logprobs": _pick(rng, [-2, "x", 2.5])}, (), "top_logprobs"
        return {"logprobs": _pick(rng, [-2, "x", 2.5, [1]])}, (), "logprobs"
    if kind == 6:  # logit_bias
        bad = _pick(rng, [{"1": "x"}, [1, 2], "x", {"1": [1]}])
        return {"logit_bias": bad}, (), "logit_bias"
    if kind == 7:  # stop strings
        bad = _pick(rng, ["", [""], ["a", ""], [1], 5, {"a": 1}, ["ok", 3], "\ud800"])
        return {"stop": bad}, (), "stop"
    if kind == 8:  # stop_token_ids
        bad = _pick(rng, [["a"], "1", [1.5], 5])
        return {"stop_token_ids": bad}, (), "stop_token_ids"
    if kind == 9:  # response_format
        bad, param = _pick(rng, [
            ("json", "response_format"), ({}, "response_format.type"), ({"type": "xml"}, "response_format.type"),
            ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
            ({"type": "json_schema", "json_schema": {"name": "n", "schema": "x"}}, "response_format.json_schema.schema"),
        ])
        return {"response_format": bad}, (), param
    if kind == 10:  # stream_options without streaming
        return {"stream_options": _pick(rng, [{"include_usage": True}, {"continuous_usage_stats": True}])}, (), \
            "stream_options"
    if kind == 11:  # cross-field rules
        if chat and rng.random() < 0.5:
            return _pick(rng, [({"top_logprobs": 3}, (), "top_logprobs"),
                               ({"max_completion_tokens": 0}, ("max_tokens",), "max_tokens")])
        return _pick(rng, [({"max_tokens": 4, "min_tokens": 5 + rng.randrange(9)}, (), "min_tokens"),
                           ({"max_tokens": 3000 + rng.randrange(10**5)}, (), "max_tokens")])
    if kind == 12:  # the model
        return {"model": _pick(rng, [5, [MODEL], {"m": 1}])}, (), "model"
    if kind == 13 and chat:  # messages
        i = rng.randrange(3)
        good = [{"role": "user", "content": "x"}] * i
        bad, param = _pick(rng, [({"role": "user", "content": 5}, f"messages.{i}.content"),
                                 ({"role": "user", "content": "\udfff"}, f"messages.{i}.content"),
                                 ("x", f"messages.{i}")])
        return {"messages": good + [bad]}, (), param
    if kind == 13:  # prompt
        return {"prompt": _pick(rng, [5, "", [], [-1], [1.5], {"a": 1}, None, "\ud800x", [3] * 2048])}, (), "prompt"
    if kind == 14:  # missing the prompt
        name = "messages" if chat else "prompt"
        return {}, (name,), name
    if kind == 15:  # an oversize prompt: refused from its size, before rendering
        big = "word " * rng.randint(30_000, 200_000)
        if chat:
            return {"messages": [{"role": "user", "content": big}]}, (), "messages"
        return {"prompt": big}, (), "prompt"
    raise AssertionError(kind)


def _malformed(rng: random.Random) -> bytes:
    """A body that is not a JSON object (param "body", as vLLM names it), or not JSON at all, or JSON
    Python accepts and OpenAI does not (param None)."""
    depth = rng.randint(1_000, 100_000)
    return _pick(rng, [b"", b"{", b'{"model": ', b"[1, 2]", b"null", b"7", b'"s"', b"\xff\xfe\x00",
                       b'{"model": "tiny-qwen2", "prompt": "x", "temperature": NaN}',
                       b'{"model": "tiny-qwen2", "prompt": "x", "top_p": Infinity}',
                       b'{"model": "tiny-qwen2", "prompt": "x", "seed": -Infinity}',
                       b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth,
                       b'{"model": "tiny-qwen2", "prompt": ' + b"[" * depth + b"]" * depth + b"}"])


def _json_but_not_object(raw: bytes) -> bool:
    try:
        return not isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def generated_bad_requests(seed: int = 7, n: int = N_GENERATED) -> list[tuple[bool, bytes, str | None]]:
    """(chat, raw body, the param the 400 names) for `n` generated bad requests."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        chat = rng.random() < 0.5
        if rng.random() < 0.08:
            raw = _malformed(rng)
            cases.append((chat, raw, "body" if _json_but_not_object(raw) else None))
            continue
        body = _base(rng, chat)
        update, drop, param = _mutation(rng, chat)
        body.update(update)
        for k in drop:
            body.pop(k, None)
        cases.append((chat, json.dumps(body).encode(), param))
    return cases


def test_generated_bad_requests_get_400_naming_the_field_and_reach_no_engine():
    cases = generated_bad_requests()
    assert len(cases) >= 1000 and len({raw for _, raw, _ in cases}) >= 600  # many, and mostly distinct

    async def run():
        prefill, decode = _Pool("prefill", ["p1"]), _Pool("decode", ["d1", "d2"])
        r = await _router(prefill, decode)
        wrong = []
        for chat, raw, param in cases:
            resp, body = await _post(r, raw, chat)
            err = body.get("error", {}) if isinstance(body, dict) else {}
            if (resp.status_code, err.get("param")) != (400, param):
                wrong.append((raw[:120], param, resp.status_code, body))
            else:
                _assert_openai_error(resp, body, 400, param)
        return r, prefill, decode, wrong
    r, prefill, decode, wrong = asyncio.run(run())
    assert not wrong, f"{len(wrong)} of {len(cases)} wrong:\n" + "\n".join(map(str, wrong[:12]))
    assert prefill.calls == [] and decode.calls == []
    assert r.counters.rejected_400 == len(cases) and r.counters.failed == 0 and r.flights == {}


# --- engine-side validation errors -------------------------------------------------------------------

@pytest.mark.parametrize("where", ["decode", "prefill"])
@pytest.mark.parametrize("param, body_extra, chat, field", [
    ("stop", {"stop": "\n"}, False, "stop"),
    ("structured_outputs", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "nonsense"}}}}, True, "response_format"),
    ("logprobs", {"logprobs": True, "top_logprobs": 5}, True, "top_logprobs"),
    (None, {}, False, None),
])
def test_an_engine_refusing_the_request_is_a_400_without_retry(where, param, body_extra, chat, field):
    async def run():
        refusal = _ray_error(InvalidRequest("the engine refuses this value", param))
        prefill = _Pool("prefill", ["p1", "p2"], error=refusal if where == "prefill" else None)
        decode = _Pool("decode", ["d1", "d2"], error=refusal if where == "decode" else None)
        r = await _router(prefill, decode)
        body = {"model": MODEL, "max_tokens": 4, **body_extra}
        body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
        resp, out = await _post(r, body, chat)
        return r, prefill, decode, resp, out
    r, prefill, decode, resp, out = asyncio.run(run())
    _assert_openai_error(resp, out, 400, field)
    assert "the engine refuses this value" in out["error"]["message"]
    c = r.counters
    assert (c.prefill_retries, c.decode_retries, c.failed, c.local_prefill_fallbacks) == (0, 0, 0, 0)
    assert c.rejected_400 == 1 and r.flights == {} and len(r.ledger) == 0
    decodes = [c for c in decode.calls if c[0] == "decode"]
    assert len(prefill.calls) == 1 and len(decodes) == (1 if where == "decode" else 0)  # tried once only
    # a prefill's KV the refusing decode will never pull is released there
    releases = [(replica, call[1]) for name, replica, call in decode.calls if name == "release_kv"]
    assert releases == ([(decodes[0][1], decodes[0][2].kv_transfer_params)] if where == "decode" else [])


def test_an_engine_fault_is_still_retried_on_another_instance():
    async def run():
        prefill, decode = _Pool("prefill", ["p1"]), _Pool("decode", ["d1", "d2"], error=_ray_error(RuntimeError("boom")))
        r = await _router(prefill, decode)
        resp, out = await _post(r, {"model": MODEL, "prompt": "x", "max_tokens": 2})
        return r, decode, resp, out
    r, decode, resp, out = asyncio.run(run())
    assert resp.status_code == 503 and out["error"]["type"] == "service_unavailable"
    decodes = [c for c in decode.calls if c[0] == "decode"]
    assert len(decodes) == 2 and r.counters.decode_retries == 2 and r.counters.failed == 1
    # the prefill's KV, never pulled, is released through the decode instance it was meant for
    assert [(c[0], c[1]) for c in decode.calls if c[0] != "decode"] == [("release_kv", decodes[0][1])]


# --- the body, the prompt's size, pathological JSON, unknown paths ------------------------------------

def test_a_body_over_the_limit_is_a_413_before_parsing():
    async def run():
        r = await _router(_Pool("prefill", ["p1"]), _Pool("decode", ["d1"]), max_body_bytes=4096)
        raw = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()
        streamed = await r._handle(_request(raw), chat=False)
        declared = await r._handle(_request(raw, headers={"content-length": str(len(raw))}), chat=False)
        ok, _ = await _post(r, {"model": MODEL, "prompt": "x" * 100, "max_tokens": 1})
        return streamed, declared, ok
    streamed, declared, ok = asyncio.run(run())
    for resp in (streamed, declared):
        _assert_openai_error(resp, json.loads(resp.body), 413, None)
        assert "max_body_bytes" in json.loads(resp.body)["error"]["message"]
    assert ok.status_code == 200


def test_an_oversize_prompt_is_refused_fast_without_tokenizing():
    async def run():
        r = await _router(_Pool("prefill", ["p1"]), _Pool("decode", ["d1"]))
        served = next(iter(r.served.values()))
        calls = []
        real = served.tokenizer.encode
        served.tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
        raw = json.dumps({"model": MODEL, "prompt": "word " * 1_500_000}).encode()  # 7.5 MB, under 8 MiB
        t0 = time.perf_counter()
        resp = await r._handle(_request(raw), chat=False)
        return resp, time.perf_counter() - t0, calls
    resp, elapsed, calls = asyncio.run(run())
    _assert_openai_error(resp, json.loads(resp.body), 400, "prompt")
    assert calls == [] and elapsed < 0.1 * 3, elapsed  # < 100 ms on an idle core; x3 for a busy CI machine


def test_a_long_prompt_that_may_fit_is_tokenized_off_the_event_loop():
    async def run():
        r = await _router(_Pool("prefill", ["p1"]), _Pool("decode", ["d1"]))
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1
        t = asyncio.get_running_loop().create_task(ticker())
        resp, body = await _post(r, {"model": MODEL, "prompt": "word " * 8_000})  # ~8k tokens: too long
        t.cancel()
        return resp, body, ticks
    resp, body, ticks = asyncio.run(run())
    _assert_openai_error(resp, body, 400, "prompt")
    message = body["error"]["message"]
    assert "maximum context length is 2048 tokens" in message and "characters" not in message  # counted exactly
    assert ticks > 1  # the loop kept running while the prompt was tokenized


def test_unknown_paths_and_methods_answer_in_the_openai_shape():
    from starlette.testclient import TestClient

    with TestClient(fastapi_app) as client:
        nf = client.post("/v1/nope", json={})
        na = client.get("/v1/completions")
    assert nf.status_code == 404 and nf.json()["error"]["type"] == "not_found_error"
    assert na.status_code == 405 and na.json()["error"]["type"] == "invalid_request_error"
    for r in (nf, na):
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# --- the accepted surface ------------------------------------------------------------------------------

def test_every_sampling_field_reaches_the_engines_as_vllms_sampling_params():
    """vLLM's `to_sampling_params` makes the parameters; the decode gets them whole, the prefill the
    same request (it makes its one-token copy itself, `serve_app.sampling.prefill_params`)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
            "min_p": 0.05, "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1,
            "logit_bias": {"5": -100, "6": 2.5}, "min_tokens": 2, "stop": ["\n"], "stop_token_ids": [3],
            "seed": 11, "ignore_eos": True, "logprobs": 2, "user": "u", "allowed_token_ids": [5, 6, 7],
            "bad_words": ["zz"], "include_stop_str_in_output": True, "prompt_logprobs": 1,
            "response_format": {"type": "json_object"}}

    async def run():
        prefill, decode = _Pool("prefill", ["p1"]), _Pool("decode", ["d1"])
        r = await _router(prefill, decode)
        resp, out = await _post(r, body)
        return prefill, decode, resp, out
    prefill, decode, resp, out = asyncio.run(run())
    assert resp.status_code == 200, out
    (_, _, call), = decode.calls
    p = call.params
    got = {k: getattr(p, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                                      "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop",
                                      "stop_token_ids", "seed", "ignore_eos", "logprobs", "allowed_token_ids",
                                      "bad_words", "include_stop_str_in_output", "prompt_logprobs", "n")}
    assert got == {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                   "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1,
                   "logit_bias": {5: -100.0, 6: 2.5}, "min_tokens": 2, "stop": ["\n"], "stop_token_ids": [3],
                   "seed": 11, "ignore_eos": True, "logprobs": 2, "allowed_token_ids": [5, 6, 7], "bad_words": ["zz"],
                   "include_stop_str_in_output": True, "prompt_logprobs": 1, "n": 1}
    assert p.structured_outputs is not None and p.structured_outputs.json_object
    (_, _, pcall), = prefill.calls
    assert pcall.sampling.max_tokens == 8 and pcall.sampling.prompt_logprobs == 1  # the request, whole


def _json_events(chunks) -> list[dict]:
    """The JSON events of a streamed response's body chunks (bytes or str), [DONE] left out."""
    sse = SseDecoder()
    return [json.loads(data) for chunk in chunks for data in sse.feed(chunk) if data != DONE]


def test_the_engines_logprobs_reach_the_answer_streamed_or_not():
    async def run():
        r = await _router(_Pool("prefill", ["p1"]), _Pool("decode", ["d1"]))
        comp, cbody = await _post(r, {"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 2})
        chat, chbody = await _post(r, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                       "max_tokens": 3, "logprobs": True, "top_logprobs": 3}, chat=True)
        none, nbody = await _post(r, {"model": MODEL, "prompt": "x", "max_tokens": 3})
        _, sc = await _post(r, {"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 1, "stream": True})
        return cbody, chbody, nbody, sc
    cbody, chbody, nbody, sc = asyncio.run(run())
    lp = cbody["choices"][0]["logprobs"]
    assert lp["tokens"] == ["b", "a", "b"] and lp["token_logprobs"] == [-1.5, -0.25, -1.5]
    assert lp["text_offset"] == [0, 1, 2] and all(len(t) <= 3 for t in lp["top_logprobs"])
    content = chbody["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["b", "a", "b"] and content[0]["bytes"] == [98]
    assert all(len(c["top_logprobs"]) == 3 for c in content)
    assert min(t["logprob"] for c in content for t in c["top_logprobs"]) == -9999.0  # -inf, as vLLM answers it
    assert nbody["choices"][0]["logprobs"] is None
    streamed = [e["choices"][0]["logprobs"] for e in _json_events(sc) if e["choices"] and e["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == ["b", "a", "b"]


def test_invalid_request_survives_pickling_whole():
    import pickle

    e = pickle.loads(pickle.dumps(InvalidRequest("stop cannot contain an empty string.", "stop")))
    assert isinstance(e, ValueError) and (e.message, e.param) == ("stop cannot contain an empty string.", "stop")
    assert asdict(TokenLogprob("a", -1.0, (("a", -1.0),))) == {"token": "a", "logprob": -1.0, "top": (("a", -1.0),)}
