"""How long the CPU profile takes to stop after streaming load, and whether the stop is graceful.

Usage (from the repository root, with no Ray cluster or engine running):

    .venv/bin/python benchmarks/stop_time.py --rounds 2 --requests 200 --json runs/stop_time.json
    RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=30 .venv/bin/python benchmarks/stop_time.py ...  # Serve's default

Each round starts `deployments/local.yaml` with the launcher (`serve_app.launch.LocalStack`, as
`make run` does), streams `--requests` completions 16 at a time, then stops the stack and reports
its phases: `serve shutdown` (routers drained, then engines), the engine processes' exit, the whole
stop; what the stop had to force (a `serve shutdown` timing out, signals to engines); and whether
the stack's runtime folder and the system temp folder's vLLM files are gone. A graceful stop
forces nothing. The HAProxy drain window comes from the environment, as for `make run`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from disagg.app_client import COMPLETIONS, AppClient, AppError  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402
from serve_app.launch import FAST_PATH_ENV, LocalStack, engine_processes, runtime_dir, vllm_temp_files  # noqa: E402

WINDOW_VAR = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def one_round(requests: int) -> dict:
    before = vllm_temp_files()
    stack = LocalStack(ROOT / "deployments" / "local.yaml", log=lambda m: log(f"[stack] {m}"))
    with stack:
        def ask(i: int) -> int | None:
            body = {"model": "tiny-qwen2", "prompt": "hello " * (5 + i % 50), "max_tokens": 64, "ignore_eos": True,
                    "stream": True}
            try:
                with AppClient(stack.base_url, timeout_s=120) as app, app.stream(COMPLETIONS, body) as events:
                    for _ in events:
                        pass
                return 200
            except AppError as e:
                return e.status

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(ask, range(requests)))
        log(f"load: {codes.count(200)} of {requests} answered 200; stopping")
    return {"requests_ok": codes.count(200), "requests": requests, **stack.stop_times, "forced": stack.forced,
            "engines_left": engine_processes(stack.stack_id), "runtime_dir_left": runtime_dir(stack.stack_id).exists(),
            "temp_files_left": sorted(vllm_temp_files() - before)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--json", help="write the rounds and their medians here")
    args = ap.parse_args()
    window = os.environ.get(WINDOW_VAR, FAST_PATH_ENV[WINDOW_VAR])
    log(f"HAProxy drain window {window} s")
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(args.requests))
        log(f"round {i + 1}: {json.dumps(rounds[-1])}")
    summary = {k: statistics.median(r[k] for r in rounds if k in r)
               for k in ("serve_shutdown_s", "engines_gone_s", "total_s") if any(k in r for r in rounds)}
    graceful = sum(not r["forced"] for r in rounds)
    print(f"drain window {window} s: {graceful} of {len(rounds)} stops graceful; medians "
          + ", ".join(f"{k} {v:.1f}" for k, v in summary.items())
          + "; ranges " + ", ".join(f"{k} {min(r[k] for r in rounds if k in r):.1f}-"
                                    f"{max(r[k] for r in rounds if k in r):.1f}" for k in summary))
    if args.json:
        write_result(args.json, {"drain_window_s": float(window), "rounds": rounds, "medians": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
