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

Pure: the router passes the views it routes with; no clock, no I/O.
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
