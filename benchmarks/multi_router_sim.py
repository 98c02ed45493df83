"""Several router replicas in the simulator: goodput at K = 1, 2, 4 routers, relative to one router.

Usage (from the repository root):

    DISAGG_TRACE_DIR=<trace dir> python benchmarks/multi_router_sim.py \
        --requests 3000 --seeds 5 --ablations --json runs/multi_router_sim.json

For each trace — two generated workloads (disagg/sim/workloads.py) and, when they resolve, the
real Azure traces (`azure_conv_2023`, `azure_code_2023`, looked up like `disagg sim --trace` does:
a path, or a name in $DISAGG_TRACE_DIR) — the first `--requests` requests are run at the
saturation rate of `disagg sim --saturation` (round robin mid-collapse, one router, seed 0). Then,
per seed (the SLO-class draw, the predictor and the tie-break seed), policy (marginal_cost,
pair_cost) and tie tolerance (0 and `--tie-tolerance`), at K = 1, 2, 4 routers:
- `polls`: every 50 ms; each router sees its own admissions at once and the other routers' work
  as the engines' received-call ledgers report it at its latest poll;
- `polls+notices`: plus each router's notice to its peers of every call it sends, visible to them
  after `--notice-ms` (2 ms) until their next poll of that engine covers it;
- `push`: the live mechanism: every change of an engine's state reaches every router `--push-ms`
  (5 ms) after it happened.
Goodput is reported relative to K = 1 with the same policy, tolerance, seed and mechanism (polls
or push; median and range over seeds). `--ablations` adds the diagnostics behind docs/multi-router.md: marginal_cost at K = 4
without the engines' totals, with notices after 0 / 2 / 5 / 10 ms, with notices of prefill calls only,
with 10 / 25 ms polls, and with pushes after 0 / 2 / 5 / 10 / 20 ms (against K = 1 with 50 ms polls).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from disagg.bench.script import write_result
from disagg.core.cost_model import load_profile
from disagg.sim.runner import find_saturation, prepare_trace, simulate
from disagg.sim.simulator import Simulator, Topology
from disagg.sim.traces import read_trace
from disagg.sim.workloads import generate
from disagg.user_input import UsageError, resolve_trace

GENERATED = ("mixed_bursty", "short_chat")
REAL = ("azure_conv_2023", "azure_code_2023")
POLICIES = ("marginal_cost", "pair_cost")
ROUTERS = (1, 2, 4)


class _PrefillNoticesOnly(Simulator):
    """Ablation: routers notify each other of prefill calls only, not of decode calls."""

    def _notify_peers(self, k, iid, work_s, now):
        if iid in self.prefill_ids:
            super()._notify_peers(k, iid, work_s, now)


def load_traces(n: int) -> dict[str, list]:
    traces = {name: generate(name, n, 10.0, 0) for name in GENERATED}
    for name in REAL:
        try:
            traces[name] = read_trace(resolve_trace(name))[:n]
        except UsageError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
    return traces


def run_one(trace, cm, topo, policy, *, seed, tol, routers, notice_s=None, others_totals=True, poll_s=0.05,
            push_s=None, sim_class=None) -> float:
    params = {"tie_tolerance": tol, "seed": seed}
    if sim_class is None:
        summary, _ = simulate(trace, cm, topo, policy, policy_params=params, seed=seed, routers=routers,
                              peer_notify_s=notice_s, others_totals=others_totals, poll_interval_s=poll_s,
                              push_s=push_s)
        return summary["goodput"]
    from disagg.core.policies import build_policy
    from disagg.core.predictor import BucketMeanPredictor
    from disagg.sim.metrics import summarize
    from disagg.sim.runner import clamp_to_context

    sim = sim_class(cm, topo, build_policy(policy, cm, params), BucketMeanPredictor(), poll_interval_s=poll_s,
                    routers=routers, peer_notify_s=notice_s, record_decision_time=False)
    res = sim.run(clamp_to_context(trace, cm.engine.kv_capacity_tokens)[0])
    return summarize(res.records, res.instance_tokens)["goodput"]


def rel_stats(values: list[float], base: list[float]) -> dict:
    rel = [v / b - 1.0 for v, b in zip(values, base)]
    return {"median": statistics.median(rel), "min": min(rel), "max": max(rel),
            "goodput_mean": statistics.mean(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000, help="first N requests of each trace")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--topology", default="2P4D")
    ap.add_argument("--cost-model", default="a40")
    ap.add_argument("--tie-tolerance", type=float, default=0.05)
    ap.add_argument("--notice-ms", type=float, default=2.0, help="delay of the routers' notices to each other")
    ap.add_argument("--push-ms", type=float, default=5.0, help="delay of the engines' state pushes (the live "
                    "engines coalesce over 5 ms)")
    ap.add_argument("--ablations", action="store_true", help="also run the diagnostics (marginal_cost, K = 4)")
    ap.add_argument("--json", help="write every run and the summary here")
    args = ap.parse_args()

    cm, topo = load_profile(args.cost_model), Topology.parse(args.topology)
    seeds = list(range(args.seeds))
    tols = (0.0, args.tie_tolerance)
    notice_s, push_s = args.notice_ms / 1e3, args.push_ms / 1e3
    out: dict = {"config": {**vars(args), "routers": ROUTERS, "policies": POLICIES, "poll_interval_s": 0.05},
                 "traces": {}}
    t_start = time.perf_counter()
    for name, base_trace in load_traces(args.requests).items():
        t0 = time.perf_counter()
        sat = find_saturation(base_trace, cm, topo, tight_share=0.5, seed=0)
        rate = sat["rate"]
        prepared = {s: prepare_trace(base_trace, rate, 0.5, s) for s in seeds}
        runs: dict[str, list[float]] = {}
        for policy in POLICIES:
            for tol in tols:
                for k in ROUTERS:
                    for mech in (("polls", "push") if k == 1 else ("polls", "polls+notices", "push")):
                        key = f"{policy}|{tol}|{k}|{mech}"
                        runs[key] = [run_one(prepared[s], cm, topo, policy, seed=s, tol=tol, routers=k,
                                             notice_s=notice_s if mech == "polls+notices" else None,
                                             push_s=push_s if mech == "push" else None)
                                     for s in seeds]
        rows = []
        for key, vals in runs.items():
            policy, tol, k, mech = key.split("|")
            base = runs[f"{policy}|{tol}|1|{'push' if mech == 'push' else 'polls'}"]  # like against like
            rows.append({"policy": policy, "tie_tolerance": float(tol), "routers": int(k), "views": mech,
                         **rel_stats(vals, base)})
        for policy in POLICIES:  # what the tolerance itself costs or gains with one router
            vals, base = runs[f"{policy}|{tols[1]}|1|polls"], runs[f"{policy}|0.0|1|polls"]
            rows.append({"policy": policy, "tie_tolerance": tols[1], "routers": 1, "views": "vs tolerance 0",
                         **rel_stats(vals, base)})
        ablations = []
        if args.ablations:
            base = runs["marginal_cost|0.0|1|polls"]
            variants = [("no engine totals", dict(others_totals=False)),
                        *((f"notices {ms:g} ms", dict(notice_s=ms / 1e3)) for ms in (0, 2, 5, 10)),
                        ("prefill notices only, 2 ms", dict(notice_s=0.002, sim_class=_PrefillNoticesOnly)),
                        ("polls every 10 ms", dict(poll_s=0.01)), ("polls every 25 ms", dict(poll_s=0.025)),
                        *((f"pushes after {ms:g} ms", dict(push_s=ms / 1e3)) for ms in (0, 2, 5, 10, 20))]
            for label, kw in variants:
                vals = [run_one(prepared[s], cm, topo, "marginal_cost", seed=s, tol=0.0, routers=4, **kw)
                        for s in seeds]
                ablations.append({"variant": label, **rel_stats(vals, base)})
        out["traces"][name] = {"requests": len(base_trace), "saturation": sat, "rows": rows, "ablations": ablations,
                               "runs": runs, "wall_s": time.perf_counter() - t0}
        print(f"\n## {name}: {len(base_trace)} requests at {rate:.2f} req/s (saturation), "
              f"{time.perf_counter() - t0:.0f} s")
        print("| policy | tol | K | views | goodput (mean) | vs K=1: median | min | max |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['policy']} | {r['tie_tolerance']:g} | {r['routers']} | {r['views']} | "
                  f"{r['goodput_mean']:.4f} | {r['median']:+.2%} | {r['min']:+.2%} | {r['max']:+.2%} |")
        if ablations:
            print("\n| marginal_cost, K=4, tol 0 | goodput (mean) | vs K=1: median | min | max |")
            print("|---|---|---|---|---|")
            for r in ablations:
                print(f"| {r['variant']} | {r['goodput_mean']:.4f} | {r['median']:+.2%} | {r['min']:+.2%} | "
                      f"{r['max']:+.2%} |")
        sys.stdout.flush()
    out["wall_s"] = time.perf_counter() - t_start
    print(f"\ntotal {out['wall_s']:.0f} s", file=sys.stderr)
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
