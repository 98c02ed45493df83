"""The engine deployment: one Serve replica = one in-process vLLM engine (`VllmEngine`).

Called by the router deployment through the pool's handle with `replica=<this replica's id>`
(see `pinned_router`):
- `prefill(call)`: run the prompt, keep its KV for a remote decode; returns where the KV is;
- `generate(call)`: one sample as a stream of vLLM's own outputs (`OutputDelta`), what the
  router's OpenAI layer serves; pulls the KV over NIXL when `kv_transfer_params` is given,
  prefills locally when it is None (colocated, or the fallback after a failed prefill);
- `decode(call)`: the same as text chunks, for tools that drive engines without the OpenAI layer;
- `watch(router)`: a stream of load reports, one each time a routing signal moves
  (`serve_app.state_push`), which each router keeps open; `state()`: the current report, for the
  router's slow liveness poll;
- `abort(request_id)`, `release_kv(request_id, kv_transfer_params)` (free a prefill's KV that will
  never be pulled), `reset_prefix_cache()`: control plane;
- `probe(call)`: one calibration measurement on this very engine (`disagg calibrate --live`).
Every reply names the replica that produced it, so the router can verify the pinning.

Each replica claims a NIXL side-channel port at start from the range the config owns
(`serve_app.ports`; replicas come and go with autoscaling, so ports cannot be assigned one by
one in the config file).

Ready means proven: before `__init__` returns (and Serve routes to the replica), the engine has
started within `engine.start_timeout_s` and completed one request through its real path within
`engine.warmup_timeout_s` (`warm_up`). A platform fault — a kernel the CPU cannot run, a side
channel that never listens, a transfer that fails — then shows at start-up with its cause in the
replica's log, and Serve starts another replica, instead of failing a user's first request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import signal
import statistics
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from disagg.core.cost_model import stream_interval
from disagg.core.kv_event_fold import KvEventFold
from disagg.core.prefix_index import index_block_tokens
from disagg.core.types import Role
from serve_app.autoscale import PLANNED_WIDTH
from serve_app.call_ledger import CallLedger
from serve_app.config import AppConfig
from serve_app.engine import RequestAborted, VllmEngine, engine_processes_under
from serve_app.engine_args import EngineSpec, kv_events_endpoint
from serve_app.kv_events import KvEventFollower
from serve_app.messages import (
    DecodeCall, DecodeChunk, EngineStateReport, EngineTimeline, GenerateCall, InvalidRequest, OutputDelta,
    PrefillCall, PrefillReply, ProbeCall, ProbeKind, ProbeReply,
)
from serve_app.ports import claim_port
from serve_app.probes import first_output_s, median_step_s, random_prompt
from serve_app.state_push import StatePublisher
from serve_app.tiny_model import resolve_model

logger = logging.getLogger("ray.serve")


def engine_spec(cfg: AppConfig, role: Role, side_channel_host: str, port: int) -> EngineSpec:
    """The engine one replica of `role`'s pool starts: a pure function of the config (golden-tested)."""
    e = cfg.engine
    kv = e.kv_transfer
    return EngineSpec(
        model=resolve_model(cfg.model.source),
        role=role,
        kv_buffer_device=e.kv_buffer_device(),
        kv_connector=kv.vllm_connector,
        nixl_backends=kv.backends,
        ucx_tls=kv.ucx_tls,
        ucx_net_devices=kv.ucx_net_devices,
        side_channel_port=port,
        side_channel_host=side_channel_host,
        max_model_len=cfg.model.max_model_len,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        kv_cache_memory_bytes=e.kv_cache_memory_bytes,
        gpu_memory_utilization=e.gpu_memory_utilization,
        block_size=e.block_size,
        tensor_parallel_size=cfg.pool_of(role).tensor_parallel_size,
        enforce_eager=e.enforce_eager,
        seed=e.seed,
        kv_events=e.kv_events,
        engine_kwargs=e.engine_kwargs,
    )


