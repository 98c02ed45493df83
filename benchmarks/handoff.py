"""Where a disaggregated request's time and CPU go on the CPU profile: the serving path and the KV hand-off.

Usage (from the repository root):

    # from the request logs of a finished live `disagg validate` (no app needed):
    .venv/bin/python benchmarks/handoff.py --validate runs/validate-s7 --json runs/handoff_s7.json
    # lone requests through a running app (e.g. `make run`; nothing else on the machine):
    .venv/bin/python benchmarks/handoff.py --url http://127.0.0.1:8000 --requests 20 --json runs/handoff_cpu.json

`--validate` reads every live request's route header and reports two tables:
- the time outside the engines (client TTFT − the prefill engine's time − the decode engine's time
  to its first token), and the router's part of it (`router_first_s` − the same), for requests
  served on one engine and for disaggregated ones, by how many other requests of the same run were
  in flight when each was sent;
- for disaggregated requests, the decode engine's time to its first token (`decode_engine_first_s`:
  the KV pull, admission and the first step) by the prompt waiting on the prefill engine when the
  request's own prefill ended (the next request of the run, if it was sent 20 ms or more before).

`--url` sends `--requests` lone 1,024-token requests, one at a time, with the app's own policy,
then routed with `round_robin` (every one through a prefill engine and the hand-off; the app's
policy restored after, whatever happens), and reads the CPU each process group of this machine's
stack spent meanwhile (`/proc`: each engine's replica, engine core and worker; routers; proxy;
Ray's own): CPU per request by group and path. It must run on the app's machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IN_FLIGHT_BINS = ((0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, None))
QUEUED_BINS = ((0, 1), (1, 500), (500, 1500), (1500, None))  # [lo, hi) prompt tokens; None: no bound
QUEUED_BEFORE_S = 0.02  # a request sent this long before another's prefill ended was waiting on the engine
LONE_PROMPT_TOKENS = 1024


def _bin(bins: tuple, x: int) -> int:
    return next(lo for lo, hi in bins if lo <= x and (hi is None or x < hi))


def _label(bins: tuple, lo: int) -> str:
    hi = dict(bins)[lo]
    return f"{lo}+" if hi is None else str(lo) if hi == lo + 1 else f"{lo}–{hi - 1}"


def _engine_times(r: dict) -> tuple[float, float]:
    route = r["route"]
    return float(route.get("prefill_engine_s", 0.0)), float(route["decode_engine_first_s"])


def live_runs(records: list[dict]) -> dict[tuple, list[dict]]:
    """The served live requests that carry engine times, by run (`run`: the file each came from,
    trace, policy), in sending order."""
    runs: dict[tuple, list[dict]] = {}
    for r in records:
        timed = "decode_engine_first_s" in (r.get("route") or {})
        if r.get("system") != "live" or r.get("ttft_s") is None or not timed:
            continue
        runs.setdefault((r.get("run"), r["trace"], r["policy"]), []).append(r)
    for run in runs.values():
        run.sort(key=lambda r: r["sent_s"])
    return runs


def outside_by_load(runs: dict[tuple, list[dict]]) -> list[dict]:
    """Medians of the time outside the engines (and the router's part) by path and requests in flight."""
    rows: dict[tuple[bool, int], list[tuple[float, float]]] = {}
    for run in runs.values():
        spans = [(r["sent_s"], r["sent_s"] + r["e2e_s"]) for r in run]
        for i, r in enumerate(run):
            t = r["sent_s"]
            busy = sum(1 for j, (a, b) in enumerate(spans) if j != i and a <= t < b)
            prefill, first = _engine_times(r)
            router = float(r["route"].get("router_first_s", "nan")) - prefill - first
            crossed = r["prefill_id"] != r["decode_id"]
            lo = _bin(IN_FLIGHT_BINS, busy)
            rows.setdefault((crossed, lo), []).append((r["ttft_s"] - prefill - first, router))
    out = []
    for (crossed, lo), xs in sorted(rows.items()):
        out.append({"path": "disaggregated" if crossed else "one engine", "in_flight": _label(IN_FLIGHT_BINS, lo),
                    "n": len(xs),
                    "outside_p50_s": statistics.median(x for x, _ in xs),
                    "router_p50_s": statistics.median(y for _, y in xs)})
    return out


def first_token_by_queued_prefill(runs: dict[tuple, list[dict]]) -> list[dict]:
    """Disaggregated requests' decode-engine time to the first token, by the prompt tokens queued on
    the prefill engine when their own prefill ended, per trace."""
    rows: dict[tuple[str, int], list[float]] = {}
    for (_, trace, _), run in runs.items():
        for i, r in enumerate(run):
            if r["prefill_id"] == r["decode_id"]:
                continue
            _, first = _engine_times(r)
            prefill_end = r["sent_s"] + float(r["route"]["router_first_s"]) - first  # ~ the decode call
            queued = next((o["prompt_tokens"] for o in run[i + 1:]
                           if o["sent_s"] < prefill_end - QUEUED_BEFORE_S and o["prefill_id"] == r["prefill_id"]), 0)
            lo = _bin(QUEUED_BINS, queued)
            rows.setdefault((trace, lo), []).append(first)
    return [{"trace": trace, "queued_tokens": _label(QUEUED_BINS, lo), "n": len(xs),
             "decode_first_p50_s": statistics.median(xs)} for (trace, lo), xs in sorted(rows.items())]


def read_validate(folder: Path) -> list[dict]:
    """Every record of the live runs of a `disagg validate` folder, each tagged with its file (`run`)."""
    files = sorted(folder.glob("rate-*/repeat-*/requests.jsonl"))
    if not files:
        raise SystemExit(f"{folder}: no rate-*/repeat-*/requests.jsonl (not a `disagg validate --out` folder)")
    records = []
    for f in files:
        with f.open() as fh:
            for n, line in enumerate(fh, 1):
                try:
                    records.append({**json.loads(line), "run": str(f)})
                except ValueError as e:
                    raise SystemExit(f"{f}:{n}: not a JSON record ({e})") from None
    return records


# --- lone requests and the stack's CPU --------------------------------------------------------------

GROUPS = ("disagg:prefill", "disagg:decode", "disagg:router", "ProxyActor", "HAProxy", "ServeController",
          "raylet", "gcs_server")


def process_groups(proc: Path = Path("/proc")) -> dict[str, list[int]]:
    """This machine's stack by group: a vLLM process counts with the replica that started it."""
    table = {}
    for p in proc.iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        table[int(p.name)] = (cmd, ppid)

    def group(pid: int, depth: int = 0) -> str | None:
        cmd, ppid = table[pid]
        for g in GROUPS:
            if g in cmd:
                return g
        return group(ppid, depth + 1) if "VLLM::" in cmd and ppid in table and depth < 3 else None

    groups: dict[str, list[int]] = {}
    for pid in table:
        g = group(pid)
        if g is not None:
            groups.setdefault(g, []).append(pid)
    return groups


def cpu_seconds(groups: dict[str, list[int]], proc: Path = Path("/proc")) -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for g, pids in groups.items():
        total = 0
        for pid in pids:
            try:
                fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, ValueError, IndexError):
                pass  # a process that ended meanwhile
        out[g] = total / tick
    return out


