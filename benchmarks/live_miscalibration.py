"""The calibration paper's miscalibration study, on the live app: default vs calibrated constants.

Usage (from the repository root, the CPU profile running, e.g. `make run` in another shell):

    disagg calibrate --config deployments/local.yaml --out runs/cpu-calibrated.yaml
    .venv/bin/python benchmarks/live_miscalibration.py --url http://127.0.0.1:8000 \
        --calibrated runs/cpu-calibrated.yaml --trace azure_conv_2023 --trace azure_code_2023 \
        --rate 8 --max-requests 200 --repeats 3 --out runs/miscalibration

The same policy (`--policy`, default marginal_cost) serves the same trace slices twice per repeat:
once with the router holding the uncalibrated first-guess profile (`--default`, cpu-tiny), once
with the calibrated file, switched through `POST /admin/cost_model` without restarting anything.
Both arms are judged against the calibrated file's SLO targets (the hardware's real ones), so only
the router's constants differ. Arms alternate (default, calibrated, calibrated, default, ...) so
that a drift of the machine does not land on one arm. Each arm is one `disagg bench` run into its
own folder (gates, prefix-cache resets, resumable logs: rerunning the command resumes).

Printed: per trace, goodput and P99 TTFT of both arms, median and range across repeats, and the
per-repeat paired difference (calibrated − default). The router is left with the calibrated file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from disagg.app_client import AppClient, AppError
from disagg.bench.harness import BenchConfig, BenchError, run_bench
from disagg.bench.script import write_result


def set_cost_model(url: str, source: str) -> dict:
    """Every router replica of the app at `url` prices with `source` from now on."""
    with AppClient(url) as router:
        return router.set_cost_model(source)


def arm_order(repeats: int) -> list[tuple[int, str]]:
    """default, calibrated | calibrated, default | ...: each arm goes first in half of the repeats."""
    order = []
    for k in range(repeats):
        pair = ("default", "calibrated") if k % 2 == 0 else ("calibrated", "default")
        order += [(k, arm) for arm in pair]
    return order


def spread(vals: list[float]) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    return f"{statistics.median(vals):.3f} [{min(vals):.3f}, {max(vals):.3f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--calibrated", required=True, help="the calibrated cost-model YAML")
    ap.add_argument("--default", default="cpu-tiny", help="the uncalibrated profile (shipped name or YAML)")
    ap.add_argument("--policy", default="marginal_cost")
    ap.add_argument("--trace", action="append", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--max-requests", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tight-share", type=float, default=0.5)
    ap.add_argument("--realtime", action="store_true", help="the generator under SCHED_FIFO (see disagg bench)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from disagg.user_input import UsageError, resolve_trace

    try:
        traces = tuple(str(resolve_trace(t)) for t in args.trace)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = {str(p): Path(p).name.split(".")[0] for p in traces}
    sources = {"default": args.default, "calibrated": args.calibrated}
    results: dict[str, dict[str, list[dict]]] = {"default": {}, "calibrated": {}}
    try:
        for k, arm in arm_order(args.repeats):
            print(f"repeat {k + 1}/{args.repeats}: router constants = {arm} ({sources[arm]})", flush=True)
            set_cost_model(args.url, sources[arm])
            res = run_bench(BenchConfig(
                out=args.out / f"{arm}-{k}", traces=traces, policies=(args.policy,), url=args.url,
                rate=args.rate, max_requests=args.max_requests, tight_share=args.tight_share, seed=k,
                cost_model=args.calibrated, realtime=args.realtime))
            for run in res["runs"]:
                results[arm].setdefault(run["trace"], []).append(
                    {"repeat": k, "goodput": run["goodput"], "ttft_p99_s": run["ttft_p99_s"],
                     "ttft_p50_s": run["ttft_p50_s"], "requests": run["requests"], "failed": run["failed"]})
    except (BenchError, AppError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        try:
            set_cost_model(args.url, args.calibrated)
        except AppError:
            pass

    print(f"\n{args.policy}, {args.max_requests} requests per trace at {args.rate:g} req/s, {args.repeats} repeats; "
          f"median [min, max] across repeats; goodput judged with {args.calibrated}'s SLO targets\n")
    print("| trace | router constants | goodput | P99 TTFT s | paired Δ goodput (calibrated − default) |")
    print("| --- | --- | --- | --- | --- |")
    for trace in names.values():
        d, c = results["default"].get(trace, []), results["calibrated"].get(trace, [])
        by_repeat = {r["repeat"]: r for r in d}
        deltas = [r["goodput"] - by_repeat[r["repeat"]]["goodput"] for r in c if r["repeat"] in by_repeat]
        for arm, rows in (("default", d), ("calibrated", c)):
            delta = spread(deltas) if arm == "calibrated" else ""
            print(f"| {trace} | {arm} | {spread([r['goodput'] for r in rows])} | "
                  f"{spread([r['ttft_p99_s'] for r in rows])} | {delta} |")
    write_result(args.out / "miscalibration.json", {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
