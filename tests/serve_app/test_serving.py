"""The product, end to end on the real stack: HTTP → router → prefill engine → NIXL → decode engine.

One stack per session (tests/conftest.py): Ray on 127.0.0.1, the CPU profile's router,
1 prefill + 2 decode vLLM engines (CPU build) on the offline tiny model. No stand-ins.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from disagg.bench.sse import DONE, sse_data
from factories import DISAGGREGATING_POLICY, stream_text, stream_token_ids, tiny_tokenizer

pytestmark = pytest.mark.stack
MODEL = "tiny-qwen2"
TIMEOUT = httpx.Timeout(120.0)


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT) as c:
        yield c


def set_policy(client, name, params=None):
    r = client.post("/admin/policy", json={"name": name, "params": params or {}})
    assert r.status_code == 200, r.text


def state(client) -> dict:
    r = client.get("/admin/state")
    assert r.status_code == 200
    return r.json()


def route(resp) -> dict:
    """x-disagg-route → {key: value}."""
    return dict(part.split("=", 1) for part in resp.headers["x-disagg-route"].split("; "))


def complete(client, prompt, max_tokens=16, headers=None, **kw):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **kw}
    r = client.post("/v1/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r


def test_health_and_models(client):
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["instances"] == {"prefill": 1, "decode": 2}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_every_decode_replica_pulled_kv_over_nixl_before_it_reported_ready(stack):
    """The warm-up handoff: before any request, each decode engine has received a prompt's KV from a
    prefill engine (counted per token by vLLM's connector), with no failed transfer anywhere."""
    engines = stack.initial_state["instances"]
    decodes = [v for v in engines.values() if v["role"] == "decode"]
    assert len(decodes) == 2
    assert all(v["kv_received_tokens"] > 0 and v["kv_transfers_ok"] >= 1 for v in decodes), decodes
    assert all(v["kv_transfers_failed"] == 0 for v in engines.values()), engines


def test_completion_with_usage_and_route_header(client):
    set_policy(client, "marginal_cost")
    r = complete(client, "The router prices every candidate", max_tokens=12, ignore_eos=True)
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] > 3
    rt = route(r)
    instances = state(client)["instances"]
    assert rt["policy"] == "marginal_cost"
    assert rt["prefill"] in instances and instances[rt["prefill"]]["role"] == "prefill"
    assert rt["decode"] in instances and instances[rt["decode"]]["role"] == "decode"
    assert float(rt["d_work"]) > 0 and float(rt["p_work"]) > 0  # priced, per term
    # the engines' own times, which calibration subtracts from the client's TTFT
    assert 0 < float(rt["prefill_engine_s"]) < 5 and 0 < float(rt["decode_engine_first_s"]) < 5
    # the router's: reading and rendering the request, then routing to the first token, which holds both engines'
    assert 0 < float(rt["intake_s"]) < 5
    assert float(rt["router_first_s"]) >= float(rt["prefill_engine_s"]) + float(rt["decode_engine_first_s"])


def test_the_shipped_policy_prices_the_fitted_host_live(client, stack):
    """The shipped default (`slo_goodput`, deployments/local.yaml) with the constants `make run` fits
    at start, its shared host included: every placement priced at the host's stretch, each request
    served where it was routed (no fallback), whole on one engine or disaggregated over NIXL."""
    assert stack.shipped_policy == "slo_goodput"
    constants = next(iter(state(client)["models"].values()))["cost_model_constants"]
    assert constants["shared_host"] is not None  # the fit's host terms: the pricing under test
    if stack.host_fit is not None:  # a stack this session started and fitted
        # the shipped policy sends no lone request through a prefill engine: the fit routed some there
        # itself to measure the KV hand-off and its serving path (not the profile's guesses), and gave
        # the app its policy back
        assert "no request crossed" not in stack.host_fit_summary, stack.host_fit_summary
        assert "a hand-off" in stack.host_fit_summary and "round_robin" in stack.host_fit_summary
        assert stack.policy_after_fit == stack.shipped_policy
        assert constants["transfer"]["between_prefill_steps"] is True  # the CPU profile's NIXL, kept by the fit
    set_policy(client, stack.shipped_policy)
    try:
        prompts = [f"Request {i} shares two cores with its neighbours. " * (2 + 6 * i) for i in range(6)]
        with ThreadPoolExecutor(3) as pool:  # three at a time: engines busy while others are decided
            resps = list(pool.map(lambda p: complete(client, p, max_tokens=8, ignore_eos=True), prompts))
    finally:
        set_policy(client, DISAGGREGATING_POLICY)
    roles = {k: v["role"] for k, v in state(client)["instances"].items()}
    for r in resps:
        assert r.json()["usage"]["completion_tokens"] == 8
        rt = route(r)
        assert rt["policy"] == "slo_goodput"
        assert (rt["served_prefill"], rt["served_decode"]) == (rt["prefill"], rt["decode"])
        assert roles[rt["decode"]] == "decode" or rt["decode"] == rt["prefill"]  # or hosted on a prefill engine
        assert rt["prefill"] == rt["decode"] or roles[rt["prefill"]] == "prefill"


