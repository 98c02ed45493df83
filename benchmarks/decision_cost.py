"""Decision cost of each routing policy: µs per `choose` call, p50 and p99.

Usage: python benchmarks/decision_cost.py [--candidates 6 64] [--calls 20000] [--policies NAME ...]
                                          [--gc on|freeze|off] [--json OUT]

Candidates are split a third prefill, two thirds decode (6 → 2P4D, 64 → 21P43D), with random
backlog, queue and KV states (seeded). Each call is timed alone with perf_counter_ns; the figure
includes building nothing but the call itself, as the live router and the simulator make it.
`--router-views` times what the live router does per decision instead: the instance views built
from the ledger and a fresh engine report of every instance (as if each had pushed since the last
decision: the worst case), each with its exact prefix set (200 blocks, as KV events give), then the
call on a request with prefix hashes; it reports the views' and the call's share of the CPU.
`--gc freeze` moves everything alive after setup out of the collector's reach (`gc.freeze()`, as a
live router could after start-up); `--gc off` disables it: both tell how much of the tail is
collection pauses (measured: little; the tail is mostly the other processes on the cores).
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from disagg.bench.script import write_result
from disagg.core.cost_model import load_profile
from disagg.core.ledger import Ledger, PolledState
from disagg.core.policies import build_policy, known_policies
from disagg.core.prefix_index import PrefixIndex, prompt_block_hashes
from disagg.core.types import InstanceView, RequestFeatures, Role, SloClass
from disagg.stats import percentile


def make_pool(n: int, role: Role, rng: random.Random, cap: int) -> list[InstanceView]:
    views = []
    for i in range(n):
        backlog, queued, used = rng.uniform(0, 2), rng.randint(0, 40), rng.randint(0, cap)
        # half the prefill instances serve some requests whole (`slo_goodput`'s hosted decodes)
        hosted = rng.choice([0, rng.randint(0, queued)]) if role is Role.PREFILL else 0
        views.append(InstanceView(f"{role.value}-{i}", role, backlog, queued, used, cap, None, hosted))
    return views


def measure(policy_name: str, candidates: int, calls: int, seed: int = 0, gc_mode: str = "on") -> dict:
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
    if gc_mode == "freeze":
        gc.freeze()
    elif gc_mode == "off":
        gc.disable()
    try:
        for i in range(calls):
            p, d = states[i % 64]
            r = reqs[i % 256]
            t0 = clock()
            policy.choose(r, p, d, 0.0)
            ns.append(clock() - t0)
    finally:
        gc.enable()
        gc.unfreeze()
    ns = ns[calls // 10:]  # drop warm-up
    return {"policy": policy_name, "candidates": candidates, "gc": gc_mode, "p50_us": percentile(ns, 50) / 1e3,
            "p99_us": percentile(ns, 99) / 1e3}


def measure_router(policy_name: str, candidates: int, calls: int, seed: int = 0) -> dict:
    """Views and decision as the live router makes them (`--router-views`), timed in thread CPU."""
    cm = load_profile("a40")
    rng = random.Random(seed)
    n_p = max(1, candidates // 3)
    ids = [(f"prefill-{i}", Role.PREFILL) for i in range(n_p)] + [
        (f"decode-{i}", Role.DECODE) for i in range(candidates - n_p)]
    index = PrefixIndex(64)
    for iid, _ in ids:
        index.apply(iid, seq=1, since=0, added=frozenset(rng.getrandbits(60) for _ in range(200)),
                    removed=frozenset(), snapshot=True, now=0.0)
    ledger = Ledger()
    reqs = []
    for i in range(256):
        tokens = [rng.randrange(50_000) for _ in range(rng.randint(10, 4000))]
        reqs.append(RequestFeatures(f"r{i}", len(tokens), rng.randint(1, 600),
                                    SloClass.TIGHT if rng.random() < 0.5 else SloClass.LOOSE,
                                    prefix_hashes=prompt_block_hashes(tokens, 64), prefix_block_tokens=64))
    reports = [[PolledState(rng.randint(0, 60000), 60000, rng.randint(0, 40), 0, rng.uniform(0, 1), rng.randint(0, 8))
                for _ in ids] for _ in range(64)]
    policy = build_policy(policy_name, cm)
    clock = time.thread_time_ns
    views_ns, choose_ns = [], []
    for i in range(calls):
        polled = reports[i % 64]
        t0 = clock()
        views = [ledger.view(iid, role, polled[j], index.lookup(iid)) for j, (iid, role) in enumerate(ids)]
        t1 = clock()
        policy.choose(reqs[i % 256], views[:n_p], views[n_p:], 0.0)
        t2 = clock()
        views_ns.append(t1 - t0)
        choose_ns.append(t2 - t1)
    total = [a + b for a, b in zip(views_ns, choose_ns)][calls // 10:]
    return {"policy": policy_name, "candidates": candidates, "router_views": True,
            "p50_us": percentile(total, 50) / 1e3, "p99_us": percentile(total, 99) / 1e3,
            "views_p50_us": percentile(views_ns[calls // 10:], 50) / 1e3,
            "choose_p50_us": percentile(choose_ns[calls // 10:], 50) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", type=int, nargs="+", default=[6, 64])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--policies", nargs="+", choices=known_policies(), default=known_policies())
    ap.add_argument("--gc", choices=("on", "freeze", "off"), default="on",
                    help="the garbage collector while timing: as is, frozen after setup, or disabled")
    ap.add_argument("--router-views", action="store_true",
                    help="time the views and the decision as the live router makes them (thread CPU)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.router_views:
        rows = [measure_router(p, c, args.calls) for c in args.candidates for p in args.policies]
        print("| policy | candidates | p50 µs | p99 µs | views p50 µs | choose p50 µs |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['policy']} | {r['candidates']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | "
                  f"{r['views_p50_us']:.1f} | {r['choose_p50_us']:.1f} |")
    else:
        rows = [measure(p, c, args.calls, gc_mode=args.gc) for c in args.candidates for p in args.policies]
        print("| policy | candidates | p50 µs | p99 µs |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['policy']} | {r['candidates']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} |")
    if args.json:
        write_result(args.json, {"calls": args.calls, "gc": args.gc, "rows": rows})


if __name__ == "__main__":
    main()
