"""`Flight`: one request's record from validation to its last token.

The router builds it, the dispatcher fills it in as the request is placed, handed off and
streamed, and the request log and the response headers read it. A module of its own, so that
what reads it need not import what fills it in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.core.cost_model import SloTarget
from disagg.core.types import Decision, RequestFeatures, SloClass
from disagg.core.utility import Choice
from serve_app.messages import EngineTimeline, OutputDelta
from serve_app.router_text import RouterText
from serve_app.served_model import ServedModel


@dataclass(slots=True)
class Flight:
    """One request from validation to its last token: what was asked, decided and observed."""

    rid: str
    chat: bool
    slo: SloClass
    prompt_ids: list[int]  # rendered and tokenized for `model` by vLLM's OpenAI layer
    params: Any  # the request's vLLM SamplingParams
    model: ServedModel | None = None
    requested_model: str = ""  # the `model` the client named (a served model, or the alias)
    response_id: str = ""  # the answer's `id` (`rid` is per prompt: vLLM suffixes the prompt's index)
    prompt_index: int = 0  # which prompt of the request (a list of prompts: one flight each)
    fields: frozenset[str] = frozenset()  # the request fields the client set (an engine's refusal names one)
    prompt_text: str | None = None  # the rendered prompt, when there is one (vLLM's `echo` reads it)
    final_only: bool = False  # the client wants the whole answer at once: the outputs are joined before
    started: Any = None  # the task that routes, prefills and waits for the first token (`Dispatcher.start`)
    choice: Choice | None = None  # the alias route's choice (None: the request named its model)
    ttft_limit_s: float | None = None  # the alias route's TTFT limit
    lam: float | None = None  # the alias route's λ
    slo_scale: float | None = None  # its targets: this many times its own unloaded latency (None: its class's)
    prefilled: bool = False
    decision: Decision | None = None
    state_seen: dict[str, int] = field(default_factory=dict)  # instance id → the state version decided on
    decided_at: float = 0.0  # wall clock of the decision (the engines measure how old that state was)
    predicted: int | None = None  # predicted output tokens
    decision_us: float | None = None  # the placement decision's wall time (views and policy) ...
    decision_cpu_us: float | None = None  # ... and its CPU time: the wall less what the host's other processes took
    alias_us: float | None = None
    admitted: bool = False  # in the ledger
    work_s: tuple[float, float] = (0.0, 0.0)  # the prefill and decode work the ledger admitted it with
    t_received: float | None = None  # the router's handler got the request (body unread) ...
    t_arrival: float | None = None  # ... and, parsed and rendered by vLLM's layer, it is routed
    t_first: float | None = None
    actual_prefill: str | None = None  # the instances that served it (the decision may have failed over)
    actual_decode: str | None = None
    fallback: str | None = None
    prefill_engine_s: float | None = None
    decode_engine_first_s: float | None = None
    decode_engine_timeline: EngineTimeline | None = None  # where its time to the first token went
    stream: Any = None  # the decode's response stream (sample 0's)
    first_delta: OutputDelta | None = None  # received before answering, relayed first
    prompt_logprobs: Any = None  # from the prefill, when asked for (vLLM's `echo`, `prompt_logprobs`)
    num_cached_tokens: int | None = None  # prompt tokens the engines did not compute (usage's cached_tokens)
    output_ids: list[int] = field(default_factory=list)  # sample 0's tokens relayed so far (a migration prefills them)
    other_samples_tokens: int = 0  # the tokens of samples 1..n-1 (n > 1), relayed
    migrated_from: list[str] = field(default_factory=list)  # decode instances that failed mid-stream
    migrated_after: list[int] = field(default_factory=list)  # ... and the output tokens relayed when each did
    text_sent: list[str] = field(default_factory=list)  # the text relayed so far, chunk by chunk
    router_text: RouterText | None = None  # the router makes the text (`router_text`: a migration, a split character)
    prefix_hashes: tuple[int, ...] = ()  # the prompt's block hashes, when the model has a prefix index
    cached_predicted: dict[str, int] | None = None  # prompt tokens the index thought each chosen instance held
    prefill_cached_tokens: int | None = None  # ... and what the prefill engine's prefix cache supplied
    decode_held_tokens: int | None = None  # ... and what the decode engine held, by its KV events, when the call came
    finish_reason: str | None = None
    finished: bool = False

    @property
    def generated(self) -> int:
        """Sample 0's output tokens relayed so far."""
        return len(self.output_ids)

    @property
    def n(self) -> int:
        """Samples asked for."""
        return self.params.n

    @property
    def generated_total(self) -> int:
        """Output tokens relayed so far, every sample's."""
        return len(self.output_ids) + self.other_samples_tokens

    def features(self, output_tokens: int, block_tokens: int) -> RequestFeatures:
        """What its model's P/D policy knows of it: the exact prompt length, `output_tokens` predicted,
        its class, its prefix's block hashes (`block_tokens` each) and, with X-SLO-Scale, its own
        targets."""
        own = self.target() if self.slo_scale is not None else None
        return RequestFeatures(self.rid, len(self.prompt_ids), output_tokens, self.slo,
                               prefix_hashes=self.prefix_hashes, prefix_block_tokens=block_tokens,
                               ttft_target_s=own.ttft_s if own else None, tpot_target_s=own.tpot_s if own else None)

    def target(self) -> SloTarget:
        """Its latency targets on its model's fleet: its class's, or (X-SLO-Scale) that many times its
        own unloaded latency there."""
        return self.model.cost_model.target_for(self.slo, len(self.prompt_ids), self.slo_scale)

    @property
    def intake_s(self) -> float | None:
        """From the router's handler getting the request to routing it (body read, vLLM's rendering)."""
        return self.t_arrival - self.t_received if self.t_arrival and self.t_received else None

    @property
    def router_first_s(self) -> float | None:
        """From routing to the first token at the router."""
        return self.t_first - self.t_arrival if self.t_first and self.t_arrival else None

    def route_header(self) -> str:
        """The `x-disagg-route` header: the choice and decision with their costs, and who served."""
        h = self.decision.header_value() if self.decision else ""
        if self.choice is not None:
            h = f"{self.choice.header_value()}; {h}"
        actual = f"; served_prefill={self.actual_prefill}; served_decode={self.actual_decode}"
        # the engines' own share of the TTFT, and the router's: the time its handler took to read and
        # render the request (intake) and from routing to the first token; what the client measures
        # beyond them waited outside the handler (HTTP proxy, the router's event loop)
        engines = "".join(f"; {k}={v:.4f}" for k, v in (("prefill_engine_s", self.prefill_engine_s),
                                                          ("decode_engine_first_s", self.decode_engine_first_s),
                                                          ("intake_s", self.intake_s),
                                                          ("router_first_s", self.router_first_s))
                          if v is not None)
        return h + actual + engines + (f"; fallback={self.fallback}" if self.fallback else "")
