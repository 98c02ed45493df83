"""Faults injected into the real stack: engines killed by pid, clients that leave early.

Each test provokes its fault on the session's stack (tests/conftest.py), checks what the user
sees and what the engines report, and, where it killed an engine, waits until Serve has replaced
the replica (the warm-up proves the new one's handoff before it is routed to) so the tests after
it find the stack whole. The fault counters each test moves are checked exactly and added to the
session's tally (`unprovoked.provoked`): anything beyond them still fails the session.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from disagg.bench.sse import DONE, SseDecoder, sse_data
from factories import stream_text, stream_token_ids, tiny_tokenizer, vllm_text
from serve_app.engine import engine_processes_under
from unprovoked import killed_on_purpose, provoked

pytestmark = pytest.mark.stack
MODEL = "tiny-qwen2"
REPLACE_TIMEOUT_S = 420  # a killed replica's replacement: engine start and warm-up on 2 busy cores
MAX_DEPARTURES = 48  # clients leaving early, at most, until one leaves between its prefill and its first token


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.base_url, timeout=httpx.Timeout(120.0)) as c:
        yield c


def state(client) -> dict:
    r = client.get("/admin/state")
    assert r.status_code == 200, r.text
    return r.json()


def route(headers) -> dict:
    return dict(part.split("=", 1) for part in headers["x-disagg-route"].split("; "))


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def engine_pids(instance: dict) -> tuple[int, ...]:
    """The engine processes of the replica behind `instance` (an /admin/state entry), EngineCore first,
    as vLLM's own process handles name them in the replica."""
    pids = tuple(instance["engine_pids"])
    assert pids and running(pids[0]), (
        f"replica pid {instance['pid']} reports engine processes {pids}; by parent links and name: "
        f"{engine_processes_under(instance['pid'])}")
    return pids


def kill_engine_core(instance: dict) -> set[int]:
    """SIGKILL the EngineCore of the replica behind `instance`; its engine pids."""
    pids = engine_pids(instance)
    os.kill(pids[0], signal.SIGKILL)
    return set(pids)


def wait_until_replaced(client, killed: str, role: str, width: int) -> dict:
    """Until the pool is back to `width` instances, none of them `killed`; the state then."""
    deadline = time.monotonic() + REPLACE_TIMEOUT_S
    while time.monotonic() < deadline:
        s = state(client)
        pool = [k for k, v in s["instances"].items() if v["role"] == role]
        if killed not in pool and len(pool) == width:
            return s
        time.sleep(2)
    raise AssertionError(f"{role} pool not replaced within {REPLACE_TIMEOUT_S} s: {sorted(s['instances'])}")