def test_the_handoff_goes_over_nixl(client):
    set_policy(client, "marginal_cost")
    before = {k: v for k, v in state(client)["instances"].items() if v["role"] == "decode"}
    prompt = "KV blocks move from the prefill engine to the decode engine. " * 8
    r = complete(client, prompt, max_tokens=8)
    served = route(r)["served_decode"]
    time.sleep(0.5)  # let a poll see the counters
    after = state(client)["instances"][served]
    assert after["kv_transfers_ok"] > before[served]["kv_transfers_ok"]
    assert after["kv_received_tokens"] - before[served]["kv_received_tokens"] >= r.json()["usage"]["prompt_tokens"] - 16
    assert after["kv_transfers_failed"] == before[served]["kv_transfers_failed"]


def test_greedy_output_is_identical_disaggregated_colocated_and_across_decode_instances(client):
    prompt = "Greedy decoding must not depend on where the KV cache was computed:"
    set_policy(client, "colocated")
    reference = [complete(client, prompt, max_tokens=24, ignore_eos=True) for _ in range(2)]
    set_policy(client, "round_robin")
    decodes = {k for k, v in state(client)["instances"].items() if v["role"] == "decode"}
    disagg = []
    # each router replica keeps its own round-robin cursor: ask until both decode instances served
    while len(disagg) < 8 and {route(r)["served_decode"] for r in disagg} != decodes:
        disagg.append(complete(client, prompt, max_tokens=24, ignore_eos=True))
    texts = {r.json()["choices"][0]["text"] for r in reference + disagg}
    assert len(texts) == 1
    assert {route(r)["served_decode"] for r in disagg} == decodes
    assert all(route(r)["served_prefill"] == route(r)["served_decode"] for r in reference)
    assert all(route(r)["served_prefill"] != route(r)["served_decode"] for r in disagg)


def test_a_request_hosted_on_the_prefill_engine_is_served_there_whole_with_the_same_answer(client, stack):
    """`slo_goodput` serves a request whole on a prefill engine when no disaggregated placement can
    meet its SLO. Here a cost model with 5 s KV transfers (colocation on the decode engines off)
    makes every pair miss: the prefill engine prefills and decodes the request itself, with no KV
    moved, and greedy decoding gives the disaggregated answer."""
    from disagg.core.cost_model import load_profile

    prompt = "A prefill engine can decode too, when the decode pool is the limit:"
    set_policy(client, "round_robin")
    reference = complete(client, prompt, max_tokens=16, ignore_eos=True)
    slow_links = stack.run_dir / "runs" / "test-hosted-slow-links.yaml"
    cm = load_profile("cpu-tiny")
    cm.model_copy(update={"name": "cpu-tiny-slow-links",
                          "transfer": cm.transfer.model_copy(update={"latency_s": 5.0})}).save(slow_links)
    before = state(client)["instances"]
    try:
        r = client.post("/admin/cost_model", json={"cost_model": str(slow_links)})
        assert r.status_code == 200, r.text
        set_policy(client, "slo_goodput", {"allow_colocated": False})
        hosted = complete(client, prompt, max_tokens=16, ignore_eos=True)
    finally:
        slow_links.unlink(missing_ok=True)
        restore = str(stack.host_fit) if stack.host_fit else "cpu-tiny"  # what the session priced with
        assert client.post("/admin/cost_model", json={"cost_model": restore}).status_code == 200
        set_policy(client, "marginal_cost")
    rt = route(hosted)
    assert rt["policy"] == "slo_goodput"
    assert rt["prefill"] == rt["decode"] == rt["served_prefill"] == rt["served_decode"] and "fallback" not in rt
    assert before[rt["served_decode"]]["role"] == "prefill"
    assert hosted.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    assert hosted.json()["usage"]["completion_tokens"] == 16
    time.sleep(0.5)  # let a poll see the counters
    after = state(client)["instances"]
    assert all(after[k]["kv_transfers_ok"] == v["kv_transfers_ok"] for k, v in before.items() if v["role"] == "decode")


