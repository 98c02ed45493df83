"""The router deployment's ingress: vLLM's OpenAI API, routed over disaggregated engines.

The router is the application's ingress (one hop fewer on the token path than a separate
ingress), so a request's life is: HTTP proxy → this replica → (prefill replica, then decode
replica) → tokens stream back through this replica to the proxy.

`Router` is thin: it wires the router's parts from the config and hands each request on:
- here: the router's own checks, then the model's vLLM serving class, which reads, renders and
  answers the request (`openai_surface`); its engine client hands the rendered prompt to the
  dispatcher, and the route answers once every prompt's first output is in;
- `served_model.ServedModel`: each served model's pools, vLLM layer, policy, cost model, predictor;
- `registry.InstanceRegistry`: which engine instances exist and their latest polled state;
- `dispatcher.Dispatcher`: the routing decision, prefill, decode, samples and relay, with retries;
- `admin.Admin`: the `/admin/*` control plane;
- `access.Access`: who may call what — API keys on `/v1/*`, the admin gate on `/admin/*` — checked
  first in each route, before the body is read (`/health` stays open for load balancers);
- `request_log`: one JSON line per request, and the counters.
The route decorators stay on this class: `serve.ingress` captures them when it wraps it.

Before reading the body: a router whose own event loop runs `router.shed_loop_lag_s` behind
answers 429 (`loop_lag`; the cheapest answer a saturated router can give). Before parsing: a body
larger than `router.max_body_bytes` is refused with 413 as it arrives (it is never buffered
whole). Before rendering: a prompt too large to fit from its size alone gets its 400 at once
(`ServedModel.too_long`), and an overloaded fleet its 429 (`shed`).
Errors outside the routes (404 unknown path, 405 wrong method) keep the OpenAI error shape too.

Several models (a `MultiModelConfig`): a request naming a model is routed within that model's
pools; a request naming the alias (`auto` by default) is routed across every instance of every
model whose context window holds it (see `dispatcher`). Per request, `X-TTFT-Limit-Ms` (default:
the SLO class's TTFT target, the strictest among the models' cost models) and `X-Route-Lambda`
(default `router.lam`) override the configured values; the `x-disagg-route` header and the
request log carry the whole choice.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import time
import uuid
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from disagg.core.admission import shed, shed_for_lag
from disagg.core.ledger import Ledger
from disagg.core.planner import Planner, Widths, merge_window
from disagg.core.types import Role, SloClass
from disagg.core.utility import AccuracyTable
from serve_app.access import Access, CostModelFiles
from serve_app.admin import Admin
from serve_app.config import AppConfig, MultiModelConfig, is_multi_model
from serve_app.dispatcher import Dispatcher
from serve_app.flight import Flight
from serve_app.loop_lag import LoopLag
from serve_app.metrics import RouterMetrics
from serve_app.openai_api import ApiError, check_media_type, field_error, name_the_field, parse_openai, prompt_sizes
from serve_app.openai_surface import RequestContext, build_surface, entered, left
from serve_app.registry import InstanceRegistry
from serve_app.request_log import Counters, RequestLog
from serve_app.served_model import ServedModel

fastapi_app = FastAPI(title="disagg router")
logger = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 30.0
METRICS_INTERVAL_S = 1.0  # how often the counters and the instances' load go to Prometheus
PREFIX_SHARE_INTERVAL_S = 0.1  # how often a router replica sends its new prefix records to the others


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404 / 405 (and any other HTTP error outside the routes) in the OpenAI error shape."""
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    message = {404: f"unknown path {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    body = ApiError(message, status=exc.status_code, kind=kinds.get(exc.status_code, "invalid_request_error")).body()
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds {limit} bytes (router.max_body_bytes)", status=413)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(part)
    return b"".join(parts)


def _replica_identity() -> tuple[str, int, DeploymentHandle | None]:
    """(this router replica's id, its rank, a handle to every replica of its deployment).

    Outside Serve (the router built in-process, as the tests do) there are no peers."""
    try:
        ctx = serve.get_replica_context()
    except RayServeException:
        return f"router-{uuid.uuid4().hex[:8]}", 0, None
    rank = ctx.rank.rank if ctx.rank is not None else 0
    return ctx.replica_id.unique_id, rank, serve.get_deployment_handle(ctx.deployment, ctx.app_name)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


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


async def _rendered_ids(model: ServedModel, req: Any, chat: bool) -> list[int] | None:
    """The request's prompt token ids as `model`'s vLLM layer renders them (the longest of a list of
    prompts); None when it refuses the request."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    serving = model.surface.chat if chat else model.surface.completion
    req = req.model_copy(update={"model": model.name})  # it named the alias
    rendered = await (serving.render_chat_request(req) if chat else serving.render_completion_request(req))
    if isinstance(rendered, ErrorResponse):
        return None
    inputs = rendered[1] if chat else rendered
    mc = model.surface.vllm_config.model_config
    return max((list(extract_prompt_components(mc, i).token_ids or []) for i in inputs), key=len, default=None)


def freeze_startup_heap() -> None:
    """What vLLM's own API server does once started: move the start-up heap (torch, transformers,
    vLLM's OpenAI layer; about 700,000 objects) out of the garbage collector's view. Without it, a
    full collection under load walks that heap and held the event loop for 0.9–1.9 s on a busy
    2-core host (docs/results.md, the fleet rig)."""
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()


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
            self.lam, accuracy = rc.lam, mc.accuracy()
            model_router = rc.model_router(accuracy)  # the alias route's, `router.model_policy`
            prices = {m.model.served_name: m.prices.to_core() for m in mc.models}
        else:
            cfg = AppConfig.model_validate(config)
            views, rc = {cfg.model.served_name: cfg}, cfg.router
            pools = pools or {cfg.model.served_name: {Role.PREFILL.value: prefill, Role.DECODE.value: decode}}
            self.alias, self.lam, accuracy, prices = None, 0.0, AccuracyTable(), {}
            model_router = None
        self.access = Access.from_settings(rc)  # before anything starts: an unset key variable stops us here
        self.default_slo = rc.default_slo
        self.max_body_bytes = rc.max_body_bytes
        self.router_id, rank, self._peers = _replica_identity()
        self.served = {name: ServedModel.build(name, view, pools[name], prices.get(name), prefixed=bool(self.alias),
                                               replica_index=rank, surface=self._surface(name, view))
                       for name, view in views.items()}
        self.ledger = Ledger()  # shared by the registry (polls, departures) and the dispatcher (admissions)
        self.counters = Counters()
        self.metrics = RouterMetrics()
        self.registry = InstanceRegistry(self.served, self.ledger, self.counters, rc.poll_interval_s, self.router_id,
                                         kv_events=rc.prefix_index == "events")
        self.dispatcher = Dispatcher(self.registry, self.ledger, self.counters, RequestLog(rc.request_log),
                                     accuracy, rc.prefill_retries, multi_model=bool(self.alias),
                                     router_id=self.router_id, migration_limit=rc.migration_limit,
                                     metrics=self.metrics, model_router=model_router)
        self.flights = self.dispatcher.flights  # the requests in flight, for inspection
        self.admin = Admin(self.served, self.registry, self.ledger, self.counters, self.alias, self.lam,
                           replica_index=rank, cost_model_files=CostModelFiles.from_settings(rc))
        logger.info("router %s access: %s", self.router_id, self.access.describe())
        self._poll_task = asyncio.get_running_loop().create_task(self.registry.poll_forever())
        self.loop_lag = LoopLag()
        self.loop_lag_bound_s = rc.shed_loop_lag_s
        self._lag_task = asyncio.get_running_loop().create_task(self.loop_lag.run(busy=lambda: len(self.ledger) > 0))
        self._metrics_task = asyncio.get_running_loop().create_task(self._export_metrics())
        self._share_task = asyncio.get_running_loop().create_task(self._share_prefixes())
        self._adopt_task = None if self._peers is None else \
            asyncio.get_running_loop().create_task(self._adopt_admin_changes())
        self.last_plan: dict | None = None  # the planner's latest plan (rank 0 only)
        self._plan_task = None
        if rank == 0 and not self.alias and (planned := rc.planned_pools(views[next(iter(views))].pools())):
            self._plan_task = asyncio.get_running_loop().create_task(self._plan_forever(planned))
        freeze_startup_heap()

    def _surface(self, name: str, cfg: AppConfig):
        """vLLM's OpenAI layer for one model, over an engine client that routes through the dispatcher."""
        def start(f: Flight):
            return self.dispatcher.start(f)

        def outputs(f: Flight):
            return self.dispatcher.outputs(f)

        def new_flight(ctx: RequestContext, rid: str, prompt: Any, params: Any) -> Flight:
            return self._flight(self.served[name], ctx, rid, prompt, params)
        return build_surface(cfg, start, outputs, new_flight)

    def stop_background(self) -> None:
        """Stop the engines' state streams and polls, measuring the loop's lag, exporting metrics and
        sharing prefix records (in-process tests drive the first two themselves)."""
        self.registry.stop()
        for task in (self._poll_task, self._lag_task, self._metrics_task, self._share_task, self._plan_task,
                     self._adopt_task):
            if task is not None:
                task.cancel()

    async def take_window(self) -> dict:
        """This replica's counts for the planner since they were last taken (serve_app.planning)."""
        return self.dispatcher.window.take()

    async def _plan_forever(self, planned: list[str]) -> None:
        """Size the planned pools every `router.planner.interval_s` (serve_app.planning)."""
        m = next(iter(self.served.values()))
        pools = m.cfg.pools()
        bounds = {name: (p.autoscaling.min_replicas, p.autoscaling.max_replicas) if name in planned
                  else (p.num_replicas, p.num_replicas) for name, p in pools.items()}
        cfg = m.cfg.router.planner.model_copy(update={
            "min_prefill": bounds["prefill"][0], "max_prefill": bounds["prefill"][1],
            "min_decode": max(1, bounds["decode"][0]), "max_decode": bounds["decode"][1]})
        planner = Planner(m.cost_model, cfg)
        current: Widths | None = None
        since = time.monotonic()
        while True:
            await asyncio.sleep(cfg.interval_s)
            try:
                if current is None:  # a restarted router starts from the pools as they are, not as configured
                    current = Widths(*(max(pools[name].num_replicas, len(self.registry.pool(m, Role(name))))
                                       for name in ("prefill", "decode")))
                counts = [self.dispatcher.window.take()] if self._peers is None else [
                    r for r in await self._peers.broadcast("take_window").results_async(
                        timeout_s=ADMIN_TIMEOUT_S, return_exceptions=True) if isinstance(r, dict)]
                kv = max((v.pressure_after(0) for v in self.registry.views(m, Role.DECODE)), default=0.0)
                now = time.monotonic()  # the window is as long as it was, taking the counts included
                window, since = merge_window(counts, now - since, kv), now
                planner.cm = m.cost_model  # it may have been reloaded (/admin/cost_model)
                plan = planner.plan(window, current)
                if plan.widths != current:  # one line per change (INFO is not shown on the fast path)
                    logger.warning("router planner: %s", "; ".join(plan.reasons))
                current = plan.widths
                for name in planned:
                    width = getattr(plan.widths, name)
                    await m.handles[Role(name)].broadcast("set_planned_width", width).results_async(
                        timeout_s=ADMIN_TIMEOUT_S, return_exceptions=True)
                self.last_plan = {**plan.as_dict(), "time": time.time(), "window": asdict(window)}
                self.metrics.planned(m.name, {"prefill": plan.widths.prefill, "decode": plan.widths.decode})
            except Exception as e:  # never let the planner die: the pools would freeze at their widths
                logger.warning("router planner: planning failed: %s: %s", type(e).__name__, e)

    async def _share_prefixes(self) -> None:
        """Send the prefix records this replica made to the other router replicas, in batches."""
        while True:
            await asyncio.sleep(PREFIX_SHARE_INTERVAL_S)
            batch = {m.name: records for m in self.served.values()
                     if m.prefix_index is not None and (records := m.prefix_index.take_outbox())}
            if batch and self._peers is not None:
                try:
                    await self._peers.broadcast("learn_prefixes", self.router_id, batch).results_async(
                        timeout_s=ADMIN_TIMEOUT_S, return_exceptions=True)
                except Exception as e:  # a peer being replaced: its index starts empty anyway
                    logger.debug("router: sharing prefix records failed: %s", e)

    async def learn_prefixes(self, sender: str, batch: dict[str, list]) -> None:
        """Another router replica's prefix records (see `PrefixIndex`); for live instances only."""
        if sender == self.router_id:
            return
        now = time.monotonic()
        for name, records in batch.items():
            m = self.served.get(name)
            if m is None or m.prefix_index is None:
                continue
            for iid, hashes, capacity in records:
                if self.registry.get(iid) is not None:
                    m.prefix_index.record(iid, hashes, capacity, now, share=False)

    async def _export_metrics(self) -> None:
        """The counters, each instance's load and the loop's lag, to Prometheus once a second."""
        while True:
            await asyncio.sleep(METRICS_INTERVAL_S)
            views = [(m.name, v) for m in self.served.values() for role in {Role.PREFILL, m.decode_role}
                     for v in self.registry.views(m, role)]
            self.metrics.refresh(self.counters, views, self.loop_lag.lag_s)

    async def poll_once(self) -> None:
        """Poll every engine now (the background poller does it every `poll_interval_s`)."""
        await self.registry.poll_once()

    # --- HTTP ----------------------------------------------------------------------------------

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return self.access.api(request) or await self._handle(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return self.access.api(request) or await self._handle(request, chat=True)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (refused := self.access.api(request)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": await self._model_cards()})

    @fastapi_app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        if (refused := self.access.api(request)) is not None:
            return refused
        card = next((c for c in await self._model_cards() if c["id"] == model_id), None)
        if card is None:
            return _error(ApiError(f"The model `{model_id}` does not exist.", param="model", status=404,
                                   kind="NotFoundError"))
        return JSONResponse(card)

    async def _model_cards(self) -> list[dict]:
        """vLLM's model cards of every served model, and the alias's."""
        cards = []
        for m in self.served.values():
            cards.extend(c.model_dump() for c in (await m.surface.models.show_available_models()).data)
        if self.alias:
            cards.append({**cards[0], "id": self.alias, "root": None, "parent": None, "permission": [],
                          "max_model_len": max(m.cfg.model.max_model_len for m in self.served.values()),
                          "routes_to": list(self.served)})
        return cards

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's `/tokenize`: a prompt or a chat rendered and tokenized as the router prices it."""
        return self.access.api(request) or await self._tokenization(request, "tokenize")

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return self.access.api(request) or await self._tokenization(request, "detokenize")

    async def _tokenization(self, request: Request, op: str) -> Response:
        from pydantic import TypeAdapter, ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

        try:
            check_media_type(request.headers.get("content-type"))
            raw = await read_body(request, self.max_body_bytes)
            try:
                req = TypeAdapter(TokenizeRequest if op == "tokenize" else DetokenizeRequest).validate_json(raw)
            except ValidationError as e:
                raise field_error(e) from None
            model = self._targets(req.model or next(iter(self.served)))[0]
        except ApiError as e:
            return _error(e)
        t = model.surface.tokenization
        out = await (t.create_tokenize(req, request) if op == "tokenize" else t.create_detokenize(req, request))
        if isinstance(out, ErrorResponse):
            return JSONResponse(out.model_dump(), status_code=out.error.code)
        return JSONResponse(out.model_dump())

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        ok, body = self.registry.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @fastapi_app.get("/admin/state")
    async def admin_state(self, request: Request) -> Response:
        """This replica's view of the engines and models; `counters` and `in_flight` summed over
        every router replica, and `routers` with each one's."""
        if (refused := self.access.admin(request)) is not None:
            return refused
        await self.registry.poll_once(exact=True)  # the engines as they are now, not as of their last push
        state = self.admin.state()
        routers = {self.router_id: await self.router_summary()}
        if self._peers is not None:
            for reply in await self._peers.broadcast("router_summary").results_async(
                    timeout_s=ADMIN_TIMEOUT_S, return_exceptions=True):
                if not isinstance(reply, BaseException):
                    routers[reply["router"]] = reply
        state["router"], state["routers"] = self.router_id, routers
        plans = [r["plan"] for r in routers.values() if r.get("plan")]
        state["planner"] = plans[0] if plans else None  # rank 0's latest plan
        state["counters"] = {k: sum(r["counters"].get(k, 0) for r in routers.values()) for k in state["counters"]}
        state["in_flight"] = sum(r["in_flight"] for r in routers.values())
        return JSONResponse(state)

    async def router_summary(self) -> dict:
        """This replica's id, counters and requests in flight: `/admin/state` on any replica sums them."""
        return {"router": self.router_id, "counters": asdict(self.counters), "in_flight": len(self.ledger),
                "pid": os.getpid(), "loop_lag_s": self.loop_lag.lag_s, "loop_lag_peak_s": self.loop_lag.peak_s,
                "gc_frozen": gc.get_freeze_count(),
                "plan": self.last_plan, "state_pushes": self.registry.pushes,
                "policies": {name: m.policy.name for name, m in self.served.items()},
                "cost_models": {name: m.cost_model.name for name, m in self.served.items()}}

    @fastapi_app.post("/admin/policy")
    async def admin_policy(self, request: Request) -> Response:
        """Switch the P/D policy without restarting engines: {"name": ..., "params": {...}, "model": ...}."""
        return self.access.admin(request) or await self._admin_change("set_policy", await request.body())

    @fastapi_app.post("/admin/cost_model")
    async def admin_cost_model(self, request: Request) -> Response:
        """Reload a model's cost model without a restart: {"cost_model": ..., "model": ...}."""
        return self.access.admin(request) or await self._admin_change("set_cost_model", await request.body())

    @fastapi_app.post("/admin/probe")
    async def admin_probe(self, request: Request) -> Response:
        """One calibration measurement on one engine instance (`disagg calibrate --live`)."""
        if (refused := self.access.admin(request)) is not None:
            return refused
        try:
            return JSONResponse(await self.admin.probe(await request.body()))
        except ApiError as e:
            return _error(e)

    @fastapi_app.post("/admin/prefix")
    async def admin_prefix(self, request: Request) -> Response:
        """What this replica's prefix index says each instance holds of a prompt (token ids)."""
        if (refused := self.access.admin(request)) is not None:
            return refused
        try:
            return JSONResponse(self.admin.prefix(await request.body()))
        except ApiError as e:
            return _error(e)

    async def apply_admin(self, op: str, raw_body: bytes) -> str:
        """Apply an admin change another router replica validated (see `_admin_change`)."""
        self.admin.apply(op, raw_body)
        return self.router_id

    async def admin_changes(self) -> tuple[str, list[tuple[str, bytes]]]:
        """(this replica's id, the admin changes it applied since the config, in order: `Admin.changes`)."""
        return self.router_id, self.admin.changes()

    async def _adopt_admin_changes(self) -> None:
        """A replica that starts beside others (Serve replaced one, or scaled the routers up) applies
        the admin changes they applied since the config — the policy, the cost model `make run`
        fitted — so no replica routes by the config's rules while the others route by newer ones."""
        try:
            replies = await self._peers.broadcast("admin_changes").results_async(
                timeout_s=ADMIN_TIMEOUT_S, return_exceptions=True)
            peers = [reply[1] for reply in replies
                     if not isinstance(reply, BaseException) and reply[0] != self.router_id]
            theirs = max(peers, key=len, default=[])
            if self.admin.changes() or not theirs:  # a change reached us meanwhile: it is newer than theirs
                return
            for op, raw_body in theirs:
                self.admin.apply(op, raw_body)
            logger.info("router %s: applied its peers' %d admin changes", self.router_id, len(theirs))
        except Exception as e:  # it then routes with the config's settings: say so
            logger.warning("router %s: could not take its peers' admin changes (%s: %s); it routes with the "
                           "config's policy and cost model", self.router_id, type(e).__name__, e)

    async def _admin_change(self, op: str, raw_body: bytes, done: dict | None = None) -> Response:
        """Validate and apply here (a 400 changes nothing anywhere), then on every router replica:
        with several routers, one left on the old policy would route by other rules. `done`: what
        was done before, for the answer."""
        try:
            out = {**(done or {}), **self.admin.apply(op, raw_body)}
        except ApiError as e:
            return _error(e)
        applied, failed = {self.router_id}, []
        if self._peers is not None:
            for reply in await self._peers.broadcast("apply_admin", op, raw_body).results_async(
                    timeout_s=ADMIN_TIMEOUT_S, return_exceptions=True):
                if isinstance(reply, BaseException):
                    failed.append(str(reply).strip().splitlines()[-1][:300] if str(reply).strip() else repr(reply))
                else:
                    applied.add(reply)
        out["routers"] = sorted(applied)
        if failed:
            body = ApiError(f"applied on {len(applied)} router replicas, failed on {len(failed)}: {failed}",
                            status=500, kind="internal_error").body()
            return JSONResponse({**body, **out}, status_code=500)
        return JSONResponse(out)

    @fastapi_app.post("/admin/reset_prefix_cache")
    async def admin_reset_prefix_cache(self, request: Request) -> Response:
        """Drop every engine's cached prefixes, then every router replica's index of them."""
        if (denied := self.access.admin(request)) is not None:
            return denied
        engines = await self.admin.reset_prefix_cache()
        return await self._admin_change("forget_prefixes", b"{}", engines)

    # --- one request ---------------------------------------------------------------------------

    async def _handle(self, request: Request, chat: bool) -> Response:
        """One OpenAI request: the router's checks, then vLLM's serving class of the model, whose
        engine client routes (`openai_surface`); a stream starts once every prompt's first output is
        in, so a failure before it still gets its status code, and the headers name the route."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        self.counters.requests += 1
        received = time.monotonic()
        try:
            slo = self._slo(request)
            self._shed_if_behind(slo)  # before reading the body: the cheapest answer a busy router can give
            check_media_type(request.headers.get("content-type"))
            req = parse_openai(await read_body(request, self.max_body_bytes), "chat" if chat else "completion")
            limit_ms = _header_number(request, "X-TTFT-Limit-Ms", minimum_exclusive=True)
            lam = _header_number(request, "X-Route-Lambda", minimum_exclusive=False)
            slo_scale = _header_number(request, "X-SLO-Scale", minimum_exclusive=True)
            if req.model is None:  # vLLM serves its first model; the router, the alias if it has one
                req.model = self.alias or next(iter(self.served))
            targets = self._may_fit(self._targets(req.model), req, chat)
            self._admit_or_shed(targets, slo)  # before rendering: an overloaded fleet answers at once
        except ApiError as e:
            if e.status != 429:  # a shed request was valid: counted as shed_429 instead
                self.counters.rejected_400 += 1
            return _error(e)
        if limit_ms is not None:
            limit_s = limit_ms / 1e3
        elif slo_scale is not None:
            limit_s = None  # the alias's limit follows from the rendered prompt (`_choose_for_alias`)
        else:
            limit_s = self._default_limit_s(slo)
        ctx = RequestContext(slo, limit_s,
                             self.lam if lam is None else lam, chat, requested_model=req.model,
                             fields=frozenset(req.model_fields_set), received=received, slo_scale=slo_scale)
        token = entered(ctx)
        result: Any = None
        try:
            model = await self._choose_for_alias(targets, req, ctx) if req.model == self.alias else targets[0]
            serving = model.surface.chat if chat else model.surface.completion
            result = await (serving.create_chat_completion(req, request) if chat
                            else serving.create_completion(req, request))
            if not isinstance(result, ErrorResponse):
                await asyncio.gather(*(f.started for f in ctx.flights))
        except ApiError as e:
            self._abandon(ctx, result)
            if e.status < 500 and e.status != 429 and not ctx.flights:
                self.counters.rejected_400 += 1
            return _error(e)
        except asyncio.CancelledError:
            self._abandon(ctx, result)
            raise
        except Exception as e:  # what vLLM's server answers for its own layer's exceptions (a 400 for its checks)
            self._abandon(ctx, result)
            result = create_error_response(e)
            if result.error.code >= 500:
                logger.exception("router: vLLM's OpenAI layer failed")
        finally:
            left(token)
        if isinstance(result, ErrorResponse):
            self._abandon(ctx, None)
            name_the_field(result, req, "messages" if chat else "prompt")
            if result.error.code < 500:
                self.counters.rejected_400 += 1
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        headers = {"x-disagg-route": " | ".join(f.route_header() for f in ctx.flights),
                   "x-disagg-router": self.router_id}
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream", headers=headers)
        return JSONResponse(result.model_dump(), headers=headers)

    def _abandon(self, ctx: RequestContext, result: Any) -> None:
        """A request that ends before its answer streams: every prompt's flight ends with it."""
        for f in ctx.flights:
            self.dispatcher.abandon(f)
        if hasattr(result, "aclose"):
            asyncio.get_running_loop().create_task(result.aclose())

    def _flight(self, model: ServedModel, ctx: RequestContext, rid: str, prompt: Any, params: Any) -> Flight:
        """The record of one prompt of a request, as vLLM's layer hands it to the engine client."""
        from vllm.renderers.inputs.preprocess import extract_prompt_components
        from vllm.sampling_params import RequestOutputKind

        parts = extract_prompt_components(model.surface.vllm_config.model_config, prompt)
        if parts.token_ids is None:
            raise ApiError("prompt embeddings are not served on the disaggregated path", param="prompt_embeds")
        if parts.text is None and parts.token_ids and max(parts.token_ids) >= model.vocab_size:  # a token-id prompt
            raise ApiError(f"Token id {max(parts.token_ids)} is out of vocabulary (size {model.vocab_size})",
                           param="prompt", kind="BadRequestError")
        f = Flight(rid, ctx.chat, ctx.slo, list(parts.token_ids), params, model, requested_model=ctx.requested_model,
                   fields=ctx.fields, prompt_text=parts.text,
                   final_only=params.output_kind == RequestOutputKind.FINAL_ONLY)
        f.lam, f.ttft_limit_s, f.t_received, f.slo_scale = ctx.lam, ctx.ttft_limit_s, ctx.received, ctx.slo_scale
        # vLLM names prompt i's engine request `<id>-i` (completions) or `<id>_i` (chat, several prompts)
        f.prompt_index = len(ctx.flights)
        f.response_id = rid.removesuffix(f"-{f.prompt_index}").removesuffix(f"_{f.prompt_index}")
        if ctx.alias is not None:
            f.choice, f.predicted, f.alias_us = ctx.alias.choice, ctx.alias.predicted, ctx.alias.decision_us
        return f

    async def _choose_for_alias(self, targets: list[ServedModel], req: Any, ctx: RequestContext) -> ServedModel:
        """The alias route: render the request for every candidate model, keep those whose context
        window holds it, and let `choose_model` pick by accuracy − λ·cost within the TTFT limit."""
        prompts = {}
        for m in targets:
            ids = await _rendered_ids(m, req, ctx.chat)
            if ids is not None and len(ids) + (req.max_tokens or 1) <= m.cfg.model.max_model_len:
                prompts[m.name] = ids
        if not prompts:
            largest = max(m.cfg.model.max_model_len for m in targets)
            raise ApiError(f"no model's context window holds the prompt and max_tokens {req.max_tokens} "
                           f"(largest {largest})", param="messages" if ctx.chat else "prompt")
        if ctx.ttft_limit_s is None:
            ctx.ttft_limit_s = self._scaled_limit_s(prompts, ctx.slo, ctx.slo_scale)
        ctx.alias = self.dispatcher.choose_model(prompts, req.max_tokens, bool(req.ignore_eos), ctx.slo,
                                                 ctx.ttft_limit_s, ctx.lam)
        req.model = ctx.alias.choice.model
        return self.served[req.model]

    @staticmethod
    def _may_fit(targets: list[ServedModel], req: Any, chat: bool) -> list[ServedModel]:
        """The targets whose context window the prompt may fit by its size alone (no rendering);
        400 when none may (the alias drops the others, a named model has no others)."""
        sizes = prompt_sizes(req, chat)
        errors = {m.name: m.too_long(sizes, "messages" if chat else "prompt") for m in targets}
        fit = [m for m in targets if errors[m.name] is None]
        if not fit:
            raise errors[targets[0].name]
        return fit

    def _shed_if_behind(self, slo: SloClass) -> None:
        """429 with Retry-After when this router's own event loop is too far behind (`shed_for_lag`)."""
        verdict = shed_for_lag(self.loop_lag.lag_s, self.loop_lag_bound_s, slo)
        if verdict is not None:
            self.counters.shed_429 += 1
            self.counters.shed_router_busy += 1
            raise ApiError(verdict.message(), status=429, kind="rate_limit_error",
                           headers={"Retry-After": str(verdict.retry_after_s)})

    def _admit_or_shed(self, targets: list[ServedModel], slo: SloClass) -> None:
        """429 with Retry-After when every candidate model's decode instances are too far behind
        (`disagg.core.admission`); the soonest of their drain estimates is the hint."""
        verdicts = [shed(self.registry.views(m, m.decode_role), m.cfg.engine.max_num_seqs, slo,
                         m.cfg.router.shed_queue_factor) for m in targets]
        if verdicts and all(verdicts):
            soonest = min(verdicts, key=lambda s: s.retry_after_s)
            self.counters.shed_429 += 1
            raise ApiError(soonest.message(), status=429, kind="rate_limit_error",
                           headers={"Retry-After": str(soonest.retry_after_s)})

    def _slo(self, request: Request) -> SloClass:
        raw = request.headers.get("x-slo-class")
        if raw is None:
            return self.default_slo
        try:
            return SloClass.parse(raw)
        except ValueError as e:
            raise ApiError(str(e), param="X-SLO-Class") from None

    def _scaled_limit_s(self, prompts: dict[str, list[int]], slo: SloClass, slo_scale: float) -> float:
        """The alias's TTFT limit under `X-SLO-Scale`: that many times the request's unloaded TTFT on
        the fastest model that holds it, each model's by its own constants and rendering. One limit
        for every candidate, as the route compares them: a slower model is chosen only where it
        still meets what the fastest could do, scaled."""
        return min(self.served[name].cost_model.target_for(slo, len(ids), slo_scale).ttft_s
                   for name, ids in prompts.items())

    def _default_limit_s(self, slo: SloClass) -> float:
        """The SLO class's TTFT target: the strictest among the models' cost models."""
        return min(m.cost_model.target(slo).ttft_s for m in self.served.values())

    def _targets(self, name: str | None) -> list[ServedModel]:
        """The models a request naming `name` may go to (no name: the alias's, or the one model's)."""
        if name is None:
            name = self.alias or next(iter(self.served))
        if name in self.served:
            return [self.served[name]]
        if name == self.alias:
            return list(self.served.values())
        served = sorted(self.served) + ([self.alias] if self.alias else [])
        raise ApiError(f"The model `{name}` does not exist. Served: {', '.join(repr(s) for s in served)}",
                       param="model", status=404, kind="NotFoundError")  # vLLM's answer
