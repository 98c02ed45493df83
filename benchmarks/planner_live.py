"""The SLO-driven planner on the live CPU stack: a load step scales the decode pool up and back down.

Usage (from the repository root, with no other Ray cluster on the machine):

    .venv/bin/python benchmarks/planner_live.py --json runs/planner_live.json

It serves deployments/local-autoscale.yaml (1 prefill engine, a decode pool of 1 to 3 engines
sized by the router's planner every 5 s) with `serve_app.launch.LocalStack`, and sends open-loop
Poisson load in three phases: `--low-rate` for `--before-s`, `--high-rate` for `--step-s`, then
`--low-rate` for `--after-s`. Every `--sample-s` it records what the planner planned
(`/admin/state` → planner), Serve's target and running replicas of each pool (the Ray dashboard's
`/api/serve/applications/`, what `serve status` shows) and the decode instances the router
routes to. It prints the timeline and writes it with the requests' outcomes to `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from disagg.app_client import AppError, AsyncAppClient
from disagg.bench.script import write_result

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = "http://127.0.0.1:8265/api/serve/applications/"


def schedule(args, seed: int = 0) -> list[tuple[float, str]]:
    """(send time, phase) of every request: Poisson arrivals at each phase's rate."""
    rng = random.Random(seed)
    out, t0 = [], 0.0
    for phase, rate, span in (("before", args.low_rate, args.before_s), ("step", args.high_rate, args.step_s),
                              ("after", args.low_rate, args.after_s)):
        t = t0 + rng.expovariate(rate)
        while t < t0 + span:
            out.append((t, phase))
            t += rng.expovariate(rate)
        t0 += span
    return out


async def send(app: AsyncAppClient, args, i: int, results: list) -> None:
    body = {"model": "tiny-qwen2", "prompt": [100 + (i * 7919 + k * 31) % 900 for k in range(args.prompt)],
            "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0.0}
    t = time.perf_counter()
    try:
        await app.complete(body, headers={"X-SLO-Class": args.slo})
        results.append({"i": i, "status": 200, "s": time.perf_counter() - t})
    except AppError as e:
        results.append({"i": i, "status": e.status, "error": e.message[:200], "s": time.perf_counter() - t})


async def sample(app: AsyncAppClient, dashboard: httpx.AsyncClient, start: float) -> dict:
    row = {"t": round(time.perf_counter() - start, 1)}
    try:
        state = await app.state()
        plan = state.get("planner") or {}
        row["planned_decode"] = plan.get("decode")
        row["reasons"] = plan.get("reasons")
        row["decode_instances"] = sum(1 for v in state["instances"].values() if v["role"] == "decode")
        # Ray's dashboard, not the app: no credentials of the app go there
        apps = (await dashboard.get(DASHBOARD)).json()["applications"]["disagg"]["deployments"]
        for pool in ("prefill", "decode"):
            d = apps[pool]
            row[f"{pool}_target"] = d["target_num_replicas"]
            row[f"{pool}_running"] = sum(1 for r in d["replicas"] if r.get("state") == "RUNNING")
    except (AppError, httpx.HTTPError, KeyError, ValueError) as e:
        row["error"] = f"{type(e).__name__}: {e}"
    return row


async def drive(base_url: str, args) -> dict:
    plan = schedule(args)
    results: list[dict] = []
    timeline: list[dict] = []
    async with AsyncAppClient(base_url, timeout_s=args.timeout_s, max_connections=512) as app, \
            httpx.AsyncClient(trust_env=False, timeout=10.0) as dashboard:
        start = time.perf_counter()
        end = args.before_s + args.step_s + args.after_s
        tasks = []

        async def sampler() -> None:
            while time.perf_counter() - start < end + args.drain_s:
                row = await sample(app, dashboard, start)
                row["phase"] = ("before" if row["t"] < args.before_s else
                                "step" if row["t"] < args.before_s + args.step_s else "after")
                timeline.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "reasons"}), flush=True)
                await asyncio.sleep(args.sample_s)

        sampling = asyncio.create_task(sampler())
        for i, (at, _) in enumerate(plan):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(send(app, args, i, results)))
        await asyncio.wait(tasks, timeout=args.timeout_s)
        await sampling
    ok = sum(1 for r in results if r["status"] == 200)
    return {"settings": vars(args), "requests": len(plan), "ok": ok, "results": results, "timeline": timeline}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "deployments" / "local-autoscale.yaml"))
    ap.add_argument("--low-rate", type=float, default=0.5)
    ap.add_argument("--high-rate", type=float, default=30.0)
    ap.add_argument("--before-s", type=float, default=30.0)
    ap.add_argument("--step-s", type=float, default=90.0)
    ap.add_argument("--after-s", type=float, default=120.0)
    ap.add_argument("--drain-s", type=float, default=30.0, help="keep sampling this long after the last send")
    ap.add_argument("--sample-s", type=float, default=3.0)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    ap.add_argument("--slo", default="tight", choices=["tight", "loose"], help="the requests' SLO class")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--url", help="an app already up (else the config is served here)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.url:
        out = asyncio.run(drive(args.url, args))
    else:
        sys.path.insert(0, str(ROOT))
        from serve_app.launch import LocalStack

        with LocalStack(args.config, log=lambda m: print(f"[stack] {m}", flush=True)) as stack:
            out = asyncio.run(drive(stack.base_url, args))
    decode = [r.get("decode_running") for r in out["timeline"] if r.get("decode_running") is not None]
    print(f"{out['ok']}/{out['requests']} requests answered 200; decode replicas running: "
          f"min {min(decode, default=None)}, max {max(decode, default=None)}, last {decode[-1] if decode else None}")
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
