"""Ray Serve's own CPU per streamed item: the floor under the router's cost per token.

Usage (from the repository root, with nothing else running on the machine):

    .venv/bin/python benchmarks/serve_stream_floor.py --rounds 2 --json runs/serve_stream_floor.json

It starts Ray on loopback with the launcher's environment (Serve's fast token path: HAProxy in
front of the ingress, gRPC handles) and serves a bare application of two deployments that do
nothing but what the router's token path does with Serve:
- `Source` streams `--items` small items per call, one every `--interval-s` (the engines' batches);
- `Relay`, the FastAPI ingress, calls `Source` through a streaming handle and relays each item to
  the client as a server-sent event (no parsing, no formatting beyond the SSE frame).
`--streams` clients read a stream each, `--requests` in all. Each process's CPU time comes from
/proc; the relay's CPU per item, its idle rate subtracted, is what Serve itself costs the router
per streamed item (an item in from a replica, an item out to HAProxy). Medians and ranges over
`--rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from disagg.app_client import AppClient  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402
from serve_app.launch import RAY_ADDRESS, _bin, _env  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PORT = 8000


def build_app(items: int, interval_s: float):
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from ray import serve

    @serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0.1})
    class Source:
        async def stream(self, n: int):
            for i in range(n):
                await asyncio.sleep(interval_s)
                yield b"x" * 64

    app = FastAPI()

    @serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0.1})
    @serve.ingress(app)
    class Relay:
        def __init__(self, source) -> None:
            self.source = source.options(stream=True)

        @app.get("/stream")
        async def relay(self):
            async def sse():
                async for item in self.source.stream.remote(items):
                    yield b"data: " + item + b"\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")

        @app.get("/health")
        async def health(self):
            return {"status": "ok"}

    return Relay.bind(Source.bind())


def cpu_of(title: str) -> float:
    """CPU seconds so far of every process whose command line contains `title`."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if title.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) * TICK_S
    return total


async def load(streams: int, requests: int, items: int) -> int:
    """Items received over `requests` streams, `streams` at a time."""
    sem, received = asyncio.Semaphore(streams), 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal received
        async with sem, client.stream("GET", "/stream") as r:
            async for line in r.aiter_lines():
                received += line.startswith("data: ")

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=300, trust_env=False,
                                 limits=httpx.Limits(max_connections=streams)) as client:
        await asyncio.gather(*(one(client) for _ in range(requests)))
    assert received == requests * items, (received, requests * items)
    return received


def one_round(args) -> dict:
    relay = "ServeReplica:floor:Relay"
    c0, t0 = cpu_of(relay), time.monotonic()
    time.sleep(args.idle_s)
    idle_rate = (cpu_of(relay) - c0) / (time.monotonic() - t0)
    c0, t0 = cpu_of(relay), time.monotonic()
    received = asyncio.run(load(args.streams, args.requests, args.items))
    dt = time.monotonic() - t0
    used = cpu_of(relay) - c0 - idle_rate * dt
    return {"relay_idle_cores": idle_rate, "relay_us_per_item": used / received * 1e6, "items": received,
            "seconds": dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--items", type=int, default=50, help="items per stream")
    ap.add_argument("--interval-s", type=float, default=0.04, help="between a stream's items (an engine's batch)")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    os.environ.update(_env())  # before Ray is imported: it reads some of these once
    log("starting Ray on 127.0.0.1 ...")
    subprocess.run([_bin("ray"), "start", "--head", "--num-cpus=2", "--node-ip-address=127.0.0.1",
                    "--include-dashboard=false", "--disable-usage-stats"], env=_env(), check=True,
                   capture_output=True, timeout=180)
    try:
        import ray
        from ray import serve

        ray.init(address=RAY_ADDRESS, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(args.items, args.interval_s), name="floor", route_prefix="/")
        with AppClient(f"http://127.0.0.1:{PORT}") as relay:  # the relay answers /health as the app does
            relay.wait_healthy(120, poll_s=1.0)
        asyncio.run(load(args.streams, args.streams, args.items))  # warm-up
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(args))
            log(f"round {r + 1}: {rounds[-1]}")
    finally:  # Serve stops its HAProxy itself; `ray stop` alone would leave it holding the port
        try:
            from ray import serve

            serve.shutdown()
        except Exception as e:
            log(f"serve shutdown failed: {e}")
        subprocess.run([_bin("ray"), "stop", "--force"], env=_env(), capture_output=True, timeout=180)
    per_item = [r["relay_us_per_item"] for r in rounds]
    summary = {"relay_us_per_item_median": statistics.median(per_item), "relay_us_per_item_range": [min(per_item),
               max(per_item)], "rounds": rounds, "args": vars(args)}
    log(f"relay CPU per streamed item: {summary['relay_us_per_item_median']:.0f} µs "
        f"({min(per_item):.0f}-{max(per_item):.0f}) over {args.rounds} rounds")
    if args.json:
        write_result(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