def test_streaming_chat_with_usage(client):
    set_policy(client, "marginal_cost")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Stream me some tokens"}],
            "max_tokens": 20, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    chunks, done = [], False
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-SLO-Class": "tight"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert route(r)["sigma"] == "2"  # the tight class is weighted up
        for data in sse_data(r.iter_lines()):
            if data == DONE:
                done = True
                break
            chunks.append(json.loads(data))
    assert done
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 20
    # vLLM's places: the prompt's ids at the top of the first chunk, each chunk's own in its choice
    assert len(chunks[0]["prompt_token_ids"]) == chunks[-1]["usage"]["prompt_tokens"]
    assert not any(c.get("prompt_token_ids") for c in chunks[1:])
    assert sum(len(c["choices"][0].get("token_ids") or ()) for c in chunks if c["choices"]) == 20
    assert [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] == "length"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_id_prompt_that_ends_inside_a_character_gets_its_output_text_alone(client, stream):
    """vLLM's own text would start with the whole prompt's again (serve_app/router_text.py)."""
    tok = tiny_tokenizer()
    ids = tok.encode("Say it: café")
    prompt = ids[:next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0.0,
            "return_token_ids": True, "stream": stream}
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = list(sse_data(r.iter_lines()))
        text, errors = stream_text(events)
        sent_prompt, output = stream_token_ids(events)
        assert errors == []
    else:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, sent_prompt, output = choice["text"], choice["prompt_token_ids"], choice["token_ids"]
    assert sent_prompt == prompt and len(output) == 12
    assert text == tok.decode(prompt + output)[len(tok.decode(prompt)):]  # after the prompt's text, not with it


@pytest.mark.parametrize("n", [1, 7, 33])
def test_token_count_contract(client, n):
    r = complete(client, "count", max_tokens=n, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == n
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_official_openai_client(stack):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", timeout=120)
    out = c.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                               extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == chat.choices[0].message.content


def test_policy_spreads_load_over_decode_instances(client):
    set_policy(client, "least_loaded")
    seen = {route(complete(client, f"spread {i}", max_tokens=4))["served_decode"] for i in range(8)}
    assert len(seen) == 2


def test_two_router_replicas_both_serve_and_a_policy_switch_reaches_both(client):
    set_policy(client, "least_loaded")
    with httpx.Client(base_url=str(client.base_url), timeout=TIMEOUT) as c2:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            resps = list(pool.map(lambda i: complete(c2, f"which router {i}", max_tokens=3), range(24)))
    routers = {r.headers["x-disagg-router"] for r in resps}
    assert len(routers) == 2, routers  # the proxy spreads requests over both replicas
    assert {route(r)["policy"] for r in resps} == {"least_loaded"}  # the switch reached both
    s = state(client)
    assert set(s["routers"]) == routers
    assert s["counters"]["served"] == sum(r["counters"]["served"] for r in s["routers"].values())


def test_policy_switch_rejects_unknown_and_simulator_only(client):
    r = client.post("/admin/policy", json={"name": "nope"})
    assert r.status_code == 400 and "known policies" in r.json()["error"]["message"]
    r = client.post("/admin/policy", json={"name": "oracle"})
    assert r.status_code == 400 and "simulator only" in r.json()["error"]["message"]
    set_policy(client, "length_heuristic", {"long_output_tokens": 64})
    assert route(complete(client, "x", max_tokens=4))["policy"] == "length_heuristic"


BAD = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", json.dumps({"model": MODEL}).encode(), "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": 5}).encode(), "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 5000}).encode(), "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 3000}).encode(), "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(), "n"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "temperature": "hot"}).encode(), "temperature"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 2, 10**9]}).encode(), "prompt"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), "messages"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "stop": ""}).encode(), "stop"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "y"}],
                                         "tools": [{"type": "function"}]}).encode(), "tools.0.function"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "top_k": -2}).encode(), "top_k"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "logprobs": 21}).encode(), "logprobs"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}).encode(),
     "logit_bias"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}).encode(),
     "presence_penalty"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "y"}],
                                         "top_logprobs": 2}).encode(), "top_logprobs"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "y"}],
                                         "response_format": {"type": "xml"}}).encode(), "response_format.type"),
    ("/v1/completions", b'{"model": "tiny-qwen2", "prompt": "x", "temperature": NaN}', None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 1_000_000}).encode(), "prompt"),
]


