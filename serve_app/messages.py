"""The records the router and the engine replicas exchange (the engine seam's wire format).

The router calls each engine replica through its pool's handle, always with `replica=<id>` as a
keyword (`pinned_router` reads it):
- `prefill(PrefillCall) -> PrefillReply`;
- `generate(GenerateCall)`, a stream of `OutputDelta`s (vLLM's own outputs): what the router's
  OpenAI layer serves; the first one names the replica that serves it;
- `decode(DecodeCall)`, a stream of `DecodeChunk`s: the same with the seam's sampling dict and
  text records, for the tools that drive engines without the OpenAI layer (warm-up, benchmarks);
- `watch()`, a stream of `EngineStateReport`s, one per change (`serve_app.state_push`): what the
  router's `InstanceRegistry` routes on; `state() -> EngineStateReport` answers its slow liveness poll;
- `probe(ProbeCall) -> ProbeReply`: a calibration measurement on exactly this engine
  (`/admin/probe`, driven by `disagg calibrate --live`).
Every reply names the replica that produced it, so the router can verify the pinning (`misrouted`).
A call the engine refuses as invalid (vLLM's validation, e.g. a schema it cannot compile) raises
`InvalidRequest`: the router answers 400 and does not try another instance.

Ray pickles these dataclasses across processes; they hold plain values only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from disagg.core.types import Role


class InvalidRequest(ValueError):
    """The engine refused the request itself (a client error, a 400): another instance would too.

    Raised by `engine.VllmEngine` and passed through the engine replica unchanged; Ray delivers it
    to the router as a `RayTaskError` that is also an `InvalidRequest` (its `.cause` is this one).
    `param`: the sampling-dict key at fault, when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)  # both in args: the exception pickles whole across Ray
        self.message, self.param = message, param

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log-probability and its top alternatives (only when logprobs were asked for)."""

    token: str  # the token's text
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # the most likely tokens at this step, by rank: (text, logprob)


@dataclass(frozen=True, slots=True)
class PrefillCall:
    """Run a prompt on a prefill engine and keep its KV for a remote decode."""

    request_id: str  # the engine-side id, unique per attempt (`<request id>-p<attempt>`)
    prompt_token_ids: list[int]  # the tokenized prompt
    sampling: Any  # the request's vLLM SamplingParams (the engine makes the prefill's copy), or a sampling dict
    router: str = ""  # the router replica that sent it (the engine's ledger is kept per router)
    work_s: float = 0.0  # the prefill work the router priced it at, held in the engine's ledger until it returns
    state_seq: int = 0  # the version of this engine's state the router decided on (0: none)
    decided_at: float = 0.0  # when it decided (wall clock): the engine measures how old that state was


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """Where a prefilled prompt's KV is, for the decode engine to pull."""

    kv_transfer_params: dict[str, Any]  # opaque to the router: passed unchanged in the `DecodeCall`
    first_token_id: int  # the token prefill sampled (decode samples its own; equal under greedy)
    engine_ttft_s: float  # engine-side time from the call to the prefill's output
    replica: str  # the replica that ran it
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache supplied
    prompt_logprobs: Any = None  # vLLM's prompt logprobs, when the sampling parameters asked for them


@dataclass(frozen=True, slots=True)
class DecodeCall:
    """Generate a completion on a decode (or colocated) engine."""

    request_id: str  # the engine-side id, unique per attempt (`<request id>-d<attempt>`)
    prompt_token_ids: list[int]  # the tokenized prompt
    sampling: dict[str, Any]  # OpenAI sampling settings (`max_tokens`, `temperature`, ...)
    kv_transfer_params: dict[str, Any] | None = None  # a `PrefillReply`'s; None: prefill locally
    router: str = ""  # the router replica that sent it (the engine's ledger is kept per router)
    work_s: float = 0.0  # the decode work the router priced it at, held in the engine's ledger until the end
    state_seq: int = 0  # the version of this engine's state the router decided on (0: none)
    decided_at: float = 0.0  # when it decided (wall clock): the engine measures how old that state was
    prefill_work_s: float = 0.0  # the work of its prefill here (no KV given), held until its first token


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """Generate one sample of a request on a decode (or colocated) engine, as vLLM outputs."""

    request_id: str  # the engine-side id, unique per attempt and sample
    prompt_token_ids: list[int]  # the tokenized prompt
    params: Any  # vLLM SamplingParams with n = 1 (the engine makes the decode's copy)
    kv_transfer_params: dict[str, Any] | None = None  # a `PrefillReply`'s; None: prefill locally
    router: str = ""  # the router replica that sent it (the engine's ledger is kept per router)
    work_s: float = 0.0  # the decode work the router priced it at, held in the engine's ledger until the end
    state_seq: int = 0  # the version of this engine's state the router decided on (0: none)
    decided_at: float = 0.0  # when it decided (wall clock): the engine measures how old that state was
    prefill_work_s: float = 0.0  # the work of its prefill here (no KV given), held until its first token


@dataclass(frozen=True, slots=True)
class EngineTimeline:
    """Where an engine's time to a request's first token went, by vLLM's own request events (seconds
    from the replica's call; the engine core runs in a child process of the replica, on the same
    monotonic clock): `queued_s` the core took the request in, which its loop does between steps
    (so the call's way through the frontend and into the core, and the rest of any step in flight);
    `scheduled_s` a step first scheduled it; `first_token_s` the step that made the first token
    ended. The rest of `engine_first_token_s` is the token's way back to the replica."""

    queued_s: float
    scheduled_s: float
    first_token_s: float

    @classmethod
    def of(cls, stats: Any, called_at: float) -> EngineTimeline | None:
        """From a vLLM `RequestStateStats` (None, or an event not seen yet: None) and the call's
        `time.monotonic()`."""
        if stats is None or not (stats.queued_ts and stats.scheduled_ts and stats.first_token_ts):
            return None
        return cls(stats.queued_ts - called_at, stats.scheduled_ts - called_at, stats.first_token_ts - called_at)

    def as_dict(self) -> dict[str, float]:
        return {"queued_s": self.queued_s, "scheduled_s": self.scheduled_s, "first_token_s": self.first_token_s}


