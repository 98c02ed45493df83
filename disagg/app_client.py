"""The one client of the app's HTTP API: what the CLI, calibration, the bench harness, the
benchmarks and the tests' fixtures send to a running app.

`AppClient` (sync) and `AsyncAppClient` (async) offer the same calls, written once (`_Calls`):
- `health()`, `models()` / `model()` (`/v1/models`), `state()` (`/admin/state`);
- `policy()` (read from the state) and `set_policy(name, params)`, `set_cost_model(source)`,
  `probe(body)` (one calibration measurement), `reset_prefix_cache()`;
- `complete(body)` / `chat(body)`: a whole answer; `stream(path, body)`: a streaming one, whose
  server-sent events come parsed (`disagg.bench.sse`), up to `[DONE]`.
Every failure raises `AppError`, which names the method, the URL, the status (None when no
answer came) and the app's own message; a call's answer is checked for the fields it is read for.

Credentials, as the app asks for them (`router.api_keys_env`, `router.admin: token`), like the
`disagg` CLI: $DISAGG_ADMIN_TOKEN on `/admin/*`, $DISAGG_API_KEY on the rest, read at each request,
none when unset (`AppAuth`). `trust_env=False` everywhere: the traffic goes to the app under test,
never through a proxy named in the environment.

The load generator (`disagg.bench.loadgen`) sends its timed streams on this module's pooled client
(`make_client`, `AsyncAppClient.http`) and reads them chunk by chunk itself: its clock is read when a
chunk arrives, before any parsing. `benchmarks/overload.py` keeps aiohttp for its thousands of
open requests (httpx's pool would cost the generator the CPU the measurement needs).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

import httpx

from disagg.bench.sse import DONE, SseDecoder

API_KEY_VAR, ADMIN_TOKEN_VAR = "DISAGG_API_KEY", "DISAGG_ADMIN_TOKEN"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ROUTE_HEADER = "x-disagg-route"


class AppError(Exception):
    """A call to the app that failed: no answer (`status` None), an answer other than 200, or a
    200 whose body is not what the call reads (`status` 200)."""

    def __init__(self, method: str, url: str, status: int | None, message: str) -> None:
        self.method, self.url, self.status, self.message = method, url, status, message
        super().__init__(f"cannot reach {url} ({method}): {message}" if status is None
                         else f"{method} {url} answered {status}: {message}")


class AppAuth(httpx.Auth):
    """Bearer credentials for an app that requires them: $DISAGG_ADMIN_TOKEN on `/admin/*`,
    $DISAGG_API_KEY on everything else; nothing when unset. Read at each request, so a rotated key
    is picked up; never logged."""

    def auth_flow(self, request: httpx.Request):
        var = ADMIN_TOKEN_VAR if "/admin/" in request.url.path else API_KEY_VAR
        if token := os.environ.get(var):
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


def error_message(r: httpx.Response) -> str:
    """The message of an OpenAI-shaped error answer, else the start of its body (read it first)."""
    try:
        err = r.json()["error"]
        return err.get("message", err) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


def make_client(base_url: str, *, timeout_s: float, max_connections: int) -> httpx.AsyncClient:
    """One pooled async client with the app's credentials. HTTP/1.1 holds one stream per connection."""
    return httpx.AsyncClient(
        base_url=base_url, trust_env=False, auth=AppAuth(),
        timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                            keepalive_expiry=30.0),
    )


@dataclass(frozen=True, slots=True)
class EventStream:
    """A streaming answer being read: its headers (the route header, for one) and its events,
    each a parsed JSON object; iterating ends at `[DONE]`."""

    headers: httpx.Headers
    events: Any  # Iterator[dict] (AppClient) or AsyncIterator[dict] (AsyncAppClient)

    def __iter__(self) -> Iterator[dict]:
        return self.events

    def __aiter__(self) -> AsyncIterator[dict]:
        return self.events


def _json(r: httpx.Response) -> Any:
    return r.json()


