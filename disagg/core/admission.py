"""Admission control: refuse a request at once (429 + Retry-After) when the fleet is too far behind.

A request the engines cannot start for many seconds is better refused in a millisecond, with a
hint of when to come back, than accepted into a queue where it times out at the client — the way
Ray Serve, Dynamo and SGLang's gateway shed load. The signal is in the engines' own units, so it
holds on any hardware: a decode instance runs at most `max_num_seqs` requests at once, and
a request admitted where `shed_queue_factor × max_num_seqs` are already queued waits for that many
batches to drain before it decodes. When even the least loaded decode candidate is that far
behind, the request is shed.

Loose requests go first: a tight request is shed only past `tight_headroom` times that bound, so
under overload the capacity left goes to the class with the stricter SLO.

`Retry-After` is the estimated time for the least loaded candidate to drain back under the
bound: the queued requests beyond it, `max_num_seqs` at a time, each taking the mean priced
decode time of what is queued there (the ledger's backlog / queue). Clamped to 1–60 s.

The router itself can be the bottleneck: on a small machine, or under a burst, requests wait to
be read while its event loop works through the ones it has, and no engine queue shows it. So
`shed_for_lag` refuses a request before its body is read when the loop's recent lag (how late
its timers fire) passes `loop_lag_bound_s` (tight requests: `tight_headroom` times that): a
refusal costs the loop little, and lets the requests it keeps meet their targets.

Pure: the router passes the views it routes with and the lag it measured; no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from disagg.core.types import InstanceView, SloClass

RETRY_AFTER_BOUNDS_S = (1, 60)


@dataclass(frozen=True, slots=True)
class Shed:
    """Why a request is refused, and when to come back."""

    retry_after_s: int
    queued: int  # requests on the least loaded candidate
    bound: float  # the queue at which this request's class is shed

    def message(self) -> str:
        return (f"overloaded: the least loaded decode instance holds {self.queued} requests (this request's "
                f"class is refused from {self.bound:g}); retry after {self.retry_after_s} s")


def shed(candidates: Sequence[InstanceView], max_num_seqs: int, slo: SloClass, queue_factor: float,
         tight_headroom: float = 2.0) -> Shed | None:
    """A `Shed` when every decode candidate is past the request's class bound, else None.

    `queue_factor` 0 disables shedding. No candidates: None (routing reports no capacity itself).
    """
    if queue_factor <= 0 or not candidates or max_num_seqs <= 0:
        return None
    bound = queue_factor * max_num_seqs * (tight_headroom if slo is SloClass.TIGHT else 1.0)
    best = min(candidates, key=lambda v: (v.queued, v.backlog_s))
    if best.queued < bound:
        return None
    per_request_s = best.backlog_s / best.queued
    drain_s = (best.queued - bound + 1) * per_request_s / max_num_seqs
    lo, hi = RETRY_AFTER_BOUNDS_S
    return Shed(min(hi, max(lo, math.ceil(drain_s))), best.queued, bound)


@dataclass(frozen=True, slots=True)
class LagShed:
    """A request refused because the router's own event loop is behind."""

    retry_after_s: int
    lag_s: float
    bound_s: float

    def message(self) -> str:
        return (f"overloaded: the router is {self.lag_s * 1e3:.0f} ms behind (this request's class is refused from "
                f"{self.bound_s * 1e3:.0f} ms); retry after {self.retry_after_s} s")


def shed_for_lag(lag_s: float, loop_lag_bound_s: float, slo: SloClass, tight_headroom: float = 2.0) -> LagShed | None:
    """A `LagShed` when the router's loop lag is past the request's class bound, else None.
    `loop_lag_bound_s` 0 disables it. Retry-After: the lag itself, in whole seconds (1–60)."""
    if loop_lag_bound_s <= 0:
        return None
    bound = loop_lag_bound_s * (tight_headroom if slo is SloClass.TIGHT else 1.0)
    if lag_s < bound:
        return None
    lo, hi = RETRY_AFTER_BOUNDS_S
    return LagShed(min(hi, max(lo, math.ceil(lag_s))), lag_s, bound)
