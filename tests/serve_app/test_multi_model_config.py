"""Several models behind one endpoint: config validation, the graph it builds, and the router's
instance snapshots (pure pieces; the live test is test_multi_model_live.py)."""

from __future__ import annotations

import asyncio
import copy
import json
import math
from pathlib import Path

import pytest
import yaml

from disagg.core.cost_model import load_profile
from disagg.core.ttft_estimator import InstanceSnapshot, QueuedRequest, RunningRequest, estimate_ttft
from disagg.core.types import SloClass
from serve_app.config import AppConfig, ConfigError, MultiModelConfig, load_serve_config, parse_args
from serve_app.instance_state import FlightFacts, instance_snapshot

ROOT = Path(__file__).resolve().parents[2]


def multi_args() -> dict:
    return yaml.safe_load((ROOT / "deployments" / "local-multi.yaml").read_text())["applications"][0]["args"]


def single_args(name: str = "local.yaml") -> dict:
    return yaml.safe_load((ROOT / "deployments" / name).read_text())["applications"][0]["args"]


def test_the_cpu_multi_profile_serves_two_models_of_different_sizes_colocated():
    cfg = parse_args(multi_args())
    assert isinstance(cfg, MultiModelConfig) and cfg.router.alias == "auto" and cfg.router.lam == 0.0
    sources = [m.model.source for m in cfg.models]
    assert sources == ["tiny:tiny", "tiny:small"]
    views = cfg.app_configs()
    assert list(views) == ["tiny-qwen2", "small-qwen2"]
    assert all(v.is_colocated and v.router.policy == "colocated" for v in views.values())
    # the bigger model is the more accurate and the dearer one: the trade-off the alias exists for
    tiny, small = cfg.models
    assert small.accuracy_prior > tiny.accuracy_prior
    assert small.prices.input_per_token > tiny.prices.input_per_token
    assert cfg.accuracy().predict("small-qwen2", 100) == small.accuracy_prior


@pytest.mark.parametrize("file", ["local.yaml", "disagg.yaml", "local-autoscale.yaml", "bench-1p1d.yaml"])
def test_one_model_configs_keep_their_shape(file):
    (name, cfg), = load_serve_config(ROOT / "deployments" / file)
    assert isinstance(cfg, AppConfig) and not cfg.is_colocated
    assert list(cfg.pools()) == ["prefill", "decode"]


def test_a_multi_model_file_lists_one_validated_view_per_model():
    apps = load_serve_config(ROOT / "deployments" / "local-multi.yaml")
    assert [n for n, _ in apps] == ["disagg-multi/tiny-qwen2", "disagg-multi/small-qwen2"]
    assert all(isinstance(c, AppConfig) for _, c in apps)


def test_a_one_model_app_may_be_colocated():
    args = single_args()
    pool = args.pop("prefill")
    args.pop("decode")
    args["colocated"] = pool
    args["router"].pop("policy")
    cfg = parse_args(args)
    assert cfg.is_colocated and cfg.router.policy == "colocated" and list(cfg.pools()) == ["colocated"]


def _mutate_multi(fn):
    args = copy.deepcopy(multi_args())
    fn(args)
    return args


def _dup_name(a):
    a["models"][1]["model"]["served_name"] = "tiny-qwen2"