def test_bad_requests_get_400_naming_the_field_and_the_app_keeps_serving(client):
    for path, raw, param in BAD:
        r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, raw[:60], r.status_code, r.text[:200])
        err = r.json()["error"]
        assert err["code"] == 400 and err["param"] == param, (raw[:60], err)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-SLO-Class": "urgent"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-SLO-Class"
    assert complete(client, "still serving", max_tokens=3, ignore_eos=True).json()["usage"]["completion_tokens"] == 3


def test_client_disconnect_aborts_the_request(client, stack):
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # first token arrived, then the client goes away
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = state(client)
        busy = sum(v["running"] + v["waiting"] for v in s["instances"].values())
        if s["in_flight"] == 0 and busy == 0:
            break
        time.sleep(0.5)
    assert s["in_flight"] == 0, s
    assert busy == 0, "the engine kept decoding a request whose client left"
    assert s["counters"]["cancelled"] >= 1


def test_request_log_records_every_decision(client, stack):
    set_policy(client, "marginal_cost")
    r = complete(client, "log me", max_tokens=4, ignore_eos=True)
    rid = r.json()["id"]
    log = stack.run_dir / "runs" / "requests.jsonl"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and rid not in log.read_text():
        time.sleep(0.2)
    rec = next(json.loads(l) for l in log.read_text().splitlines() if json.loads(l)["id"] == rid)
    assert rec["decision"]["policy"] == "marginal_cost" and rec["output_tokens"] == 4
    assert rec["decision"]["decode_cost"]["own_work_s"] > 0 and rec["ttft_s"] > 0
    assert rec["prefill"] == route(r)["served_prefill"]
    # where the decode engine's time to the first token went, by vLLM's request events: in order, and
    # inside the replica's own measurement of it (the same clock, two processes)
    t = rec["decode_engine_timeline"]
    assert 0 < t["queued_s"] <= t["scheduled_s"] <= t["first_token_s"] < rec["decode_engine_first_s"], t


