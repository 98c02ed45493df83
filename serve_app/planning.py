"""The router's planner loop: count a window, plan the pool widths, send them to the pools.

Every router replica counts what it routes (`WindowCounter`: arrivals with their prompt lengths
and SLO classes; finished requests with their output lengths and whether they met their TTFT and
TPOT targets). The replica of rank 0 plans: every `router.planner.interval_s` it takes every
replica's counts (`take_window`), adds the decode instances' highest KV pressure, runs
`disagg.core.planner.Planner` and sends each planned pool its width (`set_planned_width`), which
Serve applies through `serve_app.autoscale`. The last plan and its reasons are in `/admin/state`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from disagg.core.cost_model import SloTarget
from disagg.core.planner import Window
from disagg.core.types import SloClass


@dataclass(slots=True)
class WindowCounter:
    """What one router replica routed since its counts were last taken."""

    arrivals: int = 0
    prompt_tokens: int = 0
    tight: int = 0
    finished: int = 0
    output_tokens: int = 0
    ttft_met: int = 0
    tpot_met: int = 0

    def admitted(self, prompt_tokens: int, slo: SloClass) -> None:
        self.arrivals += 1
        self.prompt_tokens += prompt_tokens
        self.tight += slo is SloClass.TIGHT

    def served(self, record: dict, target: SloTarget) -> None:
        """A request finished without error; `record` is its request-log line."""
        ttft, e2e, out = record.get("ttft_s"), record.get("e2e_s"), record.get("output_tokens") or 0
        if ttft is None or e2e is None:
            return
        self.finished += 1
        self.output_tokens += out
        self.ttft_met += ttft <= target.ttft_s
        self.tpot_met += out < 2 or (e2e - ttft) / (out - 1) <= target.tpot_s

    def take(self) -> dict:
        """The counts as a dict (they travel between router replicas), and zero them."""
        out = asdict(self)
        for f in fields(self):
            setattr(self, f.name, 0)
        return out


def merge(counts: list[dict], seconds: float, kv_pressure: float) -> Window:
    """One window from every router replica's counts."""
    total = {k: sum(c.get(k, 0) for c in counts) for k in (f.name for f in fields(WindowCounter))}
    n, done = total["arrivals"], total["finished"]
    return Window(seconds=seconds, arrivals=n,
                  mean_prompt_tokens=total["prompt_tokens"] / n if n else 0.0,
                  mean_output_tokens=total["output_tokens"] / done if done else 0.0,
                  tight_arrivals=total["tight"], finished=done,
                  ttft_met=total["ttft_met"] / done if done else 1.0,
                  tpot_met=total["tpot_met"] / done if done else 1.0,
                  kv_pressure=kv_pressure)
