"""What the router knows of one engine instance, as the TTFT estimator's `InstanceSnapshot`.

The alias route (`model: auto`) estimates every candidate instance's TTFT by simulating its
batching forward (`disagg.core.latency_routing.route_by_latency`). The router cannot see inside
an engine; it builds each snapshot from its own in-flight ledger — every request it sent to the
instance and has not seen finish, with the prompt length, the tokens relayed so far and the
predicted output length — and takes the KV capacity from the instance's latest poll.

Approximations (each errs by at most the stated amount, and all are visible in the request log,
where the estimate sits beside the measured TTFT):
- a request without its first token is *queued* (FCFS, nothing computed): one whose prefill has
  started in the engine is estimated from scratch, an over-estimate of at most its prefill so far;
- a request with its first token is *decoding*, with the tokens the router has relayed: tokens
  are relayed in batches (every `engine.stream_interval_s`, 20 ms, growing under load up to
  `engine.stream_interval_max_s`, 80 ms), so it lags by at most that;
  its remaining output is the predicted length minus what it produced (at least one token):
  a request that will stop early (eos) is counted until it does;
- the step in flight is not known: the snapshot is `mid_step` when the instance has work, the
  running requests' step taken as half done at `now` (the average remainder a request arriving
  at a random moment waits for; off by at most half a step) and the queued ones after it;
- KV use is implied by the requests (prompt + decoded tokens each), not by the poll, which lags
  50 ms and cannot be split per request; a request whose KV would exceed the polled capacity
  (the engine must have preempted or stopped it) is left out rather than failing the estimate;
- on a prefill instance of a disaggregated model, a request counts until its prefill returns
  (`first_token` there means "prefilled"); the KV it holds while being pulled is not modelled. A
  request the policy *hosts* there (prefill and decode on that instance, `hosted`) counts as a
  whole request, decode included: it shares the instance's steps with the prefills.

Pure: no Ray, no clock reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from disagg.core.cost_model import EngineConstants
from disagg.core.ttft_estimator import InstanceSnapshot, QueuedRequest, RunningRequest


@dataclass(frozen=True, slots=True)
class FlightFacts:
    """One request in flight on an instance, as the router knows it (admission order)."""

    prompt_tokens: int
    predicted_output_tokens: int  # total, including the first token
    first_token: bool  # has the router seen its first token?
    relayed_tokens: int = 0  # output tokens the router has relayed so far
    hosted: bool = False  # on a prefill instance: it decodes there too


def instance_snapshot(flights: Sequence[FlightFacts], constants: EngineConstants,
                      prefill_only: bool = False) -> InstanceSnapshot:
    """The snapshot of an instance holding `flights` (see the module docstring for what is approximated).

    `prefill_only`: the instance is a prefill instance of a disaggregated model; its requests end
    at their first token, but for the ones it hosts.
    """
    bs = constants.block_size
    room = constants.kv_capacity_tokens // bs
    waiting, running = [], []
    for f in flights:
        only = prefill_only and not f.hosted
        if not f.first_token:
            out = 1 if only else max(1, f.predicted_output_tokens)
            waiting.append(QueuedRequest(f.prompt_tokens, out, prefill_only=only))
            continue
        if only:
            continue  # its prefill is done; the KV hand-off is not modelled
        decoded = max(1, f.relayed_tokens)
        blocks = -(-(f.prompt_tokens + decoded) // bs)
        if blocks > room:
            continue
        room -= blocks
        running.append(RunningRequest(f.prompt_tokens, decoded, max(1, f.predicted_output_tokens - decoded)))
    # the router sees no step boundaries: whatever runs there is taken as half a step along
    return InstanceSnapshot(tuple(waiting), tuple(running), mid_step=bool(waiting or running))