def test_slo_scale_makes_a_multiple_of_the_requests_own_unloaded_latency_its_targets(client, stack):
    """X-SLO-Scale: the router prices and counts the request against x times its own unloaded TTFT
    and TPOT by its model's constants (what `disagg bench --slo-scale` judges by); without it, the
    class's targets; a bad value is a 400 naming the header."""
    from disagg.core.cost_model import CostModel
    from disagg.core.types import SloClass

    set_policy(client, "slo_goodput")
    cm = CostModel.from_dict(state(client)["models"][MODEL]["cost_model_constants"])
    scaled = complete(client, "scale my targets " * 20, max_tokens=4, ignore_eos=True, headers={"X-SLO-Scale": "2.5"})
    plain = complete(client, "scale my targets " * 20, max_tokens=4, ignore_eos=True, headers={"X-SLO-Class": "tight"})
    rec, ref = _log_record(stack, scaled.json()["id"]), _log_record(stack, plain.json()["id"])
    own = cm.unloaded(rec["prompt_tokens"])
    assert rec["slo_scale"] == 2.5 and rec["decision"]["policy"] == "slo_goodput"
    assert rec["ttft_target_s"] == pytest.approx(2.5 * own.ttft_s)
    assert rec["tpot_target_s"] == pytest.approx(2.5 * own.tpot_s)
    assert ref["slo_scale"] is None and ref["ttft_target_s"] == pytest.approx(cm.target(SloClass.TIGHT).ttft_s)
    for bad in ("0", "-1", "nan", "fast"):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-SLO-Scale": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-SLO-Scale", (bad, r.text[:200])


def _log_record(stack, rid: str) -> dict:
    log = stack.run_dir / "runs" / "requests.jsonl"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and rid not in log.read_text():
        time.sleep(0.2)
    return next(json.loads(l) for l in log.read_text().splitlines() if json.loads(l)["id"] == rid)


def _received(client, instance: str) -> int:
    """The decode engine's count of prompt tokens whose KV arrived over NIXL, once a poll saw it settle."""
    last = None
    for _ in range(20):
        time.sleep(0.3)
        now = state(client)["instances"][instance]["kv_received_tokens"]
        if now == last:
            return now
        last = now
    return last


def test_a_conversations_next_turns_go_where_its_prefix_is_cached(client, stack):
    """The router's prefix index, live: after a long first turn, every next turn (whichever router
    replica takes it) goes to the decode instance that holds the prefix; the router's guess of the
    cached tokens equals what the prefill engine's prefix cache supplied, and that decode engine pulls
    only the new part of the prompt over NIXL."""
    import random

    set_policy(client, "prefix_affinity")
    block = state(client)["models"][MODEL]["prefix_index_block_tokens"]
    assert block and block % 16 == 0  # a multiple of vLLM's KV block
    rng = random.Random(11)
    turn1 = [rng.randrange(100, 1000) for _ in range(6 * block + 40)]
    first = complete(client, turn1, max_tokens=4, ignore_eos=True)
    warm = route(first)["served_decode"]
    rec = _log_record(stack, first.json()["id"])
    assert rec["cached_tokens_predicted"] == {"prefill": 0, "decode": 0}  # nothing seen yet: all cold
    time.sleep(0.5)  # the other router replica learns the record within PREFIX_SHARE_INTERVAL_S
    routers = set()
    for i in range(20):  # until both router replicas took turns (sequential requests may land on one)
        if i >= 4 and len(routers) == 2:
            break
        turn = turn1 + [rng.randrange(100, 1000) for _ in range(30 + 10 * i)]
        before = _received(client, warm)
        r = complete(client, turn, max_tokens=4, ignore_eos=True)
        routers.add(r.headers["x-disagg-router"])
        assert route(r)["served_decode"] == warm, i
        rec = _log_record(stack, r.json()["id"])
        assert rec["cached_tokens_predicted"] == {"prefill": 6 * block, "decode": 6 * block}, rec
        assert rec["prefill_cached_tokens"] == 6 * block, rec  # the engine's own count agrees
        pulled = _received(client, warm) - before
        assert 0 < pulled <= len(turn) - 6 * block, (pulled, len(turn))  # the cached prefix did not move
    assert len(routers) == 2, routers  # both router replicas routed turns with one's records
    set_policy(client, "marginal_cost")


