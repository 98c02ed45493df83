"""The dispatcher: one validated request's life, from the routing decision to its last token.

Per request (a `Flight`), after vLLM's OpenAI layer in the router has validated and rendered it
(`openai_surface`: its engine client's `generate` calls `start`, then relays `outputs`):
1. predict the output length (`max_tokens` exactly when `ignore_eos`), take the instance views from
   the registry and call the model's P/D policy — the same object the simulator runs;
2. admit to the ledger; prefill on exactly the chosen prefill replica (`pinned_router`), retrying
   another prefill replica (`prefill_retries`) and finally prefilling on the decode replica;
3. start the decode on exactly the chosen decode replica with the prefill's `kv_transfer_params`
   (a request the policy serves whole on a prefill instance, `Policy.may_host`, skips step 2 and
   streams from that prefill replica, which prefills it locally)
   and wait for its first token before the ingress answers, so a failure still gets a proper
   status code; a decode that fails before its first token is retried once on another decode
   replica, which prefills locally;
4. stream the outputs, vLLM's own (`OutputDelta`), back to vLLM's OpenAI layer, which answers;
   `n > 1`: sample 0 pulls the KV, and once its first token is out the other samples start on
   the same decode instance, where its prefix cache holds the prompt (one prefill and one transfer
   serve every sample); on the first token the KV has left the prefill instance
   (`ledger.prefill_done`); at the end `ledger.finish`, the predictor learns the natural output
   length, and the request log gets one line with the decision and its per-term costs;
5. a decode that fails mid-stream is migrated (`migration_limit` times at most): another decode
   instance prefills the prompt plus the tokens generated so far and streams the rest, so the
   client gets the whole answer in one stream, every token once; from then on the router makes
   the text and applies the stop strings (`router_text`). Not migrated (the answer ends with an
   error event): structured output and tool calls forced through it (a grammar cannot resume
   mid-answer), and `n > 1` (the samples share one decode instance's cache).
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
from dataclasses import dataclass
from typing import Any, AsyncIterator

from disagg.core.ledger import Ledger, admission_work
from disagg.core.latency_routing import ModelInstance
from disagg.core.model_routing import LatencyAware, ModelRouter
from disagg.core.policies import Colocated
from disagg.core.planner import WindowCounter
from disagg.core.predictor import BucketMeanPredictor
from disagg.core.prefix_index import PrefixIndex, prompt_block_hashes
from disagg.core.ttft_estimator import TtftEstimateError
from disagg.core.types import InstanceView, NoCapacity, RequestFeatures, Role, SloClass
from disagg.core.utility import AccuracyTable, Choice
from serve_app.flight import Flight
from serve_app.instance_state import FlightFacts, instance_snapshot
from serve_app.metrics import RouterMetrics
from serve_app.router_text import RouterText, ends_inside_character
from serve_app.messages import GenerateCall, InvalidRequest, OutputDelta, PrefillCall, PrefillReply
from serve_app.openai_api import ApiError
from serve_app.sampling import continuation_params, replaced, sample_params
from serve_app.planning import count_served
from serve_app.registry import Instance, InstanceRegistry
from serve_app.request_log import Counters, RequestLog, request_record
from serve_app.served_model import ServedModel

logger = logging.getLogger("ray.serve")
ABANDONED_PREFILL_WAIT_S = 60.0  # how long a cancelled request's prefill is awaited to release its KV


def _last_line(e: BaseException | None) -> str:
    """A remote error's own message, without the Ray traceback around it."""
    lines = str(e).strip().splitlines()
    return lines[-1][:500] if lines else type(e).__name__


def _refused(e: BaseException) -> InvalidRequest | None:
    """The engine's `InvalidRequest` behind `e`, if that is what `e` is: Ray delivers it as a
    `RayTaskError` that is also an `InvalidRequest`, with the original as `.cause`."""
    for x in (getattr(e, "cause", None), e):
        if isinstance(x, InvalidRequest):
            return x
    return None


