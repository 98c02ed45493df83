"""CPU of each part of the serving path: per streamed token, per short request, and at idle.

Usage (from the repository root, with nothing else running on the machine):

    .venv/bin/python benchmarks/token_path_cpu.py --rounds 2 --json runs/token_path_cpu.json
    .venv/bin/python benchmarks/token_path_cpu.py --kv-events on,off --pairs 2 --json runs/kv_events_cpu.json

It starts deployments/local.yaml (2 router replicas, 1 prefill + 2 decode vLLM engines, KV over NIXL)
with the launcher and reads every process's CPU time (utime + stime, /proc/<pid>/stat) of the Ray
session's process tree, grouped into parts:
- `routers`: the router replicas;
- `ingress`: Serve's proxy and HAProxy;
- `engines`: the engine replicas and their vLLM EngineCore and worker processes;
- `ray`: everything else (GCS, raylet, agents, the Serve controller).

After a warm-up (2 × `--streams` streams) and `--settle-s` of idle, each round has three windows:
1. idle (`--idle-s`), which gives each part's idle rate in cores;
2. streaming: `--streams` concurrent streams of `--tokens` tokens each, `--stream-requests` in all;
3. short requests: `--short-requests` 8-token completions, 8 at a time.
Under load, a part's CPU minus its idle rate × the window, divided by the tokens streamed (or by the
requests served), is its cost per token (per request); `tokens_per_event` is how many tokens each
server-sent event the router relays carries (compare with benchmarks/serve_stream_floor.py, Serve's
own cost per relayed item). Ratios within one run are what to compare: the
machine is shared and noisy. Medians and ranges are over `--rounds`.

`--kv-events on,off` measures the cost of vLLM's KV events (the engines' publishers, the replicas'
subscribers and folds, the prefix deltas in the pushes): each of `--pairs` pairs starts the stack
once per setting of `engine.kv_events`, in alternating order, and the summary is per setting, with
each part's paired ratio (on / off) per pair.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory import cpu_by  # noqa: E402  (benchmarks/memory.py)

from disagg.app_client import COMPLETIONS, AppError, AsyncAppClient  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402
from serve_app.launch import LocalStack  # noqa: E402

PARTS = ("routers", "ingress", "engines", "ray")
METRICS = ("idle_cores", "per_token_us", "per_request_ms")
CONFIG = ROOT / "deployments" / "local.yaml"


def part_of(k: str, comm: str) -> str:
    if k == "router replica":
        return "routers"
    if k == "Serve proxy" or comm.startswith("haproxy"):
        return "ingress"
    if "prefill" in k or "decode" in k or k.startswith("vLLM"):
        return "engines"
    return "ray"


def cpu_by_part() -> dict[str, float]:
    """CPU seconds so far of every process of the Ray session, by part."""
    return cpu_by(part_of, PARTS)


def window(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {p: after[p] - before[p] for p in PARTS}


async def stream_load(base_url: str, requests: int, concurrency: int, tokens: int) -> tuple[int, int, int]:
    """(tokens streamed, requests that failed, server-sent events received: the router's stream items)."""
    sem = asyncio.Semaphore(concurrency)
    streamed, failed, events = 0, 0, 0

    async def one(app: AsyncAppClient, i: int) -> None:
        nonlocal streamed, failed, events
        body = {"model": "tiny-qwen2", "prompt": f"{i} measure the token path " * 4, "max_tokens": tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with sem:
            try:
                usage = None
                async with app.stream(COMPLETIONS, body) as s:
                    async for event in s:
                        events += bool(event.get("choices"))  # tokens, not usage
                        usage = event.get("usage") or usage
                streamed += tokens if usage and "completion_tokens" in usage else 0
            except AppError:
                failed += 1

    async with AsyncAppClient(base_url, timeout_s=300, max_connections=concurrency) as app:
        await asyncio.gather(*(one(app, i) for i in range(requests)))
    return streamed, failed, events


def one_round(stack: LocalStack, args) -> dict:
    idle0, t0 = cpu_by_part(), time.monotonic()
    time.sleep(args.idle_s)
    idle = window(idle0, cpu_by_part())
    idle_rate = {p: idle[p] / (time.monotonic() - t0) for p in PARTS}  # cores

    def loaded(run) -> tuple[dict[str, float], float, tuple[int, int]]:
        c0, s0 = cpu_by_part(), time.monotonic()
        result = asyncio.run(run())
        dt = time.monotonic() - s0
        used = window(c0, cpu_by_part())
        return {p: used[p] - idle_rate[p] * dt for p in PARTS}, dt, result

    stream_cpu, stream_s, (tokens, stream_failed, events) = loaded(
        lambda: stream_load(stack.base_url, args.stream_requests, args.streams, args.tokens))
    short_cpu, short_s, (_, short_failed, _) = loaded(
        lambda: stream_load(stack.base_url, args.short_requests, 8, 8))
    served = args.short_requests - short_failed
    return {
        "idle_cores": idle_rate,
        "per_token_us": {p: stream_cpu[p] / max(1, tokens) * 1e6 for p in PARTS},
        "per_request_ms": {p: short_cpu[p] / max(1, served) * 1e3 for p in PARTS},
        "tokens_streamed": tokens, "stream_s": stream_s, "stream_failed": stream_failed,
        "tokens_per_event": tokens / max(1, events),  # how many tokens each item the router relays carries
        "short_served": served, "short_s": short_s,
    }


def measure(config: Path, args) -> list[dict]:
    """`--rounds` rounds on one start of `config`."""
    rounds = []
    with LocalStack(config, log=lambda m: log(f"[stack] {m}")) as stack:
        # first requests and the engines' start-up work are not the path's cost: warm up, then settle
        asyncio.run(stream_load(stack.base_url, 2 * args.streams, args.streams, args.tokens))
        time.sleep(args.settle_s)
        for i in range(args.rounds):
            rounds.append(one_round(stack, args))
            log(f"round {i + 1}: {rounds[-1]}")
    return rounds


def summarise(rounds: list[dict], title: str) -> dict:
    """Per part and metric: median, min, max over `rounds`; printed as a table."""
    print(f"{title}\n{'part':<10} {'idle cores':>12} {'µs/token':>16} {'ms/request':>16}   "
          f"(median; range over {len(rounds)} rounds)")
    summary = {}
    for p in PARTS:
        row = {m: [r[m][p] for r in rounds] for m in METRICS}
        summary[p] = {m: {"median": statistics.median(v), "min": min(v), "max": max(v)} for m, v in row.items()}
        cell = lambda m, f: f"{statistics.median(row[m]):{f}} ({min(row[m]):{f}}-{max(row[m]):{f}})"  # noqa: E731
        print(f"{p:<10} {cell('idle_cores', '.3f'):>12} {cell('per_token_us', '.0f'):>16} "
              f"{cell('per_request_ms', '.2f'):>16}")
    return summary


def with_kv_events(on: bool, folder: Path) -> Path:
    """deployments/local.yaml with `engine.kv_events` set, written into `folder`."""
    doc = yaml.safe_load(CONFIG.read_text())
    doc["applications"][0]["args"]["engine"]["kv_events"] = on
    path = folder / f"local-kv-events-{'on' if on else 'off'}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def paired_ratios(by_setting: dict[str, list[list[dict]]]) -> dict:
    """Per pair, part and metric: the median over the pair's rounds with events on, over the one off."""
    out: dict = {p: {m: [] for m in METRICS} for p in PARTS}
    for on, off in zip(by_setting["on"], by_setting["off"]):
        for p in PARTS:
            for m in METRICS:
                a, b = (statistics.median(r[m][p] for r in rs) for rs in (on, off))
                out[p][m].append(round(a / b, 3) if b > 0 else None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=20.0, help="idle after the warm-up, before the first round")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stream-requests", type=int, default=64)
    ap.add_argument("--short-requests", type=int, default=200)
    ap.add_argument("--kv-events", help="`on,off`: compare the two settings of engine.kv_events, paired")
    ap.add_argument("--pairs", type=int, default=2, help="with --kv-events: stack starts per setting")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not args.kv_events:
        rounds = measure(CONFIG, args)
        summary = summarise(rounds, "deployments/local.yaml")
        if args.json:
            write_result(args.json, {"settings": vars(args), "rounds": rounds, "summary": summary})
        return 0
    if sorted(args.kv_events.split(",")) != ["off", "on"]:
        ap.error(f"--kv-events: `on,off`, got {args.kv_events!r}")
    by_setting: dict[str, list[list[dict]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="token-path-cpu-") as tmp:
        for k in range(args.pairs):
            for setting in ("on", "off") if k % 2 == 0 else ("off", "on"):  # alternate who goes first
                log(f"pair {k + 1}: engine.kv_events {setting}")
                by_setting[setting].append(measure(with_kv_events(setting == "on", Path(tmp)), args))
    summary = {s: summarise([r for rs in runs for r in rs], f"engine.kv_events: {s}")
               for s, runs in by_setting.items()}
    ratios = paired_ratios(by_setting)
    print("paired ratio on/off, per pair: " + "; ".join(
        f"{p} idle {ratios[p]['idle_cores']} per token {ratios[p]['per_token_us']}" for p in ("routers", "engines")))
    if args.json:
        write_result(args.json, {"settings": vars(args), "runs": by_setting, "summary": summary,
                                 "paired_ratio_on_over_off": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
