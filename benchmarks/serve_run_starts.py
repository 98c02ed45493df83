"""Fresh `serve run` starts, as a user types it: does each serve its first requests cleanly?

Usage (from the repository root, with no Ray cluster or engine running):

    .venv/bin/python benchmarks/serve_run_starts.py --starts 3 --requests 30 --json runs/serve_run_starts.json

Each start runs `serve run deployments/local.yaml` in a fresh process (which starts its own local
Ray cluster, as `serve run` does for a user with no cluster up), waits for `/health`, sends
`--requests` chat and completion requests (streaming and not, one at a time and 8 at once), then
reads the router's counters from `/admin/state` and stops `serve run` with Ctrl-C (SIGINT).
A start passes when every request got a 200 with the tokens it asked for, and the router saw no
fallback, retry, misrouting, failure or lost instance, and its engine replicas are the ones it
started with. After each stop the script waits (bounded) for every engine process to exit.

Environment: only what a user would set (`RAY_AUTH_MODE=disabled`, `RAY_USAGE_STATS_ENABLED=0`,
loopback). Nothing of `serve_app.launch` is used: this checks what the application does alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from disagg.app_client import CHAT, COMPLETIONS, AppClient, AppError
from disagg.bench.script import log, write_result

ROOT = Path(__file__).resolve().parents[1]
BASE = "http://127.0.0.1:8000"
MODEL = "tiny-qwen2"
FAULT_COUNTERS = ("prefill_retries", "local_prefill_fallbacks", "decode_retries", "misrouted", "failed",
                  "instances_lost")


def request(i: int) -> tuple[bool, str]:
    """One request of a varied mix; (ok, what went wrong)."""
    n = 4 + i % 13
    stream = i % 3 == 0
    if i % 2:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Question {i}: where do tokens go?"}],
                "max_tokens": n, "ignore_eos": True, "temperature": 0, "stream": stream}
        path = CHAT
    else:
        body = {"model": MODEL, "prompt": f"Request {i} " + "decode prefill " * (i % 40), "max_tokens": n,
                "ignore_eos": True, "temperature": 0, "stream": stream}
        path = COMPLETIONS
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        with AppClient(BASE, timeout_s=120.0) as app:
            if stream:
                with app.stream(path, body) as events:
                    events = list(events)  # to [DONE]: an error event raises
                    usage = next((e["usage"] for e in events if e.get("usage")), None)
            else:
                usage = (app.chat(body) if path == CHAT else app.complete(body))["usage"]
    except AppError as e:
        return False, str(e)
    if not usage or usage["completion_tokens"] != n:
        return False, f"asked for {n} tokens, usage {usage}"
    return True, ""


def engine_pids() -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "VLLM::" in line or "EngineCore" in line]


def one_start(index: int, args) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    t0 = time.monotonic()
    logf = open(Path(args.log_dir) / f"serve-run-{index}.log", "w")
    proc = subprocess.Popen(["serve", "run", args.config], cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)
    result: dict = {"start": index, "ok": False}
    try:
        with AppClient(BASE, timeout_s=10.0) as app:
            try:
                app.wait_healthy(args.ready_timeout, still_starting=lambda: proc.poll() is None)
            except AppError as e:
                result["error"] = f"{e} (serve run exit {proc.poll()})"
                return result
            result["ready_s"] = round(time.monotonic() - t0, 1)
            instances = set(app.state()["instances"])
            log(f"start {index}: healthy after {result['ready_s']} s; {len(instances)} engine instances")
            errors = []
            t1 = time.monotonic()
            half = args.requests // 2
            for i in range(half):  # one at a time, then 8 at once
                ok, why = request(i)
                if not ok:
                    errors.append(why)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                for ok, why in pool.map(request, range(half, args.requests)):
                    if not ok:
                        errors.append(why)
            result["requests_s"] = round(time.monotonic() - t1, 1)
            state = app.state()
            faults = {k: state["counters"].get(k) for k in FAULT_COUNTERS}
            replaced = sorted(instances - set(state["instances"]))
            result.update(errors=errors, faults=faults, replaced=replaced, served=state["counters"]["served"])
            result["ok"] = not errors and not replaced and all(v == 0 for v in faults.values())
            log(f"start {index}: {args.requests - len(errors)}/{args.requests} requests ok, faults {faults}, "
                f"replaced {replaced or 'none'} -> {'PASS' if result['ok'] else 'FAIL'}")
            return result
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 120
        while engine_pids() and time.monotonic() < deadline:
            time.sleep(1.0)
        result["engines_left_after_stop"] = engine_pids()
        result["stop_exit_code"] = proc.returncode
        logf.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="deployments/local.yaml")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--log-dir", default="runs")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.starts < 1 or args.requests < 2:
        ap.error("--starts must be >= 1 and --requests >= 2")
    if engine_pids():
        ap.error(f"vLLM engine processes are already running ({engine_pids()}); stop them first")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    results = [one_start(i, args) for i in range(args.starts)]
    passed = sum(r["ok"] for r in results)
    ready = [r["ready_s"] for r in results if "ready_s" in r]
    summary = {"starts": args.starts, "passed": passed, "requests_per_start": args.requests,
               "ready_s_median": statistics.median(ready) if ready else None,
               "ready_s_range": [min(ready), max(ready)] if ready else None}
    log(f"{passed}/{args.starts} starts passed; ready in {summary['ready_s_median']} s (median), "
        f"range {summary['ready_s_range']}")
    if args.json:
        write_result(args.json, {"summary": summary, "starts": results})
    return 0 if passed == args.starts else 1


if __name__ == "__main__":
    sys.exit(main())
