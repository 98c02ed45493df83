"""The router deployment: OpenAI-compatible ingress, routing decision, KV hand-off, token relay.

It is the application's ingress (one hop fewer on the token path than a separate ingress), so a
request's life is: HTTP proxy → this replica → (prefill replica, then decode replica) → tokens
stream back through this replica to the proxy.

Per request:
1. validate (400 naming the field), tokenize with the served model's tokenizer — the exact prompt
   length is a routing signal —, check it fits the context window;
2. predict the output length (`max_tokens` exactly when `ignore_eos`), build the instance views
   from the ledger and the latest polls, and call the policy — the same object the simulator runs;
3. admit to the ledger; prefill on exactly the chosen prefill replica (`pinned_router`), retrying
   another prefill replica and finally prefilling on the decode replica if prefills fail;
4. start the decode on exactly the chosen decode replica with the prefill's `kv_transfer_params`
   and wait for its first token before answering, so a failure still gets a proper status code;
5. stream (or collect) the tokens; on the first token the KV has left the prefill instance
   (`ledger.prefill_done`); at the end `ledger.finish`, the predictor learns the natural output
   length, and one JSON line per request records the decision with its per-term costs.
A client that goes away cancels the in-flight prefill or decode call; Serve propagates the
cancellation into the engine replica, where vLLM aborts the request.

Engine state is polled every `poll_interval_s` (50 ms by default) with `broadcast("state")`; a
replica that stops answering, or disappears when its pool scales down, is dropped from the views
and its ledger entries are released; new replicas are used from their first poll on.

Several models (a `MultiModelConfig`): each model keeps its own pools, tokenizer, P/D policy, cost
model and output-length predictor, and a request naming a model is routed within that model's
pools exactly as above. A request naming the alias (`auto` by default) is routed across every
instance of every model by `route_by_latency`: each candidate's TTFT is estimated by simulating its
batching forward from the snapshot the router keeps of it (`disagg.graph.instance_state`, which
lists the approximations), and the instance maximising accuracy − λ·cost among those within the
query's TTFT limit wins (the fastest when none is). Candidates are the engines a query starts on:
a colocated model's engines, and a disaggregated model's prefill engines (its P/D policy then picks
the decode engine; the estimate leaves out the KV transfer and the decode engine's first step).
Per request, `X-TTFT-Limit-Ms` (default: the SLO class's TTFT target, the strictest among the
models' cost models) and `X-Route-Lambda` (default `router.lam`) override the configured values;
the `x-disagg-route` header and the request log carry the whole choice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from disagg.core.cost_model import CostModel, CostModelError, EngineConstants, load_profile
from disagg.core.latency_routing import ModelInstance, route_by_latency
from disagg.core.ledger import Ledger, PolledState, admission_work
from disagg.core.policies import Policy, PolicyError, build_policy, known_policies
from disagg.core.predictor import BucketMeanPredictor
from disagg.core.ttft_estimator import TtftEstimateError
from disagg.core.types import Decision, NoCapacity, RequestFeatures, Role, SloClass
from disagg.core.utility import AccuracyTable, Choice, ModelPrices
from disagg.graph.config import AppConfig, MultiModelConfig, is_multi_model, load_cost_model
from disagg.graph.engine_server import resolve_model
from disagg.graph.instance_state import FlightFacts, instance_snapshot
from disagg.graph.openai_api import (
    STREAM_DONE, ApiError, completion_body, new_id, parse_request, stream_chunk, usage,
)

logger = logging.getLogger("ray.serve")
fastapi_app = FastAPI(title="disagg router")
STALE_AFTER_S = 5.0  # a replica silent this long is no longer routed to


@dataclass(slots=True)
class _Instance:
    instance_id: str
    role: Role
    replica: str
    polled: PolledState
    last_seen: float
    raw: dict = field(default_factory=dict)
    model: str = ""


@dataclass(slots=True)
class _Model:
    """One served model: its pools, tokenizer, P/D policy, cost model and predictor."""

    name: str
    cfg: AppConfig
    handles: dict[Role, DeploymentHandle]
    tokenizer: Any
    cost_model: CostModel
    policy: Policy
    policy_params: dict
    predictor: BucketMeanPredictor
    id_prefix: str  # instance ids: <prefix><role>-<replica>
    prices: ModelPrices | None = None
    decode_stream: Any = None  # the decoding pool's handle in streaming mode

    def __post_init__(self) -> None:
        self.decode_stream = self.handles[self.decode_role].options(stream=True)

    @property
    def decode_role(self) -> Role:
        """The role of the engines that decode (and first-token) this model's requests."""
        return Role.BOTH if self.cfg.is_colocated else Role.DECODE

    @property
    def start_role(self) -> Role:
        """The role of the engines a request of this model starts on (the alias route's candidates)."""
        return Role.BOTH if self.cfg.is_colocated else Role.PREFILL


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    served: int = 0
    failed: int = 0
    rejected_400: int = 0
    prefill_retries: int = 0
    local_prefill_fallbacks: int = 0
    decode_retries: int = 0
    misrouted: int = 0
    cancelled: int = 0


