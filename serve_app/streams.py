"""Flight streams: a placed request's decode, from its first token to its last, across failures.

`FlightStreams` is the dispatcher's streaming half (`dispatcher.Dispatcher` owns one and calls it
in this order; it routes, admits, prefills and finishes the request itself):
1. `prepare`, before routing: a token-id prompt that ends inside a multi-byte character gets its
   text from the router (`router_text`), as vLLM's would start with the prompt's again;
2. `first_token`: start the decode on exactly the chosen decode replica with the prefill's
   `kv_transfer_params` (a request the policy serves whole on a prefill instance,
   `Policy.may_host`, streams from that prefill replica, which prefills it locally) and wait for
   its first token before the ingress answers, so a failure still gets a proper status code; a
   decode that fails before its first token is retried once on another decode replica, which
   prefills locally. On the first token the KV has left the prefill instance
   (`ledger.prefill_done`);
3. `samples`: the outputs, vLLM's own (`OutputDelta`), sample by sample. `n > 1`: sample 0 pulls
   the KV, and once its first token is out the other samples start on the same decode instance,
   where its prefix cache holds the prompt (one prefill and one transfer serve every sample);
4. a decode that fails mid-stream is migrated (`migration_limit` times at most): another decode
   instance prefills the prompt plus the tokens generated so far and streams the rest, so the
   client gets the whole answer in one stream, every token once; its ledger entry moves there.
   From then on the router makes the text and applies the stop strings (`router_text`). Not
   migrated (ApiError 502, the answer ends with an error event): structured output and tool
   calls forced through it (a grammar cannot resume mid-answer), and `n > 1` (the samples share
   one decode instance's cache).
Every engine call is made in a context of its own (`_open`); an engine that refuses the request
itself (`messages.InvalidRequest`) makes it a 400 naming the field, and no other instance is tried.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any, AsyncIterator

from disagg.core.ledger import Ledger, admission_work
from disagg.core.types import Role
from serve_app.engine_calls import bad_request, decided_on, last_line, refusal
from serve_app.flight import Flight
from serve_app.messages import GenerateCall, OutputDelta
from serve_app.openai_api import ApiError
from serve_app.registry import Instance, InstanceRegistry
from serve_app.request_log import Counters
from serve_app.router_text import RouterText, ends_inside_character
from serve_app.sampling import continuation_params, replaced, sample_params
from serve_app.served_model import ServedModel

logger = logging.getLogger("ray.serve")


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


class FlightStreams:
    """Opens each placed request's engine streams and relays them; migrates a decode that fails."""

    def __init__(self, registry: InstanceRegistry, ledger: Ledger, counters: Counters, router_id: str,
                 migration_limit: int) -> None:
        self.registry = registry
        self.ledger = ledger
        self.counters = counters
        self.router_id = router_id  # this router replica: engines keep their ledger of our calls under it
        self.migration_limit = migration_limit

    def prepare(self, f: Flight) -> None:
        """Before `f` is routed: the router makes its text when its token-id prompt ends inside a character."""
        if f.prompt_text is None and ends_inside_character(_decoder(f.model), f.prompt_ids):
            f.router_text = _router_text(f)  # vLLM's text would start with the prompt's again

    async def first_token(self, f: Flight, kv: dict | None) -> None:
        """Open `f`'s decode on its chosen instance with the prefill's KV (`kv`; None: it prefills
        there), else on one other, which prefills locally; `f.stream` and `f.first_delta` are set.
        ApiError: 400 when an engine refused the request, 503 when no instance could serve it."""
        m = f.model
        targets = [f.decision.decode_id] + [i.instance_id for i in self.registry.pool(m, m.decode_role)
                                            if i.instance_id != f.decision.decode_id]
        last_error: Exception | None = None
        for n, target in enumerate(targets[:2]):  # the chosen decode, then one other (local prefill)
            inst = self.registry.get(target)
            if inst is None:
                continue
            # the engine holds what this router's ledger holds: a prefill made here until the first
            # token, the decode to the end — but not on a prefill engine serving the request whole,
            # where the decode runs beside its prefills, not ahead of them
            local = kv is None or n > 0
            call = GenerateCall(f"{f.rid}-d{n}", f.prompt_ids, self._sample_params(f, 0), None if local else kv,
                                self.router_id, 0.0 if inst.role is Role.PREFILL else f.work_s[1],
                                *decided_on(f, target), prefill_work_s=f.work_s[0] if local else 0.0)
            try:
                f.stream, f.first_delta = await self._open(f, inst, call)
            except (asyncio.CancelledError, ApiError):
                raise
            except Exception as e:
                logger.warning("router: decode of %s on %s failed before its first token: %s", f.rid, target,
                               last_line(e))
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
            f.decode_engine_timeline = f.first_delta.engine_timeline
            f.num_cached_tokens = f.first_delta.num_cached_tokens
            f.decode_held_tokens = f.first_delta.held_tokens
            if f.prompt_logprobs is None:  # computed by a local prefill
                f.prompt_logprobs = f.first_delta.prompt_logprobs
            self.ledger.prefill_done(f.rid)
            return
        raise ApiError(f"no decode instance could serve the request: {last_line(last_error)}", status=503,
                       kind="service_unavailable")

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
            if isinstance(e, Exception) and (refused := refusal(e)) is not None:
                raise bad_request(refused, f) from None
            raise
        if first.replica is not None and first.replica != inst.replica:
            self.counters.misrouted += 1
        return stream, first

    def _sample_params(self, f: Flight, index: int):
        """Sample `index`'s parameters; without stop strings where the router applies them."""
        params = sample_params(f.params, index)
        return replaced(params, stop=None) if f.router_text is not None and params.stop else params

    async def samples(self, f: Flight) -> AsyncIterator[tuple[int, Any]]:
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

    async def _migrate(self, f: Flight, error: Exception) -> OutputDelta | None:
        """Continue `f` after its decode instance failed mid-stream with `error`: another decode
        instance prefills the prompt plus the tokens so far and streams the rest. Returns the new
        stream's first chunk (None: nothing was left to generate); ApiError (502) when the request
        may not migrate (`migration_limit` reached, structured output) or no instance could take it."""
        m = f.model
        reason = last_line(error)
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
                                *decided_on(f, inst.instance_id), prefill_work_s=pw)
            try:
                f.stream, first = await self._open(f, inst, call)
            except (asyncio.CancelledError, ApiError):
                raise
            except Exception as e:
                logger.warning("router: migration of %s to %s failed: %s", f.rid, inst.instance_id, last_line(e))
                f.actual_decode, reason = inst.instance_id, last_line(e)
                continue
            logger.info("router: %s migrated from %s to %s after %d tokens", f.rid, f.migrated_from[-1],
                        inst.instance_id, f.generated)
            f.actual_decode = inst.instance_id
            if f.router_text is None:  # else it goes on making the text, as after an earlier migration
                f.router_text = _router_text(f)
            self.ledger.prefill_done(f.rid)
            return first
        raise ApiError(f"decode failed after {f.generated} tokens: {reason}", status=502, kind="upstream_error")
