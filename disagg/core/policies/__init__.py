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

One module per family: `base` (the seam, the registry and what every policy shares), `simple` (the
baselines), `prefix_affinity`, `marginal_cost` (with `oracle` and `pair_cost`), `slo_goodput`. A new
policy is a module with a `@register`ed `Policy` subclass, imported below (docs/policies.md).
"""

from disagg.core.policies.base import (
    Params, Policy, PolicyError, TieBreakParams, build_policy, known_policies, parse_policy_spec, policy_class,
    register, replica_seed,
)
from disagg.core.policies.marginal_cost import MarginalCost, Oracle, PairCost
from disagg.core.policies.prefix_affinity import PrefixAffinity
from disagg.core.policies.simple import Colocated, LeastLoaded, LengthHeuristic, PowerOfTwo, RoundRobin
from disagg.core.policies.slo_goodput import SloGoodput

__all__ = [
    "Colocated", "LeastLoaded", "LengthHeuristic", "MarginalCost", "Oracle", "PairCost", "Params", "Policy",
    "PolicyError", "PowerOfTwo", "PrefixAffinity", "RoundRobin", "SloGoodput", "TieBreakParams", "build_policy",
    "known_policies", "parse_policy_spec", "policy_class", "register", "replica_seed",
]