class RequestLog:
    """Append-only JSON lines, one per finished request; each line written whole."""

    def __init__(self, path: str | None) -> None:
        # a relative path is relative to the folder the stack was launched from (DISAGG_RUN_DIR)
        self.path = Path(os.environ.get("DISAGG_RUN_DIR", ".")) / path if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.path, "a") as f:  # one write() per line: lines never interleave
            f.write(line)


# Defined before Router: serve.ingress captures the class (and the globals it uses) when it is decorated.
@dataclass(slots=True)
class _Flight:
    rid: str
    req: Any
    chat: bool
    slo: SloClass
    prompt_ids: list[int]
    sampling: dict
    model: "_Model | None" = None
    choice: Choice | None = None  # the alias route's choice (None: the request named its model)
    ttft_limit_s: float | None = None
    lam: float | None = None
    prefilled: bool = False
    decision: Decision | None = None
    predicted: int | None = None
    decision_us: float | None = None
    alias_us: float | None = None
    admitted: bool = False
    t_arrival: float | None = None
    t_first: float | None = None
    actual_prefill: str | None = None
    actual_decode: str | None = None
    fallback: str | None = None
    prefill_engine_s: float | None = None
    decode_engine_first_s: float | None = None
    stream: Any = None
    first: dict | None = None
    generated: int = 0
    finish_reason: str | None = None
    finished: bool = False

    def route_header(self) -> str:
        h = self.decision.header_value() if self.decision else ""
        if self.choice is not None:
            h = f"{self.choice.header_value()}; {h}"
        actual = f"; served_prefill={self.actual_prefill}; served_decode={self.actual_decode}"
        return h + actual + (f"; fallback={self.fallback}" if self.fallback else "")


def _last_line(e: BaseException | None) -> str:
    """A remote error's own message, without the Ray traceback around it."""
    lines = str(e).strip().splitlines()
    return lines[-1][:500] if lines else type(e).__name__


def _min_width(pool) -> int:
    return max(1, pool.autoscaling.min_replicas if pool.autoscaling else pool.num_replicas)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


_POOL_ROLE = {"prefill": Role.PREFILL, "decode": Role.DECODE, "colocated": Role.BOTH}


def _tokenizer(source: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(source))


def _header_number(request: Request, name: str, minimum_exclusive: bool) -> float | None:
    """A numeric request header: None when absent; 400 naming the header when not a valid number."""
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0 or (minimum_exclusive and v == 0):
        need = "a positive number" if minimum_exclusive else "a finite number >= 0"
        raise ApiError(f"header {name}: must be {need}, got {raw!r}", param=name)
    return v


