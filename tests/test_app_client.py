"""disagg.app_client against a small HTTP server on 127.0.0.1: credentials from the environment,
errors that name the URL and the status, server-sent events split anywhere, both clients alike."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg.app_client import CHAT, COMPLETIONS, AppClient, AppError, AsyncAppClient

pytestmark = pytest.mark.timeout(60)

STATE = {"policy": "marginal_cost", "policy_params": {"w": 1}, "cost_model": "cpu-tiny",
         "instances": {"prefill-a": {"role": "prefill"}}, "counters": {}}
# one streamed completion as the app sends it, cut at awkward places: inside a line, inside
# "data:", between the CR and the LF, inside a multi-byte character
SSE = ('data: {"id":"c1","choices":[{"index":0,"text":"h\u00e9"}]}\r\n\r\n'
       ': keep-alive\n\n'
       'data: {"id":"c1","choices":[{"index":0,"text":"llo"}]}\n\n'
       'data: {"id":"c1","choices":[],"usage":{"completion_tokens":2}}\n\n'
       'data: [DONE]\n\n').encode()
CUTS = (7, 30, 34, 51, 60, 130)
FIRST_EVENT = SSE[:SSE.index(b": keep-alive")]
ERROR_EVENT = b'data: {"error":{"message":"engine lost","code":500}}\n\n'


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, str | None, dict | None]]  # method, path, Authorization, body

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, status: int, obj) -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, pieces: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("x-disagg-route", "prefill=prefill-a; decode=decode-b")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for piece in pieces:
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.flush()
            time.sleep(0.01)  # separate reads at the client
        self.wfile.write(b"0\r\n\r\n")

    def _route(self, body: dict | None) -> None:
        path = self.path
        self.seen.append((self.command, path, self.headers.get("authorization"), body))
        if path == "/health":
            self._reply(503 if self.server.starting else 200, {"status": "starting" if self.server.starting else "ok"})
        elif path == "/admin/state":
            self._reply(200, STATE)
        elif path == "/v1/models":
            self._reply(200, b"<html>a proxy's page</html>")
        elif path == "/admin/policy":
            if body["name"] == "fastest":
                self._reply(400, {"error": {"message": "unknown policy 'fastest'", "param": "name"}})
            else:
                self._reply(200, {"policy": body["name"], "params": body["params"]})
        elif path == "/admin/cost_model":
            self._reply(200, {"cost_model": body["cost_model"], "routers": ["r0", "r1"]})
        elif path == COMPLETIONS and body.get("stream"):
            whole = {"ok": SSE, "error": FIRST_EVENT + ERROR_EVENT, "cut": FIRST_EVENT + b"data: [DO"}[body["prompt"]]
            edges = [0, *(c for c in CUTS if c < len(whole)), len(whole)]
            self._stream([whole[a:b] for a, b in zip(edges, edges[1:])])
        elif path in (COMPLETIONS, CHAT):
            self._reply(200, {"id": "c2", "choices": [{"text": "hi"}], "usage": {"completion_tokens": 1}})
        else:
            self._reply(404, {"error": {"message": f"no route {path}"}})

    def do_GET(self) -> None:
        self._route(None)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        self._route(json.loads(raw) if raw else None)


@pytest.fixture
def app_server():
    """The server in a thread of this process; `seen` records every request it got."""
    handler = type("RecordingHandler", (Handler,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.starting = False
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    server.seen = handler.seen
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def credentials(monkeypatch):
    monkeypatch.setenv("DISAGG_API_KEY", "key-1")
    monkeypatch.setenv("DISAGG_ADMIN_TOKEN", "admin-1")
    return monkeypatch


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_admin_calls_carry_the_admin_token_and_the_rest_the_api_key(app_server, credentials):
    with AppClient(app_server.url, timeout_s=5) as app:
        assert app.state() == STATE
        assert app.policy() == ("marginal_cost", {"w": 1})
        assert app.set_policy("round_robin") == {"policy": "round_robin", "params": {}}
        assert app.set_cost_model("runs/cm.yaml", model="tiny")["routers"] == ["r0", "r1"]
        assert app.complete({"model": "m", "prompt": "p"})["usage"] == {"completion_tokens": 1}
        assert app.chat({"model": "m", "messages": []})["id"] == "c2"
        credentials.delenv("DISAGG_API_KEY")
        credentials.delenv("DISAGG_ADMIN_TOKEN")
        app.health()
        app.state()
    assert [(m, p, auth) for m, p, auth, _ in app_server.seen] == [
        ("GET", "/admin/state", "Bearer admin-1"), ("GET", "/admin/state", "Bearer admin-1"),
        ("POST", "/admin/policy", "Bearer admin-1"), ("POST", "/admin/cost_model", "Bearer admin-1"),
        ("POST", COMPLETIONS, "Bearer key-1"), ("POST", CHAT, "Bearer key-1"),
        ("GET", "/health", None), ("GET", "/admin/state", None),  # read at each request: none once unset
    ]
    bodies = [body for _, p, _, body in app_server.seen if p.startswith("/admin/") and body]
    assert bodies == [{"name": "round_robin", "params": {}}, {"cost_model": "runs/cm.yaml", "model": "tiny"}]


def test_errors_name_the_method_the_url_the_status_and_the_apps_message(app_server):
    with AppClient(app_server.url, timeout_s=5) as app:
        with pytest.raises(AppError) as refused:
            app.set_policy("fastest")
        with pytest.raises(AppError) as not_json:
            app.models()
        app_server.starting = True
        with pytest.raises(AppError) as unready:
            app.health()
    assert refused.value.status == 400
    assert str(refused.value) == f"POST {app_server.url}/admin/policy answered 400: unknown policy 'fastest'"
    assert not_json.value.status == 200 and f"GET {app_server.url}/v1/models answered 200: not the answer" \
        in str(not_json.value) and "a proxy's page" in str(not_json.value)
    assert (unready.value.status, unready.value.message) == (503, '{"status": "starting"}')

    url = _closed_port_url()
    with AppClient(url, timeout_s=2) as app, pytest.raises(AppError) as unreachable:
        app.state()
    assert unreachable.value.status is None
    assert str(unreachable.value).startswith(f"cannot reach {url}/admin/state (GET): ConnectError")


def test_a_stream_gives_its_headers_and_its_events_parsed_whatever_the_cuts(app_server):
    with AppClient(app_server.url, timeout_s=5) as app:
        with app.stream(COMPLETIONS, {"prompt": "ok", "stream": True}) as s:
            route = s.headers["x-disagg-route"]
            events = list(s)
    assert route == "prefill=prefill-a; decode=decode-b"
    assert [e["choices"][0]["text"] for e in events if e["choices"]] == ["h\u00e9", "llo"]
    assert events[-1]["usage"] == {"completion_tokens": 2}  # [DONE] ends it and is not an event


@pytest.mark.parametrize("prompt, message", [("error", "answered 200: error event: engine lost"),
                                             ("cut", r"answered 200: the stream ended without \[DONE\]")])
def test_a_stream_that_fails_midway_raises_after_the_events_before_it(app_server, prompt, message):
    got = []
    with AppClient(app_server.url, timeout_s=5) as app, pytest.raises(AppError, match=message) as e:
        with app.stream(COMPLETIONS, {"prompt": prompt, "stream": True}) as s:
            got.extend(s)
    assert [ev["choices"][0]["text"] for ev in got] == ["h\u00e9"]
    assert e.value.url == f"{app_server.url}{COMPLETIONS}"


def test_the_async_client_makes_the_same_calls(app_server, credentials):
    async def go():
        async with AsyncAppClient(app_server.url, timeout_s=5) as app:
            state = await app.state()
            with pytest.raises(AppError, match="answered 400: unknown policy 'fastest'"):
                await app.set_policy("fastest")
            async with app.stream(COMPLETIONS, {"prompt": "ok", "stream": True}) as s:
                texts = [e["choices"][0]["text"] async for e in s if e["choices"]]
            return state, texts

    state, texts = asyncio.run(go())
    assert state == STATE and texts == ["h\u00e9", "llo"]
    assert [auth for _, _, auth, _ in app_server.seen] == ["Bearer admin-1", "Bearer admin-1", "Bearer key-1"]


def test_waiting_for_health_is_bounded_and_says_what_it_last_heard(app_server):
    app_server.starting = True
    t0 = time.monotonic()
    with AppClient(app_server.url, timeout_s=5) as app, pytest.raises(AppError) as e:
        app.wait_healthy(0.5, poll_s=0.1)
    assert time.monotonic() - t0 < 5
    assert "not healthy within 0.5 s (last: {\"status\": \"starting\"})" in str(e.value)
    app_server.starting = False
    with AppClient(app_server.url, timeout_s=5) as app:
        assert app.wait_healthy(5, poll_s=0.1) == {"status": "ok"}
