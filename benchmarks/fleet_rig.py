"""The router's control path at fleet size: 64 engine stand-ins and 4 router replicas on this host.

Usage (from the repository root, with nothing else running on the machine):

    .venv/bin/python benchmarks/fleet_rig.py --rates 20,40 --seconds 30 --json runs/fleet_rig.json

It starts deployments/rig-64.yaml (16 prefill + 48 decode stand-ins of serve_app/engine_standin.py,
which push their state like the real engines and time their work with the cost model; 4 real
routers with vLLM's OpenAI layer) and measures:
- idle: each part's CPU over `--idle-s` (cores, from /proc: per router replica, and per engine
  stand-in, which runs nothing but our replica code) and the state messages sent;
- per rate, an open loop (Poisson arrivals) of short completions for `--seconds`: requests served,
  the age of the engine state behind every call (read from each stand-in through Ray: p50, p99,
  share current, share over the bound), the placement decision's wall and CPU time (from the
  request log: p50, p99; the wall includes the time the host's 70 other processes took the core),
  and the state messages per second.
The rates this host can offer are bounded by the routers' own CPU per request (about 6 ms with
vLLM's layer): the figures are for the rates given, not for a GPU fleet's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from state_age import engine_ages, open_loop, totals  # noqa: E402  (benchmarks/state_age.py)
from token_path_cpu import cpu_by_part  # noqa: E402  (benchmarks/token_path_cpu.py)

from disagg.app_client import AppClient  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402
from disagg.stats import percentile  # noqa: E402
from serve_app.launch import RAY_ADDRESS, LocalStack, _env  # noqa: E402

RIG = ROOT / "deployments" / "rig-64.yaml"
POOLS = ["prefill", "decode"]


def decision_us(log_path: Path, skip: int) -> tuple[list[float], list[float], int]:
    """The decisions' wall and CPU times (µs) in the request log after its first `skip` lines; the line count."""
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    records = [r for r in map(json.loads, lines[skip:]) if r.get("decision_us") is not None]
    return [r["decision_us"] for r in records], [r["decision_cpu_us"] for r in records], len(lines)


async def measure(stack: LocalStack, args, log_path: Path) -> dict:
    import ray

    ray.init(address=RAY_ADDRESS, namespace="serve", log_to_driver=False)
    app = AppClient(stack.base_url, timeout_s=120)
    state = app.state()
    # the config's count: a replica too busy to answer /admin/state's summary in time still uses CPU
    routers, engines = stack.apps[0][1].router.num_replicas, len(state["instances"])
    log(f"{routers} routers, {engines} engines; settling {args.settle_s:.0f} s")
    await asyncio.sleep(args.settle_s)
    await engine_ages("disagg", POOLS)
    before, cpu0, t0 = totals(app.state()), cpu_by_part(), time.monotonic()
    await asyncio.sleep(args.idle_s)
    cpu1, dt, after = cpu_by_part(), time.monotonic() - t0, totals(app.state())
    idle = {part: (cpu1[part] - cpu0.get(part, 0.0)) / dt for part in cpu1}
    out = {"routers": routers, "engines": engines, "idle_s": round(dt, 1),
           "idle_cores": {k: round(v, 4) for k, v in idle.items()},
           "idle_cores_per_router": round(idle["routers"] / routers, 4),
           "idle_ms_per_engine_per_s": round(1e3 * idle["engines"] / engines, 3),
           "idle_state_messages": after[0] - before[0], "rates": []}
    log(f"idle: routers {out['idle_cores_per_router']:.4f} cores each, engines "
        f"{out['idle_ms_per_engine_per_s']:.3f} ms/s each, {out['idle_state_messages']} state messages")
    rng = random.Random(args.seed)
    _, _, seen = decision_us(log_path, 0)
    for rate in [float(r) for r in args.rates.split(",")]:
        s0 = totals(app.state())
        sent, ok = await open_loop(stack.base_url, "tiny-qwen2", rate, args.seconds, rng)
        await asyncio.sleep(1.0)  # the last streams' logs
        s1 = totals(app.state())
        ages = await engine_ages("disagg", POOLS)
        times, cpu, seen = decision_us(log_path, seen)
        row = {"rate": rate, "sent": sent, "ok": ok, "calls": len(ages),
               "state_age_p50_ms": round(1e3 * percentile(ages, 50), 3),
               "state_age_p99_ms": round(1e3 * percentile(ages, 99), 3),
               "state_age_max_ms": round(1e3 * max(ages, default=float("nan")), 3),
               "current_share": round(sum(a == 0.0 for a in ages) / max(1, len(ages)), 4),
               "over_bound_share": round((s1[2] - s0[2]) / max(1, s1[1] - s0[1]), 4),
               "decision_p50_us": round(percentile(times, 50), 1), "decision_p99_us": round(percentile(times, 99), 1),
               "decision_cpu_p50_us": round(percentile(cpu, 50), 1),
               "decision_cpu_p99_us": round(percentile(cpu, 99), 1),
               "state_messages_per_s": round((s1[0] - s0[0]) / args.seconds, 1)}
        out["rates"].append(row)
        log(f"rate {rate:g}/s: {ok}/{sent} ok; state age p50 {row['state_age_p50_ms']} ms, p99 "
            f"{row['state_age_p99_ms']} ms ({row['current_share']:.0%} current, {row['over_bound_share']:.1%} "
            f"over the bound); decision p50 {row['decision_p50_us']} µs, p99 {row['decision_p99_us']} µs (CPU "
            f"{row['decision_cpu_p50_us']} / {row['decision_cpu_p99_us']} µs); "
            f"{row['state_messages_per_s']} state messages/s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="20,40", help="open-loop arrival rates, requests/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each rate's window")
    ap.add_argument("--idle-s", type=float, default=30.0, help="idle window")
    ap.add_argument("--settle-s", type=float, default=10.0, help="wait after start-up before measuring")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here (atomically)")
    args = ap.parse_args()

    os.environ.update(_env())  # before Ray is imported: it reads some of these once
    with tempfile.TemporaryDirectory(prefix="fleet-rig-") as tmp:
        doc = yaml.safe_load(RIG.read_text())
        log_path = Path(tmp) / "requests.jsonl"
        doc["applications"][0]["args"]["router"]["request_log"] = str(log_path)
        config = Path(tmp) / "rig-64.yaml"
        config.write_text(yaml.safe_dump(doc))
        t0 = time.monotonic()
        with LocalStack(config, log=log) as stack:
            log(f"rig up in {time.monotonic() - t0:.0f} s")
            out = {"start_s": round(time.monotonic() - t0, 1), **asyncio.run(measure(stack, args, log_path))}
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