class _Calls:
    """The calls, written once: `_call` returns the answer in `AppClient` and a coroutine of it in
    `AsyncAppClient`; `read(response)` picks what the caller gets. Each call is bounded by the
    client's timeout (`/health` by 10 s)."""

    base_url: str

    def _call(self, method: str, path: str, *, read: Callable[[httpx.Response], Any] = _json,
              **request: Any) -> Any:
        raise NotImplementedError

    def health(self):
        """`/health`'s body, when it answers 200 (every engine the app needs is registered); within
        10 s whatever the client's timeout: the app answers it at once or not at all."""
        return self._call("GET", "/health", timeout=10.0)

    def models(self):
        """The served models' cards (id, max_model_len, ...)."""
        return self._call("GET", "/v1/models", read=lambda r: r.json()["data"])

    def model(self):
        """The first served model's card."""
        return self._call("GET", "/v1/models", read=lambda r: r.json()["data"][0])

    def state(self):
        """`/admin/state`: the policies, cost models, instances, requests in flight and counters."""
        return self._call("GET", "/admin/state", read=lambda r: _has(r.json(), "instances"))

    def policy(self):
        """(name, params) of the policy the app routes with."""
        return self._call("GET", "/admin/state", read=_policy_of)

    def set_policy(self, name: str, params: dict | None = None, model: str | None = None):
        return self._call("POST", "/admin/policy", json=_body(name=name, params=params or {}, model=model))

    def set_cost_model(self, source: str, model: str | None = None):
        """Have every router replica price with `source`: a shipped profile's name, or a YAML file
        inside the app's `router.cost_model_dir`."""
        return self._call("POST", "/admin/cost_model", json=_body(cost_model=source, model=model))

    def probe(self, body: dict):
        """One calibration measurement on the instance `body` names (`serve_app.admin`)."""
        return self._call("POST", "/admin/probe", json=body)

    def reset_prefix_cache(self):
        """Every engine drops its cached prefixes, every router replica its index of them."""
        return self._call("POST", "/admin/reset_prefix_cache")

    def complete(self, body: dict, headers: dict | None = None):
        """A whole (non-streaming) completion."""
        return self._call("POST", COMPLETIONS, json=body, headers=headers)

    def chat(self, body: dict, headers: dict | None = None):
        """A whole (non-streaming) chat completion."""
        return self._call("POST", CHAT, json=body, headers=headers)

    # what both clients do with an exchange ---------------------------------------------------

    def _no_answer(self, method: str, path: str, e: Exception) -> AppError:
        return AppError(method, self.base_url + path, None, f"{type(e).__name__}: {e}")

    def _answer(self, method: str, path: str, r: httpx.Response, read: Callable[[httpx.Response], Any]) -> Any:
        if r.status_code != 200:
            raise AppError(method, self.base_url + path, r.status_code, error_message(r))
        try:
            return read(r)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise AppError(method, self.base_url + path, 200,
                           f"not the answer expected ({type(e).__name__}: {e}): {r.text[:200]}") from None

    def _events(self, path: str, chunk: bytes, decoder: SseDecoder) -> tuple[list[dict], bool]:
        """The events one raw chunk completes, and whether `[DONE]` was among them."""
        out = []
        for data in decoder.feed(chunk):
            if data == DONE:
                return out, True
            try:
                event = json.loads(data)
            except ValueError:
                raise AppError("POST", self.base_url + path, 200, f"an event that is not JSON: {data[:120]!r}") from None
            if "error" in event and not event.get("choices"):
                err = event["error"]
                raise AppError("POST", self.base_url + path, 200,
                               f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
            out.append(event)
        return out, False

    def _ended_early(self, path: str) -> AppError:
        return AppError("POST", self.base_url + path, 200, "the stream ended without [DONE]")


def _body(**fields: Any) -> dict:
    """A request body without the fields left at None (the app applies them to every model)."""
    return {k: v for k, v in fields.items() if v is not None}


def _policy_of(r: httpx.Response) -> tuple[str, dict]:
    state = r.json()
    return state["policy"], state["policy_params"]


def _has(answer: dict, key: str) -> dict:
    answer[key]  # a KeyError here: not this app's answer
    return answer


class AppClient(_Calls):
    """The app's API, blocking. A context manager (or `close()` it)."""

    def __init__(self, base_url: str, *, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, trust_env=False, auth=AppAuth(), timeout=timeout_s)

    def __enter__(self) -> "AppClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _call(self, method, path, *, read=_json, **request):
        try:
            r = self.http.request(method, path, **request)
        except httpx.HTTPError as e:
            raise self._no_answer(method, path, e) from None
        return self._answer(method, path, r, read)

    @contextlib.contextmanager
    def stream(self, path: str, body: dict, headers: dict | None = None) -> Iterator[EventStream]:
        """`with app.stream(COMPLETIONS, body) as s:` then `for event in s`; `body` asks for a stream."""
        try:
            with self.http.stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    r.read()
                yield EventStream(r.headers, self._read(path, self._answer("POST", path, r, lambda r: r)))
        except httpx.HTTPError as e:
            raise self._no_answer("POST", path, e) from None

    def _read(self, path: str, r: httpx.Response) -> Iterator[dict]:
        decoder = SseDecoder()
        for chunk in r.iter_raw():
            events, done = self._events(path, chunk, decoder)
            yield from events
            if done:
                return
        raise self._ended_early(path)

    def wait_healthy(self, timeout_s: float, *, poll_s: float = 2.0,
                     still_starting: Callable[[], bool] = lambda: True) -> dict:
        """Poll `/health` until it answers 200 (its body), within `timeout_s`; `still_starting()`
        False (the process serving it died, say) gives up at once. Either way: AppError, last answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.health()
            except AppError as e:
                gone = not still_starting()
                if gone or time.monotonic() + poll_s > deadline:
                    why = "gave up: the server stopped starting" if gone else f"not healthy within {timeout_s:g} s"
                    raise AppError("GET", e.url, e.status, f"{why} (last: {e.message})") from None
            time.sleep(poll_s)


class AsyncAppClient(_Calls):
    """The app's API for asyncio. An async context manager (or `aclose()` it); `http` is the pooled
    httpx client underneath (pass one to share its pool: it is then the caller's to close)."""

    def __init__(self, base_url: str, *, timeout_s: float = 30.0, max_connections: int = 16,
                 http: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._owned = http is None
        self.http = http or make_client(self.base_url, timeout_s=timeout_s, max_connections=max_connections)

    async def __aenter__(self) -> "AsyncAppClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owned:
            await self.http.aclose()

    async def _call(self, method, path, *, read=_json, **request):
        try:
            r = await self.http.request(method, path, **request)
        except httpx.HTTPError as e:
            raise self._no_answer(method, path, e) from None
        return self._answer(method, path, r, read)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: dict, headers: dict | None = None) -> AsyncIterator[EventStream]:
        """`async with app.stream(COMPLETIONS, body) as s:` then `async for event in s`."""
        try:
            async with self.http.stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                yield EventStream(r.headers, self._read(path, self._answer("POST", path, r, lambda r: r)))
        except httpx.HTTPError as e:
            raise self._no_answer("POST", path, e) from None

    async def _read(self, path: str, r: httpx.Response) -> AsyncIterator[dict]:
        decoder = SseDecoder()
        async for chunk in r.aiter_raw():
            events, done = self._events(path, chunk, decoder)
            for event in events:
                yield event
            if done:
                return
        raise self._ended_early(path)
