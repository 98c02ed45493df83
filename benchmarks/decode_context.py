"""A decode step's time against the context its sequences attend to.

Usage (the app running on this machine, e.g. `make run`, and nothing else loading it):

    .venv/bin/python benchmarks/decode_context.py --url http://127.0.0.1:8000 \
        [--instance ID] [--batches 1 8 32] [--contexts 16 512 1536] [--rounds 3] --json out.json

Each round probes every (batch, context) once through `/admin/probe` on one decode instance (b
streams of `context`-token prompts decoding together: the median step while all run), in an order
rotated by one per round so that a slow spell of a shared host lands on different points. It fits
every probe by non-negative least squares on relative errors two ways: the decode step as the cost
model had it, `step_base_s + decode_seq_s·b`, whose probes all held 16 tokens of context, and with
the context term, `+ decode_context_s·b·context`; and prints each point's median with both fits'
errors. A gap between the two at long contexts is what the context term adds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

import numpy as np

from calibration.fit import nnls
from calibration.live import PROBE_TIMEOUT_S
from disagg.app_client import AsyncAppClient
from disagg.bench.script import write_result

TOKENS = 32  # per stream: the probe times the steps after every stream's first token


def fit(points: list[tuple[int, int, float]], with_context: bool) -> tuple[float, float, float]:
    """(step base, per sequence, per sequence per context token) over (batch, context, seconds)
    probes, least squares on relative errors."""
    rows = [(1.0, b, b * c if with_context else 0.0) for b, c, _ in points]
    y = np.array([s for _, _, s in points])
    a = np.array(rows) / y[:, None]
    base, seq, ctx = nnls(a, np.ones(len(points)))
    return float(base), float(seq), float(ctx)


async def run(url: str, instance: str | None, batches: list[int], contexts: list[int], rounds: int
              ) -> tuple[str, list[tuple[int, int, float]]]:
    async with AsyncAppClient(url, timeout_s=PROBE_TIMEOUT_S, max_connections=2) as app:
        state = await app.state()
        decode = sorted(i for i, v in state["instances"].items() if v["role"] == "decode")
        if instance is None:
            if not decode:
                sys.exit("the app has no decode instance")
            instance = decode[0]
        elif instance not in state["instances"]:
            sys.exit(f"--instance {instance!r} is not one of {sorted(state['instances'])}")
        grid = [(b, c) for b in batches for c in contexts]
        await app.probe({"instance": instance, "kind": "decode", "size": 1, "tokens": 8})  # wake-up, unmeasured
        out = []
        for r in range(rounds):
            for b, c in grid[r % len(grid):] + grid[:r % len(grid)]:
                reply = await app.probe({"instance": instance, "kind": "decode", "size": b, "tokens": TOKENS,
                                         "context": c, "seed": r})
                out.append((b, c, float(reply["seconds"])))
                print(f"round {r} batch {b:3d} context {c:5d}: {reply['seconds'] * 1e3:7.2f} ms", flush=True)
        return instance, out


def report(points: list[tuple[int, int, float]]) -> dict:
    plain, ctx = fit(points, False), fit(points, True)
    rows = []
    for b, c in sorted({(b, c) for b, c, _ in points}):
        measured = statistics.median(s for bb, cc, s in points if (bb, cc) == (b, c))
        p0 = plain[0] + plain[1] * b
        p1 = ctx[0] + ctx[1] * b + ctx[2] * b * c
        rows.append({"batch": b, "context": c, "measured_s": measured, "plain_s": p0, "context_s": p1,
                     "plain_err": p0 / measured - 1, "context_err": p1 / measured - 1})

    def errors(key: str) -> dict:
        e = sorted(abs(r[key]) for r in rows)
        return {"median": statistics.median(e), "max": e[-1]}

    return {"plain": {"step_base_s": plain[0], "decode_seq_s": plain[1], "error": errors("plain_err")},
            "context": {"step_base_s": ctx[0], "decode_seq_s": ctx[1], "decode_context_s": ctx[2],
                        "error": errors("context_err")},
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--instance", help="the decode instance to probe (default: the first)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 512, 1536])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write every probe and both fits here (atomically)")
    args = ap.parse_args(argv)
    instance, points = asyncio.run(run(args.url, args.instance, args.batches, args.contexts, args.rounds))
    r = report(points)
    print(f"\n{'batch':>5} {'context':>7} {'measured':>9} {'plain':>16} {'with context':>16}")
    for row in r["rows"]:
        print(f"{row['batch']:5d} {row['context']:7d} {row['measured_s'] * 1e3:7.2f}ms "
              f"{row['plain_s'] * 1e3:7.2f}ms {row['plain_err']:+6.0%} {row['context_s'] * 1e3:7.2f}ms "
              f"{row['context_err']:+6.0%}")
    p, c = r["plain"], r["context"]
    print(f"plain:        base {p['step_base_s'] * 1e6:.0f} µs, {p['decode_seq_s'] * 1e6:.1f} µs/sequence; "
          f"error median {p['error']['median']:.0%}, max {p['error']['max']:.0%}")
    print(f"with context: base {c['step_base_s'] * 1e6:.0f} µs, {c['decode_seq_s'] * 1e6:.1f} µs/sequence, "
          f"{c['decode_context_s'] * 1e9:.1f} ns/sequence/context token; error median {c['error']['median']:.0%}, "
          f"max {c['error']['max']:.0%}")
    if args.json:
        write_result(args.json, {"instance": instance, "probes": points, "rounds": args.rounds, **r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
