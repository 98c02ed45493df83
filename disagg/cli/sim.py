"""`disagg sim` and `disagg study`: the policies compared, and the studies, in the simulator."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from disagg.cli.common import Progress, fmt_table
from disagg.core.cost_model import load_profile
from disagg.core.policies import known_policies
from disagg.files import json_safe, write_json_atomic
from disagg.sim import studies
from disagg.sim.simulator import Topology
from disagg.sim.traces import read_trace, trace_stats
from disagg.user_input import UsageError, parse_policies, resolve_trace

DEFAULT_POLICIES = "round_robin,least_loaded,length_heuristic,marginal_cost,oracle"
SIM_COLUMNS = [
    ("policy", "policy", "s"),
    ("goodput", "goodput", ".3f"),
    ("ttft_p50_s", "TTFT p50 s", ".3f"),
    ("ttft_p99_s", "TTFT p99 s", ".3f"),
    ("tpot_p50_s", "TPOT p50 s", ".4f"),
    ("tpot_p99_s", "TPOT p99 s", ".4f"),
    ("failed", "failed", "d"),
    ("decision_us_p50", "decide µs p50", ".1f"),
]
CAPACITY_BOUND = "oracle"  # true output lengths: what a perfect predictor would reach


def capacity_label(cap: dict) -> str:
    """The table cell of one capacity search: the rate, or which side of the bracket it fell off."""
    if cap["capacity_rps"] is None:
        return f"<{cap['bracket'][1]:.2f}"
    return f"{cap['capacity_rps']:.2f}" if cap["bracketed"] else f">={cap['capacity_rps']:.2f}"


def check_sim_args(args) -> None:
    """Refuse bad `disagg sim` flags before any work, naming the flag."""
    if args.routers < 1:
        raise UsageError(f"--routers must be an integer >= 1 (router replicas sharing the arrivals), "
                         f"got {args.routers}")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be a finite number > 0, got {args.rate}")
    if args.max_requests < 0:
        raise UsageError(f"--max-requests must be >= 0 (0 = all), got {args.max_requests}")
    if not 0.0 <= args.tight_share <= 1.0:
        raise UsageError(f"--tight-share must be in [0, 1], got {args.tight_share}")
    if not 0.0 <= args.predictor_error <= 10.0:
        raise UsageError(f"--predictor-error must be in [0, 10], got {args.predictor_error}")
    if args.slo_scale is not None and not (math.isfinite(args.slo_scale) and args.slo_scale > 0):
        raise UsageError(f"--slo-scale must be a finite number > 0 (times each request's unloaded latency), "
                         f"got {args.slo_scale}")


def capacity_settings(args) -> tuple[float, int] | None:
    """(attainment, bisection steps) of `disagg sim --capacity`, None without it; bad values refused.
    The flags default to None so that one given without --capacity is caught, not silently ignored."""
    if not args.capacity:
        for flag, value in (("--attainment", args.attainment), ("--capacity-steps", args.capacity_steps)):
            if value is not None:
                raise UsageError(f"{flag} needs --capacity")
        return None
    attainment = 0.9 if args.attainment is None else args.attainment
    steps = 8 if args.capacity_steps is None else args.capacity_steps
    if not 0.0 < attainment <= 1.0:
        raise UsageError(f"--attainment must be a share in (0, 1], got {attainment}")
    if not 0 <= steps <= 30:
        raise UsageError(f"--capacity-steps must be an integer in [0, 30], got {steps}")
    return attainment, steps


def cmd_sim(args) -> int:
    from disagg.sim.runner import (
        CAPACITY_MAX_DOUBLINGS,
        compare,
        find_capacity,
        find_saturation,
    )

    check_sim_args(args)
    cap_settings = capacity_settings(args)
    policies = parse_policies(args.policies)
    bound_added = cap_settings is not None and CAPACITY_BOUND not in policies
    if bound_added:
        policies.append(CAPACITY_BOUND)
    try:
        topology = Topology.parse(args.topology)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cost_model = load_profile(args.cost_model)
    trace = read_trace(resolve_trace(args.trace), args.format)
    if args.max_requests:
        trace = trace[: args.max_requests]
    if cap_settings and trace_stats(trace)["mean_rate"] <= 0:
        raise UsageError(f"--capacity: the trace has no arrival rate to start from ({len(trace)} requests, "
                         "span 0 s); it needs at least 2 requests arriving at different times")
    saturation = None
    rate = args.rate
    if args.saturation:
        saturation = find_saturation(trace, cost_model, topology, tight_share=args.tight_share, seed=args.seed)
        rate = saturation["rate"]
        print(f"saturation rate (round robin mid-collapse): {rate:.2f} req/s", file=sys.stderr)
    bar = Progress(len(trace) * len(policies), "simulating")
    results = compare(trace, cost_model, topology, policies, rate=rate, tight_share=args.tight_share,
                      seed=args.seed, predictor_error=args.predictor_error, progress=bar, routers=args.routers,
                      slo_scale=args.slo_scale)
    effective_rate = rate if rate is not None else trace_stats(trace)["mean_rate"]
    columns, capacity = SIM_COLUMNS, None
    if cap_settings:
        attainment, steps = cap_settings
        for name in policies:
            cap = find_capacity(trace, cost_model, topology, name, attainment=attainment,
                                steps=steps, tight_share=args.tight_share, seed=args.seed,
                                predictor_error=args.predictor_error, routers=args.routers, slo_scale=args.slo_scale)
            cap["bound"] = name == CAPACITY_BOUND
            results[name]["capacity_rps"] = cap["capacity_rps"]
            results[name]["capacity"] = cap
            print(f"capacity {name}: {capacity_label(cap)} req/s ({len(cap['probes'])} probes)", file=sys.stderr)
        capacity = {"attainment": attainment, "steps": steps,
                    "max_doublings": CAPACITY_MAX_DOUBLINGS, "start_rps": trace_stats(trace)["mean_rate"],
                    "bound_policy": CAPACITY_BOUND, "bound_added": bound_added}
        columns = [*SIM_COLUMNS, ("capacity_cell", "capacity req/s", "s")]
    rows = [{"policy": f"{n} (bound)" if capacity and n == CAPACITY_BOUND else n, **s,
             **({"capacity_cell": capacity_label(s["capacity"])} if capacity else {})}
            for n, s in results.items()]
    print(f"trace={args.trace} requests={len(trace)} topology={topology} rate={effective_rate:.2f} req/s "
          f"cost_model={cost_model.name} seed={args.seed} routers={args.routers}"
          + (f" SLO scale {args.slo_scale:g} (targets: that many times each request's own unloaded TTFT and TPOT)"
             if args.slo_scale else ""))
    if capacity:
        print(f"capacity = highest rate with >= {attainment:.0%} of requests meeting both TTFT and TPOT "
              f"targets (from {capacity['start_rps']:.2f} req/s, {steps} bisection steps); "
              f"{CAPACITY_BOUND} (true output lengths) is the bound" + (", added to the run" if bound_added else ""))
    print(fmt_table(rows, columns))
    if args.json:
        total_req = sum(s["requests"] for s in results.values())
        total_wall = sum(s["sim_wall_s"] for s in results.values())
        write_json_atomic(Path(args.json), json_safe({
            "trace": str(args.trace), "topology": str(topology), "cost_model": cost_model.name,
            "seed": args.seed, "rate": effective_rate, "saturation": saturation, "routers": args.routers,
            "slo_scale": args.slo_scale,
            "capacity": capacity, "policies": results,
            "sim_requests_per_s": total_req / total_wall if total_wall else None,
        }))
    return 0


def cmd_study(args) -> int:
    return studies.main(args)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`sim` and `study`."""
    sim = sub.add_parser("sim", help="compare routing policies in the discrete-event simulator")
    sim.add_argument("--trace", required=True, help="trace file, or a name in $DISAGG_TRACE_DIR")
    sim.add_argument("--format", default="auto", help="azure|mooncake|burstgpt|native|auto (default)")
    sim.add_argument("--topology", default="2P4D", help="e.g. 2P4D: 2 prefill and 4 decode instances")
    sim.add_argument("--policies", default=DEFAULT_POLICIES,
                     help=f"comma-separated NAME or NAME:key=value[:key=value] (e.g. slo_goodput:allow_hosted=false); "
                          f"known: {','.join(known_policies())}")
    rate = sim.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="rescale the trace to this mean arrival rate (req/s)")
    rate.add_argument("--saturation", action="store_true", help="run at the rate where round robin is mid-collapse")
    sim.add_argument("--cost-model", default="a40", help="shipped profile name (a40, cpu-tiny) or a YAML file")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--tight-share", type=float, default=0.5, help="share of requests in the tight SLO class")
    sim.add_argument("--predictor-error", type=float, default=0.0, help="relative output-length error (1.5 = 150%%)")
    sim.add_argument("--max-requests", type=int, default=0, help="use only the first N requests (0 = all)")
    sim.add_argument("--routers", type=int, default=1,
                     help="router replicas sharing the arrivals in turn, each with its own ledger and 50 ms-stale "
                          "polls of the others' work (default 1); the saturation rate is still one router's")
    sim.add_argument("--capacity", action="store_true",
                     help="also find each policy's SLO capacity: the highest rate (req/s) at which --attainment of "
                          "requests meet both TTFT and TPOT targets; adds the oracle policy as the bound")
    sim.add_argument("--attainment", type=float,
                     help="with --capacity: the share of requests that must meet their SLO (default 0.9)")
    sim.add_argument("--capacity-steps", type=int,
                     help="with --capacity: bisection steps after the doubling bracket (default 8)")
    sim.add_argument("--slo-scale", type=float, metavar="X",
                     help="judge each request by X times its own unloaded TTFT and TPOT (DistServe's SLO scale) "
                          "instead of its class's targets; slo_goodput aims at those targets too")
    sim.add_argument("--json", help="write the results here (atomically)")
    sim.set_defaults(func=cmd_sim)

    study = sub.add_parser("study", help="the simulator studies (pool width, predictor noise, miscalibration, sizing, "
                                         "latency-aware routing across models, autoscaling: planner vs Serve)")
    studies.add_arguments(study)
    study.set_defaults(func=cmd_study)