@dataclass(frozen=True, slots=True)
class OutputDelta:
    """What one sample produced since its previous delta (the engine batches them per interval):
    vLLM's `CompletionOutput` as is, without the prompt vLLM repeats in every output."""

    output: Any  # vLLM CompletionOutput: the new token ids, text, logprobs; finish and stop reason at the end
    finished: bool
    replica: str | None = None  # the replica serving the sample (first delta only)
    engine_first_token_s: float | None = None  # engine-side time from the call to this delta (first only)
    num_cached_tokens: int | None = None  # prompt tokens the engine's prefix cache or the KV pull supplied (first)
    prompt_logprobs: Any = None  # computed here (a local prefill) and asked for (first only)
    held_tokens: int | None = None  # prompt tokens its KV events said the engine held when the call came (first)
    engine_timeline: EngineTimeline | None = None  # where the engine's time to the first token went (first)


@dataclass(frozen=True, slots=True)
class DecodeChunk:
    """The tokens a decode produced since its previous chunk (the engine batches them per interval)."""

    token_ids: tuple[int, ...]  # the new output tokens
    text: str  # their detokenized text
    finish_reason: str | None  # "stop" | "length" | ... on the last chunk, else None
    replica: str | None = None  # the replica serving the decode (first chunk only)
    engine_first_token_s: float | None = None  # engine-side time from the call to this chunk (first only)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token in `token_ids`; None unless asked for


@dataclass(frozen=True, slots=True)
class PrefixUpdate:
    """What changed in an engine's prefix cache, in the router's block hashes (from vLLM's KV events,
    `disagg.core.kv_event_fold`), pushed to one router with a state version."""

    seq: int  # the engine's prefix version this brings the router to
    since: int  # the version it applies on top of (0 with `snapshot`)
    added: frozenset[int]  # hashes now held (with `snapshot`: all of them)
    removed: frozenset[int] = frozenset()  # hashes no longer held
    snapshot: bool = False  # replace what the router knows of this engine's cache, not apply


@dataclass(frozen=True, slots=True)
class EngineStateReport:
    """One engine's load signals as of its latest scheduler step (counters are cumulative since start)."""

    replica: str  # the replica reporting
    role: Role  # what its engine does
    running: int  # requests in the running batch
    waiting: int  # requests queued in the engine's scheduler
    kv_used_tokens: int  # KV cache in use, in tokens
    kv_capacity_tokens: int  # KV cache size, in tokens
    prefix_cache_hits: int  # prompt tokens served from the prefix cache
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    kv_transfers_ok: int  # NIXL reads that completed (a request may need several)
    kv_transfers_failed: int  # KV transfers that failed
    kv_received_tokens: int  # prompt tokens whose KV arrived from a remote engine
    # router → (work s, calls, calls served whole here) it is serving: `AdmittedWork.totals`
    admitted: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    pid: int = 0  # the replica's process (its vLLM engine processes are its children)
    engine_pids: tuple[int, ...] = ()  # its vLLM engine's processes: the EngineCore first, then its workers
    block_size: int = 0  # tokens per KV block (the router's prefix index hashes in multiples of it)
    node_id: str = ""  # the Ray node the replica runs on (its KV crosses nodes when the pair's differ)
    seq: int = 0  # this state's version (`serve_app.state_push`): calls name the one they were decided on
    decisions: int = 0  # calls that named the version they were decided on (cumulative)
    stale_decisions: int = 0  # ... of which on a version older than the freshness bound (`state_age_bound_s`)
    prefix_seq: int = 0  # the version of its prefix cache, from vLLM's KV events (0: events are off)
    kv_events_missed: int = 0  # event batches lost, and blocks stored under a parent never seen (cumulative)
    steps: int = 0  # engine steps with outputs (cumulative; rides the versions other signals make: `state_push.moved`)
    prefixes: PrefixUpdate | None = None  # pushed to one router: its prefix cache since that router's last update

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe (the role as its value), for `/admin/state`; without the pushed prefix hashes."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "prefixes"} | {"role": self.role.value}


class ProbeKind(str, Enum):
    PREFILL = "prefill"  # a lone prompt of `size` tokens: its time to the first token
    DECODE = "decode"  # `size` streams of `tokens` tokens at once: the median step while all run


PROBE_CONTEXT = 16  # a decode probe's prompt tokens per stream, unless the call says


@dataclass(frozen=True, slots=True)
class ProbeCall:
    """One calibration measurement, computed on the engine alone: a greedy completion of random token
    ids (no prefix-cache hits), no KV moving, timed inside the engine replica so that no Serve hop
    is counted."""

    kind: ProbeKind
    size: int  # prompt tokens (prefill) or concurrent streams (decode)
    tokens: int = 1  # output tokens per stream (decode)
    seed: int = 0  # of the random prompts
    repeats: int = 1  # measured back to back; the reply's `seconds` is their median
    context: int = PROBE_CONTEXT  # prompt tokens of each decode stream: the context its steps attend to


@dataclass(frozen=True, slots=True)
class ProbeReply:
    seconds: float  # the median over the repeats of the prefill's time to its first token, or of the decode step
    replica: str  # the replica that measured it
    kv_capacity_tokens: int  # its KV cache size, in tokens
    samples: tuple[float, ...] = ()  # every repeat's value
