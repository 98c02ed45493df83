"""`Flight`: one request's record from validation to its last token.

The router builds it, the dispatcher fills it in as the request is placed, handed off and
streamed, and the request log and the response headers read it. A module of its own, so that
what reads it need not import what fills it in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.core.types import Decision, SloClass
from disagg.core.utility import Choice
from serve_app.messages import DecodeChunk
from serve_app.router_text import RouterText
from serve_app.served_model import ServedModel


@dataclass(slots=True)
class Flight:
    """One request from validation to its last token: what was asked, decided and observed."""

    rid: str
    req: Any  # the parsed OpenAI request
    chat: bool
    slo: SloClass
    prompt_ids: list[int]  # tokenized for `model`
    sampling: dict
    model: ServedModel | None = None
    choice: Choice | None = None  # the alias route's choice (None: the request named its model)
    ttft_limit_s: float | None = None  # the alias route's TTFT limit
    lam: float | None = None  # the alias route's λ
    prefilled: bool = False
    decision: Decision | None = None
    predicted: int | None = None  # predicted output tokens
    decision_us: float | None = None
    alias_us: float | None = None
    admitted: bool = False  # in the ledger
    work_s: tuple[float, float] = (0.0, 0.0)  # the prefill and decode work the ledger admitted it with
    t_arrival: float | None = None
    t_first: float | None = None
    actual_prefill: str | None = None  # the instances that served it (the decision may have failed over)
    actual_decode: str | None = None
    fallback: str | None = None
    prefill_engine_s: float | None = None
    decode_engine_first_s: float | None = None
    stream: Any = None  # the decode's response stream
    first_chunk: DecodeChunk | None = None  # received before answering, relayed first
    output_ids: list[int] = field(default_factory=list)  # output tokens relayed so far (a migration prefills them)
    migrated_from: list[str] = field(default_factory=list)  # decode instances that failed mid-stream
    migrated_after: list[int] = field(default_factory=list)  # ... and the output tokens relayed when each did
    text_sent: list[str] = field(default_factory=list)  # the text relayed so far, chunk by chunk
    router_text: RouterText | None = None  # the router makes the text (`router_text`: a migration, a split character)
    prefix_hashes: tuple[int, ...] = ()  # the prompt's block hashes, when the model has a prefix index
    cached_predicted: dict[str, int] | None = None  # prompt tokens the index thought each chosen instance held
    prefill_cached_tokens: int | None = None  # ... and what the prefill engine's prefix cache supplied
    finish_reason: str | None = None
    finished: bool = False

    @property
    def generated(self) -> int:
        """Output tokens relayed so far."""
        return len(self.output_ids)

    def route_header(self) -> str:
        """The `x-disagg-route` header: the choice and decision with their costs, and who served."""
        h = self.decision.header_value() if self.decision else ""
        if self.choice is not None:
            h = f"{self.choice.header_value()}; {h}"
        actual = f"; served_prefill={self.actual_prefill}; served_decode={self.actual_decode}"
        # the engines' own share of the TTFT: what the client measures beyond it is the serving path
        engines = "".join(f"; {k}={v:.4f}" for k, v in (("prefill_engine_s", self.prefill_engine_s),
                                                          ("decode_engine_first_s", self.decode_engine_first_s))
                          if v is not None)
        return h + actual + engines + (f"; fallback={self.fallback}" if self.fallback else "")