def wait_until_idle(client, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = state(client)
        if s["in_flight"] == 0 and all(v["running"] + v["waiting"] == 0 for v in s["instances"].values()):
            return s
        time.sleep(0.2)
    raise AssertionError(f"the stack did not go idle within {timeout_s} s: {s}")


def test_a_decode_engine_killed_mid_stream_is_migrated_and_the_answer_continues_from_the_tokens_sent(client, stack):
    """The client gets one whole stream: the tokens sent before the kill, each once, then the new
    instance's greedy continuation of prompt + those tokens. Not necessarily the uninterrupted
    answer: the new instance recomputes those tokens as a prefill, and bf16 kernels need not round
    as the incremental decode did (vLLM alone diverges so on some hosts: docs/known-gaps.md). So
    the continuation is checked against the same recompute, sent as a token-id prompt. The text is
    the detokenized ids, the two characters vLLM held back for the stop string included."""
    body = {"model": MODEL, "prompt": "A decode engine dies mid-answer; the router carries on:", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0.0, "return_token_ids": True, "stop": "§§§"}  # never met
    reference = client.post("/v1/completions", json=body)
    assert reference.status_code == 200, reference.text
    ref = reference.json()["choices"][0]
    # no engine may hold blocks the reference's decode computed: the continuation below would take
    # them from one cache and not from the other, and bf16 kernels need not round alike
    assert client.post("/admin/reset_prefix_cache").status_code == 200
    before = wait_until_idle(client)
    width = sum(v["role"] == "decode" for v in before["instances"].values())
    assert width >= 2, "migration needs a second decode instance"

    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        served = route(r.headers)["served_decode"]
        events, killed = [], set()
        for data in sse_data(r.iter_lines()):
            events.append(data)
            if not killed and len(events) >= 3:  # mid-stream
                killed = kill_engine_core(before["instances"][served])
    assert killed, "the stream ended before the engine could be killed"
    # the kill is accounted for before any check of the answer: a wrong answer must not leave the
    # pool short or the kill unprovoked for the tests after this one
    after = wait_until_replaced(client, served, "decode", width)
    killed_on_purpose(stack, killed, served)
    provoked(stack, before["counters"], after["counters"], {"migrations": 1, "instances_lost": len(after["routers"])})

    text, errors = stream_text(events)
    prompt_ids, output = stream_token_ids(events)
    rid = json.loads(events[0])["id"]
    record = next(json.loads(x) for x in (stack.run_dir / "runs" / "requests.jsonl").read_text().splitlines()
                  if json.loads(x)["id"] == rid)
    assert errors == []
    assert record["migrated_from"] == [served] and record["decode"] != served
    assert record["output_tokens"] == 400 and record["error"] is None
    [sent] = record["migrated_after_tokens"]
    assert 0 < sent < 400 and len(output) == 400 and prompt_ids == ref["prompt_token_ids"]
    assert output[:sent] == ref["token_ids"][:sent]  # before the kill: the uninterrupted decode's tokens

    rest = client.post("/v1/completions", json={**body, "prompt": prompt_ids + output[:sent], "max_tokens": 400 - sent})
    assert rest.status_code == 200, rest.text
    assert output[sent:] == rest.json()["choices"][0]["token_ids"]  # after it: the recompute's, none twice or lost
    assert text == vllm_text(tiny_tokenizer(), prompt_ids, output)  # and the text is theirs, none lost at the seam


def _send_and_leave(base_url: str, body: dict, after_s: float) -> None:
    """POST `body` and close the connection `after_s` later, whatever has arrived by then."""
    url = urlsplit(base_url)
    raw = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (url.hostname.encode(), len(raw), raw))
        time.sleep(after_s)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST: gone at once


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(("kv", "cache", "blocks", "prefill", "decode", "lease", "router", "engine"))
                    for _ in range(n))


