"""Two models behind one endpoint, live: the CPU profile deployments/local-multi.yaml (tiny:tiny and
tiny:small, one colocated vLLM engine each) served as a second Serve application at /multi on the
session's cluster (same Ray, same proxy), removed again at the end of this module.

What a passing run proves: the alias routes by the TTFT estimator and accuracy − λ·cost on real
engines — a query whose limit only the fast model can meet goes to it, a loose one to the more
accurate model at λ = 0 and to the cheaper one at a large λ; concrete model names bypass the alias;
bad routing headers and unknown models are refused naming the field; every choice is explained in
the route header and logged with the estimated TTFT next to the measured one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.stack
ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "deployments" / "local-multi.yaml"
TINY, SMALL, ALIAS = "tiny-qwen2", "small-qwen2", "auto"
# 1,501 tokens: the calibrated prefill of the small model (~90 ms) is far beyond a 40 ms limit,
# the tiny model's (~17 ms) well within it
LONG = "the router prices every candidate " * 125


@pytest.fixture(scope="module")
def multi(stack):
    if os.environ.get("DISAGG_MULTI_URL"):  # develop against a multi-model app already up
        yield os.environ["DISAGG_MULTI_URL"], Path.cwd()
        return
    if not hasattr(stack, "extra_app"):
        pytest.skip("the session stack was not started here (DISAGG_STACK_URL): set DISAGG_MULTI_URL too")
    t0 = time.monotonic()
    with stack.extra_app(PROFILE, "disagg-multi", "/multi") as url:
        print(f"[multi] up in {time.monotonic() - t0:.0f} s", flush=True)
        yield url, stack.run_dir
    print(f"[multi] up and down in {time.monotonic() - t0:.0f} s", flush=True)


@pytest.fixture(scope="module")
def client(multi):
    with httpx.Client(base_url=multi[0], timeout=httpx.Timeout(120.0)) as c:
        yield c


def route(resp) -> dict:
    return dict(part.split("=", 1) for part in resp.headers["x-disagg-route"].split("; "))


def logged(multi, rid: str) -> dict:
    """The request log's record of request `rid` (the routers write it after the response: wait up to 10 s)."""
    log = multi[1] / "runs" / "multi-requests.jsonl"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (log.exists() and rid in log.read_text()):
        time.sleep(0.2)
    return next(json.loads(l) for l in log.read_text().splitlines() if json.loads(l)["id"] == rid)


def complete(client, model, prompt, headers=None, max_tokens=4):
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                             "ignore_eos": True, "temperature": 0.0}, headers=headers or {})
    assert r.status_code == 200, r.text
    return r


def test_models_lists_both_models_and_the_alias(client):
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == [TINY, SMALL, ALIAS]
    alias = client.get("/v1/models").json()["data"][2]
    assert alias["routes_to"] == [TINY, SMALL]
    h = client.get("/health").json()
    assert h["models"] == {TINY: {"both": 1}, SMALL: {"both": 1}}


def test_a_concrete_model_name_goes_to_that_model(client):
    for model in (TINY, SMALL):
        r = complete(client, model, "name the model")
        assert r.json()["model"] == model and r.json()["usage"]["completion_tokens"] == 4
        rt = route(r)
        assert "utility" not in rt  # no alias choice was made
        assert rt["served_decode"].startswith(f"{model}:both-")


def test_a_tight_limit_sends_the_query_to_the_fast_model(client):
    # λ = 0: the small model would win on accuracy if it could meet the limit
    for _ in range(3):
        r = complete(client, ALIAS, LONG, headers={"X-TTFT-Limit-Ms": "40", "X-Route-Lambda": "0"})
        assert 1000 < r.json()["usage"]["prompt_tokens"] < 2000
        rt = route(r)
        assert r.json()["model"] == TINY and rt["model"] == TINY, rt
        assert rt["feasible"] == "1" and float(rt["ttft"]) <= 0.040 and float(rt["limit"]) == 0.040