def test_router_reloads_a_calibrated_cost_model_without_restart(client, calibrated_file, tmp_path):
    """A calibrated file inside the CPU profile's router.cost_model_dir (runs/ in the run folder) is loaded
    without a restart; a file outside it is refused with the same 400 as a path that does not exist."""
    from disagg.core.cost_model import CostModel

    set_policy(client, "marginal_cost")
    r = client.post("/admin/cost_model", json={"cost_model": str(calibrated_file.path)})
    assert r.status_code == 200 and r.json()["calibrated"] is True, r.text
    assert state(client)["cost_model"] == CostModel.load(calibrated_file.path).name
    resp = complete(client, "priced with calibrated constants", max_tokens=8, ignore_eos=True)
    cm = CostModel.load(calibrated_file.path)
    d_work = float(route(resp)["d_work"])
    # 8 tokens at the calibrated τ_dec, inflated by KV pressure (≥ 1×) and the SLO weight (1 for loose);
    # the header prints 4 decimals
    assert d_work >= 8 * cm.engine.decode_token_s(1) - 0.00005

    allowed = calibrated_file.path.parent  # the router's cost_model_dir
    other_path, units_path = allowed / "test-reload-other.yaml", allowed / "test-reload-units.yaml"
    try:
        other = cm.model_copy(update={"model": "some/other-model"})
        other.save(other_path)
        r = client.post("/admin/cost_model", json={"cost_model": str(other_path)})
        assert r.status_code == 400 and "some/other-model" in r.json()["error"]["message"]
        units_path.write_text(other_path.read_text().replace(
            f"decode_seq_s: {cm.engine.decode_seq_s}", "decode_seq_s: 2.5"))
        r = client.post("/admin/cost_model", json={"cost_model": str(units_path)})
        assert r.status_code == 400 and "decode" in r.json()["error"]["message"]

        cm.save(tmp_path / "outside.yaml")  # a valid calibrated file, outside the allowed folder
        refusals = [client.post("/admin/cost_model", json={"cost_model": source}) for source in
                    (str(tmp_path / "outside.yaml"), str(allowed / "no-such-file.yaml"),
                     str(allowed / ".." / ".." / "outside.yaml"))]
        assert [x.status_code for x in refusals] == [400, 400, 400]
        assert len({x.json()["error"]["message"] for x in refusals}) == 1  # one message: nothing said of existence
    finally:
        other_path.unlink(missing_ok=True)
        units_path.unlink(missing_ok=True)
    assert state(client)["cost_model"] == cm.name  # the refused files changed nothing


# --- the OpenAI surface on the real engines --------------------------------------------------------

def _counters(client) -> dict:
    return state(client)["counters"]


def test_engine_validation_errors_are_400s_never_retried_nor_counted_as_failures(client):
    """A schema only the engine can judge (xgrammar refuses it): a 400 naming `response_format`, not a 503
    after trying both decode engines; no retry, fallback or failure is counted."""
    set_policy(client, "marginal_cost")
    before = _counters(client)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nonsense"}}}
    for body, path in [({"model": MODEL, "prompt": "x", "max_tokens": 4, "response_format": bad_schema},
                        "/v1/completions"),
                       ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                         "response_format": bad_schema}, "/v1/chat/completions")]:
        t0 = time.monotonic()
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["param"] == "response_format", err
        assert time.monotonic() - t0 < 10
    after = _counters(client)
    for k in ("prefill_retries", "decode_retries", "failed", "local_prefill_fallbacks"):
        assert after[k] == before[k], (k, before, after)
    assert complete(client, "still serving", max_tokens=3, ignore_eos=True).json()["usage"]["completion_tokens"] == 3


