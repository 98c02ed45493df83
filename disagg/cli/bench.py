"""`disagg bench`: policies measured on the live app and/or the simulator."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disagg.cli.common import Progress, fmt_table
from disagg.core.policies import known_policies
from disagg.user_input import UsageError, parse_policies, resolve_trace


def cmd_bench(args) -> int:
    """`disagg bench`: policies against the live app and/or the simulator (disagg/bench/harness.py)."""
    from disagg.bench.harness import (
        BenchConfig,
        BenchError,
        GateFailed,
        parse_baseline,
        run_bench,
    )
    from disagg.bench.report import capacity_markdown

    if args.url is None and not args.sim:
        raise UsageError("give --url (the live app) and/or --sim")
    if args.rate is not None and args.rate <= 0:
        raise UsageError(f"--rate must be > 0, got {args.rate}")
    traces = [str(resolve_trace(t)) for spec in args.trace for t in spec.split(",") if t.strip()]
    try:
        baselines = tuple(parse_baseline(b) for b in args.baseline)
    except BenchError as e:
        raise UsageError(str(e)) from None
    cfg = BenchConfig(
        out=Path(args.out), traces=tuple(traces), policies=tuple(parse_policies(args.policies)),
        url=args.url.rstrip("/") if args.url else None, fmt=args.format, rate=args.rate,
        saturation=args.saturation, duration_s=args.duration, max_requests=args.max_requests or None,
        tight_share=args.tight_share, seed=args.seed, sim=args.sim, cost_model=args.cost_model,
        topology=args.topology, max_model_len=args.max_model_len, request_timeout_s=args.request_timeout,
        lag_bound_s=args.lag_bound_ms / 1e3, probe_requests=args.probe_requests,
        probe_seconds=args.probe_seconds, probe_iterations=args.probe_iterations, realtime=args.realtime,
        baselines=baselines, capacity=args.capacity, capacity_steps=args.capacity_steps,
        accept_foreign_constants=args.accept_foreign_constants, slo_scale=args.slo_scale,
    )
    try:
        results = run_bench(cfg, progress=lambda total, label: Progress(total, label))
    except GateFailed as e:
        print(f"disagg: {e}", file=sys.stderr)
        return 1
    except BenchError as e:
        raise UsageError(str(e)) from None
    traces = list(results["traces"])
    rows = []
    for label, row in results["tables"]["goodput"].items():
        rows.append({"policy": label, **{t: row.get(t) for t in traces}, "mean": row.get("mean"),
                     "spread": row.get("spread")})
    if results["runs"]:  # none in a --capacity run
        print("goodput (share of requests meeting both SLO targets of cost model "
              f"{results['cost_model']['name']}):")
        print(fmt_table(rows, [("policy", "policy", "s"), *((t, t, ".3f") for t in traces), ("mean", "mean", ".3f"),
                               ("spread", "± std", ".3f")]))
        print()
        print(fmt_table(results["runs"], [("system", "system", "s"), ("policy", "policy", "s"), ("trace", "trace", "s"),
                                          ("requests", "requests", "d"), ("failed", "failed", "d"),
                                          ("goodput", "goodput", ".3f"), ("ttft_p50_s", "TTFT p50 s", ".3f"),
                                          ("ttft_p99_s", "TTFT p99 s", ".3f"), ("tpot_p50_s", "TPOT p50 s", ".4f"),
                                          ("tpot_p99_s", "TPOT p99 s", ".4f"), ("send_lag_p99_s", "lag p99 s", ".4f")]))
    capacity = capacity_markdown(results["resolved"], traces)
    if capacity:
        print("\n" + "\n".join(capacity))
    for w in results["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(f"\nwrote {cfg.out}/results.json, results.md, requests.jsonl, goodput.png, ttft_cdf.png")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`bench` and `validate`."""
    bench = sub.add_parser("bench", help="measure routing policies on the live app (and/or the simulator) "
                                         "with a trace; resumable")
    bench.add_argument("--url", help="the app, e.g. http://127.0.0.1:8000 (omit with --sim for a simulator-only run)")
    bench.add_argument("--trace", action="append", required=True,
                       help="trace file or name in $DISAGG_TRACE_DIR; repeat (or comma-separate) for several")
    bench.add_argument("--format", default="auto", help="azure|mooncake|burstgpt|native|auto (default)")
    bench.add_argument("--policies", default="round_robin,colocated,marginal_cost,slo_goodput",
                       help=f"comma-separated NAME or NAME:key=value[:key=value]; known: {','.join(known_policies())}")
    brate = bench.add_mutually_exclusive_group()
    brate.add_argument("--rate", type=float, help="rescale each trace slice to this mean arrival rate (req/s)")
    brate.add_argument("--saturation", action="store_true",
                       help="find round robin's mid-collapse rate first (live: slow probing; see --probe-*)")
    bench.add_argument("--capacity", type=float, nargs="?", const=0.9, default=None, metavar="ATTAINMENT",
                       help="instead of fixed-rate runs, search each policy's SLO capacity: the highest rate at which "
                            "this share (default 0.9) of requests meet both SLO targets (probes sized by --probe-*; "
                            "--rate is the search's start)")
    bench.add_argument("--capacity-steps", type=int, default=3, help="bisection steps of the capacity search")
    bench.add_argument("--duration", type=float, help="cut each slice at this many seconds (after rescaling)")
    bench.add_argument("--max-requests", type=int, default=0, help="use only the first N requests of each trace")
    bench.add_argument("--tight-share", type=float, default=0.5, help="share of requests in the tight SLO class")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", required=True, help="output folder (a rerun with the same settings resumes it)")
    bench.add_argument("--sim", action="store_true", help="also run the simulator on the same slices")
    bench.add_argument("--cost-model",
                       help="cost-model profile or YAML: SLO targets for goodput, and the simulator's constants "
                            "(default: with --url, `app`, the constants the router prices with; else cpu-tiny). "
                            "A live run first checks them against the app's engines and refuses constants of "
                            "other hardware")
    bench.add_argument("--accept-foreign-constants", action="store_true",
                       help="report goodput even when the cost model does not describe the app's hardware "
                            "(miscalibration studies)")
    bench.add_argument("--slo-scale", type=float, metavar="X",
                       help="judge each request by X times its own unloaded TTFT and TPOT instead of its class's "
                            "targets (DistServe's SLO scale; live, sent as X-SLO-Scale so the router prices the same "
                            "targets): for long prompts no fixed target suits")
    bench.add_argument("--topology", help="simulated topology (default: the live app's, else 1P2D)")
    bench.add_argument("--max-model-len", type=int,
                       help="context to fit requests to in a simulator-only run (live: read from /v1/models)")
    bench.add_argument("--request-timeout", type=float, default=300.0, help="per-request limit in seconds")
    bench.add_argument("--lag-bound-ms", type=float, default=50.0, help="flag runs whose send-lag P99 exceeds this")
    bench.add_argument("--probe-requests", type=int, default=20, help="live saturation: fewest requests per probe")
    bench.add_argument("--probe-seconds", type=float, default=20.0,
                       help="live saturation: each probe sends rate × this many seconds of the trace; "
                            "--capacity: every probe sends start rate × this many seconds of it, rescaled")
    bench.add_argument("--probe-iterations", type=int, default=5, help="live saturation: bisection steps")
    bench.add_argument("--realtime", action="store_true",
                       help="run the load generator under SCHED_FIFO (needs root) so a busy app cannot delay its "
                            "sends; recommended when the app shares the machine's cores")
    bench.add_argument("--baseline", action="append", default=[], metavar="NAME=URL",
                       help="another OpenAI-compatible system on the same trace slices, run after our policies on "
                            "every trace (repeatable), e.g. ray_serve_llm=http://127.0.0.1:8000/raylm")
    bench.set_defaults(func=cmd_bench)

    val = sub.add_parser("validate", help="the simulator against the live app on the same trace slices: predicted "
                                          "vs measured TTFT/TPOT p50/p90 and attainment, with the live noise floor")
    val.add_argument("--url", help="the app, e.g. http://127.0.0.1:8000")
    val.add_argument("--resimulate", metavar="DIR",
                     help="no app: the simulator alone with --cost-model against the live runs of an earlier "
                          "`disagg validate --out DIR` (same slices, rates, topology and SLO targets)")
    val.add_argument("--trace", action="append", default=[],
                     help="trace file or name (repeatable, or comma-separated)")
    val.add_argument("--policies", default="round_robin,marginal_cost", help="comma-separated policies")
    val.add_argument("--rates", help="comma-separated rates in req/s, e.g. light,near,past capacity")
    val.add_argument("--repeats", type=int, default=2, help="live runs per rate; 2 or more give the noise floor")
    val.add_argument("--max-requests", type=int, default=120, help="requests of each trace slice")
    val.add_argument("--cost-model", help="the simulator's constants and the SLO targets (default: the router's "
                                          "own, checked against the app's engines)")
    val.add_argument("--within", type=float, default=0.15, help="relative error a latency cell may have")
    val.add_argument("--seed", type=int, default=0)
    val.add_argument("--realtime", action="store_true", help="the load generator under SCHED_FIFO (see bench)")
    val.add_argument("--at-measured-speed", action="store_true",
                     help="simulate every repeat with the engines' step times scaled to what its constants check "
                          "measured just before it (the host's drift since the fit), not once per rate as fitted")
    val.add_argument("--refit", metavar="DIR",
                     help="before each live run, fit the router's constants on the live engines again (as `make "
                          "run` does at start) into DIR, a folder the router may load from (its "
                          "router.cost_model_dir), and simulate each repeat with its own run's constants")
    val.add_argument("--out", required=True, help="output folder; one resumable bench folder per repeat and rate")
    val.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    """`disagg validate` (disagg/bench/validate.py)."""
    from disagg.bench.harness import BenchError, GateFailed
    from disagg.bench.refit import app_refit
    from disagg.bench.validate import (
        FIGURE, RESULTS_JSON, RESULTS_MD, ValidateConfig, markdown, resimulate, run_validate,
    )

    if args.resimulate:
        if args.url or args.trace or args.rates:
            raise UsageError("--resimulate takes the traces, rates and live runs of the earlier validate: "
                             "drop --url, --trace and --rates")
        if not args.cost_model:
            raise UsageError("--resimulate needs --cost-model: the constants to simulate with")
        try:
            report = resimulate(Path(args.resimulate), args.cost_model, Path(args.out),
                                log=lambda m: print(m, file=sys.stderr, flush=True),
                                at_measured_speed=args.at_measured_speed)
        except BenchError as e:
            raise UsageError(str(e)) from None
        print(markdown(report), end="")
        print(f"\nwrote {args.out}/{RESULTS_JSON}, {RESULTS_MD}, {FIGURE}")
        return 0
    if not (args.url and args.trace and args.rates):
        raise UsageError("validate needs --url, --trace and --rates (or --resimulate DIR --cost-model FILE)")
    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        raise UsageError(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
    traces = [str(resolve_trace(t)) for spec in args.trace for t in spec.split(",") if t.strip()]
    cfg = ValidateConfig(url=args.url.rstrip("/"), out=Path(args.out), traces=tuple(traces),
                         policies=tuple(parse_policies(args.policies)), rates=rates, repeats=args.repeats,
                         max_requests=args.max_requests or None, cost_model=args.cost_model, seed=args.seed,
                         within=args.within, realtime=args.realtime, at_measured_speed=args.at_measured_speed)
    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    try:
        report = run_validate(cfg, log=log,
                              progress=lambda total, label: Progress(total, label),
                              refit=app_refit(cfg.url, Path(args.refit), log) if args.refit else None)
    except GateFailed as e:
        print(f"disagg: {e}", file=sys.stderr)
        return 1
    except BenchError as e:
        raise UsageError(str(e)) from None
    print(markdown(report), end="")
    print(f"\nwrote {cfg.out}/{RESULTS_JSON}, {RESULTS_MD}, {FIGURE}")
    return 0