def lone_cpu(url: str, requests: int, seed: int) -> list[dict]:
    from calibration.cli import _routed_with
    from calibration.measure import serving_path_gaps
    from disagg.app_client import AppClient

    with AppClient(url, timeout_s=60.0) as app:
        model = next(iter(app.state()["models"]))
    groups = process_groups()
    if not any(g.startswith("disagg:") for g in groups):
        raise SystemExit("no process of the app on this machine: run it where `make run` runs")
    rows = []

    def window(path: str, run) -> None:
        before, t0 = cpu_seconds(groups), time.monotonic()
        gaps = run()
        wall, after = time.monotonic() - t0, cpu_seconds(groups)
        rows.append({"path": path, "requests": requests, "wall_s": wall,
                     "crossed": sum(g.disaggregated for g in gaps),
                     "cpu_per_request_s": {g: (after[g] - before[g]) / requests for g in groups}})

    window("idle (same wall time as the next)", lambda: time.sleep(3.0) or [])
    window("app's policy", lambda: asyncio.run(serving_path_gaps(url, LONE_PROMPT_TOKENS, requests, seed=seed)))
    with _routed_with(url, model, "round_robin"):
        window("round_robin", lambda: asyncio.run(serving_path_gaps(url, LONE_PROMPT_TOKENS, requests,
                                                                    seed=seed + 1)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--validate", type=Path, help="a finished `disagg validate --out` folder")
    src.add_argument("--url", help="a running app on this machine")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if not 3 <= args.requests <= 200:
        ap.error(f"--requests must be in [3, 200], got {args.requests}")
    if args.validate:
        runs = live_runs(read_validate(args.validate))
        result = {"validate": str(args.validate), "outside_by_load": outside_by_load(runs),
                  "decode_first_by_queued_prefill": first_token_by_queued_prefill(runs)}
        for row in result["outside_by_load"]:
            print(f"{row['path']:13} in flight {row['in_flight']:6} n={row['n']:4}  "
                  f"outside p50 {row['outside_p50_s'] * 1e3:6.1f} ms, router {row['router_p50_s'] * 1e3:5.1f} ms")
        for row in result["decode_first_by_queued_prefill"]:
            print(f"{row['trace']:18} prompt tokens queued {row['queued_tokens']:9} "
                  f"n={row['n']:4}  decode engine's first token p50 {row['decode_first_p50_s'] * 1e3:6.1f} ms")
    else:
        result = {"url": args.url, "rows": lone_cpu(args.url.rstrip("/"), args.requests, args.seed)}
        for row in result["rows"]:
            cpu = row["cpu_per_request_s"]
            print(f"{row['path']:34} " + "  ".join(f"{g} {cpu[g] * 1e3:.1f}" for g in sorted(cpu))
                  + f"  all {sum(cpu.values()) * 1e3:.1f} ms CPU per request")
    if args.json:
        from disagg.bench.script import write_result

        write_result(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
