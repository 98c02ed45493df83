"""The policy seam: the `Policy` base, its registry and parameters, and what every policy shares:
feasibility (a prompt that fits), near-tie breaking and a round-robin cursor. See the package
docstring for the contract every policy keeps, and how to add one."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Callable, ClassVar, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from disagg.core.cost_model import CostModel, TransferConstants
from disagg.core.types import Decision, InstanceView, NoCapacity, RequestFeatures

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


def fits(view: InstanceView, prompt_tokens: int) -> bool:
    """Can this instance ever hold the prompt (plus the first generated token)?"""
    return prompt_tokens + 1 <= view.kv_capacity_tokens


def cached_prompt_tokens(v: InstanceView, req: RequestFeatures) -> int:
    """Prompt tokens `v` holds cached, as a prefill there may reuse them: whole leading blocks, never
    the block of the last prompt token (always computed, as in vLLM)."""
    if not req.prefix_hashes:
        return 0
    blocks = v.cached_prefix_blocks(req.prefix_hashes)
    block = req.prefix_block_tokens
    return min(blocks, (req.prompt_tokens - 1) // block) * block if blocks else 0


def decode_context(v: InstanceView, req: RequestFeatures, out: int) -> int:
    """The tokens of context a decode step on `v` attends to while the request decodes there, on
    average: what `v`'s sequences hold (its KV in use), the request's prompt and half its output."""
    return v.kv_used_tokens + req.prompt_tokens + out // 2


def feasible(pool: Sequence[InstanceView], req: RequestFeatures, pool_name: str) -> list[InstanceView]:
    if not pool:
        raise NoCapacity(f"the {pool_name} pool is empty")
    need = req.prompt_tokens + 1
    ok = [v for v in pool if need <= v.kv_capacity_tokens]  # `fits`, inline: every decision filters every pool
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


class TieBreak:
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


class Cursor:
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


def queued(v: InstanceView) -> int:
    return v.queued


class PairTransfers:
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
        return self._rows.get(prefill_id, NO_PAIRS)


NO_PAIRS: dict[str, TransferConstants] = {}
