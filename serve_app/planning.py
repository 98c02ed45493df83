"""The router's side of the planner's window: a finished request's log line, counted.

Every router replica counts what it routes in a `disagg.core.planner.WindowCounter` (the
dispatcher's `window`). The replica of rank 0 plans: every `router.planner.interval_s` it takes
every replica's counts (`Router.take_window`), merges them with the decode instances' highest KV
pressure (`merge_window`), runs `disagg.core.planner.Planner` and sends each planned pool its width
(`set_planned_width`), which Serve applies through `serve_app.autoscale`. The last plan and its
reasons are in `/admin/state`.
"""

from __future__ import annotations

from disagg.core.cost_model import EngineConstants, SloTarget
from disagg.core.planner import WindowCounter, ttft_floor_s


def count_served(window: WindowCounter, record: dict, target: SloTarget, engine: EngineConstants) -> None:
    """A request finished without error; `record` is its request-log line, `engine` its model's
    constants. One that never got a first token is not counted."""
    ttft, e2e, out = record.get("ttft_s"), record.get("e2e_s"), record.get("output_tokens") or 0
    if ttft is None or e2e is None:
        return
    window.served(out, ttft, (e2e - ttft) / (out - 1) if out >= 2 else None, target,
                  ttft_floor_s(engine, record.get("prompt_tokens") or 0))
