"""Hot-path records shared by the live router, the simulator and the policies.

Everything here is pure data: frozen, slotted dataclasses and enums. A policy sees the world only
through these types, which is what lets the simulator run the very same policy code as the router.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import TypeVar

_R = TypeVar("_R")


def quick_init(cls: type[_R]) -> type[_R]:
    """Class decorator, above `@dataclass(frozen=True, slots=True)`: an `__init__` that sets each slot
    through the slot's own descriptor.

    A frozen dataclass's generated `__init__` goes through `object.__setattr__` for every field, about
    twice the cost; these records are built several times per routed request, by the live router and
    the simulator alike. Same signature, defaults and default factories as the generated one, and the
    instance is as frozen (assigning to it afterwards raises)."""
    env: dict = {"_FACTORY": object()}  # stands for "not given" where a field has a default factory
    params, sets = [], []
    if hasattr(cls, "__post_init__") or any(not f.init or f.kw_only for f in fields(cls)):
        raise TypeError(f"quick_init: {cls.__name__} needs the dataclass's own __init__")
    for f in fields(cls):
        name, value = f.name, f.name
        env[f"_set_{name}"] = cls.__dict__[name].__set__  # the slot's member descriptor
        if f.default is not MISSING:
            env[f"_default_{name}"] = f.default
            params.append(f"{name}=_default_{name}")
        elif f.default_factory is not MISSING:
            env[f"_factory_{name}"] = f.default_factory
            params.append(f"{name}=_FACTORY")
            value = f"_factory_{name}() if {name} is _FACTORY else {name}"
        else:
            params.append(name)
        sets.append(f"    _set_{name}(self, {value})\n")
    exec(f"def __init__(self, {', '.join(params)}):\n{''.join(sets)}", env)
    env["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = env["__init__"]
    return cls


class Role(enum.Enum):
    """What an engine instance does in the disaggregated graph."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # colocated: prefills and decodes on one engine

    # members are singletons, so identity hashing is exact; Enum's own `__hash__` hashes the name in
    # Python code, on every dict lookup keyed by a member
    __hash__ = object.__hash__

    def serves_prefill(self) -> bool:
        return self is not Role.DECODE

    def serves_decode(self) -> bool:
        return self is not Role.PREFILL


class SloClass(enum.Enum):
    """Latency class of a request; strict classes are weighted up by the cost model's sigma."""

    TIGHT = "tight"
    LOOSE = "loose"

    __hash__ = object.__hash__  # as `Role`'s: the SLO class keys the targets, weights and predictor buckets

    @classmethod
    def parse(cls, value: str) -> "SloClass":
        try:
            return cls(value.strip().lower())
        except ValueError:
            allowed = ", ".join(c.value for c in cls)
            raise ValueError(f"unknown SLO class {value!r}; allowed: {allowed}") from None


PREFIX_BLOCK_TOKENS = 512  # tokens per prefix-hash block in traces: the Mooncake `hash_ids` convention


