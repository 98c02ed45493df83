"""The multi-model router's decision path in-process, with stand-in engine handles.

The engines are not under test here (test_multi_model_live.py runs the real ones); the router is:
its class is instantiated without Serve, its pool handles answer `state` polls and stream tokens
like engine replicas would. This covers what the CPU profile cannot show cheaply: a disaggregated
model behind the alias (the choice pins the prefill engine, the model's P/D policy picks the
decode engine), and the in-flight ledger feeding the estimator.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")
from starlette.requests import Request  # noqa: E402

from disagg.core.types import SloClass  # noqa: E402
from serve_app.messages import DecodeChunk  # noqa: E402
from factories import StandInPool, in_process_router  # noqa: E402
from serve_app.router import Router  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LONG = "the router prices every candidate " * 125  # 1,501 tokens


class _Stream:
    """A decode stream: `n` one-token chunks, the first after `first_s`; it holds until released."""

    def __init__(self, replica: str, n: int, first_s: float, hold: asyncio.Event | None):
        self.replica, self.n, self.i, self.first_s, self.hold = replica, n, 0, first_s, hold

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.i >= self.n:
            raise StopAsyncIteration
        if self.i == 1 and self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(self.first_s if self.i == 0 else 0.0)
        self.i += 1
        first = self.i == 1
        return DecodeChunk((7,), "a", "length" if self.i == self.n else None,
                           replica=self.replica if first else None, engine_first_token_s=self.first_s if first else None)

    def cancel(self):
        pass


class _Pool(StandInPool):
    """Replicas `ids`; decodes stream `max_tokens` one-token chunks, holding after the first until `hold`."""

    def __init__(self, role: str, ids: list[str], hold: asyncio.Event | None = None):
        super().__init__(role, ids)
        self.hold = hold

    def decode_stream(self, call, replica):
        return _Stream(replica, call.params.max_tokens, 0.001, self.hold)


def _args(disaggregated_tiny: bool = False) -> dict:
    args = copy.deepcopy(yaml.safe_load((ROOT / "deployments" / "local-multi.yaml").read_text())
                         ["applications"][0]["args"])
    args["router"]["request_log"] = None
    if disaggregated_tiny:
        tiny = args["models"][0]
        tiny.pop("colocated")
        tiny.update(prefill={"num_replicas": 2, "num_cpus": 0.1}, decode={"num_replicas": 1, "num_cpus": 0.1})
    return args


def _request(body: dict, headers: dict | None = None) -> Request:
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in {"content-type": "application/json", **(headers or {})}.items()]}, receive)


async def _router(args: dict, pools: dict) -> Router:
    return await in_process_router(None, None, args, pools)


async def _complete(r, model, prompt, headers=None, max_tokens=4):
    resp = await r._handle(_request({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                     "ignore_eos": True}, headers), chat=False)
    body = json.loads(resp.body)
    assert resp.status_code == 200, body
    route = dict(p.split("=", 1) for p in resp.headers["x-disagg-route"].split("; "))
    return body, route


def test_a_disaggregated_model_behind_the_alias_prefills_on_the_chosen_engine():
    async def run():
        prefill, decode = _Pool("prefill", ["p1", "p2"]), _Pool("decode", ["d1"])
        small = _Pool("both", ["s1"])
        r = await _router(_args(disaggregated_tiny=True),
                          {"tiny-qwen2": {"prefill": prefill, "decode": decode}, "small-qwen2": {"both": small}})
        body, rt = await _complete(r, "auto", LONG, {"X-TTFT-Limit-Ms": "40"})
        assert body["model"] == "tiny-qwen2" and rt["candidates"] == "3"  # two prefill engines + one colocated
        assert rt["instance"].startswith("tiny-qwen2:prefill-")
        assert rt["prefill"] == rt["instance"] == rt["served_prefill"]  # the chosen engine did the prefill
        assert rt["decode"] == rt["served_decode"] == "tiny-qwen2:decode-d1" and rt["policy"] == "marginal_cost"
        assert [c[0] for c in prefill.calls] == ["prefill"] and [c[0] for c in decode.calls] == ["decode"]
        assert small.calls == []
        body, rt = await _complete(r, "auto", LONG, {"X-TTFT-Limit-Ms": "2000"})
        assert body["model"] == "small-qwen2" and rt["instance"] == rt["served_decode"] == "small-qwen2:both-s1"
    asyncio.run(run())


def test_an_slo_scale_sets_the_alias_limit_from_the_fastest_models_unloaded_ttft(tmp_path):
    log = tmp_path / "requests.jsonl"

    async def run():
        args = _args()
        args["router"]["request_log"] = str(log)
        tiny, small = _Pool("both", ["t1"]), _Pool("both", ["s1"])
        r = await _router(args, {"tiny-qwen2": {"both": tiny}, "small-qwen2": {"both": small}})
        await _complete(r, "auto", LONG, {"X-SLO-Scale": "3"})
        await _complete(r, "auto", LONG, {"X-SLO-Scale": "3", "X-TTFT-Limit-Ms": "250"})  # the header wins
        await _complete(r, "auto", LONG)  # neither: the class's target, as before
        return r
    r = asyncio.run(run())
    scaled, explicit, plain = [json.loads(x) for x in log.read_text().splitlines()]
    # 3× each model's unloaded TTFT of the prompt (the two share a tokenizer: one length), by its own
    # constants; the fastest model's sets the limit
    slo = SloClass(scaled["slo_class"])
    own = {name: m.cost_model.target_for(slo, scaled["prompt_tokens"], 3.0).ttft_s for name, m in r.served.items()}
    assert len(set(own.values())) == 2  # the two models' constants differ: which one sets it matters
    assert scaled["slo_scale"] == 3.0 and scaled["ttft_limit_s"] == pytest.approx(min(own.values()))
    assert explicit["ttft_limit_s"] == pytest.approx(0.25)
    assert plain["slo_scale"] is None and plain["ttft_limit_s"] == pytest.approx(r._default_limit_s(slo))


def test_requests_in_flight_raise_the_estimate_of_their_instance():
    async def run():
        hold = asyncio.Event()
        tiny, small = _Pool("both", ["t1"], hold), _Pool("both", ["s1"], hold)
        r = await _router(_args(), {"tiny-qwen2": {"both": tiny}, "small-qwen2": {"both": small}})
        _, before = await _complete(r, "auto", LONG, {"X-TTFT-Limit-Ms": "5000", "X-Route-Lambda": "1e9"},
                                    max_tokens=1)
        busy = [asyncio.create_task(_complete(r, "tiny-qwen2", LONG, max_tokens=64)) for _ in range(6)]
        await asyncio.sleep(0.05)
        assert len(r.flights) == 6  # decoding on the tiny engine, as the router's ledger knows them
        _, after = await _complete(r, "auto", LONG, {"X-TTFT-Limit-Ms": "5000", "X-Route-Lambda": "1e9"},
                                   max_tokens=1)
        hold.set()
        await asyncio.gather(*busy)
        assert r.flights == {} and len(r.ledger) == 0  # finished requests leave the snapshots
        return before, after
    before, after = asyncio.run(run())
    # a huge λ: the cheap tiny model both times; its estimated TTFT now includes the 6 decodes in flight
    assert before["model"] == after["model"] == "tiny-qwen2"
    assert float(after["ttft"]) > float(before["ttft"])


H1 = {"engine_cores": 1.19, "cores": 2.0, "token_cpu_s": 1.8e-4, "prefill_weight": 1.05, "mixed_cores": 1.09}
H2 = {"engine_cores": 0.97, "cores": 2.0, "token_cpu_s": 5.7e-4, "prefill_weight": 1.89, "mixed_cores": 0.94}


def _alias_estimate_beside_busy_decodes(tiny_host: dict, small_host: dict) -> float:
    """The alias's TTFT estimate of the tiny engine (a huge λ picks it) with 6 of its decodes in
    flight, the tiny and small models' cost models carrying the given host measurements."""
    args = _args()
    args["models"][0]["cost_model"]["shared_host"] = tiny_host
    args["models"][1]["cost_model"]["shared_host"] = small_host

    async def run():
        hold = asyncio.Event()
        tiny, small = _Pool("both", ["t1"], hold), _Pool("both", ["s1"], hold)
        r = await _router(args, {"tiny-qwen2": {"both": tiny}, "small-qwen2": {"both": small}})
        busy = [asyncio.create_task(_complete(r, name, LONG, max_tokens=64))
                for name in ("tiny-qwen2", "small-qwen2") for _ in range(3)]
        await asyncio.sleep(0.05)
        _, rt = await _complete(r, "auto", LONG, {"X-TTFT-Limit-Ms": "5000", "X-Route-Lambda": "1e9"},
                                max_tokens=1)
        hold.set()
        await asyncio.gather(*busy)
        assert rt["model"] == "tiny-qwen2"
        return float(rt["ttft"])
    return asyncio.run(run())


def test_the_alias_prices_the_host_from_every_models_measurement_of_it():
    from disagg.core.cost_model import SharedHost

    pooled = SharedHost.pooled([SharedHost(**H1), SharedHost(**H2)]).model_dump(exclude={"measured_at"})
    both = _alias_estimate_beside_busy_decodes(H1, H2)
    assert both == pytest.approx(_alias_estimate_beside_busy_decodes(pooled, pooled), rel=1e-6)
    # not whichever model is listed first: its measurement alone prices the engines otherwise
    assert both != pytest.approx(_alias_estimate_beside_busy_decodes(H1, H1), rel=1e-3)


def test_models_whose_cost_models_describe_hosts_of_different_sizes_are_refused_naming_the_field():
    from disagg.core.cost_model import CostModelError

    args = _args()
    args["models"][0]["cost_model"]["shared_host"] = H1
    args["models"][1]["cost_model"]["shared_host"] = {**H2, "cores": 4.0}
    with pytest.raises(CostModelError, match=r"shared_host\.cores.*tiny-qwen2: 2, small-qwen2: 4"):
        asyncio.run(_router(args, {"tiny-qwen2": {"both": _Pool("both", ["t1"])},
                                   "small-qwen2": {"both": _Pool("both", ["s1"])}}))
