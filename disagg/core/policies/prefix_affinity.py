"""`prefix_affinity`: route to the instance that holds the request's prefix, within a load bound."""

from __future__ import annotations

from pydantic import Field

from disagg.core.cost_model import CostModel
from disagg.core.policies.base import Cursor, Params, Policy, feasible, queued, register
from disagg.core.types import Decision, InstanceView


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
        self._p, self._d = Cursor(), Cursor()

    def choose(self, req, prefill, decode, now):
        p = self._pick(self._p.rotated(feasible(prefill, req, "prefill")), req.prefix_hashes)
        d = self._pick(self._d.rotated(feasible(decode, req, "decode")), req.prefix_hashes)
        return Decision(p.instance_id, d.instance_id, self.name)

    def _pick(self, pool: list[InstanceView], hashes: tuple[int, ...]) -> InstanceView:
        least = min(pool, key=queued)  # first of equal minima: round-robin ties
        if not hashes:
            return least
        cached = [v.cached_prefix_blocks(hashes) for v in pool]
        best = max(cached)
        if best == 0 or best < self.params.match_threshold * len(hashes):
            return least
        warm = min((v for v, c in zip(pool, cached) if c == best), key=queued)
        return warm if warm.queued - least.queued <= self.params.imbalance_threshold else least
