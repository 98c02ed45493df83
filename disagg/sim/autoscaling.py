"""Pool widths that change during a simulation: the instances' life cycle, and the scalers that size the pools.

**The fleet** (`Fleet`). Every instance of the simulated topology (the most each pool may have)
exists from the start; an instance is off, starting, active or draining:
- off → starting: a scale-up requests it; it costs from that moment (a GPU is held while the
  engine loads its weights and warms up) and serves `startup_s` later (60 s: a vLLM engine of a
  few billion parameters on one GPU);
- starting → active: the router's policy sees it from then on (and only then);
- active → draining: a scale-down takes it out of the routing (the policy never sees it again) and
  it finishes the requests it holds: the prefills whose KV has not left it, the decodes routed to it;
- draining → off: released when it holds none; its cost stops then.
A scale-down cancels starting instances first (the newest first; they serve nobody yet), then
drains the active instance with the fewest requests (the first to be free; the highest index on a
tie). A scale-up starts off instances (the lowest index first) and, when none is off, takes a
draining one back at once (it is still loaded). A pool's width is what a scaler controls: its
starting and active instances (Serve's `target_num_replicas`); its active instances are Serve's
running replicas. GPU-seconds are the sum over instances of the time they were starting, active
or draining. The instances a scaler starts with (`Scaler.initial`) are active at 0 and cost from 0.

**The scalers** (`Scaler`: `name`, `initial`, `interval_s`, `decide`). The simulator evaluates a
scaler every `interval_s` seconds of simulated time and shows it a `FleetState`: the widths, the
active instances, the planner's `Window` of the last interval and each pool's ongoing requests
integrated over time; the scaler answers the widths the pools should have.
- `FixedWidths`: never evaluated; the pools keep their widths (a run with fixed widths is the
  run without a scaler, result for result).
- `ServeDefault`: Ray Serve's default autoscaling policy (`replica_queue_length_autoscaling_policy`
  wrapped by `_apply_autoscaling_config`, then clipped to the bounds, as
  ray/serve/autoscaling_policy.py and _private/autoscaling_state.py in Ray 2.60 do), applied to
  each pool independently as to one deployment each: ongoing = running + queued requests at the
  pool's replicas, averaged over `look_back_period_s`; desired = ongoing / target_ongoing_requests
  (running × error ratio), through the up/down-scaling factors, and only after the wish to scale
  up (down) has lasted `upscale_delay_s` (`downscale_delay_s`); evaluated every 0.1 s, Ray's
  control loop period (`control_interval_s`). Not modelled: the metrics' push interval (replicas
  report every 10 s in Ray; here the controller sees the exact ongoing counts, which favours Serve).
  A request is ongoing on its prefill replica from its routing until its prefill returns, and on
  its decode replica from the decode call (the prefill returned) until its last token; a colocated
  request on its decode replica from its routing.
- `PlannerScaler`: `disagg.core.planner.Planner`, the code the live router runs, every
  `PlannerConfig.interval_s`, on a window built as the live router builds it
  (the same `disagg.core.planner.WindowCounter`): arrivals with their prompt lengths and SLO classes, finished
  requests with their output lengths and whether they met their class's TTFT and TPOT targets,
  and the highest KV pressure of an active decode instance at the evaluation. Its plan is applied
  as is (the live config runs it with Serve's delays at 0: the planner has its own hysteresis).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from disagg.core.cost_model import EngineConstants, SloTarget
from disagg.core.planner import Plan, Planner, Widths, Window, WindowCounter, merge_window, ttft_floor_s
from disagg.core.types import Role, SloClass
from disagg.sim.metrics import RequestRecord

POOLS = (Role.PREFILL, Role.DECODE)


def width_of(widths: Widths, role: Role) -> int:
    return widths.prefill if role is Role.PREFILL else widths.decode


# --- what a scaler sees and answers ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetState:
    """What a scaler is shown at an evaluation."""

    now: float
    widths: Widths  # starting + active instances per pool: what the scalers set (Serve's target replicas)
    active: Widths  # the instances serving (Serve's running replicas)
    window: Window  # the planner's window: what the router saw since the previous evaluation
    prefill_ongoing_s: float  # ∫ ongoing requests dt on the prefill pool since 0 (request-seconds)
    decode_ongoing_s: float

    def ongoing_s(self, role: Role) -> float:
        return self.prefill_ongoing_s if role is Role.PREFILL else self.decode_ongoing_s


class Scaler(Protocol):
    """Sizes the prefill and decode pools during a simulation.

    The simulator reads `initial` once (the widths at time 0, active at once), then calls `decide`
    every `interval_s` seconds of simulated time (never when `interval_s` is None) and applies the
    widths it returns: each within 0 and the pool's instances, decode at least 1 (the simulator
    refuses others, naming the scaler). A scaler may keep state between calls; it must not read
    the clock (time comes in `FleetState.now`)."""

    name: str
    initial: Widths
    interval_s: float | None

    def decide(self, state: FleetState) -> Widths: ...


@dataclass(slots=True)
class FixedWidths:
    """The pools keep `initial` for the whole run."""

    initial: Widths
    name: str = "fixed"
    interval_s: float | None = None

    def decide(self, state: FleetState) -> Widths:
        return self.initial


class ServeAutoscaling(BaseModel):
    """One deployment's `autoscaling_config` as Ray Serve reads it (the fields the default policy uses,
    with Ray 2.60's defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_ongoing_requests: float = Field(default=2.0, gt=0, description="ongoing requests per replica to aim at")
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    look_back_period_s: float = Field(default=30.0, gt=0, description="the ongoing requests' averaging window")
    upscale_delay_s: float = Field(default=30.0, ge=0)
    downscale_delay_s: float = Field(default=600.0, ge=0)
    downscale_to_zero_delay_s: float | None = Field(default=None, ge=0)
    upscaling_factor: float | None = Field(default=None, gt=0)
    downscaling_factor: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "ServeAutoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        return self


