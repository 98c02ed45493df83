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
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from disagg.bench.harness import BenchConfig, run_bench
from disagg.bench.script import write_result
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--trace", action="append", required=True)
    ap.add_argument("--policies", required=True, help="comma-separated; the first is the paired baseline")
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--max-requests", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cost-model", help="SLO targets (default: the constants the router prices with, checked "
                                         "against its engines by the bench)")
    ap.add_argument("--tight-share", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--realtime", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if args.repeats < 1 or len(policies) < 2:
        ap.error("need --repeats >= 1 and at least two policies")
    out = Path(args.out)
    per_repeat = []
    for r in range(args.repeats):
        order = rotated(policies, r)
        print(f"[repeats] repeat {r + 1}/{args.repeats}: {', '.join(order)}", file=sys.stderr, flush=True)
        cfg = BenchConfig(out=out / f"repeat{r}", traces=tuple(str(resolve_trace(t)) for t in args.trace), policies=tuple(order), url=args.url,
                          rate=args.rate, max_requests=args.max_requests, tight_share=args.tight_share,
                          seed=args.seed, cost_model=args.cost_model, gates=r == 0, realtime=args.realtime)
        per_repeat.append(run_bench(cfg))
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
