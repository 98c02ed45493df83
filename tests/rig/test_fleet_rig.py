"""The fleet-scale rig, short: 64 engine stand-ins and 4 real routers on this host
(deployments/rig-64.yaml; benchmarks/fleet_rig.py is the long run with the figures).

It checks what only fleet size shows: every router knows all 64 engines, nothing is sent while
the fleet is idle, and under load the state behind 99% of decisions is within the engines'
freshness bound."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from calibration.host import host_cpu_s

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.rig


@pytest.fixture(scope="module")
def rig():
    from serve_app.launch import LocalStack

    with LocalStack(ROOT / "deployments" / "rig-64.yaml", log=lambda m: print(f"[rig] {m}", flush=True)) as s:
        yield s
    assert not s.forced, f"the rig's stop was not graceful: {s.forced}"


def _until_the_host_stops_settling(limit_s: float, window_s: float = 3.0) -> tuple[float, float]:
    """Wait until the host's CPU use over a window is no longer 10% below the window's before, at
    most `limit_s`: the seconds waited and the last window's cores (the idle rig). Relative, so it
    holds on a host of any speed."""
    waited, before, cores = 0.0, None, 0.0
    while waited < limit_s:
        cpu0, t0 = host_cpu_s(), time.monotonic()
        time.sleep(window_s)
        wall = time.monotonic() - t0
        waited += wall
        cores = (host_cpu_s() - cpu0) / wall
        if before is not None and cores > 0.9 * before:
            break
        before = cores
    return waited, cores


def _totals(state: dict) -> tuple[int, int, int]:
    pushes = sum(r["state_pushes"] for r in state["routers"].values())
    decisions = sum(i["decisions"] for i in state["instances"].values())
    stale = sum(i["stale_decisions"] for i in state["instances"].values())
    return pushes, decisions, stale


def test_sixty_four_engines_pushed_to_four_routers_fresh_under_load_silent_at_idle(rig):
    import httpx

    from disagg.app_client import AppClient

    app = AppClient(rig.base_url, timeout_s=60)
    state = app.state()
    assert len(state["routers"]) == 4
    # each router froze its start-up heap: a full collection over it stalls a loop for a second here
    assert all(r["gc_frozen"] > 100_000 for r in state["routers"].values()), state["routers"]
    assert len(state["instances"]) == 64 and app.health()["status"] == "ok"
    # every router's prefix index of every stand-in comes from its (modelled) KV events
    assert {v["prefix_source"] for v in state["instances"].values()} == {"events"}
    # 68 replicas that have just started keep the host busy a while (imports, first collections,
    # Serve's reconciling): the load below starts once the host's CPU use stops falling
    settled_s, idle_cores = _until_the_host_stops_settling(limit_s=90.0)
    idle = _totals(app.state())
    time.sleep(5.0)
    assert _totals(app.state()) == idle  # 64 engines × 4 routers, idle: not one message
    print(f"[rig] idle: {idle_cores:.2f} cores, after {settled_s:.0f} s settling", flush=True)

    async def load(n: int, rate: float) -> list[int]:
        async with httpx.AsyncClient(base_url=rig.base_url, timeout=120, trust_env=False) as client:
            async def one(i: int) -> int:
                await asyncio.sleep(i / rate)
                r = await client.post("/v1/completions", json={
                    "model": "tiny-qwen2", "prompt": f"request {i} " * (10 + i % 50), "max_tokens": 8,
                    "ignore_eos": True})
                return r.status_code
            return await asyncio.gather(*(one(i) for i in range(n)))

    # 20 requests/s: what 4 routers sustain on 2 cores beside 64 replicas (benchmarks/fleet_rig.py);
    # past it the routers shed (429), which is right, and not what this test is about
    codes = asyncio.run(load(200, 20.0))
    state = app.state()
    # on failure: which requests, and each router's (loop-lag peak, sheds for lag): a stall or a backlog;
    # and how busy the idle rig kept the host (about 1 of its 2 cores where 20 req/s was measured)
    assert codes == [200] * 200, (
        [i for i, c in enumerate(codes) if c != 200], f"idle rig: {idle_cores:.2f} cores after {settled_s:.0f} s",
        {k: state["counters"][k] for k in ("shed_429", "shed_router_busy")},
        {k: (r["loop_lag_peak_s"], r["counters"]["shed_router_busy"]) for k, r in state["routers"].items()})
    pushes, decisions, stale = _totals(state)
    assert pushes > idle[0]
    assert decisions - idle[1] >= 200  # every request's first engine call names the version it was decided on
    assert stale - idle[2] <= 0.01 * (decisions - idle[1]), (
        f"{stale - idle[2]} of {decisions - idle[1]} calls decided on state older than the bound")
    assert sum(v["kv_events_missed"] for v in state["instances"].values()) == 0