# Ray's tolerance for its delay comparisons (ray.serve.autoscaling_policy._DELAY_ELAPSED_EPS_S)
_DELAY_EPS_S = 1e-6


class ServeRule:
    """Ray Serve's default autoscaling decision for one deployment, step for step as Ray 2.60 takes it
    (ray/serve/autoscaling_policy.py: the cold-start path, `_core_replica_queue_length_policy`,
    `_apply_scaling_factors`, `_apply_delay_logic`; then `apply_bounds`). Keeps the delay state."""

    def __init__(self, config: ServeAutoscaling) -> None:
        self.config = config
        self._counter = 0  # > 0: consecutive wishes to scale up; < 0: down (Ray's decision counter)
        self._since: float | None = None  # when the current wish began

    def decide(self, total_ongoing: float, running: int, target: int, now: float) -> int:
        """The deployment's next target from the look-back mean of its ongoing requests, its running
        replicas and its current target."""
        c = self.config
        up = c.upscaling_factor or 1.0
        if running == 0 and total_ongoing > 0:  # cold start: no delay
            return self._bounded(max(math.ceil(1 * up), target))
        if running == 0:
            desired: float = target
        else:
            desired = running * (total_ongoing / (c.target_ongoing_requests * running))
        desired = self._scaled(desired, running)
        if running == 0 and desired > 0:
            return self._bounded(desired)
        return self._bounded(self._delayed(max(0, desired), target, now))

    def _scaled(self, desired: float, running: int) -> int:
        if running == 0:
            return math.ceil(desired)
        delta = desired - running
        factor = (self.config.upscaling_factor or 1.0) if delta > 0 else (self.config.downscaling_factor or 1.0)
        scaled = math.ceil(running + factor * delta)
        if math.ceil(float(desired)) < running and scaled == running:  # a factor < 1 must not stall a scale-down
            scaled -= 1
        return scaled

    def _delayed(self, desired: int, target: int, now: float) -> int:
        c = self.config
        decision = target
        if desired > target:
            if self._counter < 0:
                self._counter, self._since = 0, None
            self._counter += 1
            if self._since is None:
                self._since = now
            if now - self._since + _DELAY_EPS_S >= c.upscale_delay_s:
                self._counter, self._since = 0, None
                decision = desired
        elif desired < target:
            if self._counter > 0:
                self._counter, self._since = 0, None
            self._counter -= 1
            if target == 1:
                delay = c.downscale_to_zero_delay_s if c.downscale_to_zero_delay_s is not None else c.downscale_delay_s
            else:
                delay = c.downscale_delay_s
                desired = max(1, desired)
            if self._since is None:
                self._since = now
            if now - self._since + _DELAY_EPS_S >= delay:
                self._counter, self._since = 0, None
                decision = desired
        else:
            self._counter, self._since = 0, None
        return decision

    def _bounded(self, n: int) -> int:
        return max(self.config.min_replicas, min(self.config.max_replicas, n))