@serve.ingress(fastapi_app)
class Router:
    async def __init__(self, prefill: DeploymentHandle | None, decode: DeploymentHandle | None, config: dict,
                       pools: dict[str, dict[str, DeploymentHandle]] | None = None) -> None:
        """One model: `prefill`, `decode` and its `AppConfig`. A colocated model, or several models
        (`MultiModelConfig`): `pools` maps each served name to {role value: handle}."""
        if is_multi_model(config):
            mc = MultiModelConfig.model_validate(config)
            views, rc = mc.app_configs(), mc.router
            self.alias: str | None = rc.alias
            self.lam, self.accuracy = rc.lam, mc.accuracy()
            prices = {m.model.served_name: m.prices.to_core() for m in mc.models}
            log_path = rc.request_log
        else:
            cfg = AppConfig.model_validate(config)
            views, rc = {cfg.model.served_name: cfg}, cfg.router
            pools = pools or {cfg.model.served_name: {Role.PREFILL.value: prefill, Role.DECODE.value: decode}}
            self.alias, self.lam, self.accuracy, prices = None, 0.0, AccuracyTable(), {}
            log_path = rc.request_log
        self.poll_interval_s, self.default_slo, self.prefill_retries = rc.poll_interval_s, rc.default_slo, rc.prefill_retries
        self.served: dict[str, _Model] = {}
        for name, view in views.items():
            cm = load_cost_model(view.router.cost_model)
            self.served[name] = _Model(
                name=name, cfg=view, handles={Role(r): h for r, h in pools[name].items()},
                tokenizer=_tokenizer(view.model.source), cost_model=cm,
                policy=build_policy(view.router.policy, cm, view.router.policy_params),
                policy_params=dict(view.router.policy_params), predictor=BucketMeanPredictor(),
                id_prefix=f"{name}:" if self.alias else "", prices=prices.get(name))
        self.first = next(iter(self.served.values()))
        self.alias_predictor = BucketMeanPredictor()
        self.ledger = Ledger()
        self.flights: dict[str, _Flight] = {}  # admitted and not finished, in admission order
        self.instances: dict[str, _Instance] = {}
        self.counters = _Counters()
        self.log = RequestLog(log_path)
        self._constants: dict[tuple, EngineConstants] = {}
        self._poll_task = asyncio.get_running_loop().create_task(self._poll_forever())

    # --- engine state --------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        interval = self.poll_interval_s
        while True:
            t0 = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # never let the poller die: routing would go stale silently
                logger.exception("engine state poll failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))

    async def poll_once(self) -> None:
        now = time.monotonic()
        pools = [(m, role, h) for m in self.served.values() for role, h in m.handles.items()]
        results = await asyncio.gather(*(
            h.broadcast("state").results_async(timeout_s=2.0, return_exceptions=True) for _, _, h in pools))
        for (model, role, _), states in zip(pools, results):
            for s in states:
                if isinstance(s, BaseException) or not isinstance(s, dict):
                    continue
                iid = f"{model.id_prefix}{role.value}-{s['replica']}"
                polled = PolledState(s["kv_used_tokens"], s["kv_capacity_tokens"], s["running"], s["waiting"])
                inst = self.instances.get(iid)
                if inst is None:
                    self.instances[iid] = _Instance(iid, role, s["replica"], polled, now, s, model.name)
                    logger.info("router: instance %s joined", iid)
                else:
                    inst.polled, inst.last_seen, inst.raw = polled, now, s
                self.ledger.polled(iid)
        for iid in [i for i, inst in self.instances.items() if now - inst.last_seen > STALE_AFTER_S]:
            lost = self.ledger.forget_instance(iid)
            del self.instances[iid]
            logger.warning("router: instance %s left (silent %.0f s); %d in-flight requests released",
                           iid, STALE_AFTER_S, len(lost))

    def _pool(self, model: _Model, role: Role) -> list[_Instance]:
        return [i for i in self.instances.values() if i.role is role and i.model == model.name]

    def _views(self, model: _Model, role: Role):
        return [self.ledger.view(i.instance_id, role, i.polled) for i in self._pool(model, role)]

    def _expected(self) -> dict[tuple[str, Role], int]:
        return {(m.name, _POOL_ROLE[name]): _min_width(pool)
                for m in self.served.values() for name, pool in m.cfg.pools().items()}

    # --- HTTP ----------------------------------------------------------------------------------

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict:
        data = [{"id": m.name, "object": "model", "owned_by": "disagg", "root": m.cfg.model.source,
                 "max_model_len": m.cfg.model.max_model_len} for m in self.served.values()]
        if self.alias:
            data.append({"id": self.alias, "object": "model", "owned_by": "disagg", "root": None,
                         "max_model_len": max(m.cfg.model.max_model_len for m in self.served.values()),
                         "routes_to": list(self.served)})
        return {"object": "list", "data": data}

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        expected = self._expected()
        have = {(m, r): len(self._pool(self.served[m], r)) for m, r in expected}
        ok = all(have[k] >= n for k, n in expected.items())
        counts: dict[str, int] = {}
        want: dict[str, int] = {}
        for (m, r), n in expected.items():
            counts[r.value] = counts.get(r.value, 0) + have[(m, r)]
            want[r.value] = want.get(r.value, 0) + n
        per_model = {m: {r.value: have[(mm, r)] for (mm, r) in expected if mm == m} for m in self.served}
        return JSONResponse({"status": "ok" if ok else "starting", "instances": counts, "expected": want,
                             "models": per_model}, status_code=200 if ok else 503)

    @fastapi_app.get("/admin/state")
    async def admin_state(self) -> dict:
        return {
            "policy": self.first.policy.name, "policy_params": self.first.policy_params,
            "cost_model": self.first.cost_model.name, "alias": self.alias, "lambda": self.lam,
            "models": {m.name: {"policy": m.policy.name, "policy_params": m.policy_params,
                                "cost_model": m.cost_model.name,
                                "layout": "colocated" if m.cfg.is_colocated else "disaggregated"}
                       for m in self.served.values()},
            "instances": {i.instance_id: {"role": i.role.value, "model": i.model, **i.raw,
                                          "backlog_s": self.ledger.backlog_s(i.instance_id),
                                          "queued": self.ledger.queued(i.instance_id)}
                          for i in self.instances.values()},
            "in_flight": len(self.ledger), "counters": asdict(self.counters),
        }

    def _admin_models(self, body: dict) -> list[_Model]:
        """The models an admin call applies to: `model` in the body, else all of them."""
        name = body.get("model")
        if name is None:
            return list(self.served.values())
        if name not in self.served:
            raise ApiError(f"unknown model {name!r}; served: {sorted(self.served)}", param="model")
        return [self.served[name]]

    @fastapi_app.post("/admin/policy")
    async def admin_policy(self, request: Request) -> Response:
        """Switch the P/D policy without restarting engines: {"name": ..., "params": {...}, "model": ...}
        (without `model`: every model; a colocated model takes only 'colocated')."""
        try:
            body = json.loads(await request.body())
            name, params = body["name"], body.get("params") or {}
            targets = self._admin_models(body)
            built = []
            for m in targets:
                policy = build_policy(name, m.cost_model, params)
                if policy.simulator_only:
                    raise PolicyError(f"policy {name!r} runs in the simulator only")
                if m.cfg.is_colocated and name != "colocated":
                    raise ApiError(f"model {m.name!r} is colocated: its only policy is 'colocated'", param="model")
                built.append(policy)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return _error(ApiError('body must be {"name": <policy>, "params": {...}}', param="name"))
        except PolicyError as e:
            return _error(ApiError(str(e), param="name"))
        except ApiError as e:
            return _error(e)
        for m, policy in zip(targets, built):
            m.policy, m.policy_params = policy, dict(params)
        return JSONResponse({"policy": name, "params": params, "models": [m.name for m in targets],
                             "known": known_policies(False)})

    @fastapi_app.post("/admin/cost_model")
    async def admin_cost_model(self, request: Request) -> Response:
        """Reload a model's cost model (a shipped profile name or a YAML path) without a restart:
        {"cost_model": ..., "model": ...} (`model` may be left out when the app serves one model)."""
        try:
            body = json.loads(await request.body())
            source = body["cost_model"]
            targets = self._admin_models(body)
            if len(targets) != 1:
                raise ApiError(f"this app serves {len(self.served)} models: name one with 'model'", param="model")
            m = targets[0]
            cm = load_profile(source)
            if cm.calibrated and cm.model and cm.model != m.cfg.model.source:
                raise CostModelError(f"{source} was calibrated for model {cm.model!r}; this app serves "
                                     f"{m.cfg.model.source!r}")
            policy = build_policy(m.policy.name, cm, m.policy_params)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return _error(ApiError('body must be {"cost_model": <profile name or path>}', param="cost_model"))
        except (CostModelError, PolicyError) as e:
            return _error(ApiError(str(e), param="cost_model"))
        except ApiError as e:
            return _error(e)
        m.cost_model, m.policy = cm, policy
        return JSONResponse({"cost_model": cm.name, "calibrated": cm.calibrated, "model": m.name})

    @fastapi_app.post("/admin/reset_prefix_cache")
    async def admin_reset_prefix_cache(self) -> dict:
        out = {}
        for m in self.served.values():
            for role, h in m.handles.items():
                key = role.value if len(self.served) == 1 else f"{m.name}:{role.value}"
                out[key] = await h.broadcast("reset_prefix_cache").results_async(timeout_s=30.0)
        return out

    # --- one request ---------------------------------------------------------------------------

    async def _handle(self, request: Request, chat: bool) -> Response:
        self.counters.requests += 1
        try:
            req = parse_request(await request.body(), "chat" if chat else "completion")
            slo = self._slo(request)
            limit_ms = _header_number(request, "X-TTFT-Limit-Ms", minimum_exclusive=True)
            lam = _header_number(request, "X-Route-Lambda", minimum_exclusive=False)
            targets = self._targets(req.model)
            prompts = {m.name: self._tokenize(m, req, chat) for m in targets}
            if req.model == self.alias:
                targets = self._fitting(targets, req, prompts)
            model = targets[0]
            sampling = self._sampling(model, req, len(prompts[model.name]))
        except ApiError as e:
            self.counters.rejected_400 += 1
            return _error(e)
        flight = _Flight(new_id("chatcmpl" if chat else "cmpl"), req, chat, slo, prompts[model.name], sampling, model)
        flight.lam = self.lam if lam is None else lam
        flight.ttft_limit_s = limit_ms / 1e3 if limit_ms is not None else self._default_limit_s(slo)
        try:
            if req.model == self.alias:
                self._choose_model(flight, targets, prompts)
            await self._start(flight)
        except ApiError as e:
            self.counters.failed += 1
            self._finish(flight, error=e.message)
            return _error(e)
        except asyncio.CancelledError:
            self.counters.cancelled += 1
            self._finish(flight, error="cancelled by client")
            raise
        headers = {"x-disagg-route": flight.route_header()}
        if req.stream:
            return StreamingResponse(self._sse(flight), media_type="text/event-stream", headers=headers)
        try:
            text, finish = await self._collect(flight)
        except ApiError as e:
            return _error(e)
        body = completion_body(flight.rid, flight.model.name, text, finish,
                               usage(len(flight.prompt_ids), flight.generated), chat)
        return JSONResponse(body, headers=headers)

    def _slo(self, request: Request) -> SloClass:
        raw = request.headers.get("x-slo-class")
        if raw is None:
            return self.default_slo
        try:
            return SloClass.parse(raw)
        except ValueError as e:
            raise ApiError(str(e), param="X-SLO-Class") from None

    def _default_limit_s(self, slo: SloClass) -> float:
        """The SLO class's TTFT target: the strictest among the models' cost models."""
        return min(m.cost_model.target(slo).ttft_s for m in self.served.values())

    def _targets(self, name: str) -> list[_Model]:
        if name in self.served:
            return [self.served[name]]
        if name == self.alias:
            return list(self.served.values())
        served = sorted(self.served) + ([self.alias] if self.alias else [])
        raise ApiError(f"unknown model {name!r}; served: {', '.join(repr(s) for s in served)}", param="model")

    def _fitting(self, models: list[_Model], req, prompts: dict[str, list[int]]) -> list[_Model]:
        """The alias's candidate models: those whose context window holds the prompt and max_tokens."""
        ok = [m for m in models if len(prompts[m.name]) + (req.max_tokens or 1) <= m.cfg.model.max_model_len]
        if not ok:
            p = max(len(v) for v in prompts.values())
            too_long = all(len(prompts[m.name]) >= m.cfg.model.max_model_len for m in models)
            param = ("messages" if hasattr(req, "messages") else "prompt") if too_long else "max_tokens"
            raise ApiError(f"the prompt has {p} tokens and max_tokens is {req.max_tokens}: no model's context "
                           f"window holds them (largest {max(m.cfg.model.max_model_len for m in models)})",
                           param=param)
        return ok

    def _tokenize(self, model: _Model, req, chat: bool) -> list[int]:
        tok = model.tokenizer
        if chat:
            msgs = [m.model_dump() for m in req.messages]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # recent transformers return a BatchEncoding (a mapping, not a list)
                ids = ids["input_ids"]
            param = "messages"
        elif isinstance(req.prompt, list):
            vocab = len(tok)
            bad = next((t for t in req.prompt if t >= vocab), None)
            if bad is not None:
                raise ApiError(f"token id {bad} is outside the vocabulary (size {vocab})", param="prompt")
            ids, param = list(req.prompt), "prompt"
        else:
            ids, param = tok.encode(req.prompt), "prompt"
        limit = model.cfg.model.max_model_len
        if not ids:
            raise ApiError("the prompt is empty after tokenization", param=param)
        if len(ids) >= limit and req.model != self.alias:
            raise ApiError(f"the prompt has {len(ids)} tokens; the context window is {limit}", param=param)
        return list(ids)

    def _sampling(self, model: _Model, req, prompt_tokens: int) -> dict:
        limit = model.cfg.model.max_model_len
        room = limit - prompt_tokens
        if req.max_tokens is not None and req.max_tokens > room:
            raise ApiError(f"max_tokens {req.max_tokens} + {prompt_tokens} prompt tokens exceed the context "
                           f"window of {limit}", param="max_tokens")
        return req.sampling(default_max_tokens=room)

    # --- the alias route -----------------------------------------------------------------------

    def _instance_constants(self, model: _Model, inst: _Instance) -> EngineConstants:
        """The model's calibrated constants for this instance, with the KV capacity the engine reports."""
        c = model.cost_model.for_instance(inst.instance_id)
        cap = inst.polled.kv_capacity_tokens
        key = (id(c), inst.instance_id, cap)
        hit = self._constants.get(key)
        if hit is None:
            hit = c if cap <= 0 or cap == c.kv_capacity_tokens else c.model_copy(update={"kv_capacity_tokens": cap})
            if len(self._constants) > 1024:  # cost-model reloads and scaling churn the keys
                self._constants.clear()
            self._constants[key] = hit
        return hit

    def _snapshot_facts(self, inst: _Instance) -> list[FlightFacts]:
        facts = []
        prefill_side = inst.role is Role.PREFILL
        for f in self.flights.values():
            d = f.decision
            on = d.prefill_id == inst.instance_id if prefill_side else d.decode_id == inst.instance_id
            if not on:
                continue
            started = f.prefilled if prefill_side else f.t_first is not None
            facts.append(FlightFacts(len(f.prompt_ids), f.predicted or 1, started, f.generated))
        return facts

    def _choose_model(self, f: "_Flight", models: list[_Model], prompts: dict[str, list[int]]) -> None:
        """Route the alias: pick the instance (and so the model) by accuracy − λ·cost within the TTFT limit."""
        p = max(len(prompts[m.name]) for m in models)  # tokenizers may differ: price the longest
        room = min(m.cfg.model.max_model_len - len(prompts[m.name]) for m in models)
        max_tokens = f.req.max_tokens or room
        f.predicted = max_tokens if f.req.ignore_eos else min(max_tokens, self.alias_predictor.predict(p, f.slo))
        candidates = []
        for m in models:
            for inst in self._pool(m, m.start_role):
                c = self._instance_constants(m, inst)
                snap = instance_snapshot(self._snapshot_facts(inst), c, prefill_only=inst.role is Role.PREFILL)
                candidates.append((ModelInstance(inst.instance_id, m.name, c, m.prices), snap))
        t0 = time.perf_counter()
        try:
            choice = route_by_latency(candidates, p, f.predicted, f.ttft_limit_s, f.lam, self.accuracy,
                                      time.monotonic())
        except NoCapacity as e:
            raise ApiError(f"no capacity: {e}", status=503, kind="service_unavailable") from None
        except (ValueError, TtftEstimateError) as e:  # a bug or an impossible snapshot: say so, do not guess
            logger.exception("router: latency routing failed")
            raise ApiError(f"latency routing failed: {e}", status=500, kind="internal_error") from None
        f.alias_us = (time.perf_counter() - t0) * 1e6
        f.choice = choice
        f.model = self.served[choice.model]
        f.prompt_ids = prompts[choice.model]
        f.sampling = self._sampling(f.model, f.req, len(f.prompt_ids))

    async def _start(self, f: "_Flight") -> None:
        """Route, prefill, and get the first token (so errors still have a status code)."""
        t_arrival = time.monotonic()
        m = f.model
        p = len(f.prompt_ids)
        max_tokens = f.sampling["max_tokens"]
        if f.choice is None:
            f.predicted = max_tokens if f.req.ignore_eos else min(max_tokens, m.predictor.predict(p, f.slo))
        feats = RequestFeatures(f.rid, p, f.predicted, f.slo)
        t0 = time.perf_counter()
        decode_views = self._views(m, m.decode_role)
        if f.choice is not None and m.start_role is Role.PREFILL:  # the alias chose the prefill engine
            prefill_views = [v for v in self._views(m, Role.PREFILL) if v.instance_id == f.choice.instance_id]
        elif f.choice is not None:  # ... or the colocated engine
            decode_views = [v for v in decode_views if v.instance_id == f.choice.instance_id]
            prefill_views = []
        else:
            prefill_views = self._views(m, Role.PREFILL) if not m.cfg.is_colocated else []
        try:
            decision = m.policy.choose(feats, prefill_views, decode_views, t_arrival)
        except NoCapacity as e:
            raise ApiError(f"no capacity: {e}", status=503, kind="service_unavailable") from None
        f.decision_us = (time.perf_counter() - t0) * 1e6
        f.decision, f.t_arrival = decision, t_arrival
        pw, dw = admission_work(m.cost_model, decision.prefill_id, decision.decode_id, p, f.predicted,
                                self.ledger.queued(decision.decode_id))
        self.ledger.admit(f.rid, decision.prefill_id, decision.decode_id, pw, dw, p)
        self.flights[f.rid] = f
        f.admitted = True
        kv = None if decision.colocated else await self._prefill(f)
        f.prefilled = True
        await self._first_token(f, kv)

    async def _prefill(self, f: "_Flight") -> dict | None:
        """KV location from the chosen prefill replica; other replicas on failure; None = prefill locally."""
        tried = []
        m = f.model
        target = f.decision.prefill_id
        for attempt in range(self.prefill_retries + 1):
            inst = self.instances.get(target)
            if inst is None:
                break
            tried.append(target)
            call = {"request_id": f"{f.rid}-p{attempt}", "prompt_token_ids": f.prompt_ids, "sampling": f.sampling}
            try:
                out = await m.handles[Role.PREFILL].prefill.remote(call, replica=inst.replica)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a dead or failing prefill replica: try another, then go local
                logger.warning("router: prefill of %s on %s failed: %s", f.rid, target, _last_line(e))
                self.counters.prefill_retries += 1
                others = [i.instance_id for i in self._pool(m, Role.PREFILL) if i.instance_id not in tried]
                if not others:
                    break
                target = min(others, key=self.ledger.backlog_s)
                continue
            if out["replica"] != inst.replica:
                self.counters.misrouted += 1
            f.actual_prefill = f"{m.id_prefix}prefill-{out['replica']}"
            f.prefill_engine_s = out["engine_ttft_s"]
            return out["kv_transfer_params"]
        self.counters.local_prefill_fallbacks += 1
        f.fallback = "local_prefill"
        f.actual_prefill = f.decision.decode_id
        return None

    async def _first_token(self, f: "_Flight", kv: dict | None) -> None:
        m = f.model
        targets = [f.decision.decode_id] + [i.instance_id for i in self._pool(m, m.decode_role)
                                            if i.instance_id != f.decision.decode_id]
        last_error: Exception | None = None
        for n, target in enumerate(targets[:2]):  # the chosen decode, then one other (local prefill)
            inst = self.instances.get(target)
            if inst is None:
                continue
            call = {"request_id": f"{f.rid}-d{n}", "prompt_token_ids": f.prompt_ids, "sampling": f.sampling,
                    "kv_transfer_params": kv if n == 0 else None}
            stream = m.decode_stream.decode.remote(call, replica=inst.replica)
            try:
                first = await stream.__anext__()
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except StopAsyncIteration:
                last_error = RuntimeError("decode ended without output")
                continue
            except Exception as e:
                logger.warning("router: decode of %s on %s failed before its first token: %s", f.rid, target,
                               _last_line(e))
                last_error = e
                stream.cancel()
                self.counters.decode_retries += 1
                if n == 0 and kv is not None:
                    f.fallback = "decode_retry_local_prefill"
                continue
            if first.get("r") != inst.replica:
                self.counters.misrouted += 1
            f.actual_decode = target
            if n > 0 or f.actual_prefill is None:  # prefilled locally on this decode instance
                f.actual_prefill = target
            f.stream, f.first = stream, first
            f.t_first = time.monotonic()
            f.decode_engine_first_s = first.get("e")
            self.ledger.prefill_done(f.rid)
            return
        raise ApiError(f"no decode instance could serve the request: {_last_line(last_error)}", status=503,
                       kind="service_unavailable")

    async def _chunks(self, f: "_Flight") -> AsyncIterator[dict]:
        error = None
        try:
            chunk = f.first
            while chunk is not None:
                f.generated += len(chunk["t"])
                if chunk.get("f"):
                    f.finish_reason = chunk["f"]
                yield chunk
                try:
                    chunk = await f.stream.__anext__()
                except StopAsyncIteration:
                    chunk = None
        except (asyncio.CancelledError, GeneratorExit):
            error = "cancelled by client"
            self.counters.cancelled += 1
            f.stream.cancel()
            raise
        except Exception as e:
            error = f"decode failed after {f.generated} tokens: {_last_line(e)}"
            self.counters.failed += 1
            raise ApiError(error, status=502, kind="upstream_error") from None
        finally:
            if error is None:
                self.counters.served += 1
                if f.finish_reason == "stop":
                    f.model.predictor.observe(len(f.prompt_ids), f.slo, f.generated)
                    if f.choice is not None:
                        self.alias_predictor.observe(len(f.prompt_ids), f.slo, f.generated)
            self._finish(f, error=error)

    async def _collect(self, f: "_Flight") -> tuple[str, str | None]:
        parts = [c["x"] async for c in self._chunks(f)]
        return "".join(parts), f.finish_reason

    async def _sse(self, f: "_Flight") -> AsyncIterator[bytes]:
        model = f.model.name
        first = True
        try:
            async for c in self._chunks(f):
                yield stream_chunk(f.rid, model, c["x"], c.get("f"), f.chat, first=first)
                first = False
        except ApiError as e:
            yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
        if f.req.include_usage:
            yield stream_chunk(f.rid, model, "", None, f.chat, usage=usage(len(f.prompt_ids), f.generated))
        yield STREAM_DONE

    def _finish(self, f: "_Flight", error: str | None) -> None:
        if f.finished:
            return
        f.finished = True
        if f.admitted:
            self.ledger.finish(f.rid)
        self.flights.pop(f.rid, None)
        now = time.monotonic()
        record = {
            "id": f.rid, "time": time.time(), "slo_class": f.slo.value, "prompt_tokens": len(f.prompt_ids),
            "max_tokens": f.sampling["max_tokens"], "predicted_output_tokens": f.predicted,
            "output_tokens": f.generated, "finish_reason": f.finish_reason, "error": error,
            "prefill": f.actual_prefill, "decode": f.actual_decode, "fallback": f.fallback,
            "decision": f.decision.as_dict() if f.decision else None, "decision_us": f.decision_us,
            "ttft_s": (f.t_first - f.t_arrival) if f.t_first and f.t_arrival else None,
            "e2e_s": (now - f.t_arrival) if f.t_arrival else None,
            "prefill_engine_s": f.prefill_engine_s, "decode_engine_first_s": f.decode_engine_first_s,
        }
        if self.alias:
            record.update({"requested_model": f.req.model, "model": f.model.name if f.model else None})
        if f.choice is not None:
            c = f.choice.chosen
            choice = f.choice.as_dict()
            for cand in choice["candidates"]:  # beyond the limit: not estimated further (JSON has no inf)
                if math.isinf(cand["ttft_s"]):
                    cand["ttft_s"] = None
            record.update({"choice": choice, "estimated_ttft_s": c.ttft_s,
                           "ttft_limit_s": f.ttft_limit_s, "lambda": f.lam, "feasible": f.choice.feasible,
                           "accuracy": c.accuracy, "cost": c.cost, "utility": c.utility,
                           "alias_decision_us": f.alias_us})
        self.log.write(record)
