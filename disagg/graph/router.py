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
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from disagg.core.cost_model import CostModelError, load_profile
from disagg.core.ledger import Ledger, PolledState, admission_work
from disagg.core.policies import PolicyError, build_policy, known_policies
from disagg.core.predictor import BucketMeanPredictor
from disagg.core.types import Decision, NoCapacity, RequestFeatures, Role, SloClass
from disagg.graph.config import AppConfig
from disagg.graph.engine_server import resolve_model
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
    decision: Decision | None = None
    predicted: int | None = None
    decision_us: float | None = None
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


@serve.ingress(fastapi_app)
class Router:
    async def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, config: dict) -> None:
        from transformers import AutoTokenizer

        self.cfg = AppConfig.model_validate(config)
        rc = self.cfg.router
        self.cost_model = load_profile(rc.cost_model)
        self.policy = build_policy(rc.policy, self.cost_model, rc.policy_params)
        self.policy_params = dict(rc.policy_params)
        self.ledger = Ledger()
        self.predictor = BucketMeanPredictor()
        self.handles = {Role.PREFILL: prefill, Role.DECODE: decode}
        self.decode_stream = decode.options(stream=True)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.cfg.model.source))
        self.instances: dict[str, _Instance] = {}
        self.counters = _Counters()
        self.log = RequestLog(rc.request_log)
        self.expected = {Role.PREFILL: _min_width(self.cfg.prefill), Role.DECODE: _min_width(self.cfg.decode)}
        self._poll_task = asyncio.get_running_loop().create_task(self._poll_forever())

    # --- engine state --------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        interval = self.cfg.router.poll_interval_s
        while True:
            t0 = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # never let the poller die: routing would go stale silently
                logger.exception("engine state poll failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))

    async def poll_once(self) -> None:
        now = time.monotonic()
        results = await asyncio.gather(*(
            h.broadcast("state").results_async(timeout_s=2.0, return_exceptions=True)
            for h in self.handles.values()))
        for role, states in zip(self.handles, results):
            for s in states:
                if isinstance(s, BaseException) or not isinstance(s, dict):
                    continue
                iid = f"{role.value}-{s['replica']}"
                polled = PolledState(s["kv_used_tokens"], s["kv_capacity_tokens"], s["running"], s["waiting"])
                inst = self.instances.get(iid)
                if inst is None:
                    self.instances[iid] = _Instance(iid, role, s["replica"], polled, now, s)
                    logger.info("router: instance %s joined", iid)
                else:
                    inst.polled, inst.last_seen, inst.raw = polled, now, s
                self.ledger.polled(iid)
        for iid in [i for i, inst in self.instances.items() if now - inst.last_seen > STALE_AFTER_S]:
            lost = self.ledger.forget_instance(iid)
            del self.instances[iid]
            logger.warning("router: instance %s left (silent %.0f s); %d in-flight requests released",
                           iid, STALE_AFTER_S, len(lost))

    def _pool(self, role: Role) -> list[_Instance]:
        return [i for i in self.instances.values() if i.role is role]

    def _views(self, role: Role):
        return [self.ledger.view(i.instance_id, role, i.polled) for i in self._pool(role)]

    # --- HTTP ----------------------------------------------------------------------------------

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict:
        m = self.cfg.model
        return {"object": "list", "data": [{"id": m.served_name, "object": "model", "owned_by": "disagg",
                                            "root": m.source, "max_model_len": m.max_model_len}]}

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        counts = {r.value: len(self._pool(r)) for r in self.handles}
        ok = all(counts[r.value] >= self.expected[r] for r in self.handles)
        return JSONResponse({"status": "ok" if ok else "starting", "instances": counts,
                             "expected": {r.value: n for r, n in self.expected.items()}},
                            status_code=200 if ok else 503)

    @fastapi_app.get("/admin/state")
    async def admin_state(self) -> dict:
        return {
            "policy": self.policy.name, "policy_params": self.policy_params, "cost_model": self.cost_model.name,
            "instances": {i.instance_id: {"role": i.role.value, **i.raw,
                                          "backlog_s": self.ledger.backlog_s(i.instance_id),
                                          "queued": self.ledger.queued(i.instance_id)}
                          for i in self.instances.values()},
            "in_flight": len(self.ledger), "counters": asdict(self.counters),
        }

    @fastapi_app.post("/admin/policy")
    async def admin_policy(self, request: Request) -> Response:
        """Switch the routing policy without restarting engines: {"name": ..., "params": {...}}."""
        try:
            body = json.loads(await request.body())
            name, params = body["name"], body.get("params") or {}
            policy = build_policy(name, self.cost_model, params)
            if policy.simulator_only:
                raise PolicyError(f"policy {name!r} runs in the simulator only")
        except (json.JSONDecodeError, KeyError, TypeError):
            return _error(ApiError('body must be {"name": <policy>, "params": {...}}', param="name"))
        except PolicyError as e:
            return _error(ApiError(str(e), param="name"))
        self.policy, self.policy_params = policy, dict(params)
        return JSONResponse({"policy": name, "params": params, "known": known_policies(False)})

    @fastapi_app.post("/admin/cost_model")
    async def admin_cost_model(self, request: Request) -> Response:
        """Reload the cost model (a shipped profile name or a YAML path) without a restart."""
        try:
            source = json.loads(await request.body())["cost_model"]
            cm = load_profile(source)
            if cm.calibrated and cm.model and cm.model != self.cfg.model.source:
                raise CostModelError(f"{source} was calibrated for model {cm.model!r}; this app serves "
                                     f"{self.cfg.model.source!r}")
            policy = build_policy(self.policy.name, cm, self.policy_params)
        except (json.JSONDecodeError, KeyError, TypeError):
            return _error(ApiError('body must be {"cost_model": <profile name or path>}', param="cost_model"))
        except (CostModelError, PolicyError) as e:
            return _error(ApiError(str(e), param="cost_model"))
        self.cost_model, self.policy = cm, policy
        return JSONResponse({"cost_model": cm.name, "calibrated": cm.calibrated})

    @fastapi_app.post("/admin/reset_prefix_cache")
    async def admin_reset_prefix_cache(self) -> dict:
        out = {}
        for role, h in self.handles.items():
            out[role.value] = await h.broadcast("reset_prefix_cache").results_async(timeout_s=30.0)
        return out

    # --- one request ---------------------------------------------------------------------------

    async def _handle(self, request: Request, chat: bool) -> Response:
        self.counters.requests += 1
        try:
            req = parse_request(await request.body(), "chat" if chat else "completion")
            slo = self._slo(request)
            prompt_ids = self._tokenize(req, chat)
            sampling = self._sampling(req, len(prompt_ids))
        except ApiError as e:
            self.counters.rejected_400 += 1
            return _error(e)
        flight = _Flight(new_id("chatcmpl" if chat else "cmpl"), req, chat, slo, prompt_ids, sampling)
        try:
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
        body = completion_body(flight.rid, self.cfg.model.served_name, text, finish,
                               usage(len(prompt_ids), flight.generated), chat)
        return JSONResponse(body, headers=headers)

    def _slo(self, request: Request) -> SloClass:
        raw = request.headers.get("x-slo-class")
        if raw is None:
            return self.cfg.router.default_slo
        try:
            return SloClass.parse(raw)
        except ValueError as e:
            raise ApiError(str(e), param="X-SLO-Class") from None

    def _tokenize(self, req, chat: bool) -> list[int]:
        if req.model != self.cfg.model.served_name:
            raise ApiError(f"unknown model {req.model!r}; served: {self.cfg.model.served_name!r}", param="model")
        if chat:
            msgs = [m.model_dump() for m in req.messages]
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # recent transformers return a BatchEncoding (a mapping, not a list)
                ids = ids["input_ids"]
            param = "messages"
        elif isinstance(req.prompt, list):
            vocab = len(self.tokenizer)
            bad = next((t for t in req.prompt if t >= vocab), None)
            if bad is not None:
                raise ApiError(f"token id {bad} is outside the vocabulary (size {vocab})", param="prompt")
            ids, param = list(req.prompt), "prompt"
        else:
            ids, param = self.tokenizer.encode(req.prompt), "prompt"
        limit = self.cfg.model.max_model_len
        if not ids:
            raise ApiError("the prompt is empty after tokenization", param=param)
        if len(ids) >= limit:
            raise ApiError(f"the prompt has {len(ids)} tokens; the context window is {limit}", param=param)
        return list(ids)

    def _sampling(self, req, prompt_tokens: int) -> dict:
        limit = self.cfg.model.max_model_len
        room = limit - prompt_tokens
        if req.max_tokens is not None and req.max_tokens > room:
            raise ApiError(f"max_tokens {req.max_tokens} + {prompt_tokens} prompt tokens exceed the context "
                           f"window of {limit}", param="max_tokens")
        return req.sampling(default_max_tokens=room)

    async def _start(self, f: "_Flight") -> None:
        """Route, prefill, and get the first token (so errors still have a status code)."""
        t_arrival = time.monotonic()
        p = len(f.prompt_ids)
        max_tokens = f.sampling["max_tokens"]
        predicted = max_tokens if f.req.ignore_eos else min(max_tokens, self.predictor.predict(p, f.slo))
        feats = RequestFeatures(f.rid, p, predicted, f.slo)
        t0 = time.perf_counter()
        try:
            decision = self.policy.choose(feats, self._views(Role.PREFILL), self._views(Role.DECODE), t_arrival)
        except NoCapacity as e:
            raise ApiError(f"no capacity: {e}", status=503, kind="service_unavailable") from None
        f.decision_us = (time.perf_counter() - t0) * 1e6
        f.decision, f.predicted, f.t_arrival = decision, predicted, t_arrival
        pw, dw = admission_work(self.policy.cost_model, decision.prefill_id, decision.decode_id, p, predicted,
                                self.ledger.queued(decision.decode_id))
        self.ledger.admit(f.rid, decision.prefill_id, decision.decode_id, pw, dw, p)
        f.admitted = True
        kv = None if decision.colocated else await self._prefill(f)
        await self._first_token(f, kv)

    async def _prefill(self, f: "_Flight") -> dict | None:
        """KV location from the chosen prefill replica; other replicas on failure; None = prefill locally."""
        tried = []
        target = f.decision.prefill_id
        for attempt in range(self.cfg.router.prefill_retries + 1):
            inst = self.instances.get(target)
            if inst is None:
                break
            tried.append(target)
            call = {"request_id": f"{f.rid}-p{attempt}", "prompt_token_ids": f.prompt_ids, "sampling": f.sampling}
            try:
                out = await self.handles[Role.PREFILL].prefill.remote(call, replica=inst.replica)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a dead or failing prefill replica: try another, then go local
                logger.warning("router: prefill of %s on %s failed: %s", f.rid, target, _last_line(e))
                self.counters.prefill_retries += 1
                others = [i.instance_id for i in self._pool(Role.PREFILL) if i.instance_id not in tried]
                if not others:
                    break
                target = min(others, key=self.ledger.backlog_s)
                continue
            if out["replica"] != inst.replica:
                self.counters.misrouted += 1
            f.actual_prefill = f"prefill-{out['replica']}"
            f.prefill_engine_s = out["engine_ttft_s"]
            return out["kv_transfer_params"]
        self.counters.local_prefill_fallbacks += 1
        f.fallback = "local_prefill"
        f.actual_prefill = f.decision.decode_id
        return None

    async def _first_token(self, f: "_Flight", kv: dict | None) -> None:
        targets = [f.decision.decode_id] + [i.instance_id for i in self._pool(Role.DECODE)
                                            if i.instance_id != f.decision.decode_id]
        last_error: Exception | None = None
        for n, target in enumerate(targets[:2]):  # the chosen decode, then one other (local prefill)
            inst = self.instances.get(target)
            if inst is None:
                continue
            call = {"request_id": f"{f.rid}-d{n}", "prompt_token_ids": f.prompt_ids, "sampling": f.sampling,
                    "kv_transfer_params": kv if n == 0 else None}
            stream = self.decode_stream.decode.remote(call, replica=inst.replica)
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
                    self.predictor.observe(len(f.prompt_ids), f.slo, f.generated)
            self._finish(f, error=error)

    async def _collect(self, f: "_Flight") -> tuple[str, str | None]:
        parts = [c["x"] async for c in self._chunks(f)]
        return "".join(parts), f.finish_reason

    async def _sse(self, f: "_Flight") -> AsyncIterator[bytes]:
        model = self.cfg.model.served_name
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
        self.log.write(record)