def test_a_loose_limit_goes_by_utility(client):
    loose = {"X-TTFT-Limit-Ms": "5000"}
    r = complete(client, ALIAS, LONG, headers={**loose, "X-Route-Lambda": "0"})
    rt = route(r)
    assert r.json()["model"] == SMALL and rt["model"] == SMALL, rt  # the more accurate model
    assert rt["feasible"] == "1" and float(rt["acc"]) == pytest.approx(0.75)
    assert float(rt["ttft"]) > 0.040  # the same query the tight limit kept away from it
    r = complete(client, ALIAS, LONG, headers={**loose, "X-Route-Lambda": "1e6"})
    rt = route(r)
    assert r.json()["model"] == TINY and rt["model"] == TINY, rt  # cost dominates: the cheaper model
    assert float(rt["lambda"]) == 1e6 and float(rt["utility"]) < 0.55


def test_the_default_limit_is_the_slo_class_target(client):
    profile = yaml.safe_load(PROFILE.read_text())["applications"][0]["args"]["models"]
    tight = min(m["cost_model"]["slo"]["tight"]["ttft_s"] for m in profile)
    r = complete(client, ALIAS, "short", headers={"X-SLO-Class": "tight"})
    assert float(route(r)["limit"]) == pytest.approx(tight, abs=1e-4)


@pytest.mark.parametrize("headers, param", [
    ({"X-TTFT-Limit-Ms": "0"}, "X-TTFT-Limit-Ms"),
    ({"X-TTFT-Limit-Ms": "-5"}, "X-TTFT-Limit-Ms"),
    ({"X-TTFT-Limit-Ms": "soon"}, "X-TTFT-Limit-Ms"),
    ({"X-TTFT-Limit-Ms": "inf"}, "X-TTFT-Limit-Ms"),
    ({"X-Route-Lambda": "-1"}, "X-Route-Lambda"),
    ({"X-Route-Lambda": "nan"}, "X-Route-Lambda"),
    ({"X-Route-Lambda": "1e400"}, "X-Route-Lambda"),
])
def test_bad_routing_headers_get_400_naming_the_header(client, headers, param):
    r = client.post("/v1/completions", json={"model": ALIAS, "prompt": "x", "max_tokens": 2}, headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_an_unknown_model_gets_404_naming_model_and_listing_the_served_ones(client):
    """vLLM's status for a model it does not serve, with the served names and the alias."""
    r = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and all(n in err["message"] for n in (TINY, SMALL, ALIAS))


def test_the_request_log_carries_the_choice_and_the_estimated_ttft(client, multi):
    r = complete(client, ALIAS, "log the choice", headers={"X-TTFT-Limit-Ms": "500", "X-Route-Lambda": "2"})
    rec = logged(multi, r.json()["id"])
    rt = route(r)
    assert rec["requested_model"] == ALIAS and rec["model"] == rt["model"] == r.json()["model"]
    assert rec["ttft_limit_s"] == 0.5 and rec["lambda"] == 2.0 and rec["feasible"] is True
    assert rec["choice"]["instance"] == rt["instance"] and len(rec["choice"]["candidates"]) == 2
    assert 0 < rec["estimated_ttft_s"] <= 0.5 and rec["ttft_s"] > 0  # estimate beside the measurement
    t = rec["decode_engine_timeline"]  # ... and where the engine's time to it went (a colocated engine)
    assert 0 < t["queued_s"] <= t["scheduled_s"] <= t["first_token_s"] < rec["decode_engine_first_s"], t
    assert rec["utility"] == pytest.approx(rec["accuracy"] - 2.0 * rec["cost"])


def test_an_slo_scale_sets_the_limit_from_the_fastest_models_unloaded_ttft(client, multi):
    """X-SLO-Scale without X-TTFT-Limit-Ms: the limit is 3× the prompt's unloaded TTFT on the faster
    model, each by the constants its router prices with now."""
    from disagg.core.cost_model import CostModel
    from disagg.core.types import SloClass

    r = complete(client, ALIAS, LONG, headers={"X-SLO-Scale": "3"})
    rec = logged(multi, r.json()["id"])
    models = client.get("/admin/state").json()["models"]
    # the two models share a tokenizer: the logged prompt length is each one's
    own = {name: CostModel.from_dict(m["cost_model_constants"]).target_for(SloClass.LOOSE, rec["prompt_tokens"], 3.0)
           for name, m in models.items()}
    assert set(own) == {TINY, SMALL} and own[TINY].ttft_s != own[SMALL].ttft_s
    assert rec["slo_scale"] == 3.0 and rec["ttft_limit_s"] == pytest.approx(min(t.ttft_s for t in own.values()))
    assert float(route(r)["limit"]) == pytest.approx(rec["ttft_limit_s"], abs=1e-4)
