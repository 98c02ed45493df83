"""Overload: drive the app well past its capacity and check it sheds instead of drowning.

Usage (from the repository root, nothing else running; it starts the CPU profile itself unless
`--url` names a running app):

    .venv/bin/python benchmarks/overload.py --factor 3 --duration 60 --json runs/overload.json

1. Capacity: `--concurrency` closed-loop clients for `--probe-s` seconds, each request
   `--tokens` output tokens (ignore_eos); capacity = completed requests per second.
2. Overload: open-loop Poisson arrivals at `--factor` × capacity for `--duration` seconds, half of
   them `X-SLO-Class: tight`. Every request has a client timeout (`--timeout`); nothing is retried.
3. Reported: accepted requests and how many completed with every token; 429s, their latency and
   Retry-After; other errors; client timeouts (connect or read); the router replicas' memory
   (RSS) sampled every 5 s; per SLO class the share shed.

What should hold: every accepted request completes, the rest get a fast 429 (p99 < 50 ms), no
client timeouts, router memory flat, loose requests shed before tight ones.

`--burst N` replaces steps 1-2 by N requests sent at once (half tight), the overload a Python
load generator on the same 2 cores can produce for sure: at the open-loop rates above, the
generator itself falls behind (its latencies then include its own queueing; see `sent_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from disagg.app_client import AppError, AsyncAppClient
from disagg.bench.script import log, write_result
from disagg.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-qwen2"


SEND_LATE_S: list[float] = []  # per request sent open-loop: seconds behind its scheduled time


def router_rss_mb() -> float:
    out = subprocess.run(["ps", "-eo", "rss=,args="], capture_output=True, text=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if "ServeReplica:" in line and ":router" in line) / 1024


async def one(client, i: int, slo: str, tokens: int) -> dict:
    body = {"model": MODEL, "prompt": f"overload {i} " + "word " * (i % 50), "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0}
    t0 = time.perf_counter()
    try:
        async with client.post("/v1/completions", json=body, headers={"X-SLO-Class": slo}) as r:
            out = {"slo": slo, "status": r.status}
            if r.status == 200:
                out["complete"] = (await r.json())["usage"]["completion_tokens"] == tokens
            elif r.status == 429:
                out["retry_after"] = r.headers.get("Retry-After")
            else:
                out["error"] = (await r.text())[:200]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # timeouts and connection errors: what must not happen
        return {"slo": slo, "status": None, "error": type(e).__name__, "latency_s": time.perf_counter() - t0}
    out["latency_s"] = time.perf_counter() - t0
    return out


async def capacity(client, concurrency: int, probe_s: float, tokens: int) -> float:
    done, stop = 0, time.perf_counter() + probe_s

    async def worker(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            r = await one(client, 10_000 * k + i, "loose", tokens)
            i += 1
            done += r["status"] == 200
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def overload(client, rate: float, duration_s: float, tokens: int, seed: int) -> tuple[list[dict], list[float]]:
    rng = random.Random(seed)
    tasks, rss, t0 = [], [router_rss_mb()], time.perf_counter()
    next_rss, t, i = t0 + 5.0, 0.0, 0
    while t < duration_s:
        t += rng.expovariate(rate)
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        # how late this generator sends (its own lag on shared cores): part of every latency measured
        SEND_LATE_S.append(max(0.0, -delay))
        tasks.append(asyncio.create_task(one(client, i, "tight" if i % 2 else "loose", tokens)))
        i += 1
        if time.perf_counter() >= next_rss:
            rss.append(router_rss_mb())
            next_rss += 5.0
    results = await asyncio.gather(*tasks)
    rss.append(router_rss_mb())
    return results, rss


def summarize(results: list[dict], rss: list[float], cap: float, rate: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 429]
    timeouts = [r for r in results if r["status"] is None]
    other = [r for r in results if r["status"] not in (200, 429, None)]
    # None, not NaN, where there is nothing to rank: the summary is printed as JSON
    ok_s, shed_s = [r["latency_s"] for r in ok], [r["latency_s"] for r in shed]
    by_class = {c: {"sent": sum(r["slo"] == c for r in results),
                    "shed": sum(r["slo"] == c and r["status"] == 429 for r in results)} for c in ("loose", "tight")}
    return {
        "capacity_rps": cap, "offered_rps": rate, "sent": len(results),
        "accepted": len(ok), "accepted_complete": sum(r.get("complete", False) for r in ok),
        "shed_429": len(shed), "shed_latency_ms_p50": percentile(shed_s, 50, empty=0.0) * 1e3,
        "shed_latency_ms_p99": percentile(shed_s, 99, empty=0.0) * 1e3,
        "retry_after_s": sorted({r["retry_after"] for r in shed}),
        "accepted_latency_s_p50": percentile(ok_s, 50, empty=None),
        "accepted_latency_s_p99": percentile(ok_s, 99, empty=None),
        "client_timeouts_or_connection_errors": len(timeouts), "other_errors": len(other),
        "other_error_samples": [r.get("error") for r in other[:3]],
        "by_class": by_class, "router_rss_mb": rss,
        "router_rss_growth_mb": (rss[-1] - rss[0]) if len(rss) > 1 else 0.0,
        "generator_send_late_s_p50": percentile(SEND_LATE_S, 50, empty=None),
        "generator_send_late_s_p99": percentile(SEND_LATE_S, 99, empty=None),
    }


async def burst(client, n: int, tokens: int) -> tuple[list[dict], list[float]]:
    rss = [router_rss_mb()]
    results = await asyncio.gather(*(one(client, i, "tight" if i % 2 else "loose", tokens) for i in range(n)))
    rss.append(router_rss_mb())
    return list(results), rss


async def run(args) -> dict:
    # aiohttp, not httpx: at thousands of open requests httpx's pool costs the generator more CPU
    # than the 2-core machine can spare, and its own delays would pass for the app's
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url=args.url, timeout=aiohttp.ClientTimeout(total=args.timeout),
                                     connector=connector, trust_env=False) as client:
        if args.burst:
            log(f"burst: {args.burst} requests at once, {args.tokens} tokens each ...")
            t0 = time.perf_counter()
            results, rss = await burst(client, args.burst, args.tokens)
            summary = summarize(results, rss, float("nan"), float("nan"))
            summary["burst_wall_s"] = time.perf_counter() - t0
            return summary
        if args.rate:
            cap, rate = None, args.rate
        else:
            log(f"capacity probe: {args.concurrency} closed-loop clients for {args.probe_s:.0f} s ...")
            cap = await capacity(client, args.concurrency, args.probe_s, args.tokens)
            if cap <= 0:
                raise SystemExit("the capacity probe completed no request: is the app up and serving?")
            rate = args.factor * cap
            log(f"capacity {cap:.1f} req/s")
        log(f"overload at {rate:.1f} req/s for {args.duration:.0f} s ...")
        results, rss = await overload(client, rate, args.duration, args.tokens, args.seed)
        summary = summarize(results, rss, cap, rate)
        summary.update(await router_view(args.url))
    return summary


async def router_view(url: str) -> dict:
    """What the routers counted (their 429s by cause) and how far their event loops fell behind."""
    try:
        async with AsyncAppClient(url) as app:
            state = await app.state()
    except AppError as e:  # admin not reachable from here (token or loopback settings): say so
        return {"router_state": str(e)}
    keys = ("served", "failed", "shed_429", "shed_router_busy")
    return {"router_counters": {k: state["counters"].get(k) for k in keys},
            "router_loop_lag_peak_s": max((x.get("loop_lag_peak_s") or 0.0) for x in state["routers"].values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "deployments" / "local.yaml"))
    ap.add_argument("--url", help="a running app (default: start --config on a local cluster)")
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--rate", type=float, help="offer this many requests/s instead of --factor × the measured "
                    "capacity (skips the probe: runs to compare at one rate)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--probe-s", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burst", type=int, default=0, help="N requests at once instead of the rate phases")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.factor <= 0 or args.duration <= 0 or args.concurrency < 1 or args.tokens < 1 or args.burst < 0:
        ap.error("--factor, --duration, --concurrency and --tokens must be positive")
    if args.rate is not None and not args.rate > 0:
        ap.error(f"--rate must be a positive number of requests/s, got {args.rate}")
    stack = None
    if args.url is None:
        from serve_app.launch import LocalStack

        os.environ.setdefault("DISAGG_RUN_DIR", os.getcwd())
        stack = LocalStack(args.config, log=lambda m: log(f"stack: {m}"))
        args.url = stack.base_url
    try:
        if stack:
            stack.start()
        summary = asyncio.run(run(args))
    finally:
        if stack:
            stack.stop()
    print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        write_result(args.json, {"summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
