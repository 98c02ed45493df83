"""The router deployment's ingress: OpenAI-compatible HTTP routes, validation, responses.

The router is the application's ingress (one hop fewer on the token path than a separate
ingress), so a request's life is: HTTP proxy → this replica → (prefill replica, then decode
replica) → tokens stream back through this replica to the proxy.

`Router` is thin: it wires the router's parts from the config and hands each request on:
- here: validate (400 naming the field), tokenize with the served model's tokenizer — the exact
  prompt length is a routing signal —, check it fits the context window, build the response;
- `served_model.ServedModel`: each served model's pools, tokenizer, policy, cost model, predictor;
- `registry.InstanceRegistry`: which engine instances exist and their latest polled state;
- `dispatcher.Dispatcher`: the routing decision, prefill, decode and token relay, with retries;
- `admin.Admin`: the `/admin/*` control plane;
- `access.Access`: who may call what — API keys on `/v1/*`, the admin gate on `/admin/*` — checked
  first in each route, before the body is read (`/health` stays open for load balancers);
- `request_log`: one JSON line per request, and the counters.
The route decorators stay on this class: `serve.ingress` captures them when it wraps it.

Before reading the body: a router whose own event loop runs `router.shed_loop_lag_s` behind
answers 429 (`loop_lag`; the cheapest answer a saturated router can give). Before parsing: a body
larger than `router.max_body_bytes` is refused with 413 as it arrives (it is never buffered whole). Before tokenizing: a prompt too large to fit from its size alone gets its 400
at once (`ServedModel.too_long`); large prompts that may fit are tokenized off the event loop.
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
import json
import logging
import math
import os
import time
import uuid
from dataclasses import asdict
from typing import AsyncIterator

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
from serve_app.openai_api import (
    STREAM_DONE, ApiError, choice_logprobs, completion_body, new_id, parse_request, stream_chunk, usage,
)
from serve_app.registry import InstanceRegistry
from serve_app.request_log import Counters, RequestLog
from serve_app.served_model import ServedModel

fastapi_app = FastAPI(title="disagg router")
logger = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 30.0
METRICS_INTERVAL_S = 1.0  # how often the counters and the instances' load go to Prometheus
PREFIX_SHARE_INTERVAL_S = 0.1  # how often a router replica sends its new prefix records to the others
OFF_LOOP_TOKENIZE_CHARS = 16_384  # longer prompts tokenize in a thread (~1 ms per 1,000 characters)


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
            prices = {m.model.served_name: m.prices.to_core() for m in mc.models}
        else:
            cfg = AppConfig.model_validate(config)
            views, rc = {cfg.model.served_name: cfg}, cfg.router
            pools = pools or {cfg.model.served_name: {Role.PREFILL.value: prefill, Role.DECODE.value: decode}}
            self.alias, self.lam, accuracy, prices = None, 0.0, AccuracyTable(), {}
        self.access = Access.from_settings(rc)  # before anything starts: an unset key variable stops us here
        self.default_slo = rc.default_slo
        self.max_body_bytes = rc.max_body_bytes
        self.router_id, rank, self._peers = _replica_identity()
        self.served = {name: ServedModel.build(name, view, pools[name], prices.get(name), prefixed=bool(self.alias),
                                               replica_index=rank)
                       for name, view in views.items()}
        self.ledger = Ledger()  # shared by the registry (polls, departures) and the dispatcher (admissions)
        self.counters = Counters()
        self.metrics = RouterMetrics()
        self.registry = InstanceRegistry(self.served, self.ledger, self.counters, rc.poll_interval_s, self.router_id)
        self.dispatcher = Dispatcher(self.registry, self.ledger, self.counters, RequestLog(rc.request_log),
                                     accuracy, rc.prefill_retries, multi_model=bool(self.alias),
                                     router_id=self.router_id, migration_limit=rc.migration_limit,
                                     metrics=self.metrics)
        self.flights = self.dispatcher.flights  # the requests in flight, for inspection
        self.admin = Admin(self.served, self.registry, self.ledger, self.counters, self.alias, self.lam,
                           replica_index=rank, cost_model_files=CostModelFiles.from_settings(rc))
        logger.info("router %s access: %s", self.router_id, self.access.describe())
        self._poll_task = asyncio.get_running_loop().create_task(self.registry.poll_forever())
        self.loop_lag = LoopLag()
        self.loop_lag_bound_s = rc.shed_loop_lag_s
        self._lag_task = asyncio.get_running_loop().create_task(self.loop_lag.run())
        self._metrics_task = asyncio.get_running_loop().create_task(self._export_metrics())
        self._share_task = asyncio.get_running_loop().create_task(self._share_prefixes())
        self.last_plan: dict | None = None  # the planner's latest plan (rank 0 only)
        self._plan_task = None
        if rank == 0 and not self.alias and (planned := rc.planned_pools(views[next(iter(views))].pools())):
            self._plan_task = asyncio.get_running_loop().create_task(self._plan_forever(planned))

    def stop_background(self) -> None:
        """Stop polling the engines, measuring the loop's lag, exporting metrics and sharing prefix
        records (in-process tests drive the first two themselves)."""
        for task in (self._poll_task, self._lag_task, self._metrics_task, self._share_task, self._plan_task):
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
        for name, records in batch.items():
            m = self.served.get(name)
            if m is None or m.prefix_index is None:
                continue
            for iid, hashes, capacity in records:
                if self.registry.get(iid) is not None:
                    m.prefix_index.record(iid, hashes, capacity, share=False)

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
        data = [{"id": m.name, "object": "model", "owned_by": "disagg", "root": m.cfg.model.source,
                 "max_model_len": m.cfg.model.max_model_len} for m in self.served.values()]
        if self.alias:
            data.append({"id": self.alias, "object": "model", "owned_by": "disagg", "root": None,
                         "max_model_len": max(m.cfg.model.max_model_len for m in self.served.values()),
                         "routes_to": list(self.served)})
        return JSONResponse({"object": "list", "data": data})

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
                "plan": self.last_plan}

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

    async def apply_admin(self, op: str, raw_body: bytes) -> str:
        """Apply an admin change another router replica validated (see `_admin_change`)."""
        getattr(self.admin, op)(raw_body)
        return self.router_id

    async def _admin_change(self, op: str, raw_body: bytes, done: dict | None = None) -> Response:
        """Validate and apply here (a 400 changes nothing anywhere), then on every router replica:
        with several routers, one left on the old policy would route by other rules. `done`: what
        was done before, for the answer."""
        try:
            out = {**(done or {}), **getattr(self.admin, op)(raw_body)}
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
        self.counters.requests += 1
        try:
            slo = self._slo(request)
            self._shed_if_behind(slo)  # before reading the body: the cheapest answer a busy router can give
            req = parse_request(await read_body(request, self.max_body_bytes), "chat" if chat else "completion")
            limit_ms = _header_number(request, "X-TTFT-Limit-Ms", minimum_exclusive=True)
            lam = _header_number(request, "X-Route-Lambda", minimum_exclusive=False)
            targets = self._may_fit(self._targets(req.model), req)
            self._admit_or_shed(targets, slo)  # before tokenizing: an overloaded fleet answers at once
            prompts = await self._tokenize_all(targets, req, chat)
            if req.model == self.alias:
                targets = self._fitting(targets, req, prompts)
            model = targets[0]
            sampling = model.sampling(req, len(prompts[model.name]))
        except ApiError as e:
            if e.status != 429:  # a shed request was valid: counted as shed_429 instead
                self.counters.rejected_400 += 1
            return _error(e)
        flight = Flight(new_id("chatcmpl" if chat else "cmpl"), req, chat, slo, prompts[model.name], sampling, model)
        flight.lam = self.lam if lam is None else lam
        flight.ttft_limit_s = limit_ms / 1e3 if limit_ms is not None else self._default_limit_s(slo)
        alias_prompts = {m.name: prompts[m.name] for m in targets} if req.model == self.alias else None
        try:
            await self.dispatcher.start(flight, alias_prompts)
        except ApiError as e:
            return _error(e)
        headers = {"x-disagg-route": flight.route_header(), "x-disagg-router": self.router_id}
        if req.stream:
            return StreamingResponse(self._sse(flight), media_type="text/event-stream", headers=headers)
        try:
            text, logprobs = await self.dispatcher.collect_with_logprobs(flight)
        except ApiError as e:
            return _error(e)
        ids = (flight.prompt_ids, flight.output_ids) if req.return_token_ids else None
        body = completion_body(flight.rid, flight.model.name, text, flight.finish_reason,
                               usage(len(flight.prompt_ids), flight.generated), chat,
                               logprobs=choice_logprobs(logprobs, chat), token_ids=ids)
        return JSONResponse(body, headers=headers)

    @staticmethod
    def _may_fit(targets: list[ServedModel], req) -> list[ServedModel]:
        """The targets whose context window the prompt may fit by its size alone (no tokenizing);
        400 when none may (the alias drops the others, a named model has no others)."""
        errors = {m.name: m.too_long(req) for m in targets}
        fit = [m for m in targets if errors[m.name] is None]
        if not fit:
            raise errors[targets[0].name]
        return fit

    async def _tokenize_all(self, targets: list[ServedModel], req, chat: bool) -> dict[str, list[int]]:
        """Each target's tokenized prompt; a long prompt in a worker thread, so the loop keeps serving
        (the tokenizers are only read there, never reconfigured)."""
        def run() -> dict[str, list[int]]:
            return {m.name: self._tokenize(m, req, chat) for m in targets}
        if req.prompt_chars > OFF_LOOP_TOKENIZE_CHARS:
            return await asyncio.to_thread(run)
        return run()

    async def _sse(self, f: Flight) -> AsyncIterator[bytes]:
        """The completion as server-sent events; a decode failing mid-stream ends it with an error event."""
        model = f.model.name
        first = True
        offset = 0  # completions' text_offset runs across chunks
        try:
            async for c in self.dispatcher.chunks(f):
                asked = f.sampling.get("logprobs") is not None
                lps = choice_logprobs(c.logprobs or (), f.chat, offset) if asked else None
                ids = (f.prompt_ids if first else None, c.token_ids) if f.req.return_token_ids else None
                yield stream_chunk(f.rid, model, c.text, c.finish_reason, f.chat, first=first, logprobs=lps,
                                   token_ids=ids)
                offset += sum(len(lp.token) for lp in c.logprobs or ())
                first = False
        except ApiError as e:
            yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
        if f.req.include_usage:
            yield stream_chunk(f.rid, model, "", None, f.chat, usage=usage(len(f.prompt_ids), f.generated))
        yield STREAM_DONE

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

    def _default_limit_s(self, slo: SloClass) -> float:
        """The SLO class's TTFT target: the strictest among the models' cost models."""
        return min(m.cost_model.target(slo).ttft_s for m in self.served.values())

    def _targets(self, name: str) -> list[ServedModel]:
        if name in self.served:
            return [self.served[name]]
        if name == self.alias:
            return list(self.served.values())
        served = sorted(self.served) + ([self.alias] if self.alias else [])
        raise ApiError(f"unknown model {name!r}; served: {', '.join(repr(s) for s in served)}", param="model")

    def _fitting(self, models: list[ServedModel], req, prompts: dict[str, list[int]]) -> list[ServedModel]:
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

    def _tokenize(self, model: ServedModel, req, chat: bool) -> list[int]:
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
        if len(ids) >= limit and req.model != self.alias:  # the alias drops the models it does not fit
            raise ApiError(f"the prompt has {len(ids)} tokens; the context window is {limit}", param=param)
        return list(ids)