# the request fields behind an engine-side sampling parameter, by preference
_FIELDS_OF = {"structured_outputs": ("structured_outputs", "response_format", "tool_choice"),
              "logprobs": ("top_logprobs", "logprobs")}


def _bad_request(refused: InvalidRequest, f: Flight) -> ApiError:
    """An engine's refusal as a 400 naming the field the client set."""
    param = refused.param
    if param in _FIELDS_OF:
        param = next((name for name in _FIELDS_OF[param] if name in f.fields), param)
    return ApiError(f"{param}: {refused.message}" if param else refused.message, param=param, kind="BadRequestError")


def _decided_on(f: Flight, instance_id: str) -> tuple[int, float]:
    """(the version of the instance's state the flight was routed on, when): 0 for an instance its
    decision did not pick (a retry elsewhere), whose state age is then not measured."""
    return f.state_seen.get(instance_id, 0), f.decided_at


def _detached(step) -> asyncio.Task:
    """A task outside the current request's context: Serve cancels every call made in a request's
    context when the request is cancelled, and these calls must outlive it."""
    return asyncio.get_running_loop().create_task(step, context=contextvars.Context())


def _decoder(model: ServedModel):
    """The served model's detokenizer, as vLLM's output text uses it."""
    tokenizer = model.tokenizer
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _router_text(f: Flight) -> RouterText:
    """The router's text for `f` from here on (the output tokens and text sent so far are kept)."""
    p = f.params
    return RouterText(_decoder(f.model), f.prompt_ids, f.output_ids, "".join(f.text_sent), p.stop,
                      p.min_tokens, include_stop=p.include_stop_str_in_output)


def _retext(text: RouterText, out: Any) -> bool:
    """An engine's CompletionOutput delta with the router's text, in place; True when a stop string
    ended the answer in it (its tokens after that one are dropped, as vLLM drops them)."""
    # the engine has no stop strings here: its "stop" is a stop token's (EOS, `stop_token_ids`)
    new, kept = text.feed(out.token_ids, finished=out.finish_reason is not None,
                          token_stopped=out.finish_reason == "stop")
    out.text = new
    if kept is None:
        return False
    out.token_ids = list(out.token_ids)[:kept]
    if out.logprobs is not None:
        out.logprobs = out.logprobs[:kept]
    out.finish_reason, out.stop_reason = "stop", text.stopped_by
    return True


@dataclass(frozen=True, slots=True)
class AliasChoice:
    """The alias route's pick (`Dispatcher.choose_model`)."""

    choice: Choice
    predicted: int  # output tokens predicted for the request
    decision_us: float


def _no_capacity(e: NoCapacity) -> ApiError:
    return ApiError(f"no capacity: {e}", status=503, kind="service_unavailable")


