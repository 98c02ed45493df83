"""Who may do what: the real Router in-process over HTTP (httpx's ASGI transport), stand-in engine pools.

- API keys (`router.api_keys_env`): every OpenAI route answers 401 in the OpenAI error shape to a
  missing, wrong or malformed key, before the body is read; a right key passes; `/health` stays open;
  no key in the config keeps the API open;
- the admin gate (`router.admin`): `disabled` → 404 as an unknown path, `loopback` → 403 to any other
  client (X-Forwarded-For is not believed), `token` → 401 without the admin token;
- `POST /admin/cost_model` loads a shipped profile or a YAML file inside `router.cost_model_dir`:
  `..`, absolute paths outside, symlinks out, missing files, non-YAML, non-mappings, FIFOs — one 400,
  one message;
- no key or token reaches a log line or a response; a variable that is unset or empty stops the router.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
from pathlib import Path

import httpx
import pytest
import yaml

pytest.importorskip("ray.serve")
from starlette.requests import Request  # noqa: E402

from disagg.core.cost_model import PROFILES_DIR, CostModel  # noqa: E402
from serve_app.access import AccessConfigError  # noqa: E402
from serve_app.config import AdminAccess, ConfigError, RouterSettings, load_serve_config, parse_args  # noqa: E402
from serve_app.messages import DecodeChunk  # noqa: E402
from serve_app.router import fastapi_app  # noqa: E402
from factories import StandInPool, in_process_router, shipped_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen2"
KEYS_VAR, TOKEN_VAR = "DISAGG_TEST_API_KEYS", "DISAGG_TEST_ADMIN_TOKEN"
KEY_ONE, KEY_TWO = "sk-test-0123456789abcdef", "sk-test-fedcba9876543210-second"
ADMIN_TOKEN = "adm-test-5f2c9e71b0d84a36"
ROUTER_POLICY = shipped_args()["router"]["policy"]  # what a refused admin change must leave in place
SECRETS = (KEY_ONE, KEY_TWO, ADMIN_TOKEN)

OPENAI_ROUTES = [  # (method, path, a valid body)
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("GET", "/v1/models", None),
]
ADMIN_ROUTES = [  # (method, path, a valid body)
    ("GET", "/admin/state", None),
    ("POST", "/admin/policy", {"name": "marginal_cost"}),
    ("POST", "/admin/cost_model", {"cost_model": "cpu-tiny"}),
    ("POST", "/admin/reset_prefix_cache", None),
    ("POST", "/admin/probe", {"instance": "prefill-p1", "kind": "prefill", "size": 8}),
]
# Authorization headers that carry no valid key: (label, header values, the error code)
BAD_CREDENTIALS = [
    ("missing", [], "missing_api_key"),
    ("wrong key", [f"Bearer {KEY_ONE}x"], "invalid_api_key"),
    ("a prefix of a key", [f"Bearer {KEY_ONE[:-1]}"], "invalid_api_key"),
    ("the admin token", [f"Bearer {ADMIN_TOKEN}"], "invalid_api_key"),
    ("Basic scheme", [f"Basic {KEY_ONE}"], "invalid_api_key"),
    ("no scheme", [KEY_ONE], "invalid_api_key"),
    ("scheme glued to the key", [f"Bearer{KEY_ONE}"], "invalid_api_key"),
    ("scheme only", ["Bearer"], "invalid_api_key"),
    ("scheme and spaces", ["Bearer    "], "invalid_api_key"),
    ("two tokens", [f"Bearer {KEY_ONE} {KEY_TWO}"], "invalid_api_key"),
    ("two headers", [f"Bearer {KEY_ONE}", f"Bearer {KEY_ONE}"], "invalid_api_key"),
    ("empty header", [""], "invalid_api_key"),
]


# --- stand-in engines ------------------------------------------------------------------------------

class _Stream:
    def __init__(self, replica: str, n: int):
        self.replica, self.n, self.i = replica, n, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.i >= self.n:
            raise StopAsyncIteration
        self.i += 1
        first = self.i == 1
        return DecodeChunk((7,), "a", "length" if self.i == self.n else None, replica=self.replica if first else None,
                           engine_first_token_s=0.001 if first else None)

    def cancel(self):
        pass


class _Pool(StandInPool):
    """Replicas `ids`; decodes stream `max_tokens` one-token chunks."""

    def decode_stream(self, call, replica):
        return _Stream(replica, call.params.max_tokens)


# --- the router over HTTP, in-process --------------------------------------------------------------

def _args(**router) -> dict:
    return shipped_args(num_replicas=1, **router)


async def _router(**router):
    prefill, decode = _Pool("prefill", ["p1"]), _Pool("decode", ["d1", "d2"])  # the CPU profile: 1P2D
    r = await in_process_router(prefill, decode, _args(**router))
    r.test_pools = (prefill, decode)
    return r


def _servable_dependency():
    """The dependency Serve's class-based view resolves `self` with (the replica's servable object)."""
    for route in fastapi_app.routes:
        for dep in getattr(getattr(route, "dependant", None), "dependencies", ()):
            if dep.name == "self":
                return dep.call
    raise AssertionError("no route resolves `self`: has serve.ingress changed?")


class _Http:
    """The router's FastAPI app over httpx, `self` resolved to the router under test; one client address
    per call (what `request.client.host` is on the replica)."""

    def __init__(self, router):
        self.router, self.dep = router, _servable_dependency()

    def __enter__(self):
        fastapi_app.dependency_overrides[self.dep] = lambda: self.router
        return self

    def __exit__(self, *exc):
        fastapi_app.dependency_overrides.pop(self.dep, None)

    async def call(self, method: str, path: str, body=None, auth: list[str] | None = None,
                   client: str = "127.0.0.1", headers: dict | None = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=fastapi_app, client=(client, 40000))
        hdrs = [("authorization", a) for a in (auth or [])] + list((headers or {}).items())
        content = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        if content is not None:
            hdrs.append(("content-type", "application/json"))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.request(method, path, content=content, headers=hdrs)


def _run(coro):
    return asyncio.run(coro)


def _assert_error(resp: httpx.Response, status: int, kind: str, code, what: str) -> dict:
    assert resp.status_code == status, (what, resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (what, body)
    assert body["error"]["type"] == kind and body["error"]["code"] == code and body["error"]["param"] is None, \
        (what, body)
    assert not any(s in resp.text for s in SECRETS), (what, resp.text)
    return body


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv(KEYS_VAR, f" {KEY_ONE} ,{KEY_TWO},, ")  # spaces and empty entries are dropped
    monkeypatch.setenv(TOKEN_VAR, ADMIN_TOKEN)


# --- API keys -----------------------------------------------------------------------------------------

def test_every_openai_route_refuses_a_missing_wrong_or_malformed_key_with_a_401(keys):
    async def run():
        r = await _router(api_keys_env=KEYS_VAR)
        with _Http(r) as http:
            for method, path, body in OPENAI_ROUTES:
                for label, auth, code in BAD_CREDENTIALS:
                    resp = await http.call(method, path, body, auth=auth)
                    _assert_error(resp, 401, "authentication_error", code, f"{path}: {label}")
                    assert resp.headers["www-authenticate"] == "Bearer", (path, label)
                # auth comes before the body: an unparseable body still gets the 401, not a 400
                if method == "POST":
                    resp = await http.call(method, path, b"{not json", auth=[f"Bearer {KEY_ONE}x"])
                    _assert_error(resp, 401, "authentication_error", "invalid_api_key", f"{path}: bad body")
        return r
    r = _run(run())
    assert [p.calls for p in r.test_pools] == [[], []]  # nothing reached an engine
    assert r.counters.requests == 0 and r.counters.rejected_400 == 0


def test_a_refused_request_body_is_never_read(keys):
    async def run():
        r = await _router(api_keys_env=KEYS_VAR)

        async def receive():
            raise AssertionError("the body was read before the key was checked")
        req = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                       "headers": [(b"authorization", b"Bearer nope")]}, receive)
        return await r.completions(req), await r.chat_completions(req)
    for resp in _run(run()):
        assert resp.status_code == 401 and json.loads(resp.body)["error"]["code"] == "invalid_api_key"


def test_each_configured_key_opens_every_openai_route_and_health_needs_none(keys):
    async def run():
        r = await _router(api_keys_env=KEYS_VAR)
        out = []
        with _Http(r) as http:
            for auth in (f"Bearer {KEY_ONE}", f"Bearer {KEY_TWO}", f"bearer {KEY_ONE}", f"BEARER   {KEY_TWO}  "):
                for method, path, body in OPENAI_ROUTES:
                    out.append((auth, path, await http.call(method, path, body, auth=[auth])))
            out.append(("none", "/health", await http.call("GET", "/health")))
            out.append(("none", "/health from afar", await http.call("GET", "/health", client="203.0.113.7")))
        return r, out
    r, out = _run(run())
    for auth, path, resp in out:
        assert resp.status_code == 200, (auth, path, resp.text)
    models = next(resp for _, path, resp in out if path == "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert r.counters.requests == 8  # 4 credentials × 2 completion routes


def test_without_api_keys_the_openai_routes_stay_open():
    async def run():
        r = await _router()
        with _Http(r) as http:
            return [await http.call(m, p, b, client="203.0.113.7") for m, p, b in OPENAI_ROUTES]
    assert [resp.status_code for resp in _run(run())] == [200, 200, 200]


def test_the_multi_model_router_takes_the_same_keys(keys):
    args = copy.deepcopy(yaml.safe_load((ROOT / "deployments" / "local-multi.yaml").read_text())
                         ["applications"][0]["args"])
    args["router"].update(request_log=None, api_keys_env=KEYS_VAR)

    async def run():
        pools = {"tiny-qwen2": {"both": _Pool("both", ["t1"])}, "small-qwen2": {"both": _Pool("both", ["s1"])}}
        r = await in_process_router(None, None, args, pools, poll=False)
        with _Http(r) as http:
            return (await http.call("GET", "/v1/models"),
                    await http.call("GET", "/v1/models", auth=[f"Bearer {KEY_TWO}"]))
    refused, served = _run(run())
    _assert_error(refused, 401, "authentication_error", "missing_api_key", "multi-model /v1/models")
    assert served.status_code == 200 and {m["id"] for m in served.json()["data"]} == {"tiny-qwen2", "small-qwen2",
                                                                                       "auto"}


@pytest.mark.parametrize("value, problem", [
    (None, "is not set"),
    (" , ,", "holds no key"),
    (f"{KEY_ONE},with space", "key #2"),
    (f"{KEY_ONE},caf\u00e9", "key #2"),
])
def test_an_unset_or_unusable_key_variable_stops_the_router(monkeypatch, value, problem):
    if value is None:
        monkeypatch.delenv(KEYS_VAR, raising=False)
    else:
        monkeypatch.setenv(KEYS_VAR, value)
    with pytest.raises(AccessConfigError) as e:
        _run(_router(api_keys_env=KEYS_VAR))
    assert problem in str(e.value) and KEYS_VAR in str(e.value)
    assert KEY_ONE not in str(e.value) and "with space" not in str(e.value)


def test_token_mode_with_an_unset_token_variable_stops_the_router(monkeypatch):
    monkeypatch.delenv(TOKEN_VAR, raising=False)
    with pytest.raises(AccessConfigError, match=f"{TOKEN_VAR} is not set"):
        _run(_router(admin="token", admin_token_env=TOKEN_VAR))


def test_no_key_or_token_reaches_the_logs(keys, caplog):
    caplog.set_level(logging.DEBUG)

    async def run():
        r = await _router(api_keys_env=KEYS_VAR, admin="token", admin_token_env=TOKEN_VAR)
        with _Http(r) as http:
            for auth in ([f"Bearer {KEY_ONE}"], [f"Bearer {KEY_TWO}x"], [f"Bearer {ADMIN_TOKEN}"], [KEY_ONE]):
                for method, path, body in OPENAI_ROUTES + ADMIN_ROUTES:
                    await http.call(method, path, body, auth=auth)
    _run(run())
    assert "access: /v1: 2 API key(s); /admin: token" in caplog.text  # the start-up line: counts, not keys
    for secret in SECRETS:
        assert secret not in caplog.text
        assert secret[:12] not in caplog.text  # not even a prefix


# --- the admin gate --------------------------------------------------------------------------------

def test_admin_disabled_answers_404_like_an_unknown_path(keys):
    async def run():
        r = await _router(admin="disabled")
        with _Http(r) as http:
            return r, [(path, await http.call(m, path, b, auth=[f"Bearer {ADMIN_TOKEN}"]))
                       for m, path, b in ADMIN_ROUTES]
    r, out = _run(run())
    for path, resp in out:
        body = _assert_error(resp, 404, "not_found_error", None, path)
        assert path in body["error"]["message"]  # the same words as any unknown path
    assert r.admin.state()["policy"] == ROUTER_POLICY


@pytest.mark.parametrize("client, allowed", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("10.0.0.5", False), ("192.168.1.20", False), ("203.0.113.7", False), ("::ffff:10.0.0.5", False),
    ("2001:db8::1", False), ("testclient", False),
])
def test_admin_loopback_serves_only_loopback_clients(client, allowed):
    async def run():
        r = await _router(admin="loopback")
        with _Http(r) as http:
            out = [(path, await http.call(m, path, b, client=client)) for m, path, b in ADMIN_ROUTES
                   if path != "/admin/policy"]
            # an admin change from a refused client changes nothing
            out.append(("/admin/policy", await http.call("POST", "/admin/policy", {"name": "round_robin"},
                                                         client=client)))
        return r, out
    r, out = _run(run())
    for path, resp in out:
        if allowed:
            assert resp.status_code == 200, (client, path, resp.text)
        else:
            _assert_error(resp, 403, "permission_error", None, f"{client} {path}")
    assert r.admin.state()["policy"] == ("round_robin" if allowed else ROUTER_POLICY)


def test_admin_loopback_does_not_believe_forwarded_headers():
    async def run():
        r = await _router(admin="loopback")
        with _Http(r) as http:
            return [await http.call("GET", "/admin/state", client="203.0.113.7", headers=h)
                    for h in ({"X-Forwarded-For": "127.0.0.1"}, {"Forwarded": "for=127.0.0.1"},
                              {"X-Real-IP": "127.0.0.1"})]
    for resp in _run(run()):
        assert resp.status_code == 403


def test_admin_token_mode_needs_the_admin_token_from_any_client(keys):
    async def run():
        r = await _router(api_keys_env=KEYS_VAR, admin="token", admin_token_env=TOKEN_VAR)
        out = []
        with _Http(r) as http:
            for m, path, b in ADMIN_ROUTES:
                for label, auth in [("none", []), ("wrong", [f"Bearer {ADMIN_TOKEN}x"]),
                                    ("an API key", [f"Bearer {KEY_ONE}"]), ("no scheme", [ADMIN_TOKEN]),
                                    ("loopback, no token", [])]:
                    out.append((path, label, None, await http.call(m, path, b, auth=auth,
                                                                   client="127.0.0.1" if "loopback" in label
                                                                   else "203.0.113.7")))
                out.append((path, "token", 200, await http.call(m, path, b, auth=[f"Bearer {ADMIN_TOKEN}"],
                                                                client="203.0.113.7")))
            # the admin token is no API key
            out.append(("/v1/models", "admin token", None,
                        await http.call("GET", "/v1/models", auth=[f"Bearer {ADMIN_TOKEN}"])))
        return out
    for path, label, ok, resp in _run(run()):
        if ok:
            assert resp.status_code == 200, (path, label, resp.text)
        elif path.startswith("/admin"):
            _assert_error(resp, 401, "authentication_error", "invalid_admin_token", f"{path}: {label}")
            assert resp.headers["www-authenticate"] == "Bearer"
        else:
            _assert_error(resp, 401, "authentication_error", "invalid_api_key", f"{path}: {label}")


# --- config ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("router, message", [
    ({"admin": "token"}, "needs router.admin_token_env"),
    ({"admin_token_env": TOKEN_VAR}, "router.admin is 'loopback'"),
    ({"admin": False}, "write 'disabled'"),  # YAML's bare `off`
    ({"admin": "open"}, "Input should be 'disabled', 'loopback' or 'token'"),
    ({"api_keys_env": KEY_ONE}, "the NAME of an environment variable"),  # the key itself pasted in
    ({"admin": "token", "admin_token_env": f"{ADMIN_TOKEN}"}, "the NAME of an environment variable"),
])
def test_access_settings_are_checked_at_build_time_without_echoing_secrets(router, message):
    with pytest.raises(ConfigError) as e:
        parse_args(_args(**router))
    assert message in str(e.value)
    assert KEY_ONE not in str(e.value) and ADMIN_TOKEN not in str(e.value)


def test_yaml_off_is_refused_with_a_hint(tmp_path):
    doc = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    text = yaml.safe_dump(doc).replace("admin: loopback", "admin: off")
    (tmp_path / "off.yaml").write_text(text)
    with pytest.raises(ConfigError, match="write 'disabled'"):
        load_serve_config(tmp_path / "off.yaml")


@pytest.mark.parametrize("host, admin, ok", [
    ("127.0.0.1", "loopback", True), ("localhost", "loopback", True), ("::1", "loopback", True),
    (None, "loopback", True),  # Serve's default bind is 127.0.0.1
    ("0.0.0.0", "loopback", False), ("10.1.2.3", "loopback", False), ("::", "loopback", False),
    ("0.0.0.0", "disabled", True),
])
def test_loopback_admin_is_refused_on_a_public_bind(tmp_path, host, admin, ok):
    doc = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    if host is None:
        doc.pop("http_options")
    else:
        doc["http_options"]["host"] = host
    doc["applications"][0]["args"]["router"]["admin"] = admin
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    if ok:
        load_serve_config(tmp_path / "c.yaml")
    else:
        with pytest.raises(ConfigError, match="HAProxy"):
            load_serve_config(tmp_path / "c.yaml")


def test_the_shipped_configs_gate_admin_as_documented():
    def router(name):
        return RouterSettings.model_validate(
            {k: v for k, v in yaml.safe_load((ROOT / "deployments" / name).read_text())["applications"][0]["args"]
             ["router"].items() if k in RouterSettings.model_fields})
    # production binds 0.0.0.0: a token (calibrate --live --apply needs /admin/*), never loopback
    assert router("disagg.yaml").admin is AdminAccess.TOKEN
    assert router("disagg.yaml").admin_token_env == "DISAGG_ADMIN_TOKEN"
    assert router("local.yaml").admin is AdminAccess.LOOPBACK and router("local.yaml").cost_model_dir == "runs"
    for name in ("disagg.yaml", "local.yaml", "local-multi.yaml", "local-autoscale.yaml", "bench-1p1d.yaml"):
        load_serve_config(ROOT / "deployments" / name)


# --- cost models over HTTP -------------------------------------------------------------------------

@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run folder with `runs/` (the allowed folder) and files in and around it."""
    run, allowed, outside = tmp_path / "run", tmp_path / "run" / "runs", tmp_path / "elsewhere"
    allowed.mkdir(parents=True)
    outside.mkdir()
    good = CostModel.load(PROFILES_DIR / "cpu-tiny.yaml").model_copy(update={"name": "cpu-tiny-edited"})
    good.save(allowed / "good.yaml")
    good.save(allowed / "good.yml")
    good.model_copy(update={"name": "outside"}).save(outside / "valid.yaml")
    good.model_copy(update={"name": "beside"}).save(run / "beside.yaml")
    (allowed / "syntax.yaml").write_text("engine: [unclosed\n")
    (allowed / "list.yaml").write_text("- 1\n- 2\n")
    (allowed / "scalar.yaml").write_text("just a string\n")
    (allowed / "empty.yaml").write_text("")
    (allowed / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
    (allowed / "good.txt").write_text((allowed / "good.yaml").read_text())
    (allowed / "folder.yaml").mkdir()
    (allowed / "out-link.yaml").symlink_to(outside / "valid.yaml")
    (allowed / "out-dir").symlink_to(outside)
    (allowed / "in-link.yaml").symlink_to(allowed / "good.yaml")
    (allowed / "loop.yaml").symlink_to(allowed / "loop.yaml")
    os.mkfifo(allowed / "fifo.yaml")
    monkeypatch.setenv("DISAGG_RUN_DIR", str(run))
    return run


def _refused_sources(run: Path) -> list:
    allowed = run / "runs"
    return [
        "runs/../../elsewhere/valid.yaml", "../elsewhere/valid.yaml", str(allowed / ".." / ".." / "elsewhere" /
                                                                          "valid.yaml"),
        str(run.parent / "elsewhere" / "valid.yaml"),  # absolute, outside, exists
        "beside.yaml", str(run / "beside.yaml"),  # the run folder itself is not the allowed folder
        "runs/out-link.yaml", "runs/out-dir/valid.yaml",  # symlinks out
        "runs/out-dir/../elsewhere/valid.yaml",  # '..' after a symlink climbs from where the link points
        "runs/missing.yaml", str(allowed / "missing.yaml"), "/etc/passwd", "/etc/hostname", "/nonexistent.yaml",
        "runs/syntax.yaml", "runs/list.yaml", "runs/scalar.yaml", "runs/empty.yaml", "runs/binary.yaml",
        "runs/good.txt", "runs/folder.yaml", "runs/loop.yaml", "runs/fifo.yaml", "runs", str(allowed),
        "../profiles/cpu-tiny", "cpu-tiny.yaml", str(PROFILES_DIR / "cpu-tiny.yaml"),  # names, not paths
        "runs/good.yaml\x00.txt", "", 123, None, ["runs/good.yaml"], {"path": "runs/good.yaml"},
    ]


def test_cost_model_files_load_only_from_inside_the_allowed_folder(run_dir):
    async def run():
        r = await _router(cost_model_dir="runs")
        with _Http(r) as http:
            async def post(source):
                resp = await http.call("POST", "/admin/cost_model", {"cost_model": source})
                return resp, r.admin.state()["cost_model"]
            accepted = [(s, *await post(s)) for s in ("runs/good.yaml", str(run_dir / "runs" / "good.yml"),
                                                      "runs/./in-link.yaml", "runs/../runs/good.yaml",
                                                      "cpu-tiny", "a40")]
            refused = [(s, (await post(s))[0]) for s in _refused_sources(run_dir)]
            return accepted, refused, r.admin.state()["cost_model"]
    accepted, refused, final = asyncio.run(run())
    for source, resp, name in accepted:
        assert resp.status_code == 200, (source, resp.text)
        assert name == resp.json()["cost_model"]
    assert [name for *_, name in accepted][:4] == ["cpu-tiny-edited"] * 4
    messages = set()
    for source, resp in refused:
        assert resp.status_code == 400, (source, resp.text)
        err = resp.json()["error"]
        assert err["param"] == "cost_model" and err["type"] == "invalid_request_error", (source, err)
        messages.add(err["message"])
    assert len(messages) == 1, messages  # one message: it never tells whether a path exists
    (message,) = messages
    assert "router.cost_model_dir" in message and "cpu-tiny" in message
    assert str(run_dir) not in message and "elsewhere" not in message
    assert final == "a40-qwen2.5-3b"  # the last accepted (a40); no refusal changed it


def test_without_a_cost_model_dir_only_profile_names_load(run_dir):
    async def run():
        r = await _router(cost_model_dir=None)
        with _Http(r) as http:
            return [await http.call("POST", "/admin/cost_model", {"cost_model": s})
                    for s in ("runs/good.yaml", str(run_dir / "runs" / "good.yaml"), "runs/missing.yaml", "a40")]
    *files, profile = _run(run())
    assert [f.status_code for f in files] == [400, 400, 400]
    assert len({f.json()["error"]["message"] for f in files}) == 1
    assert "router.cost_model_dir is not set" in files[0].json()["error"]["message"]
    assert profile.status_code == 200 and profile.json()["cost_model"] == "a40-qwen2.5-3b"


def test_a_file_inside_the_folder_that_is_no_valid_cost_model_names_the_field(run_dir):
    bad = CostModel.load(run_dir / "runs" / "good.yaml").to_dict()
    bad["engine"]["decode_seq_s"] = 2.5
    (run_dir / "runs" / "units.yaml").write_text(yaml.safe_dump(bad))

    async def run():
        r = await _router(cost_model_dir="runs")
        with _Http(r) as http:
            return await http.call("POST", "/admin/cost_model", {"cost_model": "runs/units.yaml"}), r
    resp, r = _run(run())
    assert resp.status_code == 400 and "decode" in resp.json()["error"]["message"], resp.text
    assert r.admin.state()["cost_model"] == "cpu-tiny"