def test_oversize_prompt_is_refused_fast(client):
    t0 = time.monotonic()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 1_000_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert time.monotonic() - t0 < 2.0  # 5 MB over loopback included; the router's own part is < 100 ms
    r = client.post("/v1/completions", content=b"x" * (9 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] is None


def test_unknown_path_and_wrong_method_answer_in_the_openai_shape(client):
    r = client.post("/v1/nope", json={})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = client.get("/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def _greedy_logprobs(client, chat: bool) -> tuple[list, dict]:
    prompt = "Logprobs must not depend on where the KV cache was computed:"
    if chat:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
                "temperature": 0.0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        return [(c["token"], c["logprob"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
                for c in content], route(r)
    r = complete(client, prompt, max_tokens=12, ignore_eos=True, logprobs=3)
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 12 and lp["text_offset"][0] == 0
    return [(t, v, dict(top)) for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])], route(r)


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_logprobs_are_the_same_disaggregated_and_colocated(client, chat):
    """The decode engine samples (and scores) every output token itself, the first included, from the KV
    the prefill engine computed: the logprobs match a colocated engine's. bf16 on CPU: the last prompt
    token's attention runs as a one-token step on the decode engine and inside the batched prompt on the
    colocated one, so values agree to bf16 precision, the tokens exactly."""
    set_policy(client, "colocated")
    ref, rt = _greedy_logprobs(client, chat)
    assert rt["served_prefill"] == rt["served_decode"]
    set_policy(client, "round_robin")
    got, rt = _greedy_logprobs(client, chat)
    assert rt["served_prefill"] != rt["served_decode"]
    assert [t for t, _, _ in got] == [t for t, _, _ in ref]
    # greedy: no alternative is more likely than the sampled token (bf16 logits of the tiny model tie
    # often, so another token may share the top rank)
    assert all(t in top and v == max(top.values()) for t, v, top in got), got
    for (_, v, _), (_, w, _) in zip(got, ref):
        assert v <= 0 and v == pytest.approx(w, abs=0.05), (got, ref)


def test_streamed_logprobs_match_the_whole_response(client):
    set_policy(client, "round_robin")
    body = {"model": MODEL, "prompt": "stream my logprobs", "max_tokens": 10, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 2}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    tokens, offsets = [], []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for data in sse_data(r.iter_lines()):
            if data != DONE:
                choices = json.loads(data)["choices"]
                if choices and choices[0]["logprobs"]:
                    tokens += choices[0]["logprobs"]["tokens"]
                    offsets += choices[0]["logprobs"]["text_offset"]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]


def test_structured_output_and_sampling_fields_are_served(client):
    set_policy(client, "marginal_cost")
    schema = {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "answer in JSON"}], "max_tokens": 64,
        "temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "user": "someone", "metadata": {"k": "v"}, "store": False})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].lstrip().startswith("{")
    if choice["finish_reason"] == "stop":
        assert json.loads(choice["message"]["content"])["a"] in ("x", "y")
    r = complete(client, "sampling knobs", max_tokens=8, top_k=5, min_p=0.1, frequency_penalty=0.5,
                 presence_penalty=0.5, repetition_penalty=1.2, logit_bias={"5": -100}, min_tokens=8,
                 stop_token_ids=[3], seed=7)
    assert r.json()["usage"]["completion_tokens"] == 8  # min_tokens = max_tokens: exactly 8


def test_router_metrics_reach_rays_prometheus_endpoint(client):
    """The router's series (serve_app.metrics), scraped where Prometheus would: Ray's endpoint."""
    import re
    import urllib.request

    from serve_app.launch import METRICS_PORT

    complete(client, "metrics, please", max_tokens=4, ignore_eos=True)
    wanted = ["ray_disagg_requests_total", "ray_disagg_ttft_seconds_bucket", "ray_disagg_slo_requests_total",
              "ray_disagg_decisions_total", "ray_disagg_instance_backlog_seconds", "ray_disagg_instance_kv_pressure",
              "ray_disagg_router_events_total", "ray_disagg_router_loop_lag_seconds"]
    live = set(state(client)["instances"])

    def exported(text: str) -> set[str]:
        return set(re.findall(r'^ray_disagg_instance_queued_requests\{[^}]*instance="([^"]+)"', text, re.M))

    # Ray exports every few seconds; an instance an earlier test replaced is new to the router's
    # last refresh and may not have reached the endpoint yet (its predecessor keeps its last value)
    deadline, text = time.monotonic() + 90, ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
            text = r.read().decode()
        if all(w in text for w in wanted) and live <= exported(text):
            break
        time.sleep(3)
    missing = [w for w in wanted if w not in text]
    assert not missing, f"not on Ray's metrics endpoint: {missing}"
    served = [float(m.group(1)) for m in re.finditer(r'^ray_disagg_requests_total\{[^}]*outcome="served"[^}]*\} (\S+)',
                                                      text, re.M)]
    assert sum(served) >= 1
    assert live <= exported(text), f"instances without a load gauge after 90 s: {live - exported(text)}"
