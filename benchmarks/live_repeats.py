"""Policies on the live app, repeated and interleaved: medians, spread and paired differences.

Usage (the app running, e.g. `serve run deployments/local-2p2d.yaml`; nothing else on the machine):

    .venv/bin/python benchmarks/live_repeats.py --url http://127.0.0.1:8000 --trace runs/multi_turn.csv \
        --policies marginal_cost,prefix_affinity,slo_goodput --rate 3 --max-requests 150 \
        --repeats 3 --cost-model runs/cpu-calibrated.yaml --out runs/repeats

Each repeat is one `disagg bench` run over every policy (same trace slice, same prompts), with the
policy order rotated from one repeat to the next, so a slow spell of the machine does not land on
one policy. Between policies the bench resets every prefix cache (engines and the router's index).
The correctness gates run in the first repeat only.

Prints, and writes to `--out`/summary.json, per trace and policy: the goodput of every repeat, its
median and range; the P50 TTFT median; and per repeat the paired difference to the first policy
(the baseline), with its median. Two shared cores are noisy: a difference whose paired values
straddle zero is not an effect.

SLO capacity with repeats (`--capacity`; DistServe's measure, taken live):

    .venv/bin/python benchmarks/live_repeats.py --url http://127.0.0.1:8000 --capacity \
        --trace azure_conv_2023:0.75 --trace runs/multi_turn_chat.csv:0.75 \
        --policies round_robin,colocated,slo_goodput --ours slo_goodput --rate 3 --max-requests 200 \
        --capacity-steps 2 --probe-requests 120 --probe-seconds 20 --repeats 3 --realtime --sim \
        --out runs/capacity-live-3

(120-request probes: at 60, a probe at a high rate is a burst two shared cores drain, not a load;
docs/results.md, "Live SLO capacity, priced for the shared host".)

Each repeat searches every policy's capacity on each trace (`disagg bench --capacity`: the highest
rate at which the trace's ATTAINMENT share of requests, 0.9 unless given after a ':', meet both SLO
targets; `--rate` is where each search starts), the policy order rotated as above. The summary
gives each policy's capacity per repeat, median and range, and the ratio of our best policy
(`--ours`, by median) to the best of the others, per repeat and of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from disagg.bench.harness import BenchConfig, run_bench
from disagg.bench.refit import app_refit, before_run
from disagg.bench.script import write_result
from disagg.sim.runner import attainment_crossing
from disagg.user_input import resolve_trace


def rotated(items: list[str], k: int) -> list[str]:
    k %= len(items)
    return items[k:] + items[:k]


def summary(per_repeat: list[dict], policies: list[str]) -> dict:
    """{trace: {policy: {...}}} from each repeat's results (`run_bench`'s return value)."""
    out: dict[str, dict] = {}
    base = policies[0]
    for results in per_repeat:
        for run in results["runs"]:
            if run["system"] != "live":
                continue
            cell = out.setdefault(run["trace"], {}).setdefault(run["policy"], {"goodput": [], "ttft_p50_s": []})
            cell["goodput"].append(run["goodput"])
            cell["ttft_p50_s"].append(run["ttft_p50_s"])
    for trace, cells in out.items():
        for policy, c in cells.items():
            g = c["goodput"]
            c["goodput_median"] = statistics.median(g)
            c["goodput_range"] = [min(g), max(g)]
            c["ttft_p50_median_s"] = statistics.median(c["ttft_p50_s"])
            if policy != base and base in cells and len(cells[base]["goodput"]) == len(g):
                diffs = [a - b for a, b in zip(g, cells[base]["goodput"])]
                c["paired_diff_vs_" + base] = diffs
                c["paired_diff_median"] = statistics.median(diffs)
    return out


def trace_spec(text: str) -> tuple[str, float]:
    """`NAME[:ATTAINMENT]` → (name, attainment), 0.9 by default."""
    name, colon, level = text.rpartition(":")
    if not colon:
        return text, 0.9
    try:
        attainment = float(level)
    except ValueError:
        return text, 0.9  # a ':' that is part of the name
    if not 0.0 < attainment <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: the attainment after ':' must be in (0, 1]")
    return name, attainment


def capacity_summary(per_repeat: list[dict[str, dict]], policies: list[str], ours: list[str],
                     attainment: dict[str, float]) -> dict:
    """{trace: {policies: {...}, ratio: {...}, crossing_ratio: {...}}} from each repeat's {trace:
    capacity results} (`resolved["capacity"][trace]` of `run_bench`); `ours` are policy names, a
    spec with parameters (`slo_goodput:allow_hosted=false`) counts under its name; `attainment`
    is each trace's target share. Two readings of every search: `capacity_rps`, the highest probed
    rate that passed (on the search's grid), and `crossing_rps`, where the attainment crosses the
    target between the final bracket's probes (`attainment_crossing`, read from the stored probes,
    so older runs get it too). A search that never passed counts as 0 req/s in both."""
    out: dict[str, dict] = {}
    for repeat in per_repeat:
        for trace, found in repeat.items():
            cells = out.setdefault(trace, {"policies": {}})["policies"]
            for policy in policies:
                f = found.get(policy) or {}
                c = cells.setdefault(policy, {"capacity_rps": [], "crossing_rps": [], "bracketed": []})
                c["capacity_rps"].append(f.get("capacity_rps") or 0.0)
                crossing = (attainment_crossing(f["probes"], f["bracket"], attainment[trace])
                            if f.get("probes") else None)
                c["crossing_rps"].append(crossing or f.get("capacity_rps") or 0.0)
                c["bracketed"].append(bool(f.get("bracketed")))
    for trace, t in out.items():
        cells = t["policies"]
        for c in cells.values():
            c["median_rps"] = statistics.median(c["capacity_rps"])
            c["crossing_median_rps"] = statistics.median(c["crossing_rps"])
            c["range_rps"] = [min(c["capacity_rps"]), max(c["capacity_rps"])]
        mine = [p for p in policies if p.partition(":")[0] in ours]  # a name, with or without parameters
        others = [p for p in policies if p not in mine]
        if not mine or not others:
            continue
        t["ratio"] = _ratio(cells, mine, others, "capacity_rps", "median_rps", len(per_repeat))
        t["crossing_ratio"] = _ratio(cells, mine, others, "crossing_rps", "crossing_median_rps", len(per_repeat))
    return out


def _ratio(cells: dict, mine: list[str], others: list[str], key: str, median: str, repeats: int) -> dict:
    """Our best policy against the best other, by one reading: of the medians and per repeat."""
    best = max(mine, key=lambda p: cells[p][median])
    rival = max(others, key=lambda p: cells[p][median])
    per = [(max(cells[p][key][r] for p in mine), max(cells[p][key][r] for p in others)) for r in range(repeats)]
    return {"ours": best, "best_other": rival,
            "of_medians": cells[best][median] / cells[rival][median] if cells[rival][median] > 0 else None,
            "per_repeat": [a / b if b > 0 else None for a, b in per]}


def _print_capacity(result: dict, policies: list[str]) -> None:
    for trace, t in result.items():
        print(f"\n{trace}: SLO capacity, req/s")
        for p in policies:
            c = t["policies"][p]
            unbracketed = sum(not b for b in c["bracketed"])
            note = f"  ({unbracketed} not bracketed)" if unbracketed else ""
            print(f"  {p:24s} {' '.join(f'{x:.3f}' for x in c['capacity_rps'])}  median {c['median_rps']:.3f}{note}; "
                  f"crossing {' '.join(f'{x:.3f}' for x in c['crossing_rps'])}  median {c['crossing_median_rps']:.3f}")

        def fmt(x):
            return "n/a" if x is None else f"{x:.2f}x"
        for reading, key in (("grid", "ratio"), ("crossing", "crossing_ratio")):
            if r := t.get(key):
                print(f"  {reading}: {r['ours']} / {r['best_other']}: {fmt(r['of_medians'])} of medians; per repeat "
                      + " ".join(fmt(x) for x in r["per_repeat"]))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench(cfg: BenchConfig, refit) -> dict:
    """The results of `cfg`'s run. With `refit`: a finished run is kept as it is, else the app's
    constants are fitted again just before it (`before_run`), so it is judged against constants
    minutes old, not the app's start-up fit's."""
    done = before_run(cfg.out, refit, log) if refit is not None else None
    return done or run_bench(cfg)


def run_capacity(args, policies: list[str], out: Path) -> int:
    traces = [trace_spec(t) for t in args.trace]
    ours = [p for p in args.ours.split(",") if p]
    per_repeat = []
    refit = app_refit(args.url, Path(args.refit), log) if args.refit else None
    simulated: dict[str, dict] = {}  # trace → policy → the simulator's capacity with the same constants
    targets: dict[str, float] = {}  # trace (as the bench names it) → its attainment target
    for r in range(args.repeats):
        order = rotated(policies, r)
        print(f"[repeats] capacity, repeat {r + 1}/{args.repeats}: {', '.join(order)}", file=sys.stderr, flush=True)
        found: dict[str, dict] = {}
        for i, (name, attainment) in enumerate(traces):
            cfg = BenchConfig(out=out / f"repeat{r}" / f"trace{i}", traces=(str(resolve_trace(name)),),
                              policies=tuple(order), url=args.url, rate=args.rate, max_requests=args.max_requests,
                              tight_share=args.tight_share, seed=args.seed, cost_model=args.cost_model,
                              gates=r == 0 and i == 0, realtime=args.realtime, capacity=attainment,
                              capacity_steps=args.capacity_steps, probe_requests=args.probe_requests,
                              probe_seconds=args.probe_seconds, sim=args.sim and r == 0,
                              # fitted just now on these engines, with more probes than the check's lone
                              # ones (which swing more than the drift they catch): its verdict is kept
                              # in results.json as a warning, not a stop
                              accept_foreign_constants=refit is not None, slo_scale=args.slo_scale)
            resolved = bench(cfg, refit)["resolved"]
            found.update(resolved["capacity"])
            targets.update(dict.fromkeys(resolved["capacity"], attainment))
            for trace, caps in (resolved.get("capacity_sim") or {}).items():
                simulated[trace] = {p: c.get("capacity_rps") for p, c in caps.items()}
        per_repeat.append(found)
    result = {"settings": vars(args), "traces": capacity_summary(per_repeat, policies, ours, targets),
              "simulated": simulated}
    write_result(out / "summary.json", result)
    _print_capacity(result["traces"], policies)
    for trace, caps in simulated.items():
        print(f"\n{trace}, simulated: " + ", ".join(f"{p} {c or 0:.3f}" for p, c in caps.items()))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--trace", action="append", required=True)
    ap.add_argument("--policies", required=True, help="comma-separated; the first is the paired baseline")
    ap.add_argument("--rate", type=float, required=True, help="the runs' rate; with --capacity, the searches' start")
    ap.add_argument("--max-requests", type=int, default=150)
    ap.add_argument("--capacity", action="store_true",
                    help="search each policy's SLO capacity instead (a trace may be NAME:ATTAINMENT, 0.9 by default)")
    ap.add_argument("--capacity-steps", type=int, default=2, help="with --capacity: bisection steps")
    ap.add_argument("--probe-requests", type=int, default=30, help="with --capacity: fewest requests per probe")
    ap.add_argument("--probe-seconds", type=float, default=20.0, help="with --capacity: seconds of load per probe")
    ap.add_argument("--sim", action="store_true",
                    help="with --capacity: the same searches in the simulator, with the same constants (first repeat)")
    ap.add_argument("--ours", default="slo_goodput",
                    help="with --capacity: our policies (comma-separated); the rest are the baselines")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cost-model", help="SLO targets (default: the constants the router prices with, checked "
                                         "against its engines by the bench)")
    ap.add_argument("--refit", metavar="DIR",
                    help="fit the router's constants on the live engines again before each repeat (with "
                         "--capacity: each trace's searches), into DIR (the router's cost_model_dir): every repeat "
                         "judged against constants minutes old, as a shared host drifts over an hour "
                         "(disagg.bench.refit)")
    ap.add_argument("--slo-scale", type=float, metavar="X",
                    help="judge (and route) each request by X times its own unloaded TTFT and TPOT (disagg bench)")
    ap.add_argument("--tight-share", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--realtime", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if args.repeats < 1 or len(policies) < 2:
        ap.error("need --repeats >= 1 and at least two policies")
    if args.refit and args.cost_model:
        ap.error("--refit re-fits the router's own constants: drop --cost-model")
    out = Path(args.out)
    if args.capacity:
        return run_capacity(args, policies, out)
    per_repeat = []
    refit = app_refit(args.url, Path(args.refit), log) if args.refit else None
    for r in range(args.repeats):
        order = rotated(policies, r)
        print(f"[repeats] repeat {r + 1}/{args.repeats}: {', '.join(order)}", file=sys.stderr, flush=True)
        cfg = BenchConfig(out=out / f"repeat{r}", traces=tuple(str(resolve_trace(t)) for t in args.trace),
                          policies=tuple(order), url=args.url,
                          rate=args.rate, max_requests=args.max_requests, tight_share=args.tight_share,
                          seed=args.seed, cost_model=args.cost_model, gates=r == 0, realtime=args.realtime,
                          slo_scale=args.slo_scale, accept_foreign_constants=refit is not None)
        per_repeat.append(bench(cfg, refit))
    result = {"settings": vars(args), "traces": summary(per_repeat, policies)}
    write_result(out / "summary.json", result)
    for trace, cells in result["traces"].items():
        print(f"\n{trace}")
        for p in policies:
            c = cells.get(p)
            if c is None:
                continue
            diff = (f"  paired vs {policies[0]}: {' '.join(f'{d:+.3f}' for d in c['paired_diff_vs_' + policies[0]])}"
                    f" (median {c['paired_diff_median']:+.3f})" if "paired_diff_median" in c else "")
            print(f"  {p:16s} goodput {' '.join(f'{g:.3f}' for g in c['goodput'])}  median {c['goodput_median']:.3f}"
                  f"  TTFT p50 {c['ttft_p50_median_s']:.2f} s{diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
