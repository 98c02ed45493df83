"""Serve's side of the SLO-driven planner: a pool's replica count follows the router's plan.

The planner (`disagg.core.planner`, run by the router: `serve_app.planning`) pushes each planned
pool's width to that pool's engine replicas (`EngineServer.set_planned_width`). They report it as
the custom autoscaling metric `planned_width` (`EngineServer.record_autoscaling_stats`), and Serve's
controller asks `planned_replicas` — the pool's `autoscaling_config.policy` when its config says
`policy: planner` — how many replicas the pool should have. Serve applies the pool's min/max and
its up/down delays around the answer, and the width shows in the dashboard and `serve status` like
any autoscaled deployment's.

Runs inside Serve's controller: no I/O, nothing slow.
"""

from __future__ import annotations

from typing import Any

PLANNED_WIDTH = "planned_width"  # the custom metric the engine replicas report


def planned_replicas(ctx: Any) -> tuple[int, dict]:
    """The newest planned width any replica of the pool reported; the current target until one has
    (a router that has not planned yet must not shrink the pool)."""
    newest = None
    for series in ((ctx.raw_metrics or {}).get(PLANNED_WIDTH) or {}).values():
        for sample in series or ():
            if newest is None or sample.timestamp > newest.timestamp:
                newest = sample
    if newest is None:
        return ctx.target_num_replicas, {}
    return int(round(newest.value)), {}
