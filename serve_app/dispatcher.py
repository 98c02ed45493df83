"""The dispatcher: one validated request's life, from the routing decision to its last token.

`Dispatcher` places and admits each request (a `Flight`) and accounts for it; its decode streams
and their migration run in `streams.FlightStreams`, which it owns. Per request, after vLLM's
OpenAI layer in the router has validated and rendered it (`openai_surface`: its engine client's
`generate` calls `start`, then relays `outputs`):
1. predict the output length (`max_tokens` exactly when `ignore_eos`), take the instance views from
   the registry and call the model's P/D policy — the same object the simulator runs;
2. admit to the ledger; prefill on exactly the chosen prefill replica (`pinned_router`), retrying
   another prefill replica (`prefill_retries`) and finally prefilling on the decode replica;
3. have the streams start the decode with the prefill's `kv_transfer_params` and wait for its
   first token (`FlightStreams.first_token`, with its one retry) before the ingress answers, so a
   failure still gets a proper status code (a request the policy serves whole on a prefill
   instance, `Policy.may_host`, skips step 2);
4. relay the streams' outputs (`FlightStreams.samples`, migrated mid-stream where that can be done)
   as vLLM `RequestOutput`s to vLLM's OpenAI layer, which answers; at the end `ledger.finish`, the
   predictor learns the natural output length, and the request log gets one line with the
   decision and its per-term costs (`finish`).
A client that goes away cancels the in-flight prefill or decode call; Serve propagates the
cancellation into the engine replica, where vLLM aborts the request. A prefill's KV that no decode
will pull (the client left, or the decode failed over to a local prefill) is released at once
through the decode engine (`release_kv`), instead of pinning the prefill engine's blocks until
their lease runs out.
An engine that refuses the request itself (`messages.InvalidRequest`: vLLM's validation, e.g. a
schema it cannot compile) makes it a 400 naming the field, at once: no other instance is tried, and
no retry or failure is counted (another engine would refuse it too; the instance is healthy).

The alias route (several models, a request naming the alias, `auto` by default) comes before
step 1: every instance of every model is a candidate, each candidate's TTFT is estimated by
simulating its batching forward from the snapshot the router keeps of it
(`serve_app.instance_state`, which lists the approximations), and the configured model-level
router (`router.model_policy`, disagg.core.model_routing) picks one: by default `latency_aware`,
the instance maximising accuracy − λ·cost among those within the query's TTFT limit (the fastest
when none is). Candidates are the engines a query starts on: a colocated model's engines, and a
disaggregated model's prefill engines (its P/D policy then picks the decode engine; the estimate
leaves out the KV transfer and the decode engine's first step).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, AsyncIterator

from disagg.core.cost_model import SharedHost
from disagg.core.engine_model import RequestRate
from disagg.core.latency_routing import ModelInstance
from disagg.core.ledger import Ledger, admission_work
from disagg.core.model_routing import LatencyAware, ModelRouter
from disagg.core.planner import WindowCounter
from disagg.core.policies import Colocated
from disagg.core.policies.base import cached_prompt_tokens
from disagg.core.predictor import BucketMeanPredictor
from disagg.core.prefix_index import PrefixIndex, prompt_block_hashes
from disagg.core.ttft_estimator import TtftEstimateError, peer_shares
from disagg.core.types import PREFIX_BLOCK_TOKENS, InstanceView, NoCapacity, Role, SloClass
from disagg.core.utility import AccuracyTable, Choice
from serve_app.engine_calls import bad_request, decided_on, last_line, refusal
from serve_app.flight import Flight
from serve_app.instance_state import FlightFacts, instance_snapshot
from serve_app.messages import PrefillCall, PrefillReply
from serve_app.metrics import RouterMetrics
from serve_app.openai_api import ApiError
from serve_app.planning import count_served
from serve_app.registry import Instance, InstanceRegistry
from serve_app.request_log import Counters, RequestLog, request_record
from serve_app.streams import FlightStreams

logger = logging.getLogger("ray.serve")
ABANDONED_PREFILL_WAIT_S = 60.0  # how long a cancelled request's prefill is awaited to release its KV


def _detached(step) -> asyncio.Task:
    """A task outside the current request's context: Serve cancels every call made in a request's
    context when the request is cancelled, and these calls must outlive it."""
    return asyncio.get_running_loop().create_task(step, context=contextvars.Context())


@dataclass(frozen=True, slots=True)
class AliasChoice:
    """The alias route's pick (`Dispatcher.choose_model`)."""

    choice: Choice
    predicted: int  # output tokens predicted for the request
    decision_us: float


