"""Simulator speed and memory: simulated requests per wall-second (one core), peak RSS at 1× and 10× trace.

Usage: python benchmarks/sim_speed.py --trace PATH [--policy marginal_cost] [--rate R] [--repeats 3]

Each measurement runs in a fresh subprocess, so its peak RSS (ru_maxrss) is its own. The 10× trace is
the trace laid end to end ten times (arrivals shifted by the span), so memory growth with trace length
can be read directly: linear or better means ratio ≤ 10. Beside the wall-clock rate the JSON gives the
rate per CPU second of the process (`requests_per_cpu_s`): on cores shared with other work the wall
clock counts their time too, the CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from disagg.bench.script import write_result

CHILD = r"""
import json, resource, sys, time
from dataclasses import replace
from disagg.core.cost_model import load_profile
from disagg.sim.runner import prepare_trace, simulate
from disagg.sim.simulator import Topology
from disagg.sim.traces import read_trace
path, policy, rate, copies = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
base = prepare_trace(read_trace(path), rate if rate > 0 else None, 0.5, 0)
span = base[-1].arrival_s + 1.0
trace = [replace(r, arrival_s=r.arrival_s + k * span) for k in range(copies) for r in base]
summary, res = simulate(trace, load_profile("a40"), Topology(2, 4), policy)
print(json.dumps({"requests": len(trace), "wall_s": res.sim_wall_s,
                  "requests_per_s": len(trace) / res.sim_wall_s, "requests_per_cpu_s": len(trace) / res.sim_cpu_s,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "goodput": summary["goodput"]}))
"""


def run(trace: str, policy: str, rate: float, copies: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, trace, policy, str(rate), str(copies)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--policy", default="marginal_cost")
    ap.add_argument("--rate", type=float, default=0.0, help="mean rate; 0 = the trace's own")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    one = [run(args.trace, args.policy, args.rate, 1) for _ in range(args.repeats)]
    ten = run(args.trace, args.policy, args.rate, 10)
    speeds = [r["requests_per_s"] for r in one]
    cpu_speeds = [r["requests_per_cpu_s"] for r in one]
    result = {
        "policy": args.policy, "rate": args.rate or "trace",
        "requests_1x": one[0]["requests"],
        "requests_per_s_median": statistics.median(speeds),
        "requests_per_s_min": min(speeds), "requests_per_s_max": max(speeds),
        "requests_per_cpu_s_median": statistics.median(cpu_speeds),
        "requests_per_cpu_s_min": min(cpu_speeds), "requests_per_cpu_s_max": max(cpu_speeds),
        "peak_rss_mib_1x": statistics.median(r["peak_rss_mib"] for r in one),
        "requests_10x": ten["requests"], "requests_per_s_10x": ten["requests_per_s"],
        "peak_rss_mib_10x": ten["peak_rss_mib"],
    }
    result["rss_ratio_10x_over_1x"] = result["peak_rss_mib_10x"] / result["peak_rss_mib_1x"]
    print(json.dumps(result, indent=2))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
