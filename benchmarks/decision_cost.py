"""Decision cost of each routing policy: µs per `choose` call, p50 and p99.

Usage: python benchmarks/decision_cost.py [--candidates 6 64] [--calls 20000] [--json OUT]

Candidates are split a third prefill, two thirds decode (6 → 2P4D, 64 → 21P43D), with random
backlog, queue and KV states (seeded). Each call is timed alone with perf_counter_ns; the figure
includes building nothing but the call itself, as the live router and the simulator make it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from disagg.core.cost_model import load_profile
from disagg.core.policies import build_policy, known_policies
from disagg.core.types import InstanceView, RequestFeatures, Role, SloClass


def make_pool(n: int, role: Role, rng: random.Random, cap: int) -> list[InstanceView]:
    return [InstanceView(f"{role.value}-{i}", role, rng.uniform(0, 2), rng.randint(0, 40), rng.randint(0, cap), cap)
            for i in range(n)]


def measure(policy_name: str, candidates: int, calls: int, seed: int = 0) -> dict:
    cm = load_profile("a40")
    rng = random.Random(seed)
    n_p = max(1, candidates // 3)
    n_d = candidates - n_p
    states = [(make_pool(n_p, Role.PREFILL, rng, 60000), make_pool(n_d, Role.DECODE, rng, 60000)) for _ in range(64)]
    reqs = [RequestFeatures(f"r{i}", rng.randint(10, 4000), rng.randint(1, 600),
                            SloClass.TIGHT if rng.random() < 0.5 else SloClass.LOOSE, rng.randint(1, 600))
            for i in range(256)]
    policy = build_policy(policy_name, cm)
    ns = []
    clock = time.perf_counter_ns
    for i in range(calls):
        p, d = states[i % 64]
        r = reqs[i % 256]
        t0 = clock()
        policy.choose(r, p, d, 0.0)
        ns.append(clock() - t0)
    ns = ns[calls // 10:]  # drop warm-up
    q = statistics.quantiles(ns, n=100)
    return {"policy": policy_name, "candidates": candidates, "p50_us": q[49] / 1e3, "p99_us": q[98] / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", type=int, nargs="+", default=[6, 64])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [measure(p, c, args.calls) for c in args.candidates for p in known_policies()]
    print("| policy | candidates | p50 µs | p99 µs |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['candidates']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