@functools.lru_cache(maxsize=8)
def _one_host(hosts: tuple[SharedHost, ...]) -> SharedHost | None:
    """The host the alias's models share, from each model's measurement of it (`SharedHost.pooled`);
    None when every engine owns its device."""
    return SharedHost.pooled(list(hosts)) if hosts else None


def _no_capacity(e: NoCapacity) -> ApiError:
    return ApiError(f"no capacity: {e}", status=503, kind="service_unavailable")


class Dispatcher:
    """Places, admits and prefills each request, and finishes it; keeps the requests in flight
    (`flights`). Its decode and outputs run through `streams`."""

    def __init__(self, registry: InstanceRegistry, ledger: Ledger, counters: Counters, log: RequestLog,
                 accuracy: AccuracyTable, prefill_retries: int, multi_model: bool, router_id: str = "",
                 migration_limit: int = 1, metrics: RouterMetrics | None = None,
                 model_router: ModelRouter | None = None) -> None:
        self.registry = registry
        self.router_id = router_id  # this router replica: engines keep their ledger of our calls under it
        self.ledger = ledger
        self.counters = counters
        self.log = log
        self.accuracy = accuracy
        # the alias route's model-level router (`router.model_policy`); one model: never asked
        self.model_router = model_router or LatencyAware(0.0, accuracy)
        self.prefill_retries = prefill_retries
        self.metrics = metrics  # the Prometheus series each finished request feeds (None: not exported)
        self.window = WindowCounter()  # what the planner sees of this replica's traffic (serve_app.planning)
        self.requests = RequestRate()  # requests this replica admits: the serving path's per-request CPU
        self.multi_model = multi_model
        self.alias_predictor = BucketMeanPredictor()  # output lengths of alias requests, across models
        self.flights: dict[str, Flight] = {}  # admitted and not finished, in admission order
        self._prefill_locally: dict[str, Colocated] = {}  # per model: its placement while no prefill instance is up
        self._background: set[asyncio.Task] = set()  # KV releases under way (held: tasks are weakly referenced)
        self.streams = FlightStreams(registry, ledger, counters, router_id, migration_limit)  # decode and relay

    async def start(self, f: Flight) -> None:
        """Route, prefill, and get the first output (so errors still have a status code).

        Raises ApiError (or CancelledError) after finishing the request."""
        self.requests.arrive(time.monotonic())
        try:
            self.streams.prepare(f)
            await self._route_and_admit(f)
            kv = None if f.decision.colocated else await self._prefill(f)
            f.prefilled = True
            try:
                await self.streams.first_token(f, kv)
            except BaseException:
                if kv is not None:  # its KV waits on the prefill engine for a pull that will not come
                    self._release_kv(f, kv)
                raise
            if kv is not None and f.fallback == "decode_retry_local_prefill":  # ... nor will it here
                self._release_kv(f, kv)
        except ApiError as e:
            if e.status < 500:
                self.counters.rejected_400 += 1  # the request's fault: no instance failed
            else:
                self.counters.failed += 1
            self.finish(f, error=e.message)
            raise
        except asyncio.CancelledError:
            self.counters.cancelled += 1
            self.finish(f, error="cancelled by client")
            raise

    def abandon(self, f: Flight) -> None:
        """End `f` before its outputs are read (another prompt of its request failed, or the client
        left): stop its start, or its decode, and finish it."""
        if f.started is not None and not f.started.done():
            f.started.cancel()  # `start` finishes it
            return
        if f.stream is not None:
            f.stream.cancel()
        self.finish(f, error="abandoned: the request ended before this prompt's answer was read")

    def _release_kv(self, f: Flight, kv: dict) -> None:
        """Have the chosen decode engine tell the prefill engine to free `f`'s KV now (not at the
        end of its lease): the request went away, or failed, before its decode pulled it. In the
        background: the request's own task is being cancelled. A decode that had started pulling
        has freed it already; the second notice is ignored. Any decode engine can send the notice:
        the one serving the request, else the one chosen for it, else any other."""
        m = f.model
        pool = [i.instance_id for i in self.registry.pool(m, m.decode_role)]
        live = [inst for i in (f.actual_decode, f.decision.decode_id, *pool) if (inst := self.registry.get(i))]
        if not live:
            return
        inst = live[0]
        handle = f.model.handles[f.model.decode_role]

        async def release() -> None:
            await handle.release_kv.remote(f"{f.rid}-release", kv, replica=inst.replica)
        self._in_background(release())

    def _in_background(self, step) -> None:
        """Run `step` beyond the request's own task (which is being cancelled or has ended)."""
        task = _detached(step)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("router: releasing an abandoned prefill's KV failed: %s", last_line(task.exception()))

    # --- the routing decision ------------------------------------------------------------------

    def _snapshot_facts(self, inst: Instance) -> list[FlightFacts]:
        facts = []
        prefill_side = inst.role is Role.PREFILL
        for f in self.flights.values():
            d = f.decision
            on = d.prefill_id == inst.instance_id if prefill_side else d.decode_id == inst.instance_id
            if not on:
                continue
            hosted = prefill_side and d.decode_id == inst.instance_id  # it decodes here too
            started = f.prefilled if prefill_side and not hosted else f.t_first is not None
            facts.append(FlightFacts(len(f.prompt_ids), f.predicted or 1, started, f.generated, hosted))
        return facts

    def choose_model(self, prompts: dict[str, list[int]], max_tokens: int | None, ignore_eos: bool, slo: SloClass,
                     ttft_limit_s: float, lam: float) -> AliasChoice:
        """Route the alias: the configured model-level router picks the instance (and so the model), at
        the request's λ; the answer is explained as a `Choice`. `prompts`: each candidate model's
        rendered prompt."""
        models = [self.registry.models[name] for name in prompts]
        p = max(len(ids) for ids in prompts.values())  # tokenizers may differ: price the longest
        room = min(m.cfg.model.max_model_len - len(prompts[m.name]) for m in models)
        max_tokens = max_tokens or room
        predicted = max_tokens if ignore_eos else min(max_tokens, self.alias_predictor.predict(p, slo))
        candidates = []
        for m in models:
            for inst in self.registry.pool(m, m.start_role):
                c = self.registry.constants(m, inst)
                snap = instance_snapshot(self._snapshot_facts(inst), c, prefill_only=inst.role is Role.PREFILL)
                candidates.append((ModelInstance(inst.instance_id, m.name, c, m.prices), snap))
        now = time.monotonic()
        host = _one_host(tuple(m.cost_model.shared_host for m in models if m.cost_model.shared_host is not None))
        if host is not None:  # engines on one host: each estimate runs at the stretch the others' load gives
            shares = peer_shares(host, [(inst.constants, snap) for inst, snap in candidates], self.requests, now)
            candidates = [(dataclasses.replace(inst, host=share), snap)
                          for (inst, snap), share in zip(candidates, shares)]
        router = self.model_router if lam == self.model_router.lam else self.model_router.with_lambda(lam)
        t0 = time.perf_counter()
        try:
            routed = router.choose(candidates, p, predicted, ttft_limit_s, now)
            choice = router.explain(routed, candidates, p, predicted, ttft_limit_s, now)
        except NoCapacity as e:
            raise _no_capacity(e) from None
        except (ValueError, TtftEstimateError) as e:  # a bug or an impossible snapshot: say so, do not guess
            logger.exception("router: model-level routing (%s) failed", router.name)
            raise ApiError(f"{router.name} routing failed: {e}", status=500, kind="internal_error") from None
        return AliasChoice(choice, predicted, (time.perf_counter() - t0) * 1e6)

    async def _route_and_admit(self, f: Flight) -> None:
        """The model's P/D policy picks the prefill and decode instances; the ledger admits the request."""
        t_arrival = time.monotonic()
        m = f.model
        p = len(f.prompt_ids)
        max_tokens = f.params.max_tokens
        if f.choice is None:
            f.predicted = max_tokens if f.params.ignore_eos else min(max_tokens, m.predictor.predict(p, f.slo))
        index = m.prefix_index
        output_tokens = f.predicted * f.n  # n samples: n times the decode work
        if index is not None:
            f.prefix_hashes = prompt_block_hashes(f.prompt_ids, index.block_tokens)
        feats = f.features(output_tokens, index.block_tokens if index is not None else PREFIX_BLOCK_TOKENS)
        t0, cpu0, f.decided_at = time.perf_counter(), time.thread_time(), time.time()
        decode_views = self.registry.views(m, m.decode_role)
        if f.choice is not None and m.start_role is Role.PREFILL:  # the alias chose the prefill engine
            prefill_views = [v for v in self.registry.views(m, Role.PREFILL) if v.instance_id == f.choice.instance_id]
        elif f.choice is not None:  # ... or the colocated engine
            decode_views = [v for v in decode_views if v.instance_id == f.choice.instance_id]
            prefill_views = []
        else:
            prefill_views = self.registry.views(m, Role.PREFILL) if not m.cfg.is_colocated else []
        policy = m.policy
        if not m.cfg.is_colocated and f.choice is None and not prefill_views:
            # no prefill instance is up (all failed, or being replaced): the decode instances prefill
            # for themselves until one is back, rather than every request getting a 503
            policy = self._prefill_locally.setdefault(m.name, Colocated(m.cost_model))
            self.counters.local_prefill_fallbacks += 1
            f.fallback = "no_prefill_instance"
        try:
            decision = policy.choose(feats, prefill_views, decode_views, t_arrival)
        except NoCapacity as e:
            raise _no_capacity(e) from None
        f.decision_us = (time.perf_counter() - t0) * 1e6
        f.decision_cpu_us = (time.thread_time() - cpu0) * 1e6
        f.decision, f.t_arrival = decision, t_arrival
        f.state_seen = self.registry.versions(decision.prefill_id, decision.decode_id)
        # what the prefill instance holds of the prompt, as the policy saw it (before the index notes
        # that the chosen instances now hold the whole prompt)
        cached = next((cached_prompt_tokens(v, feats) for v in (*prefill_views, *decode_views)
                       if v.instance_id == decision.prefill_id), 0) if feats.prefix_hashes else 0
        if index is not None:
            self._note_prefix(f, index, prefill_views + decode_views)
        pw, dw = admission_work(m.cost_model, decision.prefill_id, decision.decode_id, p, output_tokens,
                                self.ledger.queued(decision.decode_id), cached)
        self.ledger.admit(f.rid, decision.prefill_id, decision.decode_id, pw, dw, p)
        self.window.admitted(p, f.slo)
        if decision.prefill_id == decision.decode_id and any(v.instance_id == decision.prefill_id
                                                             for v in prefill_views):
            self.window.placed_hosted()  # served whole by a prefill instance: not the decode pool's load
        f.work_s = (pw, dw)
        self.flights[f.rid] = f
        f.admitted = True

    def _note_prefix(self, f: Flight, index: PrefixIndex, views: list[InstanceView]) -> None:
        """Log what the index believed the chosen instances held, then record that they now hold
        the prompt (the prefill computes it, the decode receives it)."""
        d = f.decision
        chosen = {v.instance_id: v for v in views}
        block, reusable = index.block_tokens, (len(f.prompt_ids) - 1) // index.block_tokens
        f.cached_predicted = {}
        for side, iid in (("prefill", d.prefill_id), ("decode", d.decode_id)):
            if (v := chosen.get(iid)) is not None:
                f.cached_predicted[side] = min(v.cached_prefix_blocks(f.prefix_hashes), reusable) * block
        for iid in {d.prefill_id, d.decode_id}:
            if (inst := self.registry.get(iid)) is not None:
                index.record(iid, f.prefix_hashes, inst.polled.kv_capacity_tokens, f.t_arrival)

    def _note_output(self, f: Flight) -> None:
        """The decode that served `f` caches its prompt and output (all but the last token's KV,
        never computed): the next turn of the conversation starts with them."""
        index = f.model.prefix_index if f.model else None
        inst = self.registry.get(f.actual_decode) if f.actual_decode else None
        if index is None or inst is None or not f.output_ids:
            return
        sequence = f.prompt_ids + f.output_ids[:-1]
        index.record(inst.instance_id, prompt_block_hashes(sequence, index.block_tokens, f.prefix_hashes),
                     inst.polled.kv_capacity_tokens, time.monotonic())

    # --- the prefill ---------------------------------------------------------------------------

    async def _prefill(self, f: Flight) -> dict | None:
        """KV location from the chosen prefill replica; other replicas on failure; None = prefill locally."""
        tried = []
        m = f.model
        target = f.decision.prefill_id
        for attempt in range(self.prefill_retries + 1):
            inst = self.registry.get(target)
            if inst is None:
                break
            tried.append(target)
            call = PrefillCall(f"{f.rid}-p{attempt}", f.prompt_ids, f.params, self.router_id, f.work_s[0],
                               *decided_on(f, target))
            try:
                reply: PrefillReply = await self._prefill_call(f, inst, call)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a dead or failing prefill replica: try another, then go local
                if (refused := refusal(e)) is not None:
                    raise bad_request(refused, f) from None
                logger.warning("router: prefill of %s on %s failed: %s", f.rid, target, last_line(e))
                self.counters.prefill_retries += 1
                others = [i.instance_id for i in self.registry.pool(m, Role.PREFILL) if i.instance_id not in tried]
                if not others:
                    break
                target = min(others, key=self.ledger.backlog_s)
                continue
            if reply.replica != inst.replica:
                self.counters.misrouted += 1
            f.actual_prefill = f"{m.id_prefix}prefill-{reply.replica}"
            f.prefill_engine_s = reply.engine_ttft_s
            f.prefill_cached_tokens = reply.cached_tokens
            f.prompt_logprobs = reply.prompt_logprobs
            return reply.kv_transfer_params
        self.counters.local_prefill_fallbacks += 1
        f.fallback = "local_prefill"
        f.actual_prefill = f.decision.decode_id
        return None

    async def _prefill_call(self, f: Flight, inst: Instance, call: PrefillCall) -> PrefillReply:
        """The prefill call on `inst`, which a cancelled request does not simply drop: the engine
        may have finished the prefill as the cancellation arrived, and then holds the prompt's KV
        for a pull that will never come. So the call is shielded; on cancellation the engine is told
        to abort it, and if the prefill had finished all the same, its KV is released (`_release_kv`)."""
        pool = f.model.handles[Role.PREFILL]

        async def run() -> PrefillReply:
            return await pool.prefill.remote(call, replica=inst.replica)
        task = _detached(run())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._in_background(self._abandon_prefill(f, inst, call, task))
            raise

    async def _abandon_prefill(self, f: Flight, inst: Instance, call: PrefillCall, task: asyncio.Task) -> None:
        await f.model.handles[Role.PREFILL].abort.remote(call.request_id, replica=inst.replica)
        try:
            reply = await asyncio.wait_for(task, ABANDONED_PREFILL_WAIT_S)
        except Exception:  # aborted before its end (nothing is held), or the replica failed
            return
        self._release_kv(f, reply.kv_transfer_params)

    # --- relaying the tokens, and the end ------------------------------------------------------

    async def outputs(self, f: Flight) -> AsyncIterator[Any]:
        """vLLM `RequestOutput`s of `f` for vLLM's OpenAI layer, once `start` has got the first
        output: deltas, or (`final_only`) one output with every sample whole. Finishes the request
        when they end; a decode that fails mid-stream is migrated (`streams`), and if it cannot
        be, ApiError (502)."""
        from vllm.outputs import RequestOutput

        await f.started
        error, first = None, True
        done = [False] * f.n
        whole = None  # final_only: every sample's output so far, joined by vLLM's own `RequestOutput.add`
        try:
            async for index, delta in self.streams.samples(f):
                done[index] = delta.finish_reason is not None
                out = RequestOutput(f.rid, f.prompt_text, f.prompt_ids, f.prompt_logprobs if first else None,
                                    [delta], all(done), num_cached_tokens=f.num_cached_tokens)
                first = False
                if not f.final_only:
                    yield out
                elif whole is None:
                    whole = out
                else:
                    whole.add(out, aggregate=True)
            if whole is not None:
                whole.outputs.sort(key=lambda o: o.index)
                yield whole
        except (asyncio.CancelledError, GeneratorExit):
            error = "cancelled by client"
            self.counters.cancelled += 1
            if f.stream is not None:
                f.stream.cancel()
            raise
        except ApiError as e:
            error = e.message
            self.counters.failed += 1
            raise
        except Exception as e:
            error = f"decode failed after {f.generated_total} tokens: {last_line(e)}"
            self.counters.failed += 1
            raise ApiError(error, status=502, kind="upstream_error") from None
        finally:
            if error is None:
                self.counters.served += 1
                if f.finish_reason == "stop":  # a natural length: what the predictors learn from
                    f.model.predictor.observe(len(f.prompt_ids), f.slo, f.generated)
                    if f.choice is not None:
                        self.alias_predictor.observe(len(f.prompt_ids), f.slo, f.generated)
            self.finish(f, error=error)

    def finish(self, f: Flight, error: str | None) -> None:
        """Release the request from the ledger and log it (idempotent); `error` None when served."""
        if f.finished:
            return
        f.finished = True
        if f.admitted:
            self.ledger.finish(f.rid)
        if error is None:
            self._note_output(f)
        self.flights.pop(f.rid, None)
        target = f.target() if f.model is not None else None  # what it was priced and is counted against
        record = request_record(f, error, time.monotonic(), self.multi_model, self.router_id, target)
        self.log.write(record)
        if target is not None:
            if error is None:
                count_served(self.window, record, target, f.model.cost_model.engine)
            if self.metrics is not None:
                self.metrics.request_finished(record, f.model.name, target.ttft_s, target.tpot_s)
