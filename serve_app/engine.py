"""The engine seam: one vLLM engine, in-process, behind five methods the graph layer calls.

Who calls what, and when
------------------------
The engine deployment (one Serve replica = one `VllmEngine`) owns the object:

* `await start()` once, before serving. It sets the per-engine environment (`engine_env`), creates
  vLLM's `AsyncLLM` (which spawns the EngineCore process) with the NixlConnector configured as
  `kv_both`, and waits until the engine is ready (15-20 s for the tiny model on 2 CPU cores).
* Per request, on the disaggregated path, the router picks a prefill and a decode engine; then
  1. prefill engine: `await prefill(rid, prompt_ids, sampling)` runs the prompt with
     `max_tokens=1` and `do_remote_decode`. vLLM keeps the prompt's KV blocks pinned and returns
     `PrefillResult.kv_transfer_params` (where the blocks are: engine id, host, port, block ids).
  2. decode engine: `decode(rid, prompt_ids, sampling, kv_transfer_params)` pulls those blocks over
     NIXL, recomputes nothing it received, and streams `TokenChunk`s. It samples the first output
     token itself, so the prefill engine's `first_token_id` is informational (equal under greedy).
  On the colocated path `decode(..., kv_transfer_params=None)` prefills locally.
* `await state()` whenever the router wants fresh load signals: it is a dict read, no I/O.
* `await abort(rid)` when a client goes away; `await shutdown()` once, at replica teardown.

What must hold
--------------
* One `VllmEngine` per process in production. Several in one process work (the test runs three):
  the environment is process-global, so `start()` holds a process-wide lock while it sets the
  engine's variables and spawns its EngineCore; concurrent `start()` calls run one after another.
* Every engine that takes part in transfers needs its own `side_channel_port` on its host.
* The prefill engine pins a request's KV blocks until the decode engine has read them or the
  NIXL lease (`kv_lease_duration`, 30 s) expires: a prefill whose decode is never called costs
  KV capacity for that long, unless a decode engine is told to release them (`release_kv`).
  `abort(rid)` of a prefill either stops it before its end (`prefill` raises `RequestAborted`:
  nothing is held) or comes too late, and then `prefill` returns its result as usual: the
  caller holds that KV and must release it.
* A decode whose KV transfer fails is not silently recomputed: vLLM's default
  `kv_load_failure_policy="fail"` ends the stream with an error finish reason, and the failure is
  counted in `EngineState.kv_transfers_failed`. Falling back (e.g. to a colocated decode) is the
  caller's decision, and should be counted there.
* Requests carry the caller's `request_id`; ids must be unique among in-flight requests of one
  engine. Using the same id for the prefill and the decode of a request is fine (and intended).

Sampling dict
-------------
Keys: `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `frequency_penalty`,
`presence_penalty`, `repetition_penalty`, `logit_bias` ({token id: bias}), `min_tokens`, `stop`
(str or list of str), `stop_token_ids`, `seed`, `ignore_eos`, `logprobs` (top alternatives per output
token; 0 = the sampled token's only), `structured_outputs` (vLLM's `StructuredOutputsParams` fields,
e.g. `{"json": schema}` or `{"json_object": True}`), `n` (only 1). Unknown keys raise `ValueError`
(a caller's bug). Missing keys take vLLM's `SamplingParams` defaults (note: `temperature` 1.0, i.e.
not greedy; pass `temperature=0` for greedy). Values vLLM refuses — at `SamplingParams` or at
admission (e.g. `stop: ""`, a schema it cannot compile, logit biases outside the vocabulary) — raise
`messages.InvalidRequest`: a client error, the same on every engine.
A prefill drops what only shapes the decoded tokens (`DECODE_ONLY_KEYS`): its one token is not
output, and e.g. `min_tokens` or a stop token would keep it from publishing its KV.

Pure asyncio, no Ray: this module is what the Serve engine deployment and the calibration
benchmarks both drive. vLLM is imported lazily, in `start()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serve_app.engine_args import EngineSpec, engine_env, engine_kwargs, on_cpu_platform
from serve_app.messages import InvalidRequest, TokenLogprob
from serve_app.sampling import decode_params, prefill_params

if TYPE_CHECKING:  # vLLM is heavy and only needed once an engine starts
    from vllm import RequestOutput, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

SAMPLING_KEYS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "stop", "stop_token_ids", "seed", "ignore_eos",
    "logprobs", "structured_outputs", "n"})
DECODE_ONLY_KEYS = frozenset({"stop", "stop_token_ids", "min_tokens", "logprobs", "structured_outputs"})

# Serialises environment mutation + EngineCore spawn across engines of one process.
_START_LOCK = threading.Lock()


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the prefill engine hands to the decode engine (via the router)."""

    kv_transfer_params: dict[str, Any]  # pass unchanged to decode(); opaque to everyone else
    first_token_id: int  # the token prefill sampled; decode samples its own (same under greedy)
    prompt_tokens: int
    engine_ttft_s: float  # wall time from prefill() call to the engine's output, this process
    cached_tokens: int = 0  # prompt tokens vLLM took from its prefix cache instead of computing
    prompt_logprobs: Any = None  # vLLM's, when the sampling parameters asked for them


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """One streamed step of a decode: the tokens and text produced since the previous chunk."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | ... on the last chunk
    logprobs: tuple[TokenLogprob, ...] | None = None  # per token, when the sampling dict asked for them


@dataclass(frozen=True, slots=True)
class EngineState:
    """Load signals of one engine, as of the engine's latest scheduler step.

    Counters (`prefix_cache_*`, `kv_transfers_*`, `kv_received_tokens`) are cumulative since start.
    `kv_transfers_ok` counts NIXL read operations that completed (a request may need more than
    one); `kv_received_tokens` counts prompt tokens whose KV arrived from a remote engine instead
    of being computed here — the per-token proof that a handoff was not a recompute.
    """

    running: int
    waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    kv_transfers_ok: int
    kv_transfers_failed: int
    kv_received_tokens: int = 0
    block_size: int = 0  # tokens per KV block (0 before the engine started)
    steps: int = 0  # engine steps whose outputs the replica processed (what its serving CPU follows)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------

@contextmanager
def _scoped_env(overrides: Mapping[str, str | None]):
    """Set (or, for None, unset) variables for the duration of the block, then restore."""
    saved = {k: os.environ.get(k) for k in overrides}
    try:
        for k, v in overrides.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


RUNTIME_DIR_VAR = "DISAGG_RUNTIME_DIR"
# What vLLM's engine processes are called in `ps` (an EngineCore, its workers): how a launcher or a
# replica finds the ones it started
ENGINE_PROCESS_MARKERS = ("EngineCore", "VLLM::EngineCore", "VLLM::Worker")
ENGINE_PROCESS_NAMES = ("VLLM::EngineCor", "VLLM::Worker")  # the titles as the kernel's 15-byte names keep them


def engine_processes_under(pid: int) -> dict[int, str]:
    """The vLLM engine processes descended from process `pid`: {pid: command line}, from /proc.

    Parent links only, no start-time check: psutil's `children()` drops a child whose start time
    reads earlier than its parent's, and it adds the boot time read anew each call, which moves
    with the wall clock (a clock step on a VM hides every child)."""
    return {child: cmd for child in descendants(pid) if (cmd := engine_command(child)) is not None}


def engine_command(pid: int) -> str | None:
    """Process `pid`'s command line if it is a vLLM engine process of this machine, else None. The
    title vLLM sets is read from the command line and, where that does not carry it, from the name
    the kernel keeps (`comm`, the title's first 15 bytes): the command line is read from the
    process's memory, the name is not, and a fresh-clone CI host refused a running EngineCore by
    its command line alone (the cause was not found)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        if any(m in cmd for m in ENGINE_PROCESS_MARKERS):
            return cmd
        with open(f"/proc/{pid}/comm", "rb") as f:  # only where the command line lacks the title
            name = f.read().decode(errors="replace").strip()
    except OSError:
        return None
    return name if name.startswith(ENGINE_PROCESS_NAMES) else None


def engine_tree(cores: Sequence[int]) -> tuple[int, ...]:
    """The EngineCore processes `cores`, then their descendants that are vLLM engine processes (the
    workers). Other descendants come and go (a compile worker pool, a probe's subprocess): a reader of
    the engine's CPU given one would fail when it exits."""
    return tuple(list(cores) + [d for c in cores for d in descendants(c) if engine_command(d) is not None])


def descendants(pid: int) -> list[int]:
    """Every process descended from process `pid` (parent links in /proc), nearest first."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # gone since the listing
                continue
            parents[int(entry)] = int(stat[stat.rfind(b")") + 2:].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop(0)
        children = [c for c, p in parents.items() if p == parent and c not in found]
        found += children
        frontier += children
    return found


def make_runtime_dir() -> str:
    """A private folder for one engine's IPC sockets, under `$DISAGG_RUNTIME_DIR` (a launcher's own
    folder, removed at its stop) or the system temp folder. vLLM names a socket per engine start
    and never removes it; a folder per engine goes with the engine."""
    parent = os.environ.get(RUNTIME_DIR_VAR) or None
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix="vllm-engine-", dir=parent)


# --------------------------------------------------------------------------------------------
# Stats
# --------------------------------------------------------------------------------------------

class _StatsRecorder:
    """Folds vLLM's per-step SchedulerStats into the latest gauges and cumulative counters.

    vLLM calls `record()` from AsyncLLM's output handler (the event loop thread) after every
    engine step that produced outputs; `snapshot()` is called from the same loop.
    """

    def __init__(self) -> None:
        self.on_step: Callable[[], None] | None = None  # told of every step (the state push's poke)
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.xfer_ok = 0
        self.xfer_failed = 0
        self.received_tokens = 0
        self.steps = 0

    def record(self, s: Any) -> None:
        self.steps += 1
        self.running = s.num_running_reqs
        self.waiting = s.num_waiting_reqs + getattr(s, "num_skipped_waiting_reqs", 0)
        self.kv_usage = s.kv_cache_usage
        if (p := s.prefix_cache_stats) is not None:
            self.prefix_hits += p.hits
            self.prefix_queries += p.queries
        if (c := getattr(s, "connector_prefix_cache_stats", None)) is not None:
            self.received_tokens += c.hits
        if data := s.kv_connector_stats:
            # NixlKVConnectorStats.data: one list entry per observation (vLLM 0.32 layout).
            self.xfer_ok += len(data.get("transfer_duration", ()))
            self.xfer_failed += sum(len(data.get(k, ())) for k in (
                "num_failed_transfers", "num_failed_handshakes", "num_failed_notifications"))
        if self.on_step is not None:
            self.on_step()


def _stat_logger_factory(recorder: _StatsRecorder) -> Callable[..., Any]:
    """A per-engine StatLoggerBase factory feeding `recorder` (vLLM's stat logger plug point)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _RecorderLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                recorder.record(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _RecorderLogger


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------

ABORTED_IDS_KEPT = 1024
LATE_OUTPUT_WAIT_S = 1.0  # bound on the output handler's draining an aborted prefill's last output
_NOT_ABORTED = object()


class RequestAborted(RuntimeError):
    """The request was aborted (`abort`) before it ended: it holds nothing."""


class VllmEngine:
    """One vLLM `AsyncLLM` with the NixlConnector, driven through prefill / decode / state.

    Every engine is configured `kv_both`, so the same class serves as prefill, decode or
    colocated engine; `spec.role` only decides which calls it accepts: a prefill engine takes no
    `prefill`-and-pull decode (KV from elsewhere) but does serve a request whole, when the router
    hosts one there; a decode engine takes no `prefill`.
    """

    def __init__(self, spec: EngineSpec, *, stat_loggers: Sequence[Any] = ()) -> None:
        """`stat_loggers`: extra vLLM stat logger factories (e.g. Ray metrics), passed through."""
        self.spec = spec
        self._owned_runtime_dir: str | None = None  # made by start() when the spec names none
        self._extra_stat_loggers = list(stat_loggers)
        self._llm: AsyncLLM | None = None
        self._stats = _StatsRecorder()
        self._kv_capacity_tokens = 0
        self._block_size = 0
        self._aborted: dict[str, None] = {}  # ids aborted on request, oldest first (an ordered set)
        self._prefilling: set[str] = set()  # prefills in vLLM now: aborting one must not lose its KV
        self.start_time_s: float | None = None  # how long start() took

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the engine and wait until it is ready. Call once."""
        if self._llm is not None:
            raise RuntimeError("engine already started")
        t0 = time.perf_counter()
        # The thread hands the engine over through a box, not its return value: to_thread's
        # futures outlive the call and would keep the AsyncLLM alive after shutdown(). If start()
        # is cancelled (e.g. a replica start-up timeout) while the thread still builds the engine,
        # whichever side comes second shuts the orphan down, so no EngineCore process is leaked.
        if self.spec.runtime_dir is None:
            self._owned_runtime_dir = make_runtime_dir()
            self.spec = dataclasses.replace(self.spec, runtime_dir=self._owned_runtime_dir)
        box = _Handover()
        try:
            await asyncio.to_thread(self._create, box)
        except asyncio.CancelledError:
            box.abandon()
            self._remove_runtime_dir()
            raise
        except Exception:
            self._remove_runtime_dir()
            raise
        self._llm = box.take()
        cache = self._llm.vllm_config.cache_config
        self._block_size = int(cache.block_size)
        self._kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * self._block_size
        self.start_time_s = time.perf_counter() - t0
        logger.info("engine %s (%s, port %d) ready in %.1f s, KV capacity %d tokens",
                    self.spec.model, self.spec.role.value, self.spec.side_channel_port,
                    self.start_time_s, self._kv_capacity_tokens)

    def _create(self, box: _Handover) -> None:
        """Blocking part of start(), run in a worker thread so the event loop stays responsive."""
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        spec = self.spec
        cpu = on_cpu_platform()
        if cpu and spec.kv_cache_memory_bytes is None and spec.gpu_memory_utilization is None:
            raise ValueError("on the CPU platform set EngineSpec.kv_cache_memory_bytes (otherwise "
                             "vLLM reserves 90% of host RAM for one engine's KV cache)")
        kwargs = engine_kwargs(spec)
        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
        if "kv_events_config" in kwargs:
            kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
        args = AsyncEngineArgs(**kwargs)

        env: dict[str, str | None] = dict(engine_env(spec, cpu_platform=cpu))
        if cpu and spec.kv_cache_memory_bytes is not None and "VLLM_CPU_KVCACHE_SPACE" in os.environ:
            logger.warning("ignoring inherited VLLM_CPU_KVCACHE_SPACE=%s: the spec sets "
                           "kv_cache_memory_bytes", os.environ["VLLM_CPU_KVCACHE_SPACE"])
            env["VLLM_CPU_KVCACHE_SPACE"] = None
        loggers = [_stat_logger_factory(self._stats), *self._extra_stat_loggers]
        # The EngineCore process copies os.environ when it is spawned, inside from_engine_args,
        # and the env of one process is shared by all its engines: hence lock + scoped env.
        with _START_LOCK, _scoped_env(env):
            llm = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        # Drop our reference explicitly: vLLM start-up leaves a traceback that references this
        # frame alive (first engine of a process), which would otherwise keep the engine alive.
        if box.put(llm):
            del llm
            return
        logger.warning("engine start was cancelled; shutting down the engine it built")
        llm.shutdown()
        del llm
        gc.collect()  # see shutdown()

    def process_ids(self) -> tuple[int, ...]:
        """This engine's processes: the EngineCore(s) vLLM started, as its own process handles name
        them, then their descendants (the workers). Empty before start and after shutdown."""
        resources = getattr(getattr(self._llm, "engine_core", None), "resources", None)
        cores = [p.pid for p in getattr(getattr(resources, "engine_manager", None), "processes", ()) if p.pid]
        return engine_tree(cores)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine and its EngineCore process. Safe to call twice."""
        llm, self._llm = self._llm, None
        if llm is None:
            self._remove_runtime_dir()
            return
        # Synchronous (~5 s of process joins). Run off-loop, vLLM's output handler would see the
        # engine die under it and log EngineDeadError tracebacks.
        llm.shutdown(timeout=timeout_s)
        # AsyncLLM.__del__ calls shutdown() again; collect it now rather than at interpreter exit,
        # where that second call fails noisily on half-torn-down module globals.
        del llm
        gc.collect()
        self._remove_runtime_dir()

    def _remove_runtime_dir(self) -> None:
        if self._owned_runtime_dir is not None:
            shutil.rmtree(self._owned_runtime_dir, ignore_errors=True)
            self._owned_runtime_dir = None

    # -- requests ----------------------------------------------------------------------------

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int],
                      sampling: Mapping[str, Any] | SamplingParams) -> PrefillResult:
        """Run the prompt, keep its KV for a remote decode engine, return where it is.

        `sampling`: a request's vLLM `SamplingParams` (its prefill copy is made here:
        `sampling.prefill_params`) or the seam's sampling dict.
        Raises RuntimeError if vLLM did not publish transfer params (e.g. the request was
        aborted), ValueError for a bad sampling dict or a decode-only engine.
        """
        if not self.spec.role.serves_prefill():
            raise ValueError(f"engine role {self.spec.role.value!r} does not serve prefill")
        if isinstance(sampling, Mapping):
            params = _sampling_params(sampling, kv_transfer_params={"do_remote_decode": True},
                                      max_tokens=1, stream=False, keep_stop=False)
        else:
            params = _validated(lambda: prefill_params(sampling), {})
            sampling = _named_fields(params)
        if self._was_aborted(request_id):  # the abort overtook the call on its way here
            raise RequestAborted(f"prefill of {request_id!r} was aborted before it started")
        t0 = time.perf_counter()
        final = None
        self._prefilling.add(request_id)
        try:
            with _client_errors_as_invalid(sampling):
                async for out in self._engine.generate(_engine_input(self._engine, prompt_token_ids),
                                                       params, request_id):
                    final = out
        finally:
            self._prefilling.discard(request_id)
        ttft = time.perf_counter() - t0
        aborted = self._was_aborted(request_id)
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            if aborted:  # stopped on purpose: vLLM ends the stream without output
                raise RequestAborted(f"prefill of {request_id!r} was aborted")
            raise RuntimeError(f"prefill of {request_id!r} produced no output")
        # Finished, aborted or not: an abort that came too late leaves the KV to the caller.
        if not final.kv_transfer_params:
            raise RuntimeError(f"prefill of {request_id!r} ended "
                               f"({final.outputs[0].finish_reason}) without kv_transfer_params")
        return PrefillResult(
            kv_transfer_params=dict(final.kv_transfer_params),
            first_token_id=int(final.outputs[0].token_ids[0]),
            prompt_tokens=len(prompt_token_ids),
            engine_ttft_s=ttft,
            cached_tokens=int(final.num_cached_tokens or 0),
            prompt_logprobs=final.prompt_logprobs,
        )

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       kv_transfer_params: Mapping[str, Any] | None) -> AsyncIterator[RequestOutput]:
        """vLLM's own outputs, as deltas, for one sample of a request whose KV is at
        `kv_transfer_params` (None: computed here): the router's OpenAI layer reads them as it
        would read a local engine's. `params`: the request's `SamplingParams` (the decode's copy is
        made here: `sampling.decode_params`). Closing the iterator early aborts the request in vLLM."""
        if kv_transfer_params is not None and not self.spec.role.serves_decode():
            raise ValueError(f"engine role {self.spec.role.value!r} does not serve decode")
        if params.n != 1:
            raise ValueError(f"one sample per engine request (the router fans n out), got n={params.n}")
        params = _validated(lambda: decode_params(params, dict(kv_transfer_params or {}) or None), {})
        gen = self._engine.generate(_engine_input(self._engine, prompt_token_ids), params, request_id)
        try:
            with _client_errors_as_invalid(_named_fields(params)):
                async for out in gen:
                    yield out
        finally:
            await gen.aclose()

    async def decode(self, request_id: str, prompt_token_ids: Sequence[int],
                     sampling: Mapping[str, Any],
                     kv_transfer_params: Mapping[str, Any] | None) -> AsyncIterator[TokenChunk]:
        """Stream the completion of a prompt whose KV is at `kv_transfer_params` (None: local).

        Closing the iterator early (or cancelling the consumer) aborts the request in vLLM.
        Chunks carry per-token logprobs only when `sampling["logprobs"]` is set.
        """
        # a prefill engine may serve a request whole (the router's `Policy.may_host`), never pull KV
        if kv_transfer_params is not None and not self.spec.role.serves_decode():
            raise ValueError(f"engine role {self.spec.role.value!r} does not serve decode")
        params = _sampling_params(sampling, kv_transfer_params=kv_transfer_params,
                                  max_tokens=None, stream=True, keep_stop=True)
        top_n = sampling.get("logprobs")
        gen = self._engine.generate(_engine_input(self._engine, prompt_token_ids), params,
                                   request_id)
        try:
            with _client_errors_as_invalid(sampling):
                async for out in gen:
                    for c in out.outputs:  # n == 1: one completion
                        if c.token_ids or c.text or c.finish_reason:
                            lps = None if top_n is None else _token_logprobs(c.token_ids, c.logprobs, top_n)
                            yield TokenChunk(tuple(c.token_ids), c.text, c.finish_reason, lps)
        finally:
            await gen.aclose()  # no-op when finished; aborts in vLLM when we stopped early

    async def generate_local(self, request_id: str, prompt_token_ids: Sequence[int],
                             max_tokens: int) -> AsyncIterator[TokenChunk]:
        """A greedy completion of exactly `max_tokens` computed on this engine whatever its role,
        its KV neither published nor pulled: what calibration probes time (`serve_app.probes`).
        Closing the iterator early aborts the request in vLLM."""
        params = _sampling_params({"temperature": 0.0, "ignore_eos": True}, kv_transfer_params=None,
                                  max_tokens=max_tokens, stream=True, keep_stop=True)
        gen = self._engine.generate(_engine_input(self._engine, prompt_token_ids), params, request_id)
        try:
            async for out in gen:
                for c in out.outputs:
                    if c.token_ids:
                        yield TokenChunk(tuple(c.token_ids), c.text, c.finish_reason, None)
        finally:
            await gen.aclose()

    async def abort(self, request_id: str) -> None:
        """Abort an in-flight request; finished ids are ignored. An id not seen yet is remembered:
        a prefill that arrives after its own abort is refused."""
        self._aborted[request_id] = None
        while len(self._aborted) > ABORTED_IDS_KEPT:  # ids of requests that had already ended
            self._aborted.pop(next(iter(self._aborted)))
        if request_id in self._prefilling:
            await self._abort_prefill(request_id)
        else:
            await self._engine.abort(request_id)

    async def _abort_prefill(self, request_id: str) -> None:
        """Abort a prefill without losing track of its KV.

        `AsyncLLM.abort` forgets the request at once, on this side. If the EngineCore had just
        finished the prefill, its output (where the KV is) is already on its way and is dropped,
        while the EngineCore ignores the abort of a finished request: the blocks stay pinned for a
        pull nobody will make, until the lease ends. So the EngineCore is asked first: it drops the
        request if it is unfinished (no output follows), or ignores the abort and the output it
        already sent still reaches `prefill`, which returns it. A round trip to the EngineCore
        (answered after every output it sent before) and the output handler draining what came
        with it mark the point after which no output can come; only then is the request
        forgotten here (a no-op if its output came). A vLLM without the external-to-internal id
        map (vLLM 0.32's `OutputProcessor.external_req_ids`) gets the plain abort, and such a
        prefill's blocks wait for their lease."""
        llm = self._engine
        internal_ids = list(getattr(llm.output_processor, "external_req_ids", {}).get(request_id, ()))
        if internal_ids:
            await llm.engine_core.abort_requests_async(internal_ids)
            await llm.is_sleeping()  # the round trip
            await _outputs_drained(llm.engine_core, LATE_OUTPUT_WAIT_S)
        await llm.abort(request_id)

    def _was_aborted(self, request_id: str) -> bool:
        """Whether `abort(request_id)` was called (and forget it)."""
        return self._aborted.pop(request_id, _NOT_ABORTED) is not _NOT_ABORTED

    async def release_kv(self, request_id: str, kv_transfer_params: Mapping[str, Any]) -> None:
        """Free a remote prefill's KV that this engine will never pull (its request went away
        between the prefill and the pull): vLLM submits a pre-aborted request whose connector
        hook tells the prefill engine to free the blocks now, not when their lease runs out."""
        await self._engine.notify_kv_transfer_request_rejected(request_id, dict(kv_transfer_params))

    # -- signals and maintenance -------------------------------------------------------------

    def on_step(self, callback: Callable[[], None]) -> None:
        """Call `callback` after every engine step that produced outputs (on the event loop)."""
        self._stats.on_step = callback

    async def state(self) -> EngineState:
        """Latest load signals; no I/O (values as of the engine's last step with outputs).

        Raises vLLM's EngineDeadError once the EngineCore has died, so it doubles as a health check.
        """
        if self._engine.errored:  # raises too if not started; makes state() a health check
            raise self._engine.dead_error
        s = self._stats
        cap = self._kv_capacity_tokens
        return EngineState(
            running=s.running,
            waiting=s.waiting,
            kv_used_tokens=round(s.kv_usage * cap),
            kv_capacity_tokens=cap,
            prefix_cache_hits=s.prefix_hits,
            prefix_cache_queries=s.prefix_queries,
            kv_transfers_ok=s.xfer_ok,
            kv_transfers_failed=s.xfer_failed,
            kv_received_tokens=s.received_tokens,
            block_size=self._block_size,
            steps=s.steps,
        )

    async def reset_prefix_cache(self) -> bool:
        """Drop cached prefix blocks (e.g. between calibration runs). True if vLLM did it."""
        return bool(await self._engine.reset_prefix_cache())

    @property
    def tokenizer(self) -> Any:
        """The engine's Hugging Face-compatible tokenizer (encode / decode / chat template)."""
        return self._engine.get_tokenizer()

    @property
    def _engine(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("engine not started (call await start() first) or shut down")
        return self._llm


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

class _Handover:
    """Passes the AsyncLLM built in start()'s thread to the loop, or shuts it down if abandoned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._llm: Any = None
        self._abandoned = False

    def put(self, llm: Any) -> bool:  # builder thread; False: abandoned, caller shuts it down
        with self._lock:
            if not self._abandoned:
                self._llm = llm
            return not self._abandoned

    def abandon(self) -> None:  # event loop, on cancellation
        with self._lock:
            self._abandoned = True
            llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            del llm
            gc.collect()

    def take(self) -> Any:
        llm, self._llm = self._llm, None
        return llm


async def _outputs_drained(engine_core: Any, timeout_s: float) -> None:
    """Return once AsyncLLM's output handler has taken every EngineCore output received so far
    (and processed it: it yields to the loop only between batches), or after `timeout_s`."""
    queue = getattr(engine_core, "outputs_queue", None)
    deadline = time.monotonic() + timeout_s
    while queue is not None and not queue.empty() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0)  # the batch it took last: processed before it awaits again
    await asyncio.sleep(0)


def _engine_input(llm: AsyncLLM, prompt_token_ids: Sequence[int]) -> Any:
    """A token prompt rendered the way vLLM 0.32 wants it (raw prompts are deprecated there)."""
    prompt = {"prompt_token_ids": list(prompt_token_ids)}
    renderer = getattr(llm, "renderer", None)
    if renderer is None or not hasattr(renderer, "render_cmpl"):
        return prompt  # older/newer vLLM without the renderer API: the raw form still works
    (engine_input,) = renderer.render_cmpl([prompt])
    return engine_input


def _sampling_params(sampling: Mapping[str, Any], *, kv_transfer_params: Mapping[str, Any] | None,
                     max_tokens: int | None, stream: bool, keep_stop: bool) -> SamplingParams:
    """Translate the seam's sampling dict into vLLM SamplingParams (see module docstring).

    `keep_stop=False` (a prefill): drop `DECODE_ONLY_KEYS`."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    unknown = set(sampling) - SAMPLING_KEYS
    if unknown:
        raise ValueError(f"unknown sampling keys {sorted(unknown)}; allowed: {sorted(SAMPLING_KEYS)}")
    if sampling.get("n", 1) != 1:
        raise ValueError(f"only n=1 is supported, got n={sampling['n']!r}")
    kw = {k: v for k, v in sampling.items() if k != "n" and v is not None}
    if not keep_stop:
        for k in DECODE_ONLY_KEYS:  # a 1-token prefill must not stop early, and its token is not output
            kw.pop(k, None)
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    try:
        if "structured_outputs" in kw:
            kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
        return SamplingParams(
            **kw,
            n=1,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            extra_args=extra,
        )
    except (VLLMClientError, ValueError, TypeError) as e:  # vLLM's own validation: the request's fault
        raise InvalidRequest(str(e), _param_of(e, kw)) from e


def _param_of(e: Exception, sampling: Mapping[str, Any]) -> str | None:
    """The sampling key a vLLM validation error is about: its `parameter`, else the key it names."""
    named = getattr(e, "parameter", None)
    if named:
        return "structured_outputs" if named.startswith("structured_outputs") else named
    text = str(e)
    keys = sorted(sampling, key=len, reverse=True)  # `stop_token_ids` before `stop`
    for key in [k for k in keys if text.startswith(k)] + [k for k in keys if k in text]:
        return key
    if "structured_outputs" in sampling and any(w in text.lower() for w in ("schema", "grammar", "json")):
        return "structured_outputs"
    return None


def _validated(make: Callable[[], SamplingParams], sampling: Mapping[str, Any]) -> SamplingParams:
    """`make()`, with vLLM's refusal of the values as `InvalidRequest` (the request's fault)."""
    from vllm.exceptions import VLLMClientError

    try:
        return make()
    except (VLLMClientError, ValueError, TypeError) as e:
        raise InvalidRequest(str(e), _param_of(e, sampling)) from e


def _named_fields(params: SamplingParams) -> dict[str, Any]:
    """The fields an engine's refusal may be about, for `_param_of` to name."""
    fields = ("logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs",
              "stop_token_ids", "stop", "max_tokens", "min_tokens", "seed")
    return {f: v for f in fields if (v := getattr(params, f, None)) not in (None, [], {})}


@contextmanager
def _client_errors_as_invalid(sampling: Mapping[str, Any]):
    """vLLM's client errors (`VLLMClientError`, raised at admission: logprobs, logit_bias, schemas)
    become `InvalidRequest`; anything else (an engine fault) passes unchanged."""
    from vllm.exceptions import VLLMClientError

    try:
        yield
    except VLLMClientError as e:
        raise InvalidRequest(str(e), _param_of(e, sampling)) from e


def _token_logprobs(token_ids: Sequence[int], logprobs: Any, top_n: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-position {token id: Logprob} (the sampled token and the top `top_n` by rank) as records."""
    out = []
    for tid, step in zip(token_ids, logprobs or ()):
        sampled = step[tid]
        top = sorted((lp for lp in step.values() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda lp: lp.rank)
        out.append(TokenLogprob(sampled.decoded_token or "", float(sampled.logprob),
                                tuple((lp.decoded_token or "", float(lp.logprob)) for lp in top)))
    return tuple(out)


__all__ = ["SAMPLING_KEYS", "EngineState", "PrefillResult", "TokenChunk", "VllmEngine"]