@pytest.mark.parametrize("mutate, needle", [
    (_dup_name, "models.1.model.served_name"),
    (lambda a: a["router"].update(alias="small-qwen2"), "router.alias"),
    (lambda a: a["router"].update(lam=-1), "router.lam"),
    (lambda a: a["router"].update(lam=float("nan")), "router.lam"),
    (lambda a: a["router"].update(accuracy_table="no/such/table.json"), "router.accuracy_table"),
    (lambda a: a["models"][0].update(accuracy_prior=1.5), "models.0.accuracy_prior"),
    (lambda a: a["models"][1]["prices"].update(output_per_token=-1e-6), "models.1.prices.output_per_token"),
    (lambda a: a["models"][1].pop("prices"), "models.1.prices"),
    (lambda a: a["models"][0].update(policy="marginal_cost"), "models.0.policy"),
    (lambda a: a["models"][0].update(cost_model="no-such-profile"), "models.0.cost_model"),
    (lambda a: a["models"][1].update(prefill={"num_replicas": 1}), "models.1.colocated"),
    (lambda a: a["models"][1].pop("colocated"), "models.1.prefill"),
    (lambda a: a.update(models=[]), "models"),
    (lambda a: a["router"].update(policy="marginal_cost"), "router.policy"),
    (lambda a: a["router"].update(model_policy="fastest"), "router.model_policy"),
    (lambda a: a["router"].update(model_policy_params={"horizon": 1.0}), "router.model_policy_params"),
])
def test_bad_multi_model_configs_are_refused_naming_the_field(mutate, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(_mutate_multi(mutate), prefix=("args",))
    assert needle in str(e.value), str(e.value)


def test_the_model_policy_is_checked_at_load_and_builds_the_alias_routes_router():
    with pytest.raises(ConfigError) as e:
        parse_args(_mutate_multi(lambda a: a["router"].update(model_policy="fastest")), prefix=("args",))
    assert "field 'args.router.model_policy'" in str(e.value)
    assert "unknown model-level router 'fastest'; known: latency_aware, accuracy_cost, load_balance" in str(e.value)
    assert parse_args(multi_args()).router.model_policy == "latency_aware"  # the default: the paper's router
    cfg = parse_args(_mutate_multi(lambda a: a["router"].update(model_policy="load_balance", lam=3.0)))
    router = cfg.router.model_router(cfg.accuracy())
    assert (router.name, router.lam) == ("load_balance", 3.0)


def test_multi_model_errors_name_file_and_line(tmp_path):
    doc = yaml.safe_load((ROOT / "deployments" / "local-multi.yaml").read_text())
    doc["applications"][0]["args"]["models"][1]["accuracy_prior"] = 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_serve_config(bad)
    line = next(i for i, l in enumerate(bad.read_text().splitlines(), 1) if "accuracy_prior: 2" in l)
    assert f"{bad}:{line}: field 'applications.0.args.models.1.accuracy_prior'" in str(e.value)


def test_a_calibrated_cost_model_for_another_model_is_refused_naming_the_model_entry():
    cm = load_profile("cpu-tiny").model_copy(update={"calibrated": True, "model": "tiny:tiny"}).to_dict()
    ok = _mutate_multi(lambda a: a["models"][0].update(cost_model=cm))
    parse_args(ok)  # calibrated for this very model: accepted, inline
    with pytest.raises(ConfigError, match=r"models\.1\.cost_model.*calibrated for model 'tiny:tiny'"):
        parse_args(_mutate_multi(lambda a: a["models"][1].update(cost_model=cm)))


def test_the_accuracy_table_file_is_loaded_and_priors_fill_the_models_without_history(tmp_path):
    from disagg.core.utility import AccuracyTable

    table = AccuracyTable().train([(100, "tiny-qwen2", 0.2)] * 20)
    table.save(tmp_path / "acc.json")
    cfg = parse_args(_mutate_multi(lambda a: a["router"].update(accuracy_table=str(tmp_path / "acc.json"))))
    acc = cfg.accuracy()
    assert acc.predict("tiny-qwen2", 100) == pytest.approx(0.2)
    assert acc.predict("small-qwen2", 100) == 0.75  # no history: its configured prior
    (tmp_path / "broken.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(ConfigError, match="router.accuracy_table.*version"):
        parse_args(_mutate_multi(lambda a: a["router"].update(accuracy_table=str(tmp_path / "broken.json"))))


def test_the_multi_model_graph_gives_each_model_its_own_pools():
    pytest.importorskip("ray.serve")
    from serve_app.app import PINNED_ROUTER, build_app

    args = _mutate_multi(lambda a: a["models"][0].update(
        colocated=None, policy=None, prefill={"num_replicas": 1, "num_cpus": 0.2},
        decode={"num_replicas": 2, "num_cpus": 0.2}))
    args["models"][0] = {k: v for k, v in args["models"][0].items() if v is not None}
    router = build_app(args)._bound_deployment
    pools = router.init_args[3]
    names = {m: {role: h._bound_deployment.name for role, h in d.items()} for m, d in pools.items()}
    assert names == {"tiny-qwen2": {"prefill": "tiny-qwen2-prefill", "decode": "tiny-qwen2-decode"},
                     "small-qwen2": {"both": "small-qwen2-colocated"}}
    decode = pools["tiny-qwen2"]["decode"]._bound_deployment
    assert decode._deployment_config.num_replicas == 2
    assert decode._deployment_config.request_router_config.request_router_class == PINNED_ROUTER
    # each engine deployment is built from its own model's one-model view
    both = pools["small-qwen2"]["both"]._bound_deployment
    assert both.init_args[0]["model"]["source"] == "tiny:small" and both.init_args[1] == "both"


# --- the router's snapshot of an instance -------------------------------------------------------


def test_snapshot_queues_what_has_no_first_token_and_decodes_the_rest():
    c = load_profile("cpu-tiny").engine
    snap = instance_snapshot([FlightFacts(100, 40, True, 10), FlightFacts(50, 8, False),
                              FlightFacts(30, 5, True, 9)], c)
    assert snap == InstanceSnapshot(
        waiting=(QueuedRequest(50, 8),),
        running=(RunningRequest(100, 10, 30), RunningRequest(30, 9, 1)),  # past its prediction: one more
        mid_step=True)  # the router cannot see the engine's step boundaries
    assert instance_snapshot([], c) == InstanceSnapshot()  # nothing there: no step in flight


def test_snapshot_of_a_prefill_instance_counts_only_unfinished_prefills():
    c = load_profile("cpu-tiny").engine
    snap = instance_snapshot([FlightFacts(100, 40, True, 3), FlightFacts(60, 8, False)], c, prefill_only=True)
    assert snap == InstanceSnapshot(waiting=(QueuedRequest(60, 1, prefill_only=True),), mid_step=True)


def test_snapshot_of_a_prefill_instance_keeps_the_decodes_it_hosts():
    c = load_profile("cpu-tiny").engine
    flights = [FlightFacts(100, 40, True, 3, hosted=True), FlightFacts(80, 20, False, hosted=True),
               FlightFacts(60, 8, False)]
    snap = instance_snapshot(flights, c, prefill_only=True)
    assert snap == InstanceSnapshot(waiting=(QueuedRequest(80, 20), QueuedRequest(60, 1, prefill_only=True)),
                                    running=(RunningRequest(100, 3, 37),), mid_step=True)
    # a hosted decode shares the instance's steps: a prefill queued behind it waits longer
    alone = instance_snapshot(flights[2:], c, prefill_only=True)
    assert estimate_ttft(c, snap, 500).ttft_s > estimate_ttft(c, alone, 500).ttft_s


def test_snapshot_never_holds_more_kv_than_the_instance_and_the_estimate_runs():
    c = load_profile("cpu-tiny").engine.model_copy(update={"kv_capacity_tokens": 256})
    flights = [FlightFacts(100, 50, True, 20), FlightFacts(100, 50, True, 20), FlightFacts(10, 5, False)]
    snap = instance_snapshot(flights, c)
    assert len(snap.running) == 2 and snap.kv_blocks(c.block_size) <= 256 // c.block_size
    est = estimate_ttft(c, snap, 20)
    assert 0 < est.ttft_s < 10


def test_more_work_ahead_means_a_later_estimated_first_token():
    c = load_profile("cpu-tiny").engine
    idle = estimate_ttft(c, instance_snapshot([], c), 200).ttft_s
    busy = estimate_ttft(c, instance_snapshot([FlightFacts(1500, 64, False)] * 4, c), 200).ttft_s
    assert busy > idle


# --- the routing headers ------------------------------------------------------------------------


def _request(headers: dict):
    from starlette.requests import Request

    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


@pytest.mark.parametrize("raw, positive, expected", [
    ("250", True, 250.0), ("0.5", True, 0.5), ("1e3", True, 1000.0),
    ("0", False, 0.0), ("12.5", False, 12.5),
    ("0", True, None), ("-1", True, None), ("-0.1", False, None), ("nan", False, None), ("inf", True, None),
    ("1e400", False, None), ("fast", True, None), ("", False, None),
])
def test_routing_headers_are_positive_or_non_negative_finite_numbers(raw, positive, expected):
    pytest.importorskip("ray.serve")
    from serve_app.openai_api import ApiError
    from serve_app.router import _header_number

    name = "X-TTFT-Limit-Ms" if positive else "X-Route-Lambda"
    if expected is None:
        with pytest.raises(ApiError) as e:
            _header_number(_request({name: raw}), name, minimum_exclusive=positive)
        assert e.value.param == name and e.value.status == 400 and name in e.value.message
    else:
        assert _header_number(_request({name: raw}), name, minimum_exclusive=positive) == expected
    assert _header_number(_request({}), name, minimum_exclusive=positive) is None


# --- the alias route's model-level router, in-process --------------------------------------------

# local-multi.yaml: tiny-qwen2 is fast, cheap, prior 0.55; small-qwen2 slower, dearer, prior 0.75. Idle,
# a 1,500-token prompt's estimated first token comes after ~17 ms on tiny and ~91 ms on small.
LONG_IDS = [5] * 1500


def _streaming_pool(ids: list[str]):
    from factories import StandInPool

    from serve_app.messages import DecodeChunk

    class Pool(StandInPool):
        def decode_stream(self, call, replica):
            async def chunks():
                n = call.params.max_tokens
                for i in range(n):
                    yield DecodeChunk((7,), "a", "length" if i == n - 1 else None, replica=replica if i == 0 else None,
                                      engine_first_token_s=0.001 if i == 0 else None)
            return chunks()
    return Pool("both", ids)


async def _multi_router(**router):
    from factories import in_process_router

    args = _mutate_multi(lambda a: a["router"].update(request_log=None, **router))
    pools = {"tiny-qwen2": {"both": _streaming_pool(["t1"])}, "small-qwen2": {"both": _streaming_pool(["s1"])}}
    return await in_process_router(None, None, args, pools)


@pytest.mark.parametrize("policy, limit_s, lam, model", [
    ("latency_aware", 0.5, 0.0, "small-qwen2"),  # both meet the limit: the accurate one
    ("latency_aware", 0.04, 0.0, "tiny-qwen2"),  # only the fast one meets it
    ("latency_aware", 0.5, 1e9, "tiny-qwen2"),  # λ: the cheap one
    ("accuracy_cost", 0.04, 0.0, "small-qwen2"),  # the limit ignored
    ("accuracy_cost", 0.5, 1e9, "tiny-qwen2"),
    ("load_balance", 0.5, 0.0, "tiny-qwen2"),  # the fastest, accuracy ignored
])
def test_the_alias_route_runs_the_configured_model_policy_at_the_requests_lambda(policy, limit_s, lam, model):
    pytest.importorskip("ray.serve")

    async def run():
        r = await _multi_router(model_policy=policy)
        assert (r.dispatcher.model_router.name, r.dispatcher.model_router.lam) == (policy, 0.0)
        pick = r.dispatcher.choose_model({"tiny-qwen2": LONG_IDS, "small-qwen2": LONG_IDS}, 4, True,
                                         SloClass.LOOSE, limit_s, lam)
        assert r.dispatcher.model_router.lam == 0.0  # the request's λ did not stick
        return pick
    pick = asyncio.run(run())
    c = pick.choice
    assert c.model == model and (c.lam, c.ttft_limit_s, len(c.terms)) == (lam, limit_s, 2)
    assert math.isfinite(c.chosen.ttft_s) and c.feasible == (c.chosen.ttft_s <= limit_s)
    assert pick.predicted == 4  # ignore_eos: exactly max_tokens


def test_a_baseline_model_policy_explains_its_route_in_the_header():
    pytest.importorskip("ray.serve")
    from starlette.requests import Request

    async def run():
        r = await _multi_router(model_policy="accuracy_cost")
        raw = json.dumps({"model": "auto", "prompt": LONG_IDS, "max_tokens": 3, "ignore_eos": True}).encode()

        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}
        req = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                       "headers": [(b"content-type", b"application/json"), (b"x-ttft-limit-ms", b"40")]}, receive)
        return await r._handle(req, chat=False)
    resp = asyncio.run(run())
    body = json.loads(resp.body)
    assert resp.status_code == 200, body
    route = dict(p.split("=", 1) for p in resp.headers["x-disagg-route"].split("; "))
    # the accurate model although it misses the 40 ms limit, and the header says so
    assert body["model"] == "small-qwen2" and route["model"] == "small-qwen2" and route["feasible"] == "0"
    assert route["candidates"] == "2" and route["served_decode"] == route["instance"] == "small-qwen2:both-s1"
    assert float(route["ttft"]) > 0.04
