"""The cost model: what one engine step costs on the target hardware, and the SLO targets.

One plain data object, loaded from and saved to YAML, read by the live router, the simulator, the
TTFT estimator and written by calibration. Every time it knows is in seconds.

One continuous-batching step costs::

    step_s = step_base_s + prefill_token_s * prefill_tokens + decode_seq_s * decode_seqs
             + prefill_attention_s * Σ c·(k + c/2)     (over the step's prefill chunks)
             + decode_context_s * Σ context              (over its decoding sequences)

where a chunk of c prompt tokens is computed over k tokens already in its KV: its attention work
grows with the context, so a prefill's time is quadratic in its prompt. c·(k + c/2) adds up over the
chunks of one prompt to p²/2 whatever the chunking, so a lone prefill of p tokens takes
``prefill_overhead_s + step_base_s + p * prefill_token_s + prefill_attention_s * p²/2`` in one chunk
(τ_pre is the linear slope; the overhead is what a finished prefill costs beyond its steps:
scheduling, KV registration for the hand-off, output handling) and one decode token at
concurrency b takes ``step_base_s + b * decode_seq_s + decode_context_s * K`` (τ_dec(b)) where K is
the tokens the b sequences hold in all: each decoding token attends to its sequence's whole
context, measured by decode probes at long prompts. KV transfer between a prefill and a decode
instance takes ``latency_s + tokens / tokens_per_s``. Constants can differ
per instance (heterogeneous fleets) and per (prefill, decode) pair (for example same node vs across
nodes); the defaults apply otherwise.

Units are checked on load: a cost model whose numbers cannot describe real hardware (a decode step
above a second, a zero prefill slope) is refused with the offending value named — with wrong units
the marginal-cost scorer silently degenerates into queue counting, which is the failure the
calibration paper measured.

Shared hardware (`shared_host`): where the engines do not own their devices — the CPU profile runs
every engine's compute on one core and the serving path's Python on every core, that one included —
every busy engine's steps run slower than alone by one stretch factor, processor sharing:

    stretch = max(1, k / engine_cores) + (request_cores + relay_cores + idle_cores) / cores
              + step_cores / (cores · stretch)

with k engines busy and the serving path demanding request_cpu_s per request at the rate requests
arrive (spent over each request's life, not in the step that prefills it); step_cpu_s per busy
engine's step, and event_cpu_s per message of tokens where a message leaves every step, at the rate
the busy engines step — the stretched rate, hence the fixed point; event_cpu_s per message where
the app batches a stream's tokens over a longer interval (`stream_interval`), at that interval's
rate (relay_cores); and idle_cores whatever is served (the stack's background: Ray, metrics).
Profiles calibrated before steps and messages were counted price token_cpu_s per streamed token
at the steps' rate instead: on the CPU profile that cost per token fell two- to fourfold from one
stream to sixteen, while per step and per message it held (docs/results.md).
The engines time-share the cores they are pinned to; the serving path's threads are not pinned, so
the operating system spreads them over every core, the engines' included, and each busy engine
loses their share of its core on top (they do not wait for the cores the engines leave idle: the
form `max(1, k / engine_cores, (k + serving_cores) / cores)`, which assumed they did, priced the CPU
profile's latencies a third too low — docs/results.md, "The serving path on every core").
Absent (one GPU per engine), the stretch is 1 and every formula above holds as it is.
"""

from __future__ import annotations