@quick_init
@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the router knows of a request at admission time.

    `true_output_tokens` is set only by the simulator; it exists so that the `oracle` policy can
    bound what a perfect output-length predictor would gain. Live requests leave it None.
    `prefix_hashes` are the prompt's block hashes, one per `prefix_block_tokens`-token block, each
    naming the whole prefix up to its block's end, or empty when unknown. Traces use the Mooncake
    convention (`PREFIX_BLOCK_TOKENS`); the live router hashes in a multiple of the engines' KV block.
    `ttft_target_s`/`tpot_target_s`: the request's own targets where SLOs scale with the request
    (the simulator's `slo_scale`); None means its class's targets.
    """

    request_id: str
    prompt_tokens: int
    predicted_output_tokens: int
    slo_class: SloClass = SloClass.LOOSE
    true_output_tokens: int | None = None
    prefix_hashes: tuple[int, ...] = ()
    prefix_block_tokens: int = PREFIX_BLOCK_TOKENS
    # the request's own latency targets (s), where SLOs scale with the request; None: its class's
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None


# How many leading blocks of the given prefix hashes an instance holds in its prefix cache.
# Must be side-effect free: policies call it while choosing, and may call it for every candidate.
PrefixLookup = Callable[[tuple[int, ...]], int]


@quick_init
@dataclass(frozen=True, slots=True)
class InstanceView:
    """What the router knows of one engine instance at decision time."""

    instance_id: str
    role: Role
    backlog_s: float  # committed work, seconds (the router's in-flight ledger)
    queued: int  # requests admitted to this instance and not finished
    kv_used_tokens: int  # latest polled KV use plus what the ledger admitted since
    kv_capacity_tokens: int
    # The instance's prefix cache, as the simulator knows it or the live router's index estimates
    # it: None means unknown, and every prefix then counts as uncached.
    prefix_lookup: PrefixLookup | None = None
    # requests this instance serves whole (prefill and decode) although its role is PREFILL: the
    # router's own, from its ledger; its `backlog_s` then counts only their prefill work
    hosted: int = 0

    def pressure_after(self, extra_tokens: int) -> float:
        """KV-cache pressure after admitting `extra_tokens` more (may exceed 1.0)."""
        return (self.kv_used_tokens + extra_tokens) / self.kv_capacity_tokens

    def cached_prefix_blocks(self, prefix_hashes: tuple[int, ...]) -> int:
        """How many leading blocks of `prefix_hashes` this instance holds cached (0 when unknown)."""
        if self.prefix_lookup is None or not prefix_hashes:
            return 0
        return self.prefix_lookup(prefix_hashes)


@quick_init
@dataclass(frozen=True, slots=True)
class CostTerms:
    """Per-term breakdown of one candidate's price, in seconds (weights already applied)."""

    backlog_s: float = 0.0
    own_work_s: float = 0.0
    pressure: float = 0.0  # press+ (dimensionless), reported for explanation
    queue_s: float = 0.0
    transfer_s: float = 0.0
    slo_weight: float = 1.0

    @property
    def total_s(self) -> float:
        return self.backlog_s + self.own_work_s + self.queue_s + self.transfer_s

    def as_dict(self) -> dict[str, float]:
        return {
            "backlog_s": round(self.backlog_s, 6),
            "own_work_s": round(self.own_work_s, 6),
            "pressure": round(self.pressure, 4),
            "queue_s": round(self.queue_s, 6),
            "transfer_s": round(self.transfer_s, 6),
            "slo_weight": self.slo_weight,
            "total_s": round(self.total_s, 6),
        }


@quick_init
@dataclass(frozen=True, slots=True)
class Decision:
    """A routing choice with its explanation.

    `prefill_id == decode_id` means the request is prefilled on its decode instance (no KV
    transfer). `prefill_cost`/`decode_cost` are the chosen candidates' price breakdowns; policies
    that do not price (round robin, JSQ) leave them at zero cost.
    """

    prefill_id: str
    decode_id: str
    policy: str
    prefill_cost: CostTerms = field(default_factory=CostTerms)
    decode_cost: CostTerms = field(default_factory=CostTerms)

    @property
    def colocated(self) -> bool:
        return self.prefill_id == self.decode_id

    def header_value(self) -> str:
        """The `x-disagg-route` header: who served the request and why."""
        p, d = self.prefill_cost, self.decode_cost
        return (
            f"prefill={self.prefill_id}; decode={self.decode_id}; policy={self.policy}; "
            f"p_backlog={p.backlog_s:.4f}; p_work={p.own_work_s:.4f}; p_press={p.pressure:.3f}; "
            f"d_backlog={d.backlog_s:.4f}; d_work={d.own_work_s:.4f}; d_press={d.pressure:.3f}; "
            f"d_queue={d.queue_s:.4f}; transfer={d.transfer_s:.4f}; sigma={d.slo_weight:g}"
        )

    def as_dict(self) -> dict:
        return {
            "prefill": self.prefill_id,
            "decode": self.decode_id,
            "policy": self.policy,
            "prefill_cost": self.prefill_cost.as_dict(),
            "decode_cost": self.decode_cost.as_dict(),
        }


class NoCapacity(Exception):
    """No candidate can ever serve this request (empty pool, or prompt beyond every KV capacity)."""