class Dispatcher:
    """Runs each request through the engines; keeps the requests in flight (`flights`)."""

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
        self.migration_limit = migration_limit
        self.metrics = metrics  # the Prometheus series each finished request feeds (None: not exported)
        self.window = WindowCounter()  # what the planner sees of this replica's traffic (serve_app.planning)
        self.multi_model = multi_model
        self.alias_predictor = BucketMeanPredictor()  # output lengths of alias requests, across models
        self.flights: dict[str, Flight] = {}  # admitted and not finished, in admission order
        self._prefill_locally: dict[str, Colocated] = {}  # per model: its placement while no prefill instance is up
        self._background: set[asyncio.Task] = set()  # KV releases under way (held: tasks are weakly referenced)

    async def start(self, f: Flight) -> None:
        """Route, prefill, and get the first output (so errors still have a status code).

        Raises ApiError (or CancelledError) after finishing the request."""
        try:
            if f.prompt_text is None and ends_inside_character(_decoder(f.model), f.prompt_ids):
                f.router_text = _router_text(f)  # vLLM's text would start with the prompt's again
            await self._route_and_admit(f)
            kv = None if f.decision.colocated else await self._prefill(f)
            f.prefilled = True
            try:
                await self._first_token(f, kv)
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
            logger.warning("router: releasing an abandoned prefill's KV failed: %s", _last_line(task.exception()))

    # --- the routing decision ------------------------------------------------------------------

    def _snapshot_facts(self, inst: Instance) -> list[FlightFacts]:
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
        router = self.model_router if lam == self.model_router.lam else self.model_router.with_lambda(lam)
        now = time.monotonic()
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
            feats = RequestFeatures(f.rid, p, output_tokens, f.slo, prefix_hashes=f.prefix_hashes,
                                    prefix_block_tokens=index.block_tokens)
        else:
            feats = RequestFeatures(f.rid, p, output_tokens, f.slo)
        t0, f.decided_at = time.perf_counter(), time.time()
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
        f.decision, f.t_arrival = decision, t_arrival
        f.state_seen = self.registry.versions(decision.prefill_id, decision.decode_id)
        if index is not None:
            self._note_prefix(f, index, prefill_views + decode_views)
        pw, dw = admission_work(m.cost_model, decision.prefill_id, decision.decode_id, p, output_tokens,
                                self.ledger.queued(decision.decode_id))
        self.ledger.admit(f.rid, decision.prefill_id, decision.decode_id, pw, dw, p)
        self.window.admitted(p, f.slo)
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
                index.record(iid, f.prefix_hashes, inst.polled.kv_capacity_tokens)

    def _note_output(self, f: Flight) -> None:
        """The decode that served `f` caches its prompt and output (all but the last token's KV,
        never computed): the next turn of the conversation starts with them."""
        index = f.model.prefix_index if f.model else None
        inst = self.registry.get(f.actual_decode) if f.actual_decode else None
        if index is None or inst is None or not f.output_ids:
            return
        sequence = f.prompt_ids + f.output_ids[:-1]
        index.record(inst.instance_id, prompt_block_hashes(sequence, index.block_tokens, f.prefix_hashes),
                     inst.polled.kv_capacity_tokens)

    # --- prefill, then the decode's first token ------------------------------------------------

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
                               *_decided_on(f, target))
            try:
                reply: PrefillReply = await self._prefill_call(f, inst, call)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a dead or failing prefill replica: try another, then go local
                if (refused := _refused(e)) is not None:
                    raise _bad_request(refused, f) from None
                logger.warning("router: prefill of %s on %s failed: %s", f.rid, target, _last_line(e))
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

    async def _open(self, f: Flight, inst: Instance, call: GenerateCall) -> tuple[Any, OutputDelta]:
        """Start `call` on `inst`; its response stream and first delta. An engine's refusal is a 400;
        any other failure propagates (the stream cancelled)."""
        # a context of its own: Serve keys a call's routing by its request context's id, and calls
        # routed at once under one id (the samples of n > 1, the prompts of a list) lose each other
        stream = contextvars.Context().run(f.model.streams[inst.role].generate.remote, call, replica=inst.replica)
        try:
            first: OutputDelta = await stream.__anext__()
        except StopAsyncIteration:
            raise RuntimeError("decode ended without output") from None
        except BaseException as e:  # cancellation included: the engine aborts the request
            stream.cancel()
            if isinstance(e, Exception) and (refused := _refused(e)) is not None:
                raise _bad_request(refused, f) from None
            raise
        if first.replica is not None and first.replica != inst.replica:
            self.counters.misrouted += 1
        return stream, first

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

    async def _first_token(self, f: Flight, kv: dict | None) -> None:
        m = f.model
        targets = [f.decision.decode_id] + [i.instance_id for i in self.registry.pool(m, m.decode_role)
                                            if i.instance_id != f.decision.decode_id]
        last_error: Exception | None = None
        for n, target in enumerate(targets[:2]):  # the chosen decode, then one other (local prefill)
            inst = self.registry.get(target)
            if inst is None:
                continue
            # a prefill engine serving the request whole counts only its prefill as the call's work,
            # as the ledger's prefill view does: the decode runs beside its prefills, not ahead of them
            work_s = f.work_s[0] if inst.role is Role.PREFILL else f.work_s[1]
            call = GenerateCall(f"{f.rid}-d{n}", f.prompt_ids, self._sample_params(f, 0), kv if n == 0 else None,
                                self.router_id, work_s, *_decided_on(f, target))
            try:
                f.stream, f.first_delta = await self._open(f, inst, call)
            except (asyncio.CancelledError, ApiError):
                raise
            except Exception as e:
                logger.warning("router: decode of %s on %s failed before its first token: %s", f.rid, target,
                               _last_line(e))
                last_error = e
                self.counters.decode_retries += 1
                if n == 0 and kv is not None:
                    f.fallback = "decode_retry_local_prefill"
                continue
            f.actual_decode = target
            if n > 0 or f.actual_prefill is None:  # prefilled locally on this decode instance
                f.actual_prefill = target
            f.t_first = time.monotonic()
            f.decode_engine_first_s = f.first_delta.engine_first_token_s
            f.num_cached_tokens = f.first_delta.num_cached_tokens
            if f.prompt_logprobs is None:  # computed by a local prefill
                f.prompt_logprobs = f.first_delta.prompt_logprobs
            self.ledger.prefill_done(f.rid)
            return
        raise ApiError(f"no decode instance could serve the request: {_last_line(last_error)}", status=503,
                       kind="service_unavailable")

    def _sample_params(self, f: Flight, index: int):
        """Sample `index`'s parameters; without stop strings where the router applies them."""
        params = sample_params(f.params, index)
        return replaced(params, stop=None) if f.router_text is not None and params.stop else params

    async def _migrate(self, f: Flight, error: Exception) -> OutputDelta | None:
        """Continue `f` after its decode instance failed mid-stream with `error`: another decode
        instance prefills the prompt plus the tokens so far and streams the rest. Returns the new
        stream's first chunk (None: nothing was left to generate); ApiError (502) when the request
        may not migrate (`migration_limit` reached, structured output) or no instance could take it."""
        m = f.model
        reason = _last_line(error)
        logger.warning("router: decode of %s on %s failed after %d tokens: %s", f.rid, f.actual_decode,
                       f.generated, reason)
        left = f.params.max_tokens - f.generated
        if left <= 0 and f.n == 1:  # the engine failed after the last token, before saying so
            f.finish_reason = "length"
            return None
        resumable = f.params.structured_outputs is None and f.n == 1
        if f.params.structured_outputs is not None:
            reason += " (a structured-output request is not migrated)"
        elif f.n > 1:
            reason += " (a request of n > 1 samples is not migrated)"
        while len(f.migrated_from) < self.migration_limit and resumable:
            f.migrated_from.append(f.actual_decode)
            f.migrated_after.append(f.generated)
            others = [i for i in self.registry.pool(m, m.decode_role) if i.instance_id not in f.migrated_from]
            if not others:
                reason += " (no other decode instance)"
                break
            inst = min(others, key=lambda i: self.ledger.backlog_s(i.instance_id))
            self.counters.migrations += 1
            prompt = f.prompt_ids + f.output_ids
            predicted = max(1, min(left, (f.predicted or left) - f.generated))
            pw, dw = admission_work(m.cost_model, inst.instance_id, inst.instance_id, len(prompt), predicted,
                                    self.ledger.queued(inst.instance_id))
            self.ledger.finish(f.rid)  # its work moves to the new instance
            self.ledger.admit(f.rid, inst.instance_id, inst.instance_id, pw, dw, len(prompt))
            f.work_s = (pw, dw)
            f.state_seen, f.decided_at = self.registry.versions(inst.instance_id), time.time()
            call = GenerateCall(f"{f.rid}-m{len(f.migrated_from)}", prompt,
                                continuation_params(f.params, f.generated), None, self.router_id, dw,
                                *_decided_on(f, inst.instance_id))
            try:
                f.stream, first = await self._open(f, inst, call)
            except (asyncio.CancelledError, ApiError):
                raise
            except Exception as e:
                logger.warning("router: migration of %s to %s failed: %s", f.rid, inst.instance_id, _last_line(e))
                f.actual_decode, reason = inst.instance_id, _last_line(e)
                continue
            logger.info("router: %s migrated from %s to %s after %d tokens", f.rid, f.migrated_from[-1],
                        inst.instance_id, f.generated)
            f.actual_decode = inst.instance_id
            if f.router_text is None:  # else it goes on making the text, as after an earlier migration
                f.router_text = _router_text(f)
            self.ledger.prefill_done(f.rid)
            return first
        raise ApiError(f"decode failed after {f.generated} tokens: {reason}", status=502, kind="upstream_error")

    # --- relaying the tokens, and the end ------------------------------------------------------

    async def outputs(self, f: Flight) -> AsyncIterator[Any]:
        """vLLM `RequestOutput`s of `f` for vLLM's OpenAI layer, once `start` has got the first
        output: deltas, or (`final_only`) one output with every sample whole. Finishes the request
        when they end; a decode that fails mid-stream is migrated (`_migrate`), and if it cannot
        be, ApiError (502)."""
        from vllm.outputs import RequestOutput

        await f.started
        error, first = None, True
        done = [False] * f.n
        whole = None  # final_only: every sample's output so far, joined by vLLM's own `RequestOutput.add`
        try:
            async for index, delta in self._samples(f):
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
            error = f"decode failed after {f.generated_total} tokens: {_last_line(e)}"
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

    async def _samples(self, f: Flight) -> AsyncIterator[tuple[int, Any]]:
        """(sample index, vLLM CompletionOutput delta) of every sample: sample 0 (`_sample_zero`),
        then, once its first output is out, samples 1..n-1 on the same decode instance, whose
        prefix cache now holds the prompt."""
        zero = self._sample_zero(f)
        if f.n == 1:
            async for out in zero:
                yield 0, out
            return
        first = await zero.__anext__()
        yield 0, first
        inst = self.registry.get(f.actual_decode)
        if inst is None:
            raise RuntimeError(f"decode instance {f.actual_decode} went away")
        others = [self._other_sample(f, inst, i) for i in range(1, f.n)]
        from vllm.utils.async_utils import merge_async_iterators

        async for which, out in merge_async_iterators(zero, *others):
            if which:
                f.other_samples_tokens += len(out.token_ids)
            yield out.index, out

    async def _other_sample(self, f: Flight, inst: Instance, index: int) -> AsyncIterator[Any]:
        """Sample `index` of `f` (n > 1) on `inst`, prefilled there from its prefix cache."""
        call = GenerateCall(f"{f.rid}-s{index}", f.prompt_ids, self._sample_params(f, index), None, self.router_id)
        stream, delta = await self._open(f, inst, call)
        try:
            while delta is not None:
                delta.output.index = index
                yield delta.output
                try:
                    delta = await stream.__anext__()
                except StopAsyncIteration:
                    delta = None
        finally:
            stream.cancel()

    async def _sample_zero(self, f: Flight) -> AsyncIterator[Any]:
        """Sample 0's CompletionOutput deltas, the first one included; across a migration."""
        delta = f.first_delta
        while delta is not None:
            out, stopped = delta.output, False
            if f.router_text is not None:
                stopped = _retext(f.router_text, out)
            f.output_ids.extend(out.token_ids)
            f.text_sent.append(out.text)
            if out.finish_reason:
                f.finish_reason = out.finish_reason
            yield out
            if stopped:  # a stop string the router found: the engine would go on
                f.stream.cancel()
                return
            try:
                delta = await f.stream.__anext__()
            except StopAsyncIteration:
                delta = None
            except asyncio.CancelledError:
                f.stream.cancel()
                raise
            except Exception as e:
                f.stream.cancel()
                # failed after its last token (the end was sent): nothing is missing
                delta = None if f.finish_reason else await self._migrate(f, e)

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
        record = request_record(f, error, time.monotonic(), self.multi_model, self.router_id)
        self.log.write(record)
        if f.model is not None:
            target = f.model.cost_model.target(f.slo)
            if error is None:
                count_served(self.window, record, target, f.model.cost_model.engine)
            if self.metrics is not None:
                self.metrics.request_finished(record, f.model.name, target.ttft_s, target.tpot_s)