class ServeDefault:
    """Ray Serve's default autoscaling, one `ServeRule` per pool (module docstring)."""

    def __init__(self, prefill: ServeAutoscaling, decode: ServeAutoscaling, initial: Widths,
                 control_interval_s: float = 0.1, name: str = "serve_default") -> None:
        if not control_interval_s > 0:
            raise ValueError(f"control_interval_s must be > 0, got {control_interval_s!r}")
        self.name = name
        self.initial = initial
        self.interval_s = control_interval_s
        self.rules = {Role.PREFILL: ServeRule(prefill), Role.DECODE: ServeRule(decode)}
        # per pool: (time, ∫ ongoing dt) at each evaluation, back to one look-back period
        self._history: dict[Role, deque[tuple[float, float]]] = {r: deque([(0.0, 0.0)]) for r in POOLS}

    def mean_ongoing(self, role: Role, now: float, integral: float) -> float:
        """The time-weighted mean of the pool's ongoing requests over the look-back period (from 0 if
        the run is younger), from the integrals recorded at the evaluations."""
        look_back = self.rules[role].config.look_back_period_s
        h = self._history[role]
        h.append((now, integral))
        while len(h) > 1 and h[1][0] <= now - look_back + 1e-9:
            h.popleft()
        t0, a0 = h[0]
        return (integral - a0) / (now - t0) if now > t0 else 0.0

    def decide(self, state: FleetState) -> Widths:
        out = {}
        for role in POOLS:
            ongoing = self.mean_ongoing(role, state.now, state.ongoing_s(role))
            out[role] = self.rules[role].decide(ongoing, width_of(state.active, role), width_of(state.widths, role),
                                                state.now)
        return Widths(out[Role.PREFILL], out[Role.DECODE])


class PlannerScaler:
    """`disagg.core.planner.Planner` on the simulation's windows; `plans` keeps every plan that changed
    a width, with its reasons."""

    def __init__(self, planner: Planner, initial: Widths, name: str = "planner") -> None:
        self.name = name
        self.planner = planner
        self.initial = initial
        self.interval_s = planner.config.interval_s
        self.plans: list[dict] = []

    def decide(self, state: FleetState) -> Widths:
        plan: Plan = self.planner.plan(state.window, state.widths)
        if plan.widths != state.widths:
            self.plans.append({"t": state.now, **plan.as_dict()})
        return plan.widths


# --- what the simulation observed --------------------------------------------------------------


class Signals:
    """What the scalers read, counted by the simulator: the planner's window since the last
    evaluation, counted as the live router counts it (serve_app.planning: arrivals with their
    prompt lengths and SLO classes; finished requests with their output lengths and whether they
    met their class's targets), and each pool's ongoing requests over time."""

    __slots__ = ("window", "_ongoing", "_integral", "_since")

    def __init__(self) -> None:
        self.window = WindowCounter()
        self._ongoing = {r: 0 for r in POOLS}
        self._integral = {r: 0.0 for r in POOLS}
        self._since = {r: 0.0 for r in POOLS}

    def arrived(self, prompt_tokens: int, slo: SloClass) -> None:
        self.window.admitted(prompt_tokens, slo)

    def hosted(self) -> None:
        """The request just admitted is served whole by a prefill instance."""
        self.window.placed_hosted()

    def served(self, record: RequestRecord, target: SloTarget, engine: EngineConstants) -> None:
        """A request finished; `target` is its SLO class's, `engine` the constants it ran with."""
        self.window.served(record.output_tokens, record.ttft_s, record.tpot_s, target,
                           ttft_floor_s(engine, record.prompt_tokens))

    def take_window(self, seconds: float, kv_pressure: float) -> Window:
        """The window since the last call, and start a new one."""
        return merge_window([self.window.take()], seconds, kv_pressure)

    def ongoing(self, role: Role, delta: int, now: float) -> None:
        """A request began (+1) or ended (−1) being ongoing on the pool at `now`."""
        self._integral[role] += self._ongoing[role] * (now - self._since[role])
        self._since[role] = now
        self._ongoing[role] += delta

    def ongoing_s(self, role: Role, now: float) -> float:
        """∫ ongoing requests dt on the pool from 0 to `now`."""
        return self._integral[role] + self._ongoing[role] * (now - self._since[role])


