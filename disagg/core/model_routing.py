"""Model-level routing: which instance, and so which model, of a heterogeneous fleet serves a query.

Every router is called with the same inputs — every candidate instance with the snapshot the
caller keeps of it, the query (prompt length, predicted output length, TTFT limit) and `now` —
and is built by name, with λ and the accuracy table, through one registry:

- `latency_aware`: `disagg.core.latency_routing.route_by_latency` — accuracy − λ·cost subject to
  the query's TTFT limit, TTFT estimated by simulating each instance's batching; the paper's router;
- `accuracy_cost`: RouteLLM-style — the model maximising accuracy − λ·cost, load ignored, then
  the instance of that model with the fewest requests in flight (ties: fleet order);
- `load_balance`: accuracy and λ ignored — the instance with the smallest estimated TTFT (the
  same estimator; ties: fleet order). At equal latency knowledge, the best a load balancer can do.

None takes parameters yet; each has a `Params` model (extra keys refused) so that one can.

Who calls, when, what holds:
- the live router's alias route (`serve_app.dispatcher.Dispatcher.choose_model`) and the fleet
  simulator (`disagg.sim.latency_sim`), once per query;
- pure: no I/O, no clock reads (`now` comes in), never mutates its arguments; a router keeps no
  state between calls, so `with_lambda` (a request's own λ) is a cheap copy;
- deterministic: the same inputs give the same `Routed`; raises NoCapacity when no instance can
  ever hold the prompt.

`Routed` carries the index of the chosen instance, its TTFT estimate if the router made one, and
(latency_aware) the whole `Choice` with every candidate's terms. `ModelRouter.explain` gives a
`Choice` for any router's answer, for the route header and the request log.

Config (a multi-model app's `router` section)::

    router: {alias: auto, lam: 0.0, model_policy: latency_aware, model_policy_params: {}}

A new router is a `@register`ed `ModelRouter` subclass in this module (docs/policies.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from pydantic import ValidationError

from disagg.core.latency_routing import ModelInstance, can_ever_hold, route_by_latency
from disagg.core.policies.base import Params
from disagg.core.ttft_estimator import InstanceSnapshot, estimate_ttft
from disagg.core.types import NoCapacity
from disagg.core.utility import AccuracyTable, CandidateTerms, Choice, cost_estimate

Fleet = Sequence[tuple[ModelInstance, InstanceSnapshot]]

_REGISTRY: dict[str, type["ModelRouter"]] = {}


class ModelRouterError(ValueError):
    """Unknown model-level router, duplicate registration, bad parameters or a bad λ."""


@dataclass(frozen=True, slots=True)
class Routed:
    """A router's answer: the index of the chosen instance, and its TTFT estimate if the router made one."""

    index: int
    estimated_ttft_s: float | None = None
    feasible: bool | None = None  # did the chosen instance meet the limit (by estimate)? None: not estimated
    choice: Choice | None = None  # latency_aware: every candidate's terms (route_by_latency's own)


class ModelRouter:
    """Base of every model-level router; subclasses set `name`, `Params` and `choose`."""

    name: ClassVar[str]
    Params: ClassVar[type[Params]] = Params

    def __init__(self, lam: float, accuracy: AccuracyTable, params: Params | None = None) -> None:
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (math.isfinite(lam) and lam >= 0.0):
            raise ModelRouterError(f"lambda must be a finite number >= 0, got {lam!r}")
        self.lam, self.accuracy = lam, accuracy
        self.params = params if params is not None else self.Params()

    def choose(self, fleet: Fleet, prompt_tokens: int, predicted_output_tokens: float, ttft_limit_s: float,
               now: float) -> Routed:  # pragma: no cover - interface
        """Pick one instance of `fleet` (every candidate with the caller's snapshot of it, in a stable order)."""
        raise NotImplementedError

    def with_lambda(self, lam: float) -> "ModelRouter":
        """The same router, table and parameters at another λ (a request's X-Route-Lambda)."""
        return type(self)(lam, self.accuracy, self.params)

    def explain(self, routed: Routed, fleet: Fleet, prompt_tokens: int, predicted_output_tokens: float,
                ttft_limit_s: float, now: float) -> Choice:
        """`routed` as a `Choice`, the explanation the route header and the request log carry.

        The router's own when it made one (latency_aware). Otherwise every candidate's accuracy,
        cost and utility at this router's λ, and the chosen instance's TTFT estimate (the router's,
        or the estimator run on the same snapshot); the other candidates' TTFT was not estimated and
        reads `inf`, as route_by_latency reports an instance it did not estimate in full.
        `feasible`: the chosen instance's estimate is within the limit.
        """
        if routed.choice is not None:
            return routed.choice
        inst, snap = fleet[routed.index]
        chosen_ttft = routed.estimated_ttft_s
        if chosen_ttft is None:  # measurement only: this router does not estimate
            chosen_ttft = estimate_ttft(inst.constants, snap, prompt_tokens, now, host=inst.host).ttft_s
        terms = []
        for i, (m, _) in enumerate(fleet):
            acc = self.accuracy.predict(m.model, prompt_tokens)
            cost = cost_estimate(m.prices, prompt_tokens, predicted_output_tokens)
            t = chosen_ttft if i == routed.index else math.inf
            terms.append(CandidateTerms(m.instance_id, m.model, t, acc, cost, acc - self.lam * cost, t <= ttft_limit_s))
        c = terms[routed.index]
        return Choice(c.instance_id, c.model, routed.index, c.feasible, c.utility, float(self.lam),
                      float(ttft_limit_s), tuple(terms))