import math
import statistics
from functools import cached_property
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from disagg.core.types import SloClass
from disagg.core.yaml_errors import explain, read_yaml, yaml_root
from disagg.files import atomic_write

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineConstants(_Strict):
    """Step-time model and scheduler limits of one engine instance."""

    step_base_s: float = Field(ge=0.0, le=1.0, description="fixed cost of one engine step (s)")
    prefill_token_s: float = Field(gt=0.0, le=0.01, description="τ_pre: seconds per prompt token")
    decode_seq_s: float = Field(ge=0.0, le=1.0, description="added step time per decoding sequence (s)")
    prefill_overhead_s: float = Field(default=0.0, ge=0.0, le=1.0,
                                      description="fixed cost per finished prefill beyond its steps (s)")
    # 0 (the default) is the linear model every profile before it meant
    prefill_attention_s: float = Field(
        default=0.0, ge=0.0, le=1e-5,
        description="seconds per prefill token per token of context it attends to: a chunk of c tokens "
                    "after k computed ones adds prefill_attention_s·c·(k + c/2) to its step")
    # 0 (the default) is the decode step every profile before it meant
    decode_context_s: float = Field(
        default=0.0, ge=0.0, le=1e-5,
        description="seconds per step per token of context a decoding sequence attends to (its prompt and "
                    "what it has generated): a step over decoding sequences holding K tokens adds "
                    "decode_context_s·K")
    kv_capacity_tokens: int = Field(gt=0, description="KV cache capacity in tokens")
    block_size: int = Field(default=16, gt=0, description="KV block size in tokens")
    max_num_seqs: int = Field(default=256, gt=0, description="cap on running sequences")
    max_batched_tokens: int = Field(default=2048, gt=0, description="token budget per step (chunked prefill)")
    measured_at: str | None = Field(
        default=None, description="when these constants were measured on the engine they describe (ISO 8601, "
                                  "UTC; `disagg calibrate --live` writes it); None: not measured per instance")

    @model_validator(mode="after")
    def _decode_step_is_physical(self) -> "EngineConstants":
        one_token = self.step_base_s + self.decode_seq_s
        if one_token <= 0.0 or one_token > 1.0:
            raise ValueError(
                f"decode time per token at batch 1 is {one_token!r} s (step_base_s + decode_seq_s); "
                "it must be in (0, 1] s — are the units seconds?"
            )
        return self

    def step_s(self, prefill_tokens: int, decode_seqs: int, pairs: float = 0.0, context: int = 0) -> float:
        """One step; `pairs` is Σ `attention_pairs(c, k)` over its prefill chunks, `context` the
        tokens its decoding sequences hold in all."""
        s = (self.step_base_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs
             + self.prefill_attention_s * pairs)
        c = self.decode_context_s  # 0 on every profile without the term: the hot paths skip it
        return s + c * context if c else s

    def prefill_s(self, prompt_tokens: int, context_tokens: int = 0) -> float:
        """A lone prefill of `prompt_tokens` after `context_tokens` already in its KV (a prefix-cache
        hit), chunked by the step token budget: each chunk pays the step base, and the chunks'
        attention adds up to `attention_pairs(prompt_tokens, context_tokens)` however they are cut."""
        chunks = -(-prompt_tokens // self.max_batched_tokens)
        return (self.prefill_overhead_s + chunks * self.step_base_s + self.prefill_token_s * prompt_tokens
                + self.prefill_attention_s * attention_pairs(prompt_tokens, context_tokens))

    def decode_token_s(self, concurrency: int, context: int = 0) -> float:
        """τ_dec at a given number of co-running sequences (≥ 1) holding `context` tokens in all."""
        s = self.step_base_s + self.decode_seq_s * max(1, concurrency)
        c = self.decode_context_s
        return s + c * context if c else s

    def scaled(self, factor: float) -> "EngineConstants":
        """The same engine with every step-time term scaled by `factor` (a slower or faster device, or
        a model `factor`× the size on the same one), same scheduler limits."""
        return self.model_copy(update={
            "step_base_s": self.step_base_s * factor, "prefill_token_s": self.prefill_token_s * factor,
            "prefill_attention_s": self.prefill_attention_s * factor, "decode_seq_s": self.decode_seq_s * factor,
            "decode_context_s": self.decode_context_s * factor, "prefill_overhead_s": self.prefill_overhead_s * factor})


def attention_pairs(chunk_tokens: int, context_tokens: int) -> float:
    """The attention work of a prefill chunk of c tokens over k tokens already computed, in
    (query, key) token pairs: each new token attends to the context and, causally, to the chunk
    before it — c·k + c²/2 (the continuous form, so that the chunks of one prompt sum to p²/2)."""
    return chunk_tokens * (context_tokens + chunk_tokens / 2)


class SharedHost(_Strict):
    """Engines that share one host's processors with each other and with the serving path."""

    engine_cores: float = Field(gt=0.0, le=4096.0,
                                description="processors the engines' steps run on, together: k busy engines each "
                                            "get engine_cores / k of one when k exceeds it")
    cores: float = Field(gt=0.0, le=4096.0,
                         description="processors of the host, shared by the engines' steps and the serving path")
    token_cpu_s: float = Field(default=0.0, ge=0.0, le=0.1,
                               description="CPU seconds per streamed token outside the engines' steps (output "
                                           "processing, engine replica, router, proxy); calibrations that count "
                                           "steps and messages (`step_cpu_s`, `event_cpu_s`) leave it at 0")
    step_cpu_s: float = Field(default=0.0, ge=0.0, le=0.1,
                              description="CPU seconds per engine step outside the engine's own processes: "
                                          "vLLM's processing of the step's outputs and its statistics, in the "
                                          "engine replica")
    event_cpu_s: float = Field(default=0.0, ge=0.0, le=0.1,
                               description="CPU seconds per message of streamed tokens the serving path relays "
                                           "(engine replica, router, proxy, to the client)")
    stream_interval_s: float = Field(default=0.0, ge=0.0, le=1.0,
                                     description="the app's batching of a stream's tokens into one message at "
                                                 "most this often (its `engine.stream_interval_s`; 0: a message "
                                                 "per token)")
    stream_interval_max_s: float = Field(default=0.0, ge=0.0, le=1.0,
                                         description="the longest the batching interval grows to with the "
                                                     "engine's open streams (its `engine.stream_interval_max_s`)")
    request_cpu_s: float = Field(default=0.0, ge=0.0, le=1.0,
                                 description="CPU seconds per request served outside the engines' steps "
                                             "(rendering, routing, the prefill and decode calls)")
    idle_cores: float = Field(default=0.0, ge=0.0, le=4096.0,
                              description="processors the serving stack takes with nothing served (Ray, the "
                                          "engines' state pushes, metrics), a share of every core")
    # 1 (the default) is the fair sharing every profile before it meant
    prefill_weight: float = Field(
        default=1.0, gt=0.0, le=10.0,
        description="the share of the engines' cores a step of prefill claims against a decode step's (1: "
                    "even). The operating system favours long compute-bound steps: beside a batch of "
                    "decodes, a 1,984-token prefill took about 62% of one core, not half")
    mixed_cores: float | None = Field(
        default=None, gt=0.0, le=4096.0,
        description="processors the engines' steps share while one of them prefills (None: engine_cores). "
                    "Decode steps beside each other lost up to 17% of their core in some calibrations; a "
                    "prefill beside a decode lost at most 8% in all")
    measured_at: str | None = Field(default=None, description="when calibration measured these (ISO 8601, UTC)")

    @model_validator(mode="after")
    def _engines_fit_on_the_host(self) -> "SharedHost":
        for name in ("engine_cores", "mixed_cores"):
            value = getattr(self, name)
            if value is not None and value > self.cores:
                raise ValueError(f"{name} ({value!r}) cannot exceed the host's cores ({self.cores!r})")
        return self

    def stretch(self, busy: int, token_cores: float = 0.0, request_cores: float = 0.0,
                own: float = 1.0, weights: float | None = None) -> float:
        """How many times slower than alone a busy engine's steps run, with `busy` engines busy, the
        serving path working for their steps (`token_cores`: the processors it needs at the engines'
        unstretched rates) and at rates of its own (`request_cores`: the requests arriving, the
        messages batched over an interval), beside the stack's background (`idle_cores`); 1 when
        nothing is busy.

        With more busy engines than their cores, each gets the cores in proportion to its step's
        weight (`own`, of `weights` summed over the busy engines, the engine's own included; by
        default every weight is 1: `step_weight`). A heavy engine's share above one core is not
        handed on to the others: the light ones are priced as if it took it, a bound that is
        exact on one core. The cores shared are `engine_cores` among decode steps and move to
        `mixed_cores` as the busy engines' weight above one each grows to one prefill's.

        The tokens come at the stretched rate — the engines that make them are slowed too — so their
        share is `token_cores / σ` and σ is the fixed point σ = b + a / σ (b the engines' sharing and
        the requests' share, a the tokens' share at full speed): at the unstretched rate, eight
        streams on each of two engines asked 3.4 processors of a two-processor host and were priced
        at 12.7 ms a token where they streamed at 8.1 (docs/results.md)."""
        if busy <= 0:
            return 1.0
        b = self._sharing(busy, own, weights) + (request_cores + self.idle_cores) / self.cores
        a = token_cores / self.cores
        return b if a == 0.0 else 0.5 * (b + math.sqrt(b * b + 4.0 * a))

    def _sharing(self, busy: int, own: float, weights: float | None) -> float:
        """How many times slower than alone the engines' own sharing of their cores runs a step of
        weight `own` (`stretch`, without the serving path and the background)."""
        if weights is None:
            return max(1.0, busy / self.engine_cores)
        cores = self._cores_shared(busy, weights)
        return 1.0 if busy <= cores else max(1.0, weights / (own * cores))

    def _cores_shared(self, busy: int, weights: float) -> float:
        """The engines' cores with `busy` steps of total weight `weights` on them (`stretch`)."""
        if self.mixed_cores is None or self.prefill_weight == 1.0:
            return self.engine_cores
        prefill = min(1.0, max(0.0, (weights - busy) / (self.prefill_weight - 1.0)))
        return self.engine_cores + (self.mixed_cores - self.engine_cores) * prefill

    def step_weight(self, prefill_s: float, seconds: float) -> float:
        """The weight of a step of `seconds` (alone), `prefill_s` of it prefill work: `prefill_weight`
        for a step all prefill, 1 for one all decode, in proportion between."""
        if self.prefill_weight == 1.0 or prefill_s <= 0.0 or seconds <= 0.0:
            return 1.0
        return 1.0 + (self.prefill_weight - 1.0) * min(1.0, prefill_s / seconds)

    @classmethod
    def pooled(cls, hosts: "list[SharedHost]") -> "SharedHost":
        """One host's terms from several measurements of it (each served model's calibration measures
        the host again): the median of each term, the latest `measured_at`. Two calibrations of one
        host 20 s apart measured a prefill weight of 1.05 and 1.89; whichever model is listed first
        is no better a judge of the host than the other. A host without `mixed_cores` counts its
        `engine_cores`. ValueError when they describe hosts of different sizes."""
        if not hosts:
            raise ValueError("pooling a shared host needs at least one measurement of it")
        if len({h.cores for h in hosts}) > 1:
            raise ValueError(f"these describe different hosts: {sorted({h.cores for h in hosts})} cores")
        if len(hosts) == 1:
            return hosts[0]

        def median(term) -> float:
            return statistics.median(term(h) for h in hosts)

        mixed = any(h.mixed_cores is not None for h in hosts)
        stamps = [h.measured_at for h in hosts if h.measured_at is not None]
        return cls(engine_cores=median(lambda h: h.engine_cores), cores=hosts[0].cores,
                   token_cpu_s=median(lambda h: h.token_cpu_s), request_cpu_s=median(lambda h: h.request_cpu_s),
                   step_cpu_s=median(lambda h: h.step_cpu_s), event_cpu_s=median(lambda h: h.event_cpu_s),
                   stream_interval_s=hosts[-1].stream_interval_s,
                   stream_interval_max_s=hosts[-1].stream_interval_max_s,
                   idle_cores=median(lambda h: h.idle_cores), prefill_weight=median(lambda h: h.prefill_weight),
                   mixed_cores=median(lambda h: h.mixed_cores or h.engine_cores) if mixed else None,
                   measured_at=max(stamps) if stamps else None)

    def serving_cores(self, tokens: float, seconds: float) -> tuple[float, float]:
        """Processors the serving path needs beside an engine whose steps of `seconds` (alone) each
        stream a token to `tokens` streams: (what follows the steps — each step's output processing,
        each token, and each message where the app sends one every step — so it slows as the steps
        are stretched; what does not — the messages where the app batches a stream's tokens over an
        interval longer than a step, a rate of their own). On the CPU profile a lone stream's tokens
        left in messages of 3–4, and its steps cost about 1 ms of serving CPU each. A step with no
        output (a prompt's chunk before its last) gives the replica nothing to process."""
        if tokens <= 0:
            return 0.0, 0.0
        per_step = self.step_cpu_s + tokens * self.token_cpu_s
        if self.event_cpu_s == 0.0:
            return per_step / seconds, 0.0
        interval = stream_interval(tokens, self.stream_interval_s, self.stream_interval_max_s)
        if interval > seconds:
            return per_step / seconds, tokens * self.event_cpu_s / interval
        return (per_step + tokens * self.event_cpu_s) / seconds, 0.0

    def request_cores(self, requests_per_s: float) -> float:
        """Processors the serving path's per-request work takes when requests arrive at `requests_per_s`."""
        return requests_per_s * self.request_cpu_s


STREAMS_PER_INTERVAL = 4  # streams an engine batches at the base interval before the interval grows


def stream_interval(streams: float, base_s: float, most_s: float) -> float:
    """The interval an engine with `streams` open batches each stream's tokens over (the app's
    engine replicas do; `base_s` its `stream_interval_s`, `most_s` its `stream_interval_max_s`):
    the base up to STREAMS_PER_INTERVAL streams, then growing with their number up to `most_s`, so
    the messages an engine sends per second stay flat as load grows instead of the token path's
    hops' cost growing with it."""
    return min(max(base_s, most_s), max(base_s, base_s * streams / STREAMS_PER_INTERVAL))


class TransferConstants(_Strict):
    latency_s: float = Field(ge=0.0, le=10.0, description="fixed cost of one KV transfer (s)")
    tokens_per_s: float = Field(gt=0.0, description="KV transfer bandwidth in tokens per second")
    between_prefill_steps: bool = Field(
        default=False,
        description="the prefill engine's side of a transfer moves only between its steps (NIXL without a "
                    "progress thread, as on the CPU profile): a transfer due while that engine runs a step "
                    "ends with the step")

    def transfer_s(self, tokens: int) -> float:
        return self.latency_s + tokens / self.tokens_per_s


class SloTarget(_Strict):
    ttft_s: float = Field(gt=0.0, description="time-to-first-token target (s)")
    tpot_s: float = Field(gt=0.0, description="time-per-output-token target (s)")


class CostModel(_Strict):
    """Calibrated constants for one deployment: engines, KV transfer, SLO targets."""

    name: str = Field(description="what this file describes, e.g. 'a40-qwen2.5-3b'")
    model: str = Field(default="", description="the model these constants were measured with")
    engine: EngineConstants
    transfer: TransferConstants
    slo: dict[SloClass, SloTarget]
    instances: dict[str, EngineConstants] = Field(
        default_factory=dict, description="per-instance overrides (heterogeneous fleets)"
    )
    pairs: dict[str, TransferConstants] = Field(
        default_factory=dict, description="per 'prefill->decode' pair transfer overrides"
    )
    serving_overhead_s: float = Field(
        default=0.0, ge=0.0, le=10.0,
        description="time a request spends outside the engines before its first token reaches the client "
                    "(HTTP proxy, router, Serve hops), unloaded; measured by `disagg calibrate --url`",
    )
    handoff_overhead_s: float = Field(
        default=0.0, ge=0.0, le=10.0,
        description="time a disaggregated request spends outside the engines beyond `serving_overhead_s`, "
                    "unloaded: the prefill call's reply and the decode call; measured by `disagg calibrate --live`",
    )
    shared_host: SharedHost | None = Field(
        default=None, description="engines sharing one host's processors with each other and the serving path "
                                  "(CPU profiles); None: each engine owns its device (one GPU each)")
    calibrated: bool = Field(default=False, description="true when written by `disagg calibrate`")

    @field_validator("slo")
    @classmethod
    def _every_class_has_a_target(cls, v: dict[SloClass, SloTarget]) -> dict[SloClass, SloTarget]:
        missing = [c.value for c in SloClass if c not in v]
        if missing:
            raise ValueError(f"missing SLO targets for class(es) {missing}")
        return v

    @field_validator("pairs")
    @classmethod
    def _pair_keys(cls, v: dict[str, TransferConstants]) -> dict[str, TransferConstants]:
        for key in v:
            if key.count("->") != 1:
                raise ValueError(f"pair key {key!r} must look like 'prefill_id->decode_id'")
        return v

    def for_instance(self, instance_id: str) -> EngineConstants:
        return self.instances.get(instance_id, self.engine)

    def transfer_between(self, prefill_id: str, decode_id: str) -> TransferConstants:
        return self.pairs.get(f"{prefill_id}->{decode_id}", self.transfer)

    def transfer_s(self, prefill_id: str, decode_id: str, tokens: int) -> float:
        if prefill_id == decode_id:
            return 0.0
        return self.transfer_between(prefill_id, decode_id).transfer_s(tokens)

    def target(self, slo_class: SloClass) -> SloTarget:
        return self.slo[slo_class]

    def target_for(self, slo_class: SloClass, prompt_tokens: int, slo_scale: float | None = None) -> SloTarget:
        """A request's targets: its class's, or (`slo_scale`) that many times its own unloaded latency."""
        if slo_scale is None:
            return self.slo[slo_class]
        own = self.unloaded(prompt_tokens)
        return SloTarget(ttft_s=slo_scale * own.ttft_s, tpot_s=slo_scale * own.tpot_s)

    def unloaded(self, prompt_tokens: int) -> SloTarget:
        """The request's own latency on an idle disaggregated fleet, by the pool's constants: TTFT =
        its prefill, the KV transfer, the first decode step and the serving path with its hand-off; TPOT =
        a decode step at batch 1. An SLO scale of x makes x times these the request's targets (DistServe)."""
        e = self.engine
        outside = self.serving_overhead_s + self.handoff_overhead_s
        return SloTarget(ttft_s=e.prefill_s(prompt_tokens) + self.transfer.transfer_s(prompt_tokens)
                         + e.decode_token_s(1) + outside, tpot_s=e.decode_token_s(1))

    @cached_property
    def max_kv_capacity_tokens(self) -> int:
        return max([self.engine.kv_capacity_tokens, *(c.kv_capacity_tokens for c in self.instances.values())])

    # --- YAML edge -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict, path: Path | None = None) -> "CostModel":
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise CostModelError(explain(e, path, yaml_root(path) if path else None)) from None

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        data = read_yaml(path, CostModelError, "cost-model")
        if not isinstance(data, dict):
            raise CostModelError(f"{path}: a cost model is a YAML mapping, got {type(data).__name__}")
        return cls.from_dict(data, path)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def save(self, path: str | Path) -> None:
        """Write atomically (`disagg.files.atomic_write`): a reader never sees half a file."""
        with atomic_write(path) as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)


class CostModelError(ValueError):
    """A cost-model file or dict that cannot be used; the message names file, line and field."""


def shipped_profiles() -> list[str]:
    """The names of the cost-model profiles shipped in disagg/profiles."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> CostModel:
    """A shipped profile by name ('a40', 'cpu-tiny') or any cost-model YAML by path.

    Any path: for trusted input (the config file). A name or path from an HTTP client goes through
    `graph.access.CostModelFiles`, which confines it."""
    if isinstance(name_or_path, str) and name_or_path in shipped_profiles():
        return CostModel.load(PROFILES_DIR / f"{name_or_path}.yaml")
    path = Path(name_or_path)
    if path.exists():
        return CostModel.load(path)
    raise CostModelError(f"no cost-model profile or file {str(name_or_path)!r}; shipped profiles: "
                         f"{shipped_profiles()}")