# --- the instances ------------------------------------------------------------------------------


class InstanceState(Enum):
    OFF = "off"
    STARTING = "starting"
    ACTIVE = "active"
    DRAINING = "draining"


_COSTING = (InstanceState.STARTING, InstanceState.ACTIVE, InstanceState.DRAINING)


@dataclass(slots=True)
class _Instance:
    iid: str
    role: Role
    index: int
    state: InstanceState = InstanceState.OFF
    since: float = 0.0  # when it was requested (its cost runs from then), while not off
    requests: int = 0  # routed to it and not done there


@dataclass(frozen=True, slots=True)
class Started:
    """An instance a scale-up started: it serves at `ready_at` unless cancelled before."""

    instance_id: str
    requested_at: float
    ready_at: float


@dataclass(slots=True)
class Fleet:
    """The instances of both pools, their states and what they cost (module docstring).

    The simulator calls `resize` with a scaler's widths, `activate` when a start-up is due,
    `assign` when it routes a request to an instance and `done` when the instance is done with it;
    `active(role)` is what the router may route to, in index order."""

    ids: dict[Role, list[str]]
    initial: Widths
    startup_s: float
    instances: dict[str, _Instance] = field(init=False)
    gpu_s: float = field(init=False, default=0.0)  # of the instances already released
    scale_ups: dict[Role, int] = field(init=False)
    scale_downs: dict[Role, int] = field(init=False)
    series: list[tuple[float, int, int, int, int]] = field(init=False)  # t, P active, P costing, D active, D costing
    _active: dict[Role, list[str]] = field(init=False)

    def __post_init__(self) -> None:
        if not (self.startup_s >= 0 and math.isfinite(self.startup_s)):
            raise ValueError(f"startup_s must be a finite number of seconds >= 0, got {self.startup_s!r}")
        self.instances = {}
        for role in POOLS:
            n = width_of(self.initial, role)
            if not 0 <= n <= len(self.ids[role]):
                raise ValueError(f"initial {role.value} width {n} is outside 0..{len(self.ids[role])} (its instances)")
            for i, iid in enumerate(self.ids[role]):
                self.instances[iid] = _Instance(iid, role, i, InstanceState.ACTIVE if i < n else InstanceState.OFF)
        self._active = {r: [i for i in self.ids[r] if self.instances[i].state is InstanceState.ACTIVE] for r in POOLS}
        self.scale_ups = {r: 0 for r in POOLS}
        self.scale_downs = {r: 0 for r in POOLS}
        self.series = []
        self._record(0.0)

    # --- reading ----------------------------------------------------------------------------

    def active(self, role: Role) -> list[str]:
        """The instances the router may route to, in index order (a copy)."""
        return list(self._active[role])

    def _count(self, role: Role, *states: InstanceState) -> int:
        return sum(1 for i in self.ids[role] if self.instances[i].state in states)

    def widths(self) -> Widths:
        """Starting + active instances per pool: the widths the scalers set."""
        s = (InstanceState.STARTING, InstanceState.ACTIVE)
        return Widths(self._count(Role.PREFILL, *s), self._count(Role.DECODE, *s))

    def serving(self) -> Widths:
        return Widths(len(self._active[Role.PREFILL]), len(self._active[Role.DECODE]))

    def state(self, iid: str) -> InstanceState:
        return self.instances[iid].state

    def gpu_seconds(self, now: float) -> float:
        """GPU-seconds so far: released instances' and the running cost of the others until `now`."""
        return self.gpu_s + sum(now - i.since for i in self.instances.values() if i.state in _COSTING)

    # --- changing ---------------------------------------------------------------------------

    def resize(self, role: Role, width: int, now: float) -> list[Started]:
        """Make the pool's width (starting + active) `width`; returns the instances started."""
        pool = [self.instances[i] for i in self.ids[role]]
        if not 0 <= width <= len(pool):
            raise ValueError(f"{role.value} width {width} is outside 0..{len(pool)} (its instances)")
        current = sum(1 for i in pool if i.state in (InstanceState.STARTING, InstanceState.ACTIVE))
        if width == current:
            return []
        started: list[Started] = []
        if width > current:
            self.scale_ups[role] += 1
            for _ in range(width - current):
                off = [i for i in pool if i.state is InstanceState.OFF]
                if off:
                    inst = off[0]
                    inst.state, inst.since = InstanceState.STARTING, now
                    started.append(Started(inst.iid, now, now + self.startup_s))
                else:  # only draining ones are left: take one back, it is still loaded
                    inst = min((i for i in pool if i.state is InstanceState.DRAINING), key=lambda i: i.index)
                    inst.state = InstanceState.ACTIVE
        else:
            self.scale_downs[role] += 1
            for _ in range(current - width):
                starting = [i for i in pool if i.state is InstanceState.STARTING]
                if starting:  # serves nobody yet: cancel the newest
                    inst = max(starting, key=lambda i: (i.since, i.index))
                    self._release(inst, now)
                    continue
                inst = min((i for i in pool if i.state is InstanceState.ACTIVE), key=lambda i: (i.requests, -i.index))
                inst.state = InstanceState.DRAINING
                if inst.requests == 0:
                    self._release(inst, now)
        self._sync(role)
        self._record(now)
        return started

    def activate(self, started: Started, now: float) -> bool:
        """A start-up is due: the instance serves from now, unless it was cancelled (and perhaps
        started again) since; then nothing changes and the answer is False."""
        inst = self.instances[started.instance_id]
        if inst.state is not InstanceState.STARTING or inst.since != started.requested_at:
            return False
        inst.state = InstanceState.ACTIVE
        self._sync(inst.role)
        self._record(now)
        return True

    def assign(self, iid: str) -> None:
        self.instances[iid].requests += 1

    def done(self, iid: str, now: float) -> None:
        """The instance is done with one of its requests; a draining instance left empty is released."""
        inst = self.instances[iid]
        inst.requests -= 1
        if inst.state is InstanceState.DRAINING and inst.requests == 0:
            self._release(inst, now)
            self._record(now)

    def _release(self, inst: _Instance, now: float) -> None:
        self.gpu_s += now - inst.since
        inst.state = InstanceState.OFF

    def _sync(self, role: Role) -> None:
        self._active[role] = [i for i in self.ids[role] if self.instances[i].state is InstanceState.ACTIVE]

    def _record(self, now: float) -> None:
        point = (now, len(self._active[Role.PREFILL]), self._count(Role.PREFILL, *_COSTING),
                 len(self._active[Role.DECODE]), self._count(Role.DECODE, *_COSTING))
        if self.series and self.series[-1][0] == now:
            self.series[-1] = point
        elif not self.series or self.series[-1][1:] != point[1:]:
            self.series.append(point)

    # --- the run's figures ------------------------------------------------------------------

    def summary(self, end: float) -> dict:
        """GPU-seconds and hours to `end`, time-weighted mean and max widths per pool (active: serving;
        provisioned: costing), scale events and the width series."""
        out: dict = {"gpu_seconds": self.gpu_seconds(end), "gpu_hours": self.gpu_seconds(end) / 3600.0,
                     "duration_s": end}
        for col, role, kind in ((1, Role.PREFILL, "active"), (2, Role.PREFILL, "provisioned"),
                                (3, Role.DECODE, "active"), (4, Role.DECODE, "provisioned")):
            area, peak = 0.0, 0
            for point, nxt in zip(self.series, self.series[1:] + [(end,)]):
                area += point[col] * (nxt[0] - point[0])
                peak = max(peak, point[col])
            out[f"{role.value}_{kind}_mean"] = area / end if end > 0 else float(width_of(self.initial, role))
            out[f"{role.value}_{kind}_max"] = peak
        for role in POOLS:
            out[f"{role.value}_scale_ups"] = self.scale_ups[role]
            out[f"{role.value}_scale_downs"] = self.scale_downs[role]
        out["scale_events"] = sum(self.scale_ups.values()) + sum(self.scale_downs.values())
        out["series"] = {"columns": ["t", "prefill_active", "prefill_provisioned", "decode_active",
                                     "decode_provisioned"], "points": [list(p) for p in self.series]}
        return out
