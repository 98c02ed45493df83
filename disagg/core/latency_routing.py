"""Latency-aware routing among heterogeneous model instances: the one decision function.

"Beyond accuracy and cost: latency-aware LLM query routing" routes each query to the instance
(and so the model) that maximises

    U(i) = acĉ(model(i), query) − λ · cost̂(model(i), query)

among the instances whose estimated TTFT is within the query's limit, and to the instance with the
smallest estimated TTFT when none is. `route_by_latency` is that decision, end to end: it prices
every candidate with the three estimators of the core —

- TTFT: `estimate_ttft` runs the instance's continuous batching forward from its snapshot
  (disagg.core.ttft_estimator; the same engine model the simulator runs), the query colocated
  (prefill and decode on the instance);
- cost: `cost_estimate` with the model's per-token prices, prompt + predicted output;
- accuracy: `AccuracyTable.predict(model, prompt_tokens)`;

— and returns `choose_instance`'s `Choice`, which carries every candidate's terms.

Who calls, when, what holds:
- the `latency_aware` model-level router (disagg.core.model_routing), which the fleet simulator
  and the live router's alias route run, once per query, with every candidate instance's
  constants and the snapshot the caller keeps of that instance;
- pure: no I/O, no clock reads (`now` comes in), never mutates its arguments;
- deterministic: the same inputs give the same Choice (ties go to the first instance).

TTFT in the Choice: exact (`estimate_ttft` without a horizon, bit for bit) for every instance
within the limit and for the chosen one. To stay fast under load, an instance is simulated only
up to the query's limit; one that cannot meet it reports `ttft_s = inf` ("beyond the limit"),
unless no instance meets the limit, in which case every instance is estimated in full and the
fastest is chosen. An instance whose KV cache can never hold the query also reports `inf` and is
never chosen; when no instance can hold it the call raises `NoCapacity`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from disagg.core.cost_model import EngineConstants
from disagg.core.engine_model import HostShare
from disagg.core.ttft_estimator import InstanceSnapshot, estimate_ttft
from disagg.core.types import NoCapacity
from disagg.core.utility import (
    AccuracyTable,
    Candidate,
    Choice,
    ModelPrices,
    Query,
    choose_instance,
    cost_estimate,
)


@dataclass(frozen=True, slots=True)
class ModelInstance:
    """One engine instance serving one model: its id, model name, calibrated constants and prices;
    `host`: where it shares a host with other engines, the share they take (`peer_share`)."""

    instance_id: str
    model: str
    constants: EngineConstants
    prices: ModelPrices
    host: HostShare | None = None


def can_ever_hold(constants: EngineConstants, prompt_tokens: int) -> bool:
    """True when an idle instance's KV cache holds the prompt plus its first token
    (the engine model's `can_ever_fit`, from the constants alone)."""
    bs = constants.block_size
    return -(-(prompt_tokens + 1) // bs) <= constants.kv_capacity_tokens // bs


def route_by_latency(
    instances: Sequence[tuple[ModelInstance, InstanceSnapshot]],
    prompt_tokens: int,
    predicted_output_tokens: float,
    ttft_limit_s: float,
    lam: float,
    accuracy: AccuracyTable,
    now: float,
) -> Choice:
    """The instance maximising accuracy − lam·cost with estimated TTFT ≤ ttft_limit_s (see module docstring).

    `instances`: every candidate with the snapshot the caller keeps of it, in a stable order (ties
    go to the first). `predicted_output_tokens` prices the query's cost only; its own output cannot
    change its first token. Raises ValueError naming 'lambda' or 'ttft_limit' for a bad λ or limit
    (as `choose_instance`), ValueError for a prompt that is not an integer ≥ 1, and NoCapacity when
    the list is empty or no instance can ever hold the prompt.
    """
    query = Query(ttft_limit_s)  # validates the limit before any work
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (math.isfinite(lam) and lam >= 0.0):
        raise ValueError(f"lambda must be a finite number >= 0, got {lam!r}")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be an integer >= 1, got {prompt_tokens!r}")
    if not instances:
        raise NoCapacity("no candidate instances for the query")

    holds = [can_ever_hold(inst.constants, prompt_tokens) for inst, _ in instances]
    if not any(holds):
        raise NoCapacity(f"a prompt of {prompt_tokens} tokens fits no instance's KV cache")
    # First pass: simulate each instance only up to the limit (a censored estimate is > limit).
    ttfts = [estimate_ttft(inst.constants, snap, prompt_tokens, now, horizon_s=ttft_limit_s, host=inst.host).ttft_s
             if ok else math.inf
             for (inst, snap), ok in zip(instances, holds)]
    if not any(t <= ttft_limit_s for t in ttfts):
        # Nobody meets the limit: the fallback is the fastest, so every estimate must be complete.
        ttfts = [estimate_ttft(inst.constants, snap, prompt_tokens, now, host=inst.host).ttft_s if ok else math.inf
                 for (inst, snap), ok in zip(instances, holds)]
    candidates = [
        Candidate(inst.instance_id, inst.model, t, accuracy.predict(inst.model, prompt_tokens),
                  cost_estimate(inst.prices, prompt_tokens, predicted_output_tokens))
        for (inst, _), t in zip(instances, ttfts)
    ]
    return choose_instance(candidates, query, lam)
