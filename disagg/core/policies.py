"""Routing policies: pick a prefill and a decode instance for one request.

Every policy implements one method, called by the live router and by the simulator with the same
inputs::

    choose(req, prefill, decode, now) -> Decision

Contract (checked by one shared test suite for every registered policy):
- pure: no I/O, no clock reads (`now` is passed in), never mutates its arguments;
- returns ids drawn from the candidates (`prefill_id == decode_id` only for policies that may
  prefill on the decode instance);
- deterministic: the same construction and call sequence give the same decisions (a policy that
  breaks near-ties at random draws from its own `random.Random(seed)`, never the global RNG);
- raises `NoCapacity` when no candidate can ever hold the request (empty pool, or a prompt
  beyond every instance's KV capacity). A candidate that is merely busy is still a candidate.
A policy may keep private state (a round-robin cursor, a tie-break RNG); it is not shared across
router replicas: each replica builds its own, with `Policy.for_replica(index)` so that replicas
built from one config do not draw the same tie-break stream in lockstep.

Near-tie breaking (`tie_tolerance`, `seed`): the argmin policies (least_loaded, colocated,
length_heuristic, marginal_cost, oracle, pair_cost) take an optional relative tolerance. With
`tie_tolerance: 0.0` (the default) they are today's deterministic argmin. With t > 0 they choose
uniformly at random among the candidates whose cost is at most (1 + t) × the best cost, from a
`random.Random(seed)` the policy owns. Why: several router replicas see each other's admissions
only at the next engine poll, so between polls they all see the same idle-looking instance; a
deterministic argmin sends all of them there (herding), a random pick among near-equals spreads them.
Measured (docs/multi-router.md): with 50 ms polls it recovers only part of what K routers lose; what
closes the gap is fresher knowledge of the calls the other routers sent since the last poll.

`power_of_two` (Ray Serve LLM's default) is random by design: it samples two candidates per pool from
its own `random.Random(seed)`, so it too is deterministic for a given seed.

Policies are built by name through `build_policy`, which rejects unknown names and unknown
parameters with the allowed ones listed. Each policy's docstring gives its config name, parameters
and a YAML example.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import random
from typing import Annotated, Any, Callable, ClassVar, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from disagg.core.cost_model import CostModel, EngineConstants, TransferConstants, attention_pairs
from disagg.core.types import (
    CostTerms, Decision, InstanceView, NoCapacity, RequestFeatures, Role, SloClass,
)

_REGISTRY: dict[str, type["Policy"]] = {}


class PolicyError(ValueError):
    """Unknown policy, duplicate registration or bad parameters."""


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Policy:
    """Base of every routing policy; subclasses set `name`, `Params` and `choose`."""

    name: ClassVar[str]
    Params: ClassVar[type[Params]] = Params
    simulator_only: ClassVar[bool] = False

    @property
    def may_colocate(self) -> bool:
        """May this policy prefill on the decode instance (`prefill_id == decode_id`)?"""
        return False

    @property
    def may_host(self) -> bool:
        """May this policy serve a request whole on a prefill instance (`decode_id == prefill_id`, a
        prefill candidate's id)?"""
        return False

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        self.cost_model = cost_model
        self.params = params if params is not None else self.Params()

    def choose(
        self,
        req: RequestFeatures,
        prefill: Sequence[InstanceView],
        decode: Sequence[InstanceView],
        now: float,
    ) -> Decision:  # pragma: no cover - interface
        raise NotImplementedError

    def for_replica(self, index: int) -> "Policy":
        """A fresh policy for router replica `index`: same class, cost model and parameters, no shared
        state. A policy with a `seed` gets a seed derived from (seed, index) — index 0 keeps the
        configured seed — so that replicas do not break ties in lockstep."""
        if index < 0:
            raise ValueError(f"replica index must be >= 0, got {index}")
        params = self.params
        if index and "seed" in type(params).model_fields:
            params = params.model_copy(update={"seed": replica_seed(params.seed, index)})
        return type(self)(self.cost_model, params)


def replica_seed(seed: int, index: int) -> int:
    """The tie-break seed of router replica `index` (0 keeps `seed`); stable across runs and platforms."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "big")


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: add a policy to the registry; a duplicate name is a bug, so it raises."""
    if cls.name in _REGISTRY:
        raise PolicyError(f"policy name {cls.name!r} registered twice ({_REGISTRY[cls.name].__name__}, {cls.__name__})")
    _REGISTRY[cls.name] = cls
    return cls


def known_policies(include_simulator_only: bool = True) -> list[str]:
    return sorted(n for n, c in _REGISTRY.items() if include_simulator_only or not c.simulator_only)


def policy_class(name: str) -> type[Policy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; known policies: {', '.join(known_policies())}") from None


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`NAME` or `NAME:key=value[:key=value...]` → (name, params): a policy with parameters where a
    command takes policy names (`disagg sim`/`bench --policies slo_goodput:allow_hosted=false`).
    Values are JSON (`false`, `0.5`, `"x"`), else text. The name and parameters are checked as
    `build_policy` checks them; PolicyError names the spec."""
    name, *pairs = spec.split(":")
    params: dict[str, Any] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not key or not eq:
            raise PolicyError(f"policy {spec!r}: expected NAME or NAME:key=value[:key=value...], got {pair!r}")
        try:
            params[key] = json.loads(raw)
        except ValueError:
            params[key] = raw
    _checked_params(policy_class(name), params, spec)
    return name, params


def build_policy(name: str, cost_model: CostModel, params: dict[str, Any] | None = None) -> Policy:
    cls = policy_class(name)
    return cls(cost_model, _checked_params(cls, params or {}, name))


def _checked_params(cls: type[Policy], params: dict[str, Any], label: str) -> Params:
    try:
        return cls.Params.model_validate(params)
    except ValidationError as e:
        allowed = ", ".join(cls.Params.model_fields) or "(none)"
        msgs = "; ".join(f"'{'.'.join(map(str, x['loc']))}': {x['msg']}" for x in e.errors())
        raise PolicyError(f"policy {label!r}: bad parameters: {msgs}. Allowed parameters: {allowed}") from None


# --- helpers ------------------------------------------------------------------------------------


def _fits(view: InstanceView, prompt_tokens: int) -> bool:
    """Can this instance ever hold the prompt (plus the first generated token)?"""
    return prompt_tokens + 1 <= view.kv_capacity_tokens


def _feasible(pool: Sequence[InstanceView], req: RequestFeatures, pool_name: str) -> list[InstanceView]:
    if not pool:
        raise NoCapacity(f"the {pool_name} pool is empty")
    need = req.prompt_tokens + 1
    ok = [v for v in pool if need <= v.kv_capacity_tokens]  # `_fits`, inline: every decision filters every pool
    if not ok:
        biggest = max(v.kv_capacity_tokens for v in pool)
        raise NoCapacity(
            f"prompt of {req.prompt_tokens} tokens exceeds every {pool_name} instance's KV capacity "
            f"(largest {biggest} tokens)"
        )
    return ok


class TieBreakParams(Params):
    """Near-tie breaking, shared by the argmin policies (module docstring)."""

    tie_tolerance: float = Field(
        default=0.0, ge=0.0, allow_inf_nan=False,
        description="choose uniformly at random among candidates within (1 + tie_tolerance) × the best cost; "
                    "0 = deterministic argmin",
    )
    seed: int = Field(default=0, description="seed of the policy's own tie-break RNG (used when tie_tolerance > 0)")


_T = TypeVar("_T")


class _TieBreak:
    """Argmin with optional random choice among near-ties, from a seeded `random.Random`.

    With tolerance 0 it is the plain argmin (first of equal minima) and draws nothing, so a policy
    at the default behaves, and costs, exactly as before the parameter existed."""

    __slots__ = ("tol", "rng")

    def __init__(self, params: TieBreakParams) -> None:
        self.tol = params.tie_tolerance
        self.rng = random.Random(params.seed)

    def pick(self, items: Sequence[_T], costs: Sequence[float]) -> _T:
        best = min(costs)
        if not self.tol:
            return items[costs.index(best)]
        bound = best + self.tol * abs(best)
        near = [x for x, c in zip(items, costs) if c <= bound]
        return near[0] if len(near) == 1 else self.rng.choice(near)

    def argmin(self, items: Sequence[_T], key: Callable[[_T], float]) -> _T:
        if not self.tol:
            return min(items, key=key)  # first of equal minima, as before
        return self.pick(items, [key(x) for x in items])


class _Cursor:
    """Round-robin cursor that tolerates pools changing size (autoscaling)."""

    __slots__ = ("i",)

    def __init__(self) -> None:
        self.i = 0

    def take(self, pool: Sequence[InstanceView]) -> InstanceView:
        v = pool[self.i % len(pool)]
        self.i += 1
        return v

    def rotated(self, pool: Sequence[InstanceView]) -> list[InstanceView]:
        """The pool starting at the cursor, for tie-breaking that spreads load."""
        k = self.i % len(pool)
        self.i += 1
        return [*pool[k:], *pool[:k]]


# --- baselines ----------------------------------------------------------------------------------


@register
class RoundRobin(Policy):
    """`round_robin`: each pool in turn, independently. No parameters.

    ```yaml
    policy: {name: round_robin}
    ```
    """

    name = "round_robin"

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._p, self._d = _Cursor(), _Cursor()

    def choose(self, req, prefill, decode, now):
        p = self._p.take(_feasible(prefill, req, "prefill"))
        d = self._d.take(_feasible(decode, req, "decode"))
        return Decision(p.instance_id, d.instance_id, self.name)


@register
class LeastLoaded(Policy):
    """`least_loaded`: join the shortest queue (fewest in-flight requests) in each pool.

    Ties go to the next instance in round-robin order, so an idle fleet is still spread evenly.
    Parameters: `tie_tolerance` (default 0.0) and `seed` (default 0): with a tolerance t > 0, a
    uniformly random instance among those with at most (1 + t) × the fewest in-flight requests
    (module docstring).

    ```yaml
    policy: {name: least_loaded, params: {tie_tolerance: 0.0, seed: 0}}
    ```
    """

    name = "least_loaded"
    Params = TieBreakParams

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._p, self._d = _Cursor(), _Cursor()
        self._tie = _TieBreak(self.params)

    def choose(self, req, prefill, decode, now):
        p = self._tie.argmin(self._p.rotated(_feasible(prefill, req, "prefill")), _queued)
        d = self._tie.argmin(self._d.rotated(_feasible(decode, req, "decode")), _queued)
        return Decision(p.instance_id, d.instance_id, self.name)


class PowerOfTwoParams(Params):
    seed: int = Field(default=0, description="seed of the policy's own sampling RNG")


@register
class PowerOfTwo(Policy):
    """`power_of_two`: Ray Serve LLM's default router (Ray's `pow_2_router.py`) as a baseline.

    In each pool, sample two distinct candidates uniformly at random and take the one with fewer
    in-flight requests — the load signal of `least_loaded`; on a tie, the first sampled. A pool
    with one candidate is taken without a draw. Two random choices instead of the global minimum
    are why it needs no global view: routers with stale, identical views still spread out.
    Prefill is drawn before decode, from one `random.Random(seed)` the policy owns; router
    replicas get derived seeds (`for_replica`). Parameters: `seed` (default 0).

    ```yaml
    policy: {name: power_of_two, params: {seed: 0}}
    ```
    """

    name = "power_of_two"
    Params = PowerOfTwoParams

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._rng = random.Random(self.params.seed)

    def choose(self, req, prefill, decode, now):
        p = self._pick(_feasible(prefill, req, "prefill"))
        d = self._pick(_feasible(decode, req, "decode"))
        return Decision(p.instance_id, d.instance_id, self.name)

    def _pick(self, pool: Sequence[InstanceView]) -> InstanceView:
        if len(pool) == 1:
            return pool[0]
        i, j = self._rng.sample(range(len(pool)), 2)
        return pool[j] if pool[j].queued < pool[i].queued else pool[i]


@register
class Colocated(Policy):
    """`colocated`: no disaggregation — prefill and decode on the same decode-pool instance, the one
    with the fewest in-flight requests (ties in round-robin order). The baseline that tells whether
    disaggregation pays on a workload, and the reference for greedy-equivalence checks.
    Parameters: `tie_tolerance` (default 0.0) and `seed` (default 0), as in `least_loaded`.

    ```yaml
    policy: {name: colocated, params: {tie_tolerance: 0.0, seed: 0}}
    ```
    """

    name = "colocated"
    Params = TieBreakParams

    @property
    def may_colocate(self) -> bool:
        return True

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._d = _Cursor()
        self._tie = _TieBreak(self.params)

    def choose(self, req, prefill, decode, now):
        d = self._tie.argmin(self._d.rotated(_feasible(decode, req, "decode")), _queued)
        return Decision(d.instance_id, d.instance_id, self.name)


def _queued(v: InstanceView) -> int:
    return v.queued


class PrefixAffinityParams(Params):
    match_threshold: float = Field(
        default=0.5, ge=0.0, le=1.0,
        description="route by cache only when an instance holds at least this share of the request's prefix blocks",
    )
    imbalance_threshold: int = Field(
        default=10, ge=0,
        description="... and the instance chosen for its cache has at most this many queued requests more than "
                    "the least loaded candidate",
    )


@register
class PrefixAffinity(Policy):
    """`prefix_affinity`: prefix-cache-aware load balancing, as Ray Serve LLM's
    PrefixCacheAffinityRouter and llm-d's prefix-cache scorer route — a baseline.

    In each pool independently: the candidates holding the longest cached prefix of the request
    (`InstanceView.cached_prefix_blocks` over `RequestFeatures.prefix_hashes`); among them the one
    with the fewest queued requests (ties in round-robin order). It is taken when that prefix is at
    least `match_threshold` of the request's blocks and it has at most `imbalance_threshold` queued
    requests more than the least loaded candidate. Otherwise the choice is `least_loaded`'s: the
    fewest queued requests, ties in round-robin order. Without prefix hashes, or with views that
    carry no cache (the live router today), it is `least_loaded`.

    Unlike Ray's router, which matches prompt text in a router-side tree of what it sent where, it
    reads the instances' block caches; Ray judges imbalance as the spread of all replicas' queues
    (default 10) before matching, and below its match threshold (default 0.1) prefers the replicas
    caching the least. Parameters: `match_threshold` (default 0.5), `imbalance_threshold`
    (default 10 queued requests).

    ```yaml
    policy: {name: prefix_affinity, params: {match_threshold: 0.5, imbalance_threshold: 10}}
    ```
    """

    name = "prefix_affinity"
    Params = PrefixAffinityParams

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._p, self._d = _Cursor(), _Cursor()

    def choose(self, req, prefill, decode, now):
        p = self._pick(self._p.rotated(_feasible(prefill, req, "prefill")), req.prefix_hashes)
        d = self._pick(self._d.rotated(_feasible(decode, req, "decode")), req.prefix_hashes)
        return Decision(p.instance_id, d.instance_id, self.name)

    def _pick(self, pool: list[InstanceView], hashes: tuple[int, ...]) -> InstanceView:
        least = min(pool, key=_queued)  # first of equal minima: round-robin ties
        if not hashes:
            return least
        cached = [v.cached_prefix_blocks(hashes) for v in pool]
        best = max(cached)
        if best == 0 or best < self.params.match_threshold * len(hashes):
            return least
        warm = min((v for v, c in zip(pool, cached) if c == best), key=_queued)
        return warm if warm.queued - least.queued <= self.params.imbalance_threshold else least


def _pressure_key(extra: int):
    return lambda v: v.pressure_after(extra)


@register
class LengthHeuristic(Policy):
    """`length_heuristic`: a threshold rule on the predicted output length.

    Prefill goes to the shortest queue. A request predicted to generate at least
    `long_output_tokens` tokens is a long-lived KV tenant: it goes to the decode instance with the
    lowest KV pressure after admission, so long generations spread by memory. Shorter ones join the
    shortest decode queue. Ties in round-robin order. Parameters: `long_output_tokens` (default 256),
    and `tie_tolerance` (default 0.0) with `seed` (default 0): near-ties of each key (queue length,
    KV pressure) broken at random (module docstring).

    ```yaml
    policy: {name: length_heuristic, params: {long_output_tokens: 256, tie_tolerance: 0.0, seed: 0}}
    ```
    """

    class Params(TieBreakParams):
        long_output_tokens: int = Field(default=256, gt=0, description="outputs at least this long count as long")

    name = "length_heuristic"

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._p, self._d = _Cursor(), _Cursor()
        self._tie = _TieBreak(self.params)

    def choose(self, req, prefill, decode, now):
        p = self._tie.argmin(self._p.rotated(_feasible(prefill, req, "prefill")), _queued)
        pool = self._d.rotated(_feasible(decode, req, "decode"))
        if req.predicted_output_tokens >= self.params.long_output_tokens:
            d = self._tie.argmin(pool, _pressure_key(req.prompt_tokens + req.predicted_output_tokens))
        else:
            d = self._tie.argmin(pool, _queued)
        return Decision(p.instance_id, d.instance_id, self.name)


# --- the calibrated scorer ----------------------------------------------------------------------


class MarginalCostParams(TieBreakParams):
    w_backlog: float = Field(default=1.0, ge=0.0, description="w_b: weight of committed backlog seconds")
    w_service: float = Field(default=1.0, ge=0.0, description="w_s: weight of the request's own work")
    w_queue_s: float = Field(default=0.002, ge=0.0, description="w_q: seconds charged per queued request")
    rho: float = Field(default=1.0, ge=0.0, description="ρ: how much post-admission KV pressure slows work")
    sigma: dict[SloClass, Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = Field(
        default_factory=lambda: {SloClass.TIGHT: 2.0, SloClass.LOOSE: 1.0},
        description="σ(class): amplification of strict SLO classes",
    )


@register
class MarginalCost(Policy):
    """`marginal_cost`: the calibration paper's scorer — argmin of expected marginal completion time.

    For each decode candidate d, with p prompt tokens, ô predicted output tokens, SLO class s::

        cost(d) = w_b·backlog(d)·σ(s) + w_s·ô·τ_dec(d)·(1 + ρ·press⁺(d))·σ(s) + w_q·queue(d)

    where τ_dec(d) is d's calibrated per-token decode time at its post-admission concurrency and
    press⁺(d) = (KV used + p + ô) / KV capacity. Prefill candidates are priced the same way with the
    calibrated prefill time of p tokens in place of ô·τ_dec and press⁺ = (KV used + p) / capacity.
    Argmin in each pool independently; ties go to the first candidate. The chosen candidates' terms
    travel in the Decision, so every choice can be explained.

    Parameters: `w_backlog`, `w_service`, `w_queue_s`, `rho`, `sigma` (above), and near-tie breaking:
    `tie_tolerance` (default 0.0 = deterministic argmin) and `seed` (default 0). With t > 0 each pool's
    choice is uniformly random among the candidates costing at most (1 + t) × that pool's best, so
    router replicas with equally stale views do not all pick the same instance.

    ```yaml
    policy:
      name: marginal_cost
      params: {w_backlog: 1.0, w_service: 1.0, w_queue_s: 0.002, rho: 1.0, sigma: {tight: 2.0, loose: 1.0},
               tie_tolerance: 0.05, seed: 0}
    ```
    """

    name = "marginal_cost"
    Params = MarginalCostParams

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._tie = _TieBreak(self.params)

    def output_tokens(self, req: RequestFeatures) -> int:
        return req.predicted_output_tokens

    def prefill_terms(self, v: InstanceView, req: RequestFeatures, sigma: float) -> CostTerms:
        prm = self.params
        press = v.pressure_after(req.prompt_tokens)
        work = self.cost_model.for_instance(v.instance_id).prefill_s(req.prompt_tokens)
        return CostTerms(
            backlog_s=prm.w_backlog * v.backlog_s * sigma,
            own_work_s=prm.w_service * work * (1.0 + prm.rho * press) * sigma,
            pressure=press,
            queue_s=prm.w_queue_s * v.queued,
            slo_weight=sigma,
        )

    def decode_terms(self, v: InstanceView, req: RequestFeatures, sigma: float, out: int) -> CostTerms:
        prm = self.params
        press = v.pressure_after(req.prompt_tokens + out)
        tau_dec = self.cost_model.for_instance(v.instance_id).decode_token_s(v.queued + 1)
        return CostTerms(
            backlog_s=prm.w_backlog * v.backlog_s * sigma,
            own_work_s=prm.w_service * out * tau_dec * (1.0 + prm.rho * press) * sigma,
            pressure=press,
            queue_s=prm.w_queue_s * v.queued,
            slo_weight=sigma,
        )

    def choose(self, req, prefill, decode, now):
        sigma = self.params.sigma.get(req.slo_class, 1.0)
        out = self.output_tokens(req)
        p_best = self._argmin_prefill(_feasible(prefill, req, "prefill"), req, sigma)
        d_best = self._argmin_decode(_feasible(decode, req, "decode"), req, sigma, out)
        return Decision(p_best.instance_id, d_best.instance_id, self.name,
                        self.prefill_terms(p_best, req, sigma), self.decode_terms(d_best, req, sigma, out))

    # The hot loops price with plain floats (same formula as *_terms, which explain the winner):
    # building a CostTerms per candidate would triple the decision cost. Without per-instance
    # constants, the prefill time is one number and τ_dec one function for the whole pool.
    def _argmin_prefill(self, pool, req, sigma):
        prm, cm, p = self.params, self.cost_model, req.prompt_tokens
        wb, ws, wq, rho = prm.w_backlog * sigma, prm.w_service * sigma, prm.w_queue_s, prm.rho
        if cm.instances:
            totals = [wb * v.backlog_s + ws * cm.for_instance(v.instance_id).prefill_s(p)
                      * (1.0 + rho * ((v.kv_used_tokens + p) / v.kv_capacity_tokens)) + wq * v.queued for v in pool]
        else:
            work = cm.engine.prefill_s(p)
            totals = [wb * v.backlog_s + ws * work * (1.0 + rho * ((v.kv_used_tokens + p) / v.kv_capacity_tokens))
                      + wq * v.queued for v in pool]
        return self._tie.pick(pool, totals)

    def _argmin_decode(self, pool, req, sigma, out):
        prm, cm, extra = self.params, self.cost_model, req.prompt_tokens + out
        wb, ws, wq, rho = prm.w_backlog * sigma, prm.w_service * sigma * out, prm.w_queue_s, prm.rho
        if cm.instances:
            totals = [wb * v.backlog_s + ws * cm.for_instance(v.instance_id).decode_token_s(v.queued + 1)
                      * (1.0 + rho * ((v.kv_used_tokens + extra) / v.kv_capacity_tokens)) + wq * v.queued for v in pool]
        else:
            tau = cm.engine.decode_token_s
            totals = [wb * v.backlog_s + ws * tau(v.queued + 1)
                      * (1.0 + rho * ((v.kv_used_tokens + extra) / v.kv_capacity_tokens)) + wq * v.queued for v in pool]
        return self._tie.pick(pool, totals)


@register
class Oracle(MarginalCost):
    """`oracle`: `marginal_cost` told the true output length — an upper bound on what a better
    output-length predictor could gain. Simulator only: live requests have no true length.
    Parameters: those of `marginal_cost`, `tie_tolerance` and `seed` included.

    ```yaml
    policy: {name: oracle, params: {tie_tolerance: 0.0, seed: 0}}   # `disagg sim` only
    ```
    """

    name = "oracle"
    simulator_only = True

    def output_tokens(self, req: RequestFeatures) -> int:
        if req.true_output_tokens is None:
            raise PolicyError("the oracle policy needs the true output length: it runs in the simulator only")
        return req.true_output_tokens


class PairCostParams(MarginalCostParams):
    allow_colocated: bool = Field(
        default=True, description="may prefill on the chosen decode instance when that is cheaper"
    )
    interference: float = Field(
        default=1.0,
        ge=0.0,
        description="share of a colocated prefill's time charged once per sequence it stalls",
    )


@register
class PairCost(MarginalCost):
    """`pair_cost`: prices (prefill, decode) as one pair, KV transfer included.

    Beyond the paper: the cost of a pair is the marginal_cost prefill price on p, plus the
    calibrated KV transfer time p→d for the prompt, plus the marginal_cost decode price on d. With
    per-pair transfer constants (for example same node vs across nodes) the argmin is taken over
    all pairs; otherwise it decomposes into the two independent argmins plus a constant.
    With `allow_colocated`, each decode instance is also priced as its own prefill: no transfer,
    but the prefill joins d's backlog and stalls the sequences running there, charged as
    `interference × prefill time × queued(d)`.

    Parameters: those of `marginal_cost` (weights, `sigma`, and `tie_tolerance` / `seed`), plus
    `allow_colocated` and `interference`. With `tie_tolerance` t > 0: without per-pair transfer
    constants the prefill instance is drawn among those priced within (1 + t) × the cheapest prefill,
    then the (prefill, decode) pairs and colocated options within (1 + t) × the cheapest of them;
    with per-pair constants, among all pairs and colocated options within (1 + t) × the cheapest.

    ```yaml
    policy: {name: pair_cost, params: {allow_colocated: true, interference: 1.0, tie_tolerance: 0.05, seed: 0}}
    ```
    """

    name = "pair_cost"
    Params = PairCostParams

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._pair_transfers = _PairTransfers(cost_model)

    @property
    def may_colocate(self) -> bool:
        return self.params.allow_colocated

    def choose(self, req, prefill, decode, now):
        prm, cm = self.params, self.cost_model
        sigma = prm.sigma.get(req.slo_class, 1.0)
        out = self.output_tokens(req)
        prompt = req.prompt_tokens
        decode_ok = _feasible(decode, req, "decode")
        prefill_ok = [v for v in prefill if _fits(v, prompt)]
        # Candidates are priced as plain floats — `prefill_terms` / `decode_terms`' expressions in the
        # same order, so the very totals their `CostTerms` add up to — and only the winner's terms are
        # built: a `CostTerms` per candidate was most of the decision's time at 64 instances.
        d_totals = self._decode_totals(decode_ok, req, sigma, out)
        p_totals = self._prefill_totals(prefill_ok, req, sigma)
        if cm.pairs:
            paired = range(len(prefill_ok))
        elif prefill_ok:
            # the prefill choice is independent of d: its near-ties are judged on the prefill price
            # alone (a tolerance on the pair total would drown them in the decode backlog)
            paired = (self._tie.pick(range(len(prefill_ok)), p_totals),)
        else:
            paired = ()
        # the options' totals, in order: each paired prefill with every decode instance, then each
        # decode instance as its own prefill
        costs: list[float] = []
        w_s = prm.w_service
        moved, stays = w_s * cm.transfer.transfer_s(prompt) * sigma, w_s * 0.0 * sigma  # default constants
        for i in paired:
            p_id, pt = prefill_ok[i].instance_id, p_totals[i]
            pair_row = self._pair_transfers.row(p_id)
            if pair_row:
                costs += [pt + dt + (stays if d.instance_id == p_id else w_s * pair_row.get(
                          d.instance_id, cm.transfer).transfer_s(prompt) * sigma) for d, dt in zip(decode_ok, d_totals)]
            else:  # `cm.transfer_s`: one price for every decode instance but p itself
                costs += [pt + dt + (stays if d.instance_id == p_id else moved) for d, dt in zip(decode_ok, d_totals)]
        n_pairs = len(costs)
        if prm.allow_colocated:
            costs += [w_s * (work + prm.interference * work * d.queued) * sigma + dt
                      for d, dt, work in zip(decode_ok, d_totals, self._prefill_works(decode_ok, prompt))]

        if not costs:
            _feasible(prefill, req, "prefill")  # raises the precise reason
            raise NoCapacity("no prefill candidate fits and colocated prefill is disabled")
        best = self._tie.pick(range(len(costs)), costs)  # tolerance 0: the first cheapest
        if best < n_pairs:
            p, d = prefill_ok[paired[best // len(decode_ok)]], decode_ok[best % len(decode_ok)]
            xfer = w_s * cm.transfer_s(p.instance_id, d.instance_id, prompt) * sigma
            return Decision(p.instance_id, d.instance_id, self.name, self.prefill_terms(p, req, sigma),
                            _with_transfer(self.decode_terms(d, req, sigma, out), xfer))
        d = decode_ok[best - n_pairs]
        work = cm.for_instance(d.instance_id).prefill_s(prompt)
        stall = prm.interference * work * d.queued
        pt = CostTerms(own_work_s=w_s * (work + stall) * sigma, slo_weight=sigma)
        return Decision(d.instance_id, d.instance_id, self.name, pt, self.decode_terms(d, req, sigma, out))

    def _prefill_works(self, pool: Sequence[InstanceView], prompt: int) -> list[float]:
        cm = self.cost_model
        if not cm.instances:
            return [cm.engine.prefill_s(prompt)] * len(pool)
        return [cm.for_instance(v.instance_id).prefill_s(prompt) for v in pool]

    def _prefill_totals(self, pool: Sequence[InstanceView], req: RequestFeatures, sigma: float) -> list[float]:
        """`prefill_terms(v, req, sigma).total_s` for each v in `pool`."""
        prm, p = self.params, req.prompt_tokens
        wb, ws, rho, wq = prm.w_backlog, prm.w_service, prm.rho, prm.w_queue_s
        return [wb * v.backlog_s * sigma + ws * work * (1.0 + rho * v.pressure_after(p)) * sigma + wq * v.queued
                for v, work in zip(pool, self._prefill_works(pool, p))]

    def _decode_totals(self, pool: Sequence[InstanceView], req: RequestFeatures, sigma: float, out: int) -> list[float]:
        """`decode_terms(v, req, sigma, out).total_s` for each v in `pool`."""
        prm, cm, extra = self.params, self.cost_model, req.prompt_tokens + out
        wb, ws, rho, wq = prm.w_backlog, prm.w_service, prm.rho, prm.w_queue_s
        return [wb * v.backlog_s * sigma
                + ws * out * cm.for_instance(v.instance_id).decode_token_s(v.queued + 1)
                * (1.0 + rho * v.pressure_after(extra)) * sigma
                + wq * v.queued for v in pool]

class _PairTransfers:
    """A cost model's per-pair transfer constants by prefill id, then decode id: `CostModel.transfer_s`
    for every pair of a decision without building a 'prefill->decode' key per pair."""

    __slots__ = ("_rows",)

    def __init__(self, cm: CostModel) -> None:
        self._rows: dict[str, dict[str, TransferConstants]] = {}
        for key, constants in cm.pairs.items():
            prefill_id, decode_id = key.split("->")  # the cost model checks there is one arrow
            self._rows.setdefault(prefill_id, {})[decode_id] = constants

    def row(self, prefill_id: str) -> dict[str, TransferConstants]:
        """Decode id → the pair's constants, for the pairs of `prefill_id` that have their own."""
        return self._rows.get(prefill_id, _NO_PAIRS)


_NO_PAIRS: dict[str, TransferConstants] = {}


def _with_transfer(t: CostTerms, transfer_s: float) -> CostTerms:
    return CostTerms(t.backlog_s, t.own_work_s, t.pressure, t.queue_s, transfer_s, t.slo_weight)


# --- goodput-directed placement ------------------------------------------------------------------


class SloGoodputParams(Params):
    latency_error: float = Field(
        default=0.15, gt=0.0, le=1.0, allow_inf_nan=False,
        description="relative spread of a latency prediction: a prediction at x × the target misses with "
                    "probability Φ((x − 1) / latency_error)",
    )
    work_weight: float = Field(
        default=0.02, ge=0.0, le=1.0, allow_inf_nan=False,
        description="expected misses charged per TTFT target of latency added (the request's predicted TTFT; a "
                    "colocated prefill's time, once for its decode instance and once per sequence it stalls)",
    )
    allow_colocated: bool = Field(default=True, description="may prefill on the chosen decode instance")
    allow_hosted: bool = Field(default=True, description="may serve a request whole (prefill and decode) on a "
                                                        "prefill instance, when the decode pool is the limit; "
                                                        "off where engines share cores (the CPU profile)")
    utilization_window_s: float = Field(
        default=5.0, gt=0.0, allow_inf_nan=False,
        description="time constant of the prefill utilization each prefill instance is judged by when it "
                    "hosts decodes: about the length of a decode",
    )


_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def _miss(predicted_s: float, target_s: float, spread: float) -> float:
    """Chance that a latency predicted at `predicted_s` misses `target_s`: a normal error of `spread`
    × target around the prediction (Φ((x − 1)/spread) with x = predicted/target)."""
    return 0.5 * math.erfc((1.0 - predicted_s / target_s) / spread * _INV_SQRT2)


def _cached_tokens(v: InstanceView, req: RequestFeatures) -> int:
    """Prompt tokens `v` holds cached, as a prefill there may reuse them: whole leading blocks, never
    the block of the last prompt token (always computed, as in vLLM)."""
    if not req.prefix_hashes:
        return 0
    blocks = v.cached_prefix_blocks(req.prefix_hashes)
    block = req.prefix_block_tokens
    return min(blocks, (req.prompt_tokens - 1) // block) * block if blocks else 0


@register
class SloGoodput(Policy):
    """`slo_goodput`: the (prefill, decode) placement with the fewest expected SLO misses — prefix-cache
    aware, colocation and hosting included.

    Candidates: the best prefill instance paired with every decode instance (every pair when the
    cost model has per-pair transfer constants; a later-ending prefill instance too when it stalls
    fewer hosted decodes), each decode instance prefilling the request itself (colocated), and each
    prefill instance serving it whole (hosted). Each is priced by what it does to SLO attainment,
    not by raw seconds:

        cost = P(the request misses) + Σ_running ΔP(a running request misses its TPOT)
               [+ P(KV overflow) for a colocated or hosted request] + w·latency added / TTFT target

    - The request's TTFT: the queue on the prefill site + the prefill of the prompt tokens *not*
      cached there + the KV transfer of the tokens the decode instance does not hold + its first
      decode step (half a step more when a batch is in flight; a full prefill chunk more when the
      decode instance is busy with a colocated prefill then) + the serving overhead. Colocated: the
      queue of colocated prefills there + the uncached prefill, chunked beside b decoding sequences.
      Hosted: the prefill instance's queue + the uncached prefill (its last chunk gives the first
      token) + the serving overhead.
    - Its TPOT: τ_dec(b + 1) on the decode instance, plus the colocated prefill time still pending
      there when it starts decoding, spread over its ô tokens.
    - Each of the b requests running on the decode instance: TPOT τ_dec(b) + pending colocated
      prefill / ô before, τ_dec(b + 1) + (that + this request's colocated prefill) / ô after —
      judged against the strictest class's TPOT target (their classes are not visible), ô being
      this request's prediction (the predictor gives a point, its mean; no quantile).
    - Hosted, the decode shares the prefill instance with its prefills: with h decodes hosted there
      and u the share of its time the policy's own prefills took lately (an exponential average
      over `utilization_window_s`), the request's TPOT is τ_dec(h + 1)/(1 − u). Every prefill sent
      to an instance hosting h decodes — hosted or not — stalls them: each of the h goes from
      τ_dec(h)/(1 − u) to that + the prefill's time / ô, judged as above. So prefills keep away
      from the instances where decodes are hosted, unless that costs misses.
    - A latency predicted at x × its target misses with probability Φ((x − 1)/`latency_error`);
      TTFT, TPOT and KV overflow count as one miss when any of them happens (taken independent).
      KV overflow (preemption) is judged the same way on the decode instance's pressure at the
      request's peak: KV used + its prompt and ô + ô/2 for each running sequence, which is midway
      through its own output. A colocated prefill on a decode instance that overflows also costs a
      running sequence's miss: it takes blocks chunk by chunk and so preempts one (vLLM's
      scheduler, and the simulator's engine model), where a transferred prompt waits for its
      blocks. Probabilities saturate: a request that will miss anyway goes where it harms the
      others least.
    - The last term, `work_weight` × the latency the placement adds / the request's TTFT target,
      is small: it orders candidates that all surely meet (or surely miss) their targets by the
      load they add. The latency added is the request's TTFT, plus for a colocated prefill its
      time once for the decode instance's capacity and once for each of the b sequences it
      stalls — so decode instances are kept for decoding unless prefilling there saves misses.
      Hosted, it is its prefill's time once for each of the h decodes there and its decode's
      per-sequence step time ô × τ_seq, which the prefills there wait for: where every placement
      meets its targets, hosting wins only if that costs less than the transfer and first decode
      step it saves. When the decode pool's KV or TPOT is the limit, the prefill pool's KV and
      time serve decodes as well.

    Queues: the ledger's `backlog_s` prices every prompt whole, so on a prefill instance the policy
    subtracts what it knows the ledger overprices: the cached part of its own prefills there, until
    their predicted end. On a decode instance the backlog mixes colocated prefill with decode work,
    so the policy keeps its own clock of when the colocated prefills it sent there end, bounded by
    the backlog; with several router replicas each sees only its own colocated prefills there
    (private state, like a round-robin cursor: fresh per replica), and its own prefills in the
    utilization u. On a prefill instance the ledger's view counts the prefill work only: the
    decodes hosted there run beside the prefills, not ahead of them (`InstanceView.hosted`).
    Cached prefixes come from `InstanceView.cached_prefix_blocks`; live views carry none, so every
    prompt is priced uncached there and the policy still works.

    Parameters (each from first principles, none fitted to a trace): `latency_error` (0.15: one
    engine step and a 50 ms poll against a 175 ms TTFT target are 10–30% of it), `work_weight`
    (0.02: a whole TTFT target of added latency is worth 2% of a miss, below any real change in
    miss probability), `allow_colocated` (true), `allow_hosted` (true), `utilization_window_s`
    (5 s: about a decode's length, ô × τ_dec for a few hundred tokens).

    ```yaml
    policy: {name: slo_goodput, params: {latency_error: 0.15, work_weight: 0.02, allow_colocated: true,
                                         allow_hosted: true, utilization_window_s: 5.0}}
    ```
    """

    name = "slo_goodput"
    Params = SloGoodputParams

    @property
    def may_colocate(self) -> bool:
        return self.params.allow_colocated

    @property
    def may_host(self) -> bool:
        return self.params.allow_hosted

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        # decode instance → when the colocated prefills this policy sent there end (its own clock)
        self._colocated_ends: dict[str, float] = {}
        # prefill instance → heap of (predicted end, seconds the ledger overprices it) of this policy's
        # prefills there: the ledger prices a prompt whole, the engine computes only its uncached part
        self._overpriced: dict[str, list[tuple[float, float]]] = {}
        self._tpot_floor_s = min(t.tpot_s for t in cost_model.slo.values())  # the strictest class's target
        self._pair_transfers = _PairTransfers(cost_model)
        # prefill instance → [prefill seconds per second this policy sent there, as of time t]: an
        # exponential average over `utilization_window_s`; a decode hosted there gets (1 − it) of the engine
        self._prefill_rate: dict[str, list[float]] = {}
        # instance id (None: the default constants) → batch size → `_step_times`; pure, so memoised
        self._steps: dict[str | None, dict[int, tuple[float, float, float, float]]] = {}

    def _prefill_queue_s(self, v: InstanceView, now: float) -> float:
        """The ledger's backlog on a prefill instance, less the cache hits of our prefills still in it."""
        heap = self._overpriced.get(v.instance_id)
        if not heap:
            return v.backlog_s
        while heap and heap[0][0] <= now:  # ended: the ledger has dropped its whole price too
            heapq.heappop(heap)
        return max(0.0, v.backlog_s - sum(x for _, x in heap))

    def _utilization(self, instance_id: str, now: float) -> float:
        """The share of the prefill instance's time its prefills take (our own, averaged), below 0.95."""
        r = self._prefill_rate.get(instance_id)
        if r is None:
            return 0.0
        return min(0.95, r[0] * math.exp((r[1] - now) / self.params.utilization_window_s))

    def _add_prefill(self, instance_id: str, work_s: float, now: float) -> None:
        window = self.params.utilization_window_s
        r = self._prefill_rate.get(instance_id)
        if r is None:
            self._prefill_rate[instance_id] = [work_s / window, now]
        else:
            r[0] = r[0] * math.exp((r[1] - now) / window) + work_s / window
            r[1] = now

    def _colocated_queue_s(self, v: InstanceView, now: float) -> float:
        """Colocated prefill still to run on a decode instance. The ledger's backlog there mixes it with
        decode work, so: our own clock, bounded by that backlog."""
        return min(v.backlog_s, max(0.0, self._colocated_ends.get(v.instance_id, now) - now))

    def choose(self, req, prefill, decode, now):
        prm, cm = self.params, self.cost_model
        spread, w = prm.latency_error, prm.work_weight
        target = cm.target(req.slo_class)
        ttft_t, tpot_t, tpot_others = target.ttft_s, target.tpot_s, self._tpot_floor_s
        prompt, hashes = req.prompt_tokens, req.prefix_hashes
        out = max(1, req.predicted_output_tokens)
        overhead = cm.serving_overhead_s
        decode_ok = _feasible(decode, req, "decode")
        prefill_ok = [v for v in prefill if _fits(v, prompt)]
        if not prefill_ok and not prm.allow_colocated:
            _feasible(prefill, req, "prefill")  # raises the precise reason
            raise NoCapacity("no prefill candidate fits and colocated prefill is disabled")

        # prefill side: a pair depends on its prefill instance through the prefill's end and the TPOT
        # misses that prefill adds to the decodes hosted there (its stall); so without per-pair transfer
        # constants only the earliest end is worth pairing, and any later one that stalls less
        all_ends = ends = self._prefill_ends(prefill_ok, req, now)
        stalls = [self._stall(p, work, out, now, spread) if p.hosted else 0.0 for _, _, work, p in ends]
        if ends and not cm.pairs:
            order = sorted(range(len(ends)), key=lambda j: ends[j][0])
            keep, low = [], math.inf
            for j in order:
                if stalls[j] < low:
                    keep.append(j)
                    low = stalls[j]
            ends, stalls = [ends[j] for j in keep], [stalls[j] for j in keep]

        # This loop prices every decode instance on every decision (43 of them at 64 instances), so it
        # is kept to float arithmetic: the cost model's step times come from a memo per batch size,
        # Φ (`_miss`) is written out, and a candidate is priced in full only if it can still win — its
        # last term, w·latency/target, is a lower bound of its cost (every other term is ≥ 0), so one
        # whose last term exceeds the best cost so far is skipped. Same expressions in the same order
        # as the straightforward form, so the same floats and the same choice
        # (tests/core/test_decision_speed.py checks it against that form).
        erfc, k = math.erfc, _INV_SQRT2
        colocated_ends, allow_colocated = self._colocated_ends, prm.allow_colocated
        same_engine, transfer = not cm.instances, cm.transfer
        xfer_whole = transfer.transfer_s(prompt)
        pair_rows = [self._pair_transfers.row(p.instance_id) for _, _, _, p in ends]
        ec, memo = cm.engine, self._steps.setdefault(None, {})
        best, best_cost, bar = None, math.inf, math.inf  # bar: the best cost + a rounding margin
        for d in decode_ok:
            did = d.instance_id
            if not same_engine:
                ec, memo = cm.for_instance(did), self._steps.setdefault(did, {})
            b = d.queued
            steps = memo.get(b)
            if steps is None:
                steps = memo[b] = _step_times(ec, b)
            tau_b, tau_after, step, step_beside_chunk = steps
            # colocated prefill still to run on d (`_colocated_queue_s`)
            pending = min(d.backlog_s, max(0.0, colocated_ends.get(did, now) - now))
            held = _cached_tokens(d, req) if hashes else 0
            # KV at the request's peak: its prompt and output, and the running sequences' growth
            # meanwhile (half an output each on average: they are midway through theirs)
            press = d.pressure_after(prompt + out + b * out // 2)
            ok_kv = None  # and `before`: computed once a candidate on d may win
            for (end, q, work, p), pair_row, stall in zip(ends, pair_rows, stalls):
                if p.instance_id == did:  # `cm.transfer_s`, by instance ids
                    xfer = 0.0
                else:
                    tc = pair_row.get(did, transfer)
                    xfer = xfer_whole if tc is transfer and not held else tc.transfer_s(prompt - held)
                arrive = end + xfer
                # the first token comes from d's next step: longer while d prefills a colocated prompt
                first = step_beside_chunk if pending > arrive else step
                if b:
                    first *= 1.5  # + the rest of the step in flight, half a step on average
                ttft = arrive + first + overhead
                load = w * ttft / ttft_t + stall
                if load > bar:
                    continue
                meets_ttft = 1.0 - 0.5 * erfc((1.0 - ttft / ttft_t) / spread * k)
                if 1.0 - meets_ttft + load > bar:  # 1 − meet ≥ 1 − meets_ttft
                    continue
                if ok_kv is None:
                    ok_kv = 1.0 - 0.5 * erfc((1.0 - press) / spread * k)
                    before = 0.5 * erfc((1.0 - (tau_b + pending / out) / tpot_others) / spread * k) if b else 0.0
                tpot = tau_after + max(0.0, pending - arrive) / out
                after = 0.5 * erfc((1.0 - (tau_after + pending / out) / tpot_others) / spread * k) if b else 0.0
                meet = meets_ttft * (1.0 - 0.5 * erfc((1.0 - tpot / tpot_t) / spread * k)) * ok_kv
                cost = 1.0 - meet + b * (after - before) + load
                if cost < best_cost or best is None:
                    best, best_cost, bar = (p, d, q, work, xfer, first, tpot, press), cost, cost + _COST_ROUNDING
            if allow_colocated:
                uncached = prompt - held
                chunk = max(1, ec.max_batched_tokens - b)
                # beside b decoding sequences, each step prefills (budget − b) tokens and costs them their step
                work = (ec.prefill_overhead_s + -(-uncached // chunk) * (ec.step_base_s + ec.decode_seq_s * b)
                        + ec.prefill_token_s * uncached + ec.prefill_attention_s * attention_pairs(uncached, held))
                ttft = pending + work + overhead
                # its time is taken from d and from each of the b sequences waiting for it
                load = w * (ttft + (1 + b) * work) / ttft_t
                if load > bar:
                    continue
                meets_ttft = 1.0 - 0.5 * erfc((1.0 - ttft / ttft_t) / spread * k)
                if 1.0 - meets_ttft + load > bar:  # 2 − meet − ok_kv ≥ 1 − meets_ttft
                    continue
                if ok_kv is None:
                    ok_kv = 1.0 - 0.5 * erfc((1.0 - press) / spread * k)
                    before = 0.5 * erfc((1.0 - (tau_b + pending / out) / tpot_others) / spread * k) if b else 0.0
                after = 0.5 * erfc((1.0 - (tau_after + (pending + work) / out) / tpot_others) / spread * k) if b else 0.0
                meet = meets_ttft * (1.0 - 0.5 * erfc((1.0 - tau_after / tpot_t) / spread * k)) * ok_kv
                # if d's KV overflows it preempts a running sequence (it takes blocks chunk by chunk, where
                # a transferred prompt waits for all of them): one more miss
                cost = 2.0 - meet - ok_kv + b * (after - before) + load
                if cost < best_cost or best is None:
                    best, best_cost, bar = (d, d, pending, work, 0.0, 0.0, tau_after, press), cost, cost + _COST_ROUNDING

        if prm.allow_hosted:
            # a prefill instance serving the request whole: no transfer, and its KV holds the decode
            for end, q, work, p in all_ends:
                if p.role is not Role.PREFILL:  # a decode instance listed as a prefill one: colocation above
                    continue
                pid = p.instance_id
                ec = cm.engine if same_engine else cm.for_instance(pid)
                memo = self._steps.setdefault(None if same_engine else pid, {})
                h = p.hosted
                steps = memo.get(h)
                if steps is None:
                    steps = memo[h] = _step_times(ec, h)
                tau_h, tau_after = steps[0], steps[1]
                ttft = end + overhead  # its last prefill chunk gives the first token
                # its time is taken from the h decodes hosted there (its prefill), and from p's prefills
                # (its decode: ô steps, each longer by one sequence's cost)
                load = w * (ttft + h * work + out * ec.decode_seq_s) / ttft_t
                if load > bar:
                    continue
                meets_ttft = 1.0 - 0.5 * erfc((1.0 - ttft / ttft_t) / spread * k)
                if 1.0 - meets_ttft + load > bar:
                    continue
                # its decode gets the engine's time the prefills leave: τ/(1 − utilization) per token
                share = 1.0 - self._utilization(pid, now)
                tpot = tau_after / share
                press = p.pressure_after(prompt + out + h * out // 2)
                ok_kv = 1.0 - 0.5 * erfc((1.0 - press) / spread * k)
                harm = 0.0
                if h:
                    before = 0.5 * erfc((1.0 - tau_h / share / tpot_others) / spread * k)
                    after = 0.5 * erfc((1.0 - (tpot + work / out) / tpot_others) / spread * k)
                    harm = h * (after - before)
                meet = meets_ttft * (1.0 - 0.5 * erfc((1.0 - tpot / tpot_t) / spread * k)) * ok_kv
                cost = 2.0 - meet - ok_kv + harm + load  # overflowing, it preempts a running sequence
                if cost < best_cost or best is None:
                    best, best_cost, bar = (p, p, q, work, 0.0, 0.0, tpot, press), cost, cost + _COST_ROUNDING

        # best is set: decode_ok is not empty, and either colocation is allowed or a prefill fits
        p, d, q, work, xfer, first, tpot, press = best
        if p is d and p.role is not Role.PREFILL:
            self._colocated_ends[d.instance_id] = now + q + work
        else:
            self._add_prefill(p.instance_id, work, now)
            overpriced = cm.for_instance(p.instance_id).prefill_s(prompt) - work
            if overpriced > 0.0:
                heapq.heappush(self._overpriced.setdefault(p.instance_id, []), (now + q + work, overpriced))
        return Decision(
            p.instance_id, d.instance_id, self.name,
            CostTerms(backlog_s=q, own_work_s=work, pressure=p.pressure_after(prompt)),
            CostTerms(backlog_s=first, own_work_s=out * tpot, pressure=press, transfer_s=xfer),
        )

    def _stall(self, p: InstanceView, work: float, out: int, now: float, spread: float) -> float:
        """The TPOT misses a prefill of `work` seconds on `p` adds to the decodes `p` hosts: each gets
        τ_dec(h)/(1 − utilization) per token, and `work` more spread over its (predicted) output."""
        ec, h = self.cost_model.for_instance(p.instance_id), p.hosted
        tpot = ec.decode_token_s(h) / (1.0 - self._utilization(p.instance_id, now))
        return h * (_miss(tpot + work / out, self._tpot_floor_s, spread) - _miss(tpot, self._tpot_floor_s, spread))

    def _prefill_ends(self, pool: list[InstanceView], req: RequestFeatures, now: float) -> list[tuple]:
        """(end of the request's prefill, queue, work, instance) on each prefill candidate."""
        cm, prompt = self.cost_model, req.prompt_tokens
        # without prefix hashes or per-instance constants the work is the same everywhere: price it once
        uniform = not (req.prefix_hashes or cm.instances)
        work = cm.engine.prefill_s(prompt) if uniform else 0.0
        ends = []
        for p in pool:
            q = self._prefill_queue_s(p, now) if self._overpriced else p.backlog_s
            if not uniform:
                cached = _cached_tokens(p, req)  # the uncached rest attends to the cached prefix too
                work = cm.for_instance(p.instance_id).prefill_s(prompt - cached, cached)
            ends.append((q + work, q, work, p))
        return ends


# Skipping a candidate whose lower bound exceeds the best cost must not depend on the last bits of
# Φ: its other terms are ≥ 0 exactly but for Φ's rounding, far below this margin.
_COST_ROUNDING = 1e-9


def _step_times(ec: EngineConstants, b: int) -> tuple[float, float, float, float]:
    """τ_dec(b), τ_dec(b + 1), a decode step of b + 1 sequences, and that step beside a full prefill chunk."""
    return (ec.decode_token_s(b), ec.decode_token_s(b + 1), ec.step_s(0, b + 1),
            ec.step_s(ec.max_batched_tokens - b - 1, b + 1))
