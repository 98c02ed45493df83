"""Simulator speed of several checkouts, measured in turn: paired ratios on a noisy machine.

Usage: python benchmarks/sim_speed_paired.py --trace PATH CHECKOUT [CHECKOUT ...] [--policy marginal_cost]
       [--rounds 8] [--json OUT]

Each round runs the simulation once in every checkout (a directory holding the `disagg` package, e.g.
a `git worktree add ../base COMMIT`), in a fresh process importing that checkout's code, one after
the other. On cores shared with other work the rate drifts by 2× within minutes, so the figure to
read is the ratio within a round (the checkouts saw the same machine), not the rates themselves.
The rate is requests per CPU-second of the `simulate` call, timed by the child itself, so older
checkouts whose results do not report their CPU time are measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from disagg.bench.script import write_result

CHILD = r"""
import json, sys, time
from disagg.core.cost_model import load_profile
from disagg.sim.runner import prepare_trace, simulate
from disagg.sim.simulator import Topology
from disagg.sim.traces import read_trace
import disagg.core.engine_model as engine_model
trace = prepare_trace(read_trace(sys.argv[1]), None, 0.5, 0)
cpu0 = time.process_time()
summary, _ = simulate(trace, load_profile("a40"), Topology(2, 4), sys.argv[2])
cpu = time.process_time() - cpu0
print(json.dumps({"requests_per_cpu_s": len(trace) / cpu, "goodput": summary["goodput"],
                  "engine_model": engine_model.__file__.rsplit("/", 1)[-1]}))
"""


def run(checkout: Path, trace: str, policy: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", CHILD, trace, policy], cwd=checkout, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:  # an older checkout may not know the policy, say
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{checkout}: the simulation failed: {last}")
    return json.loads(out.stdout)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkouts", nargs="+", type=Path)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--policy", default="marginal_cost")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    for c in args.checkouts:
        if not (c / "disagg" / "sim" / "simulator.py").is_file():
            ap.error(f"{c}: not a checkout of this project (no disagg/sim/simulator.py)")
    trace = str(Path(args.trace).resolve())
    rates: dict[str, list[float]] = {str(c): [] for c in args.checkouts}
    runs: dict[str, dict] = {}
    for _ in range(args.rounds):
        for c in args.checkouts:
            r = run(c.resolve(), trace, args.policy)
            rates[str(c)].append(r["requests_per_cpu_s"])
            runs[str(c)] = r
    names = list(rates)
    result = {
        "policy": args.policy, "rounds": args.rounds,
        "checkouts": {c: {"requests_per_cpu_s": spread(v), "per_round": v, "engine_model": runs[c]["engine_model"],
                          "goodput": runs[c]["goodput"]} for c, v in rates.items()},
        # each checkout's rate over every earlier one's, round by round
        "paired_ratios": {f"{b} / {a}": spread([x / y for x, y in zip(rates[b], rates[a])])
                          for i, a in enumerate(names) for b in names[i + 1:]},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
