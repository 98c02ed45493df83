"""The baselines: round_robin, least_loaded, power_of_two (Ray Serve LLM's default), colocated,
and length_heuristic (a threshold on the predicted output length)."""

from __future__ import annotations

import random
from typing import Sequence

from pydantic import Field

from disagg.core.cost_model import CostModel
from disagg.core.policies.base import (
    Cursor, Params, Policy, TieBreak, TieBreakParams, feasible, queued, register,
)
from disagg.core.types import Decision, InstanceView


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
        self._p, self._d = Cursor(), Cursor()

    def choose(self, req, prefill, decode, now):
        p = self._p.take(feasible(prefill, req, "prefill"))
        d = self._d.take(feasible(decode, req, "decode"))
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
        self._p, self._d = Cursor(), Cursor()
        self._tie = TieBreak(self.params)

    def choose(self, req, prefill, decode, now):
        p = self._tie.argmin(self._p.rotated(feasible(prefill, req, "prefill")), queued)
        d = self._tie.argmin(self._d.rotated(feasible(decode, req, "decode")), queued)
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
        p = self._pick(feasible(prefill, req, "prefill"))
        d = self._pick(feasible(decode, req, "decode"))
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
        self._d = Cursor()
        self._tie = TieBreak(self.params)

    def choose(self, req, prefill, decode, now):
        d = self._tie.argmin(self._d.rotated(feasible(decode, req, "decode")), queued)
        return Decision(d.instance_id, d.instance_id, self.name)


def _pressure_key(extra: int):
    return lambda v: v.pressure_after(extra)


@register
class LengthHeuristic(LeastLoaded):
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

    name = "length_heuristic"  # least_loaded's cursors and tie-break, its own rule for the decode side

    def choose(self, req, prefill, decode, now):
        p = self._tie.argmin(self._p.rotated(feasible(prefill, req, "prefill")), queued)
        pool = self._d.rotated(feasible(decode, req, "decode"))
        if req.predicted_output_tokens >= self.params.long_output_tokens:
            d = self._tie.argmin(pool, _pressure_key(req.prompt_tokens + req.predicted_output_tokens))
        else:
            d = self._tie.argmin(pool, queued)
        return Decision(p.instance_id, d.instance_id, self.name)


# --- the calibrated scorer ----------------------------------------------------------------------
