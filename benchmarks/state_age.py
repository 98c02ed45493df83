"""How old the engine state behind each routing decision is, with state pushed (serve_app.state_push).

Usage (the app running, e.g. `make run`; from the repository root):

    .venv/bin/python benchmarks/state_age.py --url http://127.0.0.1:8000 --rates 2,8 --seconds 20 \
        --json runs/state_age.json

Every call a router sends names the version of the engine's state it was decided on and when;
the engine, which knows when its state moved past that version, records how long the router's
copy had been out of date (0 when it was current). Per rate, an open loop (Poisson arrivals) of
short completions runs for `--seconds`, then every engine replica's ages are read through Ray
(`decision_ages`) and summarised: p50, p99, max, and how many were over the engines' bound. An
idle window first checks that no state moves while nothing happens (router `state_pushes`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from disagg.app_client import AppClient  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402
from disagg.stats import percentile  # noqa: E402
from serve_app.launch import RAY_ADDRESS, _env  # noqa: E402


def totals(state: dict) -> tuple[int, int, int]:
    """From `/admin/state`: (state versions the routers received by push, calls that named the
    version they were decided on, of which on one older than the engines' bound)."""
    return (sum(r["state_pushes"] for r in state["routers"].values()),
            sum(i["decisions"] for i in state["instances"].values()),
            sum(i["stale_decisions"] for i in state["instances"].values()))


async def engine_ages(app: str, pools: list[str]) -> list[float]:
    """Every engine replica's recorded ages since the previous read (which clears them)."""
    from ray import serve

    ages: list[float] = []
    for pool in pools:
        handle = serve.get_deployment_handle(pool, app)
        for reply in await handle.broadcast("decision_ages").results_async(timeout_s=30):
            ages.extend(reply)
    return ages


async def open_loop(url: str, model: str, rate: float, seconds: float, rng: random.Random) -> tuple[int, int]:
    """Poisson arrivals of short completions (20-400 words, 8 tokens) for `seconds`; (sent, ok)."""
    ok = 0
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False,
                                 limits=httpx.Limits(max_connections=512)) as client:
        async def one(words: int) -> None:
            nonlocal ok
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": "word " * words, "max_tokens": 8, "ignore_eos": True})
            ok += r.status_code == 200
        tasks, t_end = [], time.monotonic() + seconds
        while time.monotonic() < t_end:
            tasks.append(asyncio.create_task(one(rng.randint(20, 400))))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return len(tasks), ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--app", default="disagg", help="the Serve application's name")
    ap.add_argument("--pools", default="prefill,decode", help="the engine deployments, comma-separated")
    ap.add_argument("--rates", default="2,8", help="arrival rates to run, requests/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each rate's window")
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle window before the load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here (atomically)")
    return asyncio.run(run(ap.parse_args()))


async def run(args: argparse.Namespace) -> int:
    os.environ.update(_env())  # before Ray is imported: it reads some of these once
    import ray

    ray.init(address=RAY_ADDRESS, namespace="serve", log_to_driver=False)
    pools = args.pools.split(",")
    app = AppClient(args.url, timeout_s=60)
    state = app.state()
    model = next(iter(state["models"]))
    await engine_ages(args.app, pools)  # drop what came before
    before = totals(state)[0]
    log(f"idle for {args.idle_s:.0f} s")
    await asyncio.sleep(args.idle_s)
    idle_pushes = totals(app.state())[0] - before
    out = {"idle_s": args.idle_s, "idle_pushes": idle_pushes, "rates": []}
    log(f"idle: {idle_pushes} state pushes")
    rng = random.Random(args.seed)
    for rate in [float(r) for r in args.rates.split(",")]:
        s0 = app.state()
        sent, ok = await open_loop(args.url, model, rate, args.seconds, rng)
        s1 = app.state()
        ages = await engine_ages(args.app, pools)
        stale = totals(s1)[2] - totals(s0)[2]
        row = {"rate": rate, "sent": sent, "ok": ok, "decisions": len(ages),
               "age_p50_ms": 1e3 * percentile(ages, 50), "age_p99_ms": 1e3 * percentile(ages, 99),
               "age_max_ms": 1e3 * max(ages, default=float("nan")),
               "current_share": sum(a == 0.0 for a in ages) / max(1, len(ages)),
               "over_bound": stale, "pushes_per_s": (totals(s1)[0] - totals(s0)[0]) / args.seconds}
        out["rates"].append(row)
        log(f"rate {rate:g}/s: {ok}/{sent} ok, {len(ages)} calls; state age p50 {row['age_p50_ms']:.2f} ms, "
            f"p99 {row['age_p99_ms']:.2f} ms, max {row['age_max_ms']:.1f} ms; current at decision "
            f"{row['current_share']:.0%}; over the bound: {stale}; {row['pushes_per_s']:.0f} pushes/s")
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