def test_a_client_leaving_before_its_first_token_frees_the_kv_on_both_engines_within_a_second(client, stack):
    """At every moment before the first token (queued, prefilling, between the prefill and the
    decode's pull), a client that leaves costs no KV for longer than a second: the prefill
    engine's blocks are not held for a pull that will never come (Dynamo #13691). Seen on the
    engines' own KV gauges, refreshed by a one-token request after the second."""
    rng = random.Random(7)
    long = {"model": MODEL, "max_tokens": 64, "ignore_eos": True, "temperature": 0.0, "stream": True}
    probe = {"model": MODEL, "prompt": "probe", "max_tokens": 1}
    t0 = time.monotonic()
    with client.stream("POST", "/v1/completions", json={**long, "prompt": _words(500, rng),
                                                         "stream_options": {"include_usage": True}}) as r:
        lines = r.iter_lines()
        next(lines)
        ttft_s = time.monotonic() - t0  # the scale of the window to hit
        usage = json.loads([data for data in sse_data(lines) if data != DONE][-1])["usage"]
    prompt_tokens = usage["prompt_tokens"]
    before = wait_until_idle(client)
    log = stack.run_dir / "runs" / "requests.jsonl"
    seen = len(log.read_text().splitlines()) if log.exists() else 0

    def in_the_window() -> bool:  # a client left between its prefill and its first token
        records = [json.loads(x) for x in log.read_text().splitlines()[seen:]] if log.exists() else []
        return any(r["error"] == "cancelled by client" and r["ttft_s"] is None and r["prefill"] is not None
                   for r in records)

    held = []
    # 12 departures spread over [0, 1.4 × TTFT], then (bounded) more until one lands in the window
    # between the prefill and the first token, a few ms wide and placed differently on every host
    for k in range(MAX_DEPARTURES):
        step = k % 12 + (k // 12) / 4  # each further round a quarter step later
        _send_and_leave(stack.base_url, {**long, "prompt": _words(500, rng)}, after_s=ttft_s * step / 8)
        time.sleep(1.0)
        assert client.post("/v1/completions", json=probe).status_code == 200  # a step on every engine it meets
        time.sleep(0.3)  # the next poll
        s = state(client)
        held.append({k: v["kv_used_tokens"] for k, v in s["instances"].items()})
        if k >= 11 and in_the_window():
            break
    wait_until_idle(client)
    # the probe's own blocks are a few tokens; a leaked prompt would hold ~prompt_tokens
    assert all(used < prompt_tokens // 2 for h in held for used in h.values()), held

    records = [json.loads(x) for x in log.read_text().splitlines()[seen:]] if log.exists() else []
    assert any(r["error"] == "cancelled by client" for r in records), "no disconnect reached the router"
    assert in_the_window(), (f"in {len(held)} departures no client left between its prefill and its first token: "
                             "the window this test is about was not hit")
    provoked(stack, before["counters"], state(client)["counters"], {})


def test_a_prefill_engine_killed_during_handoffs_loses_no_request(client, stack):
    """The only prefill engine dies while requests are prefilling, transferring and decoding:
    every request completes with the greedy text it has when nothing fails (retried on a decode
    instance that prefills itself), and so does every request sent while Serve replaces it."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(11)
    prompts = [_words(400, rng) for _ in range(8)]
    body = {"model": MODEL, "max_tokens": 24, "ignore_eos": True, "temperature": 0.0}
    reference = {p: client.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
                 for p in prompts}
    before = wait_until_idle(client)
    (prefill_id, prefill), = [(k, v) for k, v in before["instances"].items() if v["role"] == "prefill"]

    def ask(prompt: str) -> tuple[int, str]:
        with httpx.Client(base_url=stack.base_url, timeout=httpx.Timeout(120.0)) as c:
            r = c.post("/v1/completions", json={**body, "prompt": prompt})
            return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = [pool.submit(ask, p) for p in prompts]
        time.sleep(0.05)  # the first prefills are under way, the first transfers about to start
        killed = kill_engine_core(prefill)
        results = [a.result() for a in answers]
    assert results == [(200, reference[p]) for p in prompts]

    during = 0  # while the replica is replaced, requests keep being served
    deadline = time.monotonic() + REPLACE_TIMEOUT_S
    while time.monotonic() < deadline:
        p = prompts[during % len(prompts)]
        assert ask(p) == (200, reference[p])
        during += 1
        pool_now = [k for k, v in state(client)["instances"].items() if v["role"] == "prefill"]
        if pool_now and prefill_id not in pool_now:
            break
        time.sleep(1.0)
    after = wait_until_replaced(client, prefill_id, "prefill", 1)
    killed_on_purpose(stack, killed, prefill_id)
    routers = len(after["routers"])
    moved = provoked(stack, before["counters"], after["counters"], {"instances_lost": routers},
                     may_move=("prefill_retries", "local_prefill_fallbacks", "decode_retries"))
    # every request sent while the pool was empty prefilled locally (the last may have met the new one)
    assert moved.get("local_prefill_fallbacks", 0) >= during - 1
    # and once it is back, the handoff runs through it again
    r = client.post("/v1/completions", json={**body, "prompt": prompts[0]})
    assert r.json()["choices"][0]["text"] == reference[prompts[0]]
    assert route(r.headers)["served_prefill"] == route(r.headers)["prefill"] != route(r.headers)["served_decode"]


def test_a_router_replica_killed_mid_stream_ends_its_streams_and_comes_back_with_the_engines_in_view(client, stack):
    """The router replica serving a stream dies: the client's stream ends (no hang), the engine
    stops decoding for it, Serve starts a new router replica, which rebuilds its view of every
    engine from their polls and serves."""
    before = wait_until_idle(client)
    engines = set(before["instances"])
    body = {"model": MODEL, "prompt": "The router dies mid-answer.", "max_tokens": 1800, "ignore_eos": True,
            "stream": True}
    t0, ended = time.monotonic(), "without [DONE]"
    try:
        with httpx.Client(base_url=stack.base_url, timeout=httpx.Timeout(60.0)) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                router = r.headers["x-disagg-router"]
                dying = state(client)["routers"][router]
                n, sse = 0, SseDecoder()
                for line in r.iter_lines():
                    data = sse.line(line)
                    if data is None:
                        continue
                    n += data != DONE
                    if n == 3:
                        os.kill(dying["pid"], signal.SIGKILL)
                    if '"error"' in data or data == DONE:
                        ended = "with an error event" if '"error"' in data else "completed"
                        break
    except httpx.HTTPError as e:  # the connection was cut
        ended = f"cut ({type(e).__name__})"
    assert ended != "completed", "the stream completed although its router died"
    assert time.monotonic() - t0 < 60, f"the stream took {time.monotonic() - t0:.0f} s to end ({ended})"
    wait_until_idle(client, timeout_s=10)  # the engine stopped decoding for the dead router (1,800 tokens take longer)

    def answered_state() -> dict | None:
        """The state, or None while the proxy still sends some calls to the dead replica (a 500)."""
        try:
            return state(client)
        except (httpx.HTTPError, AssertionError):
            return None

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Serve replaces the router; the new one polls the engines
        s = answered_state()
        # both replicas answer with every engine in view (4 reads: the proxy picks one per call)
        if s and router not in s["routers"] and len(s["routers"]) == len(before["routers"]) \
                and all((x := answered_state()) and set(x["instances"]) == engines for _ in range(4)):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the router replica was not replaced with the engines in view: {s}")
    # the replacement took the admin changes its peer applied since the config (the suite's policy,
    # the constants fitted at start): every replica routes by the same rules
    expected, deadline = (dying["policies"], dying["cost_models"]), time.monotonic() + 10
    while True:
        s = state(client)
        same = all((r["policies"], r["cost_models"]) == expected for r in s["routers"].values())
        if same or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert same, f"the replicas route by other rules than the dead one: {s['routers']}"
    after = wait_until_idle(client)
    # the dead replica's counters left the sums with it: so do the faults counted there
    for k in stack.provoked:
        stack.provoked[k] -= dying["counters"].get(k, 0)
    r = client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert after["counters"]["failed"] - (before["counters"]["failed"] - dying["counters"]["failed"]) == 0


ENGINE_GONE_S = 15.0  # Ray 2.60 kills a dead worker's process group within ~2.5 s (measured)


def test_a_decode_replicas_worker_killed_takes_its_engine_processes_with_it_and_the_replacement_serves(client, stack):
    """SIGKILL of a decode replica's Ray worker (not of its engine): its EngineCore and vLLM worker
    must be gone within 15 s, or a replacement on a GPU would find the GPU's memory still taken. Ray
    2.60 runs each worker in its own process group and cleans the group up when the worker dies;
    an upgrade that loses this fails here. Then Serve's replacement serves, KV pulled over NIXL."""
    before = wait_until_idle(client)
    decodes = {k: v for k, v in before["instances"].items() if v["role"] == "decode"}
    victim, inst = sorted(decodes.items())[0]
    engines = engine_pids(inst)
    os.kill(inst["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    while any(running(p) for p in engines) \
            and time.monotonic() - t0 < ENGINE_GONE_S:
        time.sleep(0.2)
    alive = [p for p in engines if running(p)]
    assert not alive, f"engine processes of the killed replica outlived it by {ENGINE_GONE_S:.0f} s: {alive}"
    after = wait_until_replaced(client, victim, "decode", len(decodes))
    killed_on_purpose(stack, set(engines), victim)
    provoked(stack, before["counters"], after["counters"], {"instances_lost": len(after["routers"])})
    # the replacement serves a handoff itself: pinned by the route, its KV pulled from the prefill engine
    (new,) = set(k for k, v in after["instances"].items() if v["role"] == "decode") - set(decodes)
    for _ in range(20):  # the policy picks the instance; a bounded number of tries until it picks the new one
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "After the kill.", "max_tokens": 4,
                                                 "ignore_eos": True, "temperature": 0.0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        if route(r.headers)["served_decode"] == new:
            break
    else:
        raise AssertionError(f"20 requests and none was decoded on the replacement {new}")
    assert state(client)["instances"][new]["kv_received_tokens"] > 0
