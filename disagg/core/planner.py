"""SLO-driven widths of the prefill and decode pools: the planner.

Every interval the planner is given what the router saw over the last window (`Window`: arrivals,
their mean prompt and output lengths, the share of finished requests meeting their TTFT and TPOT
targets, the decode instances' KV pressure) and the current widths, and answers the widths each
pool should have (`Plan`). The same code runs in the simulator and behind the live app.

**Model first**, from the calibrated constants (as Dynamo's planner sizes pools from profiled
TTFT and ITL), for the strictest SLO class present in the window:
- prefill: the pool's work is rate × S seconds per second, S = `prefill_s(mean prompt)` (plus its
  hosted decodes, below). At utilisation u an instance makes a prefill wait u·S / (2(1 − u)) on average (M/D/1), so the width
  is the smallest n whose predicted TTFT, S + wait + transfer, is within `headroom` × the TTFT
  target. When S + transfer alone exceeds that (long prompts under a tight target), no width meets
  it: the width is then the smallest whose wait is within (1 − `headroom`) × S, the margin the
  headroom leaves, rather than every instance there is;
- hosting: a share h of the arrivals served whole by prefill instances (`slo_goodput`'s hosting)
  takes its output off the decode pool and adds rate × h × output × τ_seq to the prefill pool's
  work (a hosted sequence's share of the steps the prefill instance runs anyway);
- decode: n instances each emit rate × (1 − h) × output / n tokens per second; a batch of b sequences emits
  b / τ(b) with τ(b) = base + τ_seq·b, so the steady batch is b = x·base / (1 − x·τ_seq) for x
  tokens per second. The width is the smallest n whose batch steps within `headroom` × the TPOT
  target and whose KV (prompt + half the output per sequence) fits in `kv_limit` of an instance.

**Then feedback**, for what the model does not see (contention, bursts within the window): TTFT
attainment under `attainment_goal` adds a prefill instance, TPOT attainment under it or KV pressure
over `kv_limit` a decode instance, on top of the current width. TTFT attainment counts only the
misses a width could fix: a request whose prompt's prefill alone, on an idle instance and with no
transfer (`ttft_floor_s`), exceeds its target misses at any width, and adding instances for it
only costs.

**Up fast, down slowly**: a pool grows to its target at once; it shrinks one instance at a time,
and only after the target has been below the current width `down_after` windows in a row (a new
instance takes minutes to start; a burst's lull is not a trend). Widths stay within the bounds.
Every plan says why (`reasons`), for the log and the dashboard.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from pydantic import BaseModel, ConfigDict, Field, model_validator

from disagg.core.cost_model import CostModel, EngineConstants, SloTarget
from disagg.core.types import SloClass


class PlannerConfig(BaseModel):
    """The planner's knobs (`router.planner` in a Serve config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_s: float = Field(default=10.0, gt=0, description="seconds between plans (the window's length)")
    headroom: float = Field(default=0.8, gt=0, le=1, description="size for this share of each SLO target")
    attainment_goal: float = Field(default=0.9, gt=0, le=1, description="below this attainment, add an instance")
    kv_limit: float = Field(default=0.85, gt=0, le=1, description="KV pressure a decode instance may reach")
    down_after: int = Field(default=3, ge=1, description="windows in a row wanting fewer before a pool shrinks")
    min_prefill: int = Field(default=1, ge=0)
    max_prefill: int = Field(default=8, ge=1)
    min_decode: int = Field(default=1, ge=1)
    max_decode: int = Field(default=8, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> "PlannerConfig":
        if self.min_prefill > self.max_prefill or self.min_decode > self.max_decode:
            raise ValueError(f"min widths must not exceed max widths (prefill {self.min_prefill}..{self.max_prefill},"
                             f" decode {self.min_decode}..{self.max_decode})")
        return self


@dataclass(frozen=True, slots=True)
class Window:
    """What the router saw over one planning interval."""

    seconds: float
    arrivals: int
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    tight_arrivals: int = 0  # of `arrivals`, in the tight SLO class
    finished: int = 0  # requests that finished in the window (attainment is over them)
    ttft_met: float = 1.0  # share of the finished meeting their TTFT target (1.0 when none finished)
    tpot_met: float = 1.0
    ttft_unfixable: int = 0  # of the finished, TTFT misses no width could fix (`ttft_floor_s`)
    kv_pressure: float = 0.0  # the highest KV pressure of a decode instance
    hosted_arrivals: int = 0  # of `arrivals`, served whole by a prefill instance (its decode too)

    @property
    def rate(self) -> float:
        return self.arrivals / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft_met_fixable(self) -> float:
        """The share meeting their TTFT target among the finished that a width could have helped."""
        fixable = self.finished - self.ttft_unfixable
        return min(1.0, self.ttft_met * self.finished / fixable) if fixable > 0 else 1.0


def ttft_floor_s(engine: EngineConstants, prompt_tokens: int) -> float:
    """The earliest first token a prompt can have: its prefill alone, on an idle instance, with no
    transfer (prefilled where it decodes) and no cached prefix (a width creates none)."""
    return engine.prefill_s(max(1, prompt_tokens))


@dataclass(slots=True)
class WindowCounter:
    """Counts one planning window as it happens: the live router (each replica its own, merged by
    `merge_window`) and the simulator count with this."""

    arrivals: int = 0
    prompt_tokens: int = 0
    tight: int = 0
    finished: int = 0
    output_tokens: int = 0
    ttft_met: int = 0
    tpot_met: int = 0
    ttft_unfixable: int = 0
    hosted: int = 0

    def admitted(self, prompt_tokens: int, slo: SloClass) -> None:
        self.arrivals += 1
        self.prompt_tokens += prompt_tokens
        self.tight += slo is SloClass.TIGHT

    def placed_hosted(self) -> None:
        """An admitted request goes to a prefill instance whole: its decode is not the decode pool's."""
        self.hosted += 1

    def served(self, output_tokens: int, ttft_s: float, tpot_s: float | None, target: SloTarget,
               ttft_floor_s: float = 0.0) -> None:
        """A request finished with its first token after `ttft_s` and then `tpot_s` per token (None:
        fewer than two tokens, no TPOT to miss); `ttft_floor_s`: its `ttft_floor_s`."""
        self.finished += 1
        self.output_tokens += output_tokens
        self.ttft_met += ttft_s <= target.ttft_s
        self.ttft_unfixable += ttft_s > target.ttft_s and ttft_floor_s > target.ttft_s
        self.tpot_met += tpot_s is None or tpot_s <= target.tpot_s

    def take(self) -> dict[str, int]:
        """The counts as a dict (they travel between router replicas), and zero them."""
        out = asdict(self)
        for f in fields(self):
            setattr(self, f.name, 0)
        return out


def merge_window(counts: list[dict[str, int]], seconds: float, kv_pressure: float) -> Window:
    """One window from the counts of every counter (`WindowCounter.take`) over `seconds`."""
    total = {f.name: sum(c.get(f.name, 0) for c in counts) for f in fields(WindowCounter)}
    n, done = total["arrivals"], total["finished"]
    return Window(seconds=seconds, arrivals=n,
                  mean_prompt_tokens=total["prompt_tokens"] / n if n else 0.0,
                  mean_output_tokens=total["output_tokens"] / done if done else 0.0,
                  tight_arrivals=total["tight"], finished=done,
                  ttft_met=total["ttft_met"] / done if done else 1.0,
                  tpot_met=total["tpot_met"] / done if done else 1.0,
                  ttft_unfixable=total["ttft_unfixable"],
                  kv_pressure=kv_pressure, hosted_arrivals=total["hosted"])


@dataclass(frozen=True, slots=True)
class Widths:
    prefill: int
    decode: int


@dataclass(frozen=True, slots=True)
class Plan:
    widths: Widths  # what the pools should have now
    model: Widths  # what the model alone asked for
    reasons: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return {"prefill": self.widths.prefill, "decode": self.widths.decode,
                "model": {"prefill": self.model.prefill, "decode": self.model.decode}, "reasons": list(self.reasons)}


class Planner:
    """Sizes the pools of one disaggregated model (module docstring); keeps the scale-down streaks."""

    def __init__(self, cost_model: CostModel, config: PlannerConfig = PlannerConfig()) -> None:
        self.cm = cost_model
        self.config = config
        self._below = {"prefill": 0, "decode": 0}  # windows in a row whose target was below the width

    def model_widths(self, w: Window) -> Widths:
        """The widths the calibrated model asks for this window's load (before bounds and feedback)."""
        if w.arrivals == 0:
            return Widths(0, 0)
        c, e = self.config, self.cm.engine
        target = self.cm.target(SloClass.TIGHT if w.tight_arrivals else SloClass.LOOSE)
        rate, prompt, output = w.rate, max(1.0, w.mean_prompt_tokens), max(1.0, w.mean_output_tokens)
        service = e.prefill_s(round(prompt))
        budget = c.headroom * target.ttft_s - self.cm.transfer.transfer_s(round(prompt))
        # the wait the TTFT budget leaves; a budget a lone prefill already misses would otherwise ask
        # for every instance at any load (module docstring)
        wait = max(budget - service, (1 - c.headroom) * service)
        # a sequence's share of a decode step: τ_seq, and its context (prompt and half its output on average)
        per_seq = e.decode_seq_s + e.decode_context_s * (prompt + output / 2)
        # decodes hosted on prefill instances: their tokens leave the decode pool, and each adds its
        # sequence's share of a step to the prefill pool's work
        hosted = min(1.0, w.hosted_arrivals / w.arrivals)
        work = rate * service + rate * hosted * output * per_seq  # prefill-pool seconds per second
        prefill = max(1, math.ceil(work))  # below 1 per instance, or it never drains
        while prefill < c.max_prefill:
            u = work / prefill
            if u < 1 and service * u / (2 * (1 - u)) <= wait:
                break
            prefill += 1
        tpot, room = c.headroom * target.tpot_s, c.kv_limit * e.kv_capacity_tokens
        decode = 1
        while decode < c.max_decode:
            # each instance emits rate·output/n tokens/s; a batch of b emits b/τ(b): solve for b
            tokens = rate * (1.0 - hosted) * output / decode
            if tokens * per_seq < 1:
                batch = tokens * e.step_base_s / (1 - tokens * per_seq)
                if e.step_base_s + per_seq * batch <= tpot and batch * (prompt + output / 2) <= room:
                    break
            decode += 1
        return Widths(prefill, decode)

    def plan(self, w: Window, current: Widths) -> Plan:
        c = self.config
        model = self.model_widths(w)
        reasons = [f"load {w.rate:.2f} req/s, prompt {w.mean_prompt_tokens:.0f}, output {w.mean_output_tokens:.0f}: "
                   f"model {model.prefill}P{model.decode}D"]
        want = {"prefill": model.prefill, "decode": model.decode}
        if w.finished and w.ttft_met_fixable < c.attainment_goal:
            want["prefill"] = max(want["prefill"], current.prefill + 1)
            unfixable = f" ({w.ttft_unfixable} misses no width fixes left out)" if w.ttft_unfixable else ""
            reasons.append(f"TTFT attainment {w.ttft_met_fixable:.2f}{unfixable} < {c.attainment_goal}: +1 prefill")
        if w.finished and w.tpot_met < c.attainment_goal:
            want["decode"] = max(want["decode"], current.decode + 1)
            reasons.append(f"TPOT attainment {w.tpot_met:.2f} < {c.attainment_goal}: +1 decode")
        if w.kv_pressure > c.kv_limit:
            want["decode"] = max(want["decode"], current.decode + 1)
            reasons.append(f"KV pressure {w.kv_pressure:.2f} > {c.kv_limit}: +1 decode")
        bounds = {"prefill": (c.min_prefill, c.max_prefill), "decode": (c.min_decode, c.max_decode)}
        out = {}
        for pool, now in (("prefill", current.prefill), ("decode", current.decode)):
            lo, hi = bounds[pool]
            target = min(hi, max(lo, want[pool]))
            if target >= now:
                self._below[pool] = 0
                out[pool] = target
                if target > now:
                    reasons.append(f"{pool} {now} → {target}")
                continue
            self._below[pool] += 1
            if self._below[pool] >= c.down_after:
                self._below[pool] = 0
                out[pool] = now - 1
                reasons.append(f"{pool} {now} → {now - 1} (wanted {target} for {c.down_after} windows)")
            else:
                out[pool] = now
        return Plan(Widths(out["prefill"], out["decode"]), model, tuple(reasons))
