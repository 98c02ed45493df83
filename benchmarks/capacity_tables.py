"""SLO capacity of every policy on every trace and topology: the tables of docs/simulator.md, in one command.

Usage (from the repository root):

    DISAGG_TRACE_DIR=<trace dir> python benchmarks/capacity_tables.py \
        --json runs/capacity_tables.json --markdown runs/capacity_tables.md

For each trace, topology (`--topologies`, 2P4D and 4P3D) and seed (`--seeds`, 0 and 1: the
tight/loose class draw), every policy's SLO capacity is found as `disagg sim --capacity` finds it
(`disagg.sim.runner.find_capacity`: the highest rate at which `attainment` of the requests meet both
their TTFT and TPOT targets; a40 cost model, half the requests tight). The traces:
- the real Azure traces, first `--max-requests` requests (a path, or a name in $DISAGG_TRACE_DIR):
  `azure_conv_2023` at 90%, and `azure_code_2023` at 75%, since unloaded only 77-81% of its
  requests can meet their SLO (docs/simulator.md);
- generated workloads (disagg/sim/workloads.py), `--generated-requests` each at 10 req/s, seed 0:
  `multi_turn_chat` (prefix sharing), `short_prompt_long_generation` (decode-heavy) and
  `mixed_bursty` (bursts at 3.4x the mean rate).
A trace may be given as NAME or NAME:ATTAINMENT.

Each table has one row per policy and one column per (topology, seed), then the ratio of
`slo_goodput` to the best baseline in that column: every policy but `slo_goodput` and `oracle`
(the bound: `marginal_cost` told the true output lengths) counts as a baseline, including
`pair_cost` and `colocated`. The runs are independent, so they are spread over `--jobs`
processes (2 by default: one per core here); a full run took 331 s on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from disagg.bench.script import write_result
from disagg.core.cost_model import load_profile
from disagg.files import atomic_write
from disagg.sim.runner import find_capacity
from disagg.sim.simulator import Topology
from disagg.sim.traces import read_trace
from disagg.sim.workloads import WORKLOADS, generate
from disagg.user_input import UsageError, resolve_trace

BASELINES = ("round_robin", "least_loaded", "power_of_two", "length_heuristic", "prefix_affinity",
             "marginal_cost", "pair_cost", "colocated")
OURS = "slo_goodput"
BOUND = "oracle"
DEFAULT_TRACES = ("azure_conv_2023:0.9", "azure_code_2023:0.75", "multi_turn_chat:0.9",
                  "short_prompt_long_generation:0.9", "mixed_bursty:0.9")


def _trace_spec(text: str) -> tuple[str, float]:
    name, _, level = text.partition(":")
    try:
        attainment = float(level) if level else 0.9
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the attainment after ':' must be a number") from None
    if not 0.0 < attainment <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: the attainment must be in (0, 1]")
    return name, attainment


@functools.lru_cache(maxsize=None)  # once per worker process, not once per search
def load(name: str, max_requests: int, generated_requests: int) -> tuple:
    if name in WORKLOADS:
        return tuple(generate(name, generated_requests, 10.0, 0))
    return tuple(read_trace(resolve_trace(name))[:max_requests])


def one(job: tuple) -> tuple[tuple, dict, float]:
    name, attainment, topology, seed, policy, max_requests, generated_requests, steps = job
    t0 = time.process_time()
    trace = load(name, max_requests, generated_requests)
    cap = find_capacity(trace, load_profile("a40"), Topology.parse(topology), policy, attainment=attainment,
                        steps=steps, tight_share=0.5, seed=seed)
    return (name, topology, seed, policy), cap, time.process_time() - t0


def _cell(cap: dict) -> str:
    if cap["capacity_rps"] is None:
        return f"<{cap['bracket'][1]:.2f}"
    return f"{cap['capacity_rps']:.2f}" if cap["bracketed"] else f">={cap['capacity_rps']:.2f}"


def markdown(traces, topologies, seeds, policies, results) -> str:
    cols = [(t, s) for t in topologies for s in seeds]
    out = []
    for name, attainment in traces:
        out += [f"`{name}` at {attainment:.0%} attainment, req/s:", "",
                "| policy | " + " | ".join(f"{t} seed {s}" for t, s in cols) + " |",
                "| --- |" + " --- |" * len(cols)]
        for p in policies:
            label = f"{p} (bound)" if p == BOUND else (f"**{p}**" if p == OURS else p)
            out.append(f"| {label} | " + " | ".join(_cell(results[(name, t, s, p)]) for t, s in cols) + " |")
        if OURS in policies:
            ratios = []
            for t, s in cols:
                base = {p: results[(name, t, s, p)]["capacity_rps"] or 0.0 for p in policies if p in BASELINES}
                best = max(base.values(), default=0.0)
                ours = results[(name, t, s, OURS)]["capacity_rps"] or 0.0
                leaders = sorted(p for p, v in base.items() if v == best)
                ratios.append(f"{ours / best:.2f}× {'/'.join(leaders)}" if best > 0 else "n/a")
            out.append("| ratio to the best baseline | " + " | ".join(ratios) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=lambda s: [_trace_spec(x) for x in s.split(",") if x],
                    default=[_trace_spec(x) for x in DEFAULT_TRACES], help="comma-separated NAME[:ATTAINMENT]")
    ap.add_argument("--topologies", default="2P4D,4P3D")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--policies", default=",".join((*BASELINES, BOUND, OURS)))
    ap.add_argument("--max-requests", type=int, default=3000, help="first N requests of a real trace")
    ap.add_argument("--generated-requests", type=int, default=4000)
    ap.add_argument("--capacity-steps", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args(argv)
    topologies = [t for t in a.topologies.split(",") if t]
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s]
        for t in topologies:
            Topology.parse(t)
        for name, _ in a.traces:  # fail before hours of work, not after
            load(name, 2, 2)
    except (ValueError, UsageError) as e:
        print(f"capacity_tables: {e}", file=sys.stderr)
        return 2
    policies = [p for p in a.policies.split(",") if p]
    jobs = [(name, att, t, s, p, a.max_requests, a.generated_requests, a.capacity_steps)
            for name, att in a.traces for t in topologies for s in seeds for p in policies]
    results, cpu = {}, {}
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for done, (key, cap, cpu_s) in enumerate(pool.map(one, jobs), 1):
            results[key], cpu[key] = cap, cpu_s
            print(f"[{done}/{len(jobs)}] {' '.join(map(str, key))}: {_cell(cap)} req/s ({cpu_s:.0f} CPU-s)",
                  file=sys.stderr)
    table = markdown(a.traces, topologies, seeds, policies, results)
    print(table)
    print(f"{len(jobs)} capacity searches in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if a.markdown:
        with atomic_write(a.markdown) as f:
            f.write(table + "\n")
    if a.json:
        write_result(a.json, {
            "cost_model": "a40", "tight_share": 0.5, "capacity_steps": a.capacity_steps,
            "max_requests": a.max_requests, "generated_requests": a.generated_requests,
            "traces": [{"trace": n, "attainment": att} for n, att in a.traces],
            "results": [{"trace": k[0], "topology": k[1], "seed": k[2], "policy": k[3], **v, "cpu_s": cpu[k]}
                        for k, v in results.items()],
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