def register(cls: type[ModelRouter]) -> type[ModelRouter]:
    """Class decorator: add a router to the registry; a duplicate name is a bug, so it raises."""
    if cls.name in _REGISTRY:
        raise ModelRouterError(f"model-level router name {cls.name!r} registered twice "
                               f"({_REGISTRY[cls.name].__name__}, {cls.__name__})")
    _REGISTRY[cls.name] = cls
    return cls


def known_model_routers() -> list[str]:
    """The registered names, in registration order (the paper's router first, then the baselines)."""
    return list(_REGISTRY)


def model_router_class(name: str) -> type[ModelRouter]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ModelRouterError(f"unknown model-level router {name!r}; known: "
                               f"{', '.join(known_model_routers())}") from None


def model_router_params(name: str, params: dict[str, Any] | None = None) -> Params:
    """`params` checked against router `name`'s `Params`; ModelRouterError names the bad ones and the allowed."""
    cls = model_router_class(name)
    try:
        return cls.Params.model_validate(params or {})
    except ValidationError as e:
        allowed = ", ".join(cls.Params.model_fields) or "(none)"
        msgs = "; ".join(f"'{'.'.join(map(str, x['loc']))}': {x['msg']}" for x in e.errors())
        raise ModelRouterError(f"model-level router {name!r}: bad parameters: {msgs}. "
                               f"Allowed parameters: {allowed}") from None


def build_model_router(name: str, lam: float, accuracy: AccuracyTable,
                       params: dict[str, Any] | None = None) -> ModelRouter:
    """The router `name` at λ `lam` over `accuracy`; raises ModelRouterError on a bad name, parameter or λ."""
    return model_router_class(name)(lam, accuracy, model_router_params(name, params))


# --- the routers ---------------------------------------------------------------------------------


@register
class LatencyAware(ModelRouter):
    """`latency_aware`: route_by_latency (accuracy − λ·cost under the TTFT limit). No parameters."""

    name = "latency_aware"

    def choose(self, fleet, prompt_tokens, predicted_output_tokens, ttft_limit_s, now) -> Routed:
        c = route_by_latency(fleet, prompt_tokens, predicted_output_tokens, ttft_limit_s, self.lam,
                             self.accuracy, now)
        return Routed(c.index, c.chosen.ttft_s, c.feasible, c)


@register
class AccuracyCost(ModelRouter):
    """`accuracy_cost`: the best model by accuracy − λ·cost ignoring load, then its least-loaded
    instance. No parameters."""

    name = "accuracy_cost"

    def choose(self, fleet, prompt_tokens, predicted_output_tokens, ttft_limit_s, now) -> Routed:
        best_model, best_u = None, -math.inf
        for inst, _ in fleet:  # fleet order: the first model listed wins ties
            if not can_ever_hold(inst.constants, prompt_tokens):
                continue
            u = (self.accuracy.predict(inst.model, prompt_tokens)
                 - self.lam * cost_estimate(inst.prices, prompt_tokens, predicted_output_tokens))
            if u > best_u:
                best_model, best_u = inst.model, u
        if best_model is None:
            raise NoCapacity(f"a prompt of {prompt_tokens} tokens fits no instance's KV cache")
        pool = [(snap.in_flight, i) for i, (inst, snap) in enumerate(fleet)
                if inst.model == best_model and can_ever_hold(inst.constants, prompt_tokens)]
        return Routed(min(pool)[1])


@register
class LoadBalance(ModelRouter):
    """`load_balance`: the smallest estimated TTFT over all instances, accuracy, cost and λ ignored.
    No parameters.

    Exact minimum with little work: each instance is simulated only up to the best TTFT so far
    (a censored estimate is slower than the best)."""

    name = "load_balance"

    def choose(self, fleet, prompt_tokens, predicted_output_tokens, ttft_limit_s, now) -> Routed:
        best, best_t = -1, math.inf
        for i, (inst, snap) in enumerate(fleet):
            if not can_ever_hold(inst.constants, prompt_tokens):
                continue
            horizon = None if best < 0 else best_t
            t = estimate_ttft(inst.constants, snap, prompt_tokens, now, horizon_s=horizon, host=inst.host).ttft_s
            if t < best_t:
                best, best_t = i, t
        if best < 0:
            raise NoCapacity(f"a prompt of {prompt_tokens} tokens fits no instance's KV cache")
        return Routed(best, best_t, best_t <= ttft_limit_s)


__all__ = ["AccuracyCost", "Fleet", "LatencyAware", "LoadBalance", "ModelRouter", "ModelRouterError", "Routed",
           "build_model_router", "known_model_routers", "model_router_class", "model_router_params", "register"]