def _with_cause(e: Exception) -> RuntimeError:
    """vLLM wraps the real error (EngineGenerateError from ...); name it, since Ray drops the chain."""
    logger.exception("engine call failed")
    cause = e.__cause__ or e.__context__
    return RuntimeError(f"{type(e).__name__}: {e}" + (f" (cause: {type(cause).__name__}: {cause})" if cause else ""))


def _joined_logprobs(chunks: list) -> tuple | None:
    """The coalesced chunks' per-token logprobs in order; None (no cost) when none were asked for."""
    if chunks[0].logprobs is None:
        return None
    return tuple(lp for c in chunks for lp in c.logprobs or ())


def merged(outputs: list) -> Any:
    """One vLLM output for consecutive delta outputs of one request (vLLM's own merge)."""
    first = outputs[0]
    for nxt in outputs[1:]:
        first.add(nxt, aggregate=True)
    return first


async def _bounded(step: Awaitable, timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(step, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s") from None
    except Exception as e:
        logger.error("replica start-up failed in %s: %s: %s", what, type(e).__name__, e)
        raise RuntimeError(f"{what} failed: {type(e).__name__}: {e}") from e


WARMUP_TEXT = "Warm-up: the router proves every engine's path before users reach it."
WARMUP_SAMPLING = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}


async def warm_up(engine: VllmEngine, role: Role, prefill_pool: DeploymentHandle | None, tag: str) -> None:
    """One request through the engine's real path; raises (naming what failed) if it does not work.

    - decode engine: a prefill on a running prefill replica, a NIXL pull of its KV and two decode
      steps here: the path on which a missing CPU permission (AMX) or a dead side channel shows;
    - colocated and prefill engine: a local prefill and two decode steps (a prefill engine's path
      for a request it hosts). Not a published prefill on a prefill engine: with no decode engine
      to pull it, vLLM would pin the KV for its whole lease (30 s) and step the engine empty every
      millisecond meanwhile, a core's worth of polling just after start-up. The decode replicas'
      warm-ups pull from a prefill replica: that proves publishing.
    A vLLM engine cannot pull from itself, so the pull needs a prefill replica; it waits for one.
    """
    prompt = list(engine.tokenizer.encode(WARMUP_TEXT))
    kv = None
    if role is Role.DECODE:
        if prefill_pool is None:
            raise ValueError("a decode engine's warm-up needs its model's prefill pool")
        kv = await prefill_remote(prefill_pool, f"warmup-{tag}", prompt, WARMUP_SAMPLING)
        received_before = (await engine.state()).kv_received_tokens
    tokens, finish = [], None
    async for chunk in engine.decode(f"warmup-{tag}", prompt, WARMUP_SAMPLING, kv):
        tokens.extend(chunk.token_ids)
        finish = chunk.finish_reason or finish
    if len(tokens) != WARMUP_SAMPLING["max_tokens"] or finish != "length":
        raise RuntimeError(f"warm-up decode gave {len(tokens)} tokens (finish reason {finish!r}), expected "
                           f"{WARMUP_SAMPLING['max_tokens']}" + (" after a KV pull" if kv else ""))
    if kv is not None:
        # the per-token proof that the KV arrived over NIXL rather than being recomputed
        for _ in range(50):  # stats land with the engine's next step record: bounded wait
            if (await engine.state()).kv_received_tokens > received_before:
                return
            await asyncio.sleep(0.02)
        raise RuntimeError("warm-up decode recomputed the prompt instead of pulling its KV over NIXL")


async def prefill_remote(pool: DeploymentHandle, request_id: str, prompt: list[int], sampling: dict) -> dict:
    """Prefill on any running replica of `pool`; the KV transfer params a decode engine pulls with."""
    reply: PrefillReply = await pool.prefill.remote(PrefillCall(request_id, prompt, sampling))
    return reply.kv_transfer_params


def kill_engine_children() -> None:
    """SIGKILL this process's vLLM engine processes (an engine that never finished starting)."""
    for pid in engine_processes_under(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_END = object()


async def coalesce(stream: AsyncIterator, interval_s: float | Callable[[], float]) -> AsyncIterator[list]:
    """The first item at once (time to first token is sacred), then everything that arrived,
    at most once per `interval_s` (a number, or a function read before every batch).

    Every message on the token path crosses two Serve hops (engine → router → proxy), and on a
    small machine each costs more than a decode step: batching tokens per interval, as Ray
    Serve LLM does, keeps the hops off the critical path. Closing the returned iterator closes
    `stream` (which aborts the request in vLLM).
    """
    if not callable(interval_s) and interval_s <= 0:
        async for item in stream:
            yield [item]
        return
    queue: asyncio.Queue = asyncio.Queue()
    first_done = False

    async def pump() -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as e:  # handed to the consumer, raised there
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_END)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        item = await queue.get()  # the first token: no waiting
        while item is not _END:
            if isinstance(item, Exception):
                raise item
            batch, pending = [item], None
            if not first_done:
                first_done = True
            else:
                # let the rest of this interval's tokens arrive
                await asyncio.sleep(interval_s() if callable(interval_s) else interval_s)
                while pending is None and not queue.empty():
                    nxt = queue.get_nowait()
                    if nxt is _END or isinstance(nxt, Exception):
                        pending = nxt  # the end (or the error) comes after this batch
                    else:
                        batch.append(nxt)
            yield batch
            item = pending if pending is not None else await queue.get()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class EngineServer:
    async def __init__(self, config: dict, role: str, prefill_pool: DeploymentHandle | None = None) -> None:
        """Start the engine, then prove its real path (`warm_up`) before Serve calls it ready.

        `prefill_pool`: a decode engine's model's prefill pool, which the warm-up pulls KV from.
        Any failure or timeout raises with its cause, so Serve replaces the replica.
        """
        cfg = AppConfig.model_validate(config)
        self.role = Role(role)
        self.stream_interval_base_s = cfg.engine.stream_interval_s
        self.stream_interval_max_s = max(cfg.engine.stream_interval_s, cfg.engine.stream_interval_max_s)
        self.streams = 0  # decode streams open on this replica
        host = cfg.engine.side_channel_host
        if host == "auto":
            host = ray.util.get_node_ip_address()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.calls = CallLedger(self.role)  # what each router has sent here and not seen end: routers read it
        self.planned_width: int | None = None  # this pool's width as the router's planner last set it
        self.publisher: StatePublisher | None = None  # from the end of the warm-up on
        self.kv_events: KvEventFollower | None = None  # with KV events on, from the engine's start on
        self.engine_pids: tuple[int, ...] = ()  # the engine's processes, from the end of the warm-up on
        self.port = claim_port(host, cfg.engine.side_channel_ports)
        self.engine = VllmEngine(engine_spec(cfg, self.role, host, self.port.port))
        try:
            await _bounded(self.engine.start(), cfg.engine.start_timeout_s, "engine start")
            if (endpoint := kv_events_endpoint(self.engine.spec)) is not None:  # before any block is stored
                fold = KvEventFold(index_block_tokens((await self.engine.state()).block_size))
                self.kv_events = KvEventFollower(endpoint, fold, self._poke)
            await _bounded(warm_up(self.engine, self.role, prefill_pool, self.replica_id),
                           cfg.engine.warmup_timeout_s, "warm-up handoff")
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.close()
            await self.engine.shutdown()
            kill_engine_children()  # an engine stuck in start-up never reaches the handover
            self.port.release()
            raise
        s = await self.engine.state()
        self.engine_pids = self.engine.process_ids()  # fixed from the engine's start on
        self.publisher = StatePublisher(self._report, cfg.engine.push_interval_s, s.block_size,
                                        s.kv_capacity_tokens, cfg.engine.state_age_bound_s,
                                        self.kv_events.fold if self.kv_events else None)
        self.engine.on_step(self.publisher.poke)

    def _poke(self) -> None:
        if self.publisher is not None:  # None during the warm-up only
            self.publisher.poke()

    def _admit(self, call: PrefillCall | GenerateCall | DecodeCall) -> None:
        """Hold the call in this engine's ledger, and measure how old the state it was decided on was."""
        self.calls.arrived(call)
        if self.publisher is not None:  # None during the warm-up only
            self.publisher.call_arrived(call.state_seq, call.decided_at)

    def _release(self, call: PrefillCall | GenerateCall | DecodeCall, after_first_token: bool = False) -> None:
        self.calls.ended(call, after_first_token)
        self._poke()

    async def prefill(self, call: PrefillCall, replica: str | None = None) -> PrefillReply:
        self._admit(call)
        try:
            r = await self.engine.prefill(call.request_id, call.prompt_token_ids, call.sampling)
        except (InvalidRequest, RequestAborted):
            raise  # the request's fault, or its router's wish: not this engine's failure (nothing logged)
        except Exception as e:
            raise _with_cause(e) from e
        finally:
            self._release(call)
        return PrefillReply(kv_transfer_params=r.kv_transfer_params, first_token_id=r.first_token_id,
                            engine_ttft_s=r.engine_ttft_s, replica=self.replica_id, cached_tokens=r.cached_tokens,
                            prompt_logprobs=r.prompt_logprobs)

    async def generate(self, call: GenerateCall, replica: str | None = None) -> AsyncIterator[OutputDelta]:
        # what vLLM held of the prompt as the call came, by its events: the truth the router's index is
        # scored against (vLLM's own count adds the tokens a decode pulls over NIXL)
        held = self.kv_events.fold.held_tokens(call.prompt_token_ids) if self.kv_events else None

        def delta(outs: list, first: bool, called_at: float) -> OutputDelta:
            out = merged(outs)
            if not first:
                return OutputDelta(output=out.outputs[0], finished=out.finished)
            return OutputDelta(output=out.outputs[0], finished=out.finished, replica=self.replica_id,
                               engine_first_token_s=time.monotonic() - called_at,
                               num_cached_tokens=out.num_cached_tokens, prompt_logprobs=out.prompt_logprobs,
                               held_tokens=held, engine_timeline=EngineTimeline.of(out.metrics, called_at))
        stream = self.engine.generate(call.request_id, call.prompt_token_ids, call.params, call.kv_transfer_params)
        async for d in self._relayed(call, stream, delta):  # a generator method: Serve streams what it yields
            yield d

    async def decode(self, call: DecodeCall, replica: str | None = None) -> AsyncIterator[DecodeChunk]:
        def chunk(chunks: list, first: bool, called_at: float) -> DecodeChunk:
            return DecodeChunk(token_ids=tuple(t for c in chunks for t in c.token_ids),
                               text="".join(c.text for c in chunks), finish_reason=chunks[-1].finish_reason,
                               replica=self.replica_id if first else None,
                               engine_first_token_s=time.monotonic() - called_at if first else None,
                               logprobs=_joined_logprobs(chunks))
        stream = self.engine.decode(call.request_id, call.prompt_token_ids, call.sampling, call.kv_transfer_params)
        async for c in self._relayed(call, stream, chunk):
            yield c

    async def _relayed(self, call: GenerateCall | DecodeCall, stream: AsyncIterator,
                       item: Callable[[list, bool, float], Any]) -> AsyncIterator:
        """`stream` batched per interval (`coalesce`), each batch as `item(batch, first, the call's
        time.monotonic())`: the first names who served it and the engine-side time to the first token.
        The call is held in this engine's ledger until the stream ends, a prefill it made here until
        its first token (`CallLedger`)."""
        called_at, first, prefilled = time.monotonic(), True, False
        self._admit(call)
        self.streams += 1
        try:
            async for batch in coalesce(stream, self._stream_interval_s):
                if not prefilled:
                    self.calls.first_token(call)
                    prefilled = True
                yield item(batch, first, called_at)
                first = False
        except InvalidRequest:
            raise  # the request's fault, not this engine's: it crosses Ray as itself (the router's 400)
        except Exception as e:
            raise _with_cause(e) from e
        finally:
            self.streams -= 1
            self._release(call, after_first_token=prefilled)

    def _stream_interval_s(self) -> float:
        """The batching interval of this engine's streams (`stream_interval`, which the cost model
        prices the serving path's messages by)."""
        return stream_interval(self.streams, self.stream_interval_base_s, self.stream_interval_max_s)

    async def abort(self, request_id: str, replica: str | None = None) -> None:
        await self.engine.abort(request_id)

    async def release_kv(self, request_id: str, kv_transfer_params: dict, replica: str | None = None) -> None:
        await self.engine.release_kv(request_id, kv_transfer_params)

    async def state(self, exact: bool = False) -> EngineStateReport:
        """The current report: a new version if a routing signal moved since the last one (`exact`: if
        anything did, for `/admin/state`)."""
        if self.publisher is None:
            return await self._report()
        return await self.publisher.publish(exact)

    async def watch(self, router: str = "", replica: str | None = None) -> AsyncIterator[EngineStateReport]:
        """This engine's state, pushed: every version from the current one on (see `state_push`)."""
        assert self.publisher is not None  # set before __init__ returns, and Serve routes nothing here before
        async for r in self.publisher.watch():
            yield r

    def decision_ages(self) -> list[float]:
        """How old the state behind each call since the previous read was (seconds; benchmarks)."""
        return self.publisher.take_ages() if self.publisher is not None else []

    async def _report(self) -> EngineStateReport:
        s = await self.engine.state()
        return EngineStateReport(
            replica=self.replica_id, role=self.role, running=s.running, waiting=s.waiting,
            kv_used_tokens=s.kv_used_tokens, kv_capacity_tokens=s.kv_capacity_tokens,
            prefix_cache_hits=s.prefix_cache_hits, prefix_cache_queries=s.prefix_cache_queries,
            kv_transfers_ok=s.kv_transfers_ok, kv_transfers_failed=s.kv_transfers_failed,
            kv_received_tokens=s.kv_received_tokens, admitted=self.calls.totals(), pid=os.getpid(),
            block_size=s.block_size, node_id=self.node_id, engine_pids=self.engine_pids, steps=s.steps,
            kv_events_missed=self.kv_events.missed + self.kv_events.fold.unattributed if self.kv_events else 0)

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def probe(self, call: ProbeCall, replica: str | None = None) -> ProbeReply:
        """One calibration measurement on this engine (`serve_app.probes`), beside the traffic it
        serves: the caller bounds the sizes (`Admin.probe`) and paces the probes."""
        tag = f"probe-{self.replica_id}-{call.seed}-{time.monotonic_ns()}"
        # seeded by the tag, not the seed alone: a rerun of a calibration with the same seed would
        # find its prompts in the prefix cache and time prefills of nothing
        rng = random.Random(tag)
        vocab = min(len(self.engine.tokenizer), 50_000)
        ids = itertools.count()

        def stream(prompt_tokens: int, tokens: int):
            return self.engine.generate_local(f"{tag}-{next(ids)}", random_prompt(rng, prompt_tokens, vocab), tokens)

        samples = []
        for _ in range(call.repeats):
            if call.kind is ProbeKind.PREFILL:
                samples.append(await first_output_s(stream(call.size, 1)))
            else:
                samples.append(await median_step_s(lambda: stream(call.context, call.tokens), call.size))
        s = await self.engine.state()
        return ProbeReply(seconds=statistics.median(samples), replica=self.replica_id,
                          kv_capacity_tokens=s.kv_capacity_tokens, samples=tuple(samples))

    async def set_planned_width(self, width: int) -> None:
        """The router's planner sized this pool (`serve_app.autoscale`)."""
        self.planned_width = width

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: the planned width, once there is one."""
        return {} if self.planned_width is None else {PLANNED_WIDTH: float(self.planned_width)}

    async def check_health(self) -> None:
        await asyncio.wait_for(self.engine.state(), timeout=5.0)

    async def __del__(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.kv_events is not None:
            self.kv_events.close()
        await self.engine.shutdown()
        self.port.release()
