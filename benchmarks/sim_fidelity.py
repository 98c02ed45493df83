"""The simulator against the live app, request for request: TTFT and TPOT p50/p90 and attainment,
per policy, trace and rate, for one or more cost models (`disagg validate` does it for the router's
own constants, with repeats; this compares several cost models on runs already made).

Usage (after `disagg bench` runs: one with `--url` for the live records, and one simulator run per
cost model on the same slices, same `--rate`, `--max-requests`, `--seed` and topology):

    .venv/bin/python benchmarks/sim_fidelity.py --live runs/val-live \
        --sim shared=runs/val-sim-shared --sim alone=runs/val-sim-alone --json runs/sim_fidelity.json

A folder may hold both systems (`disagg bench --url ... --sim`): its `live` records are read from
`--live` and its `sim` records from `--sim`. Each cell prints the live value, each simulator's value and
its signed relative error ((sim − live) / live); attainment is the share of requests meeting both
SLO targets, its error a difference. `--within` (default 0.15) marks the cells inside that error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from disagg.bench.script import write_result
from disagg.bench.validate import LATENCY as METRICS
from disagg.bench.validate import figures


def cells(folder: Path, system: str) -> dict[tuple, dict]:
    """(policy, trace, rate) → the figures of `system`'s records in a bench folder's requests.jsonl."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for line in (folder / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("system") == system:
            groups[(r["policy"], r["trace"], r.get("rate"))].append(r)
    return {key: figures(recs) for key, recs in groups.items()}


def compare(live: dict[tuple, dict], sims: dict[str, dict[tuple, dict]], within: float) -> list[dict]:
    rows = []
    for key, lv in sorted(live.items(), key=lambda kv: (kv[0][2] or 0, kv[0][1], kv[0][0])):
        row = {"policy": key[0], "trace": key[1], "rate": key[2], "live": lv}
        for name, cellset in sims.items():
            sv = cellset.get(key)
            if sv is None:
                continue
            err = {m: (sv[m] - lv[m]) / lv[m] if sv[m] is not None and lv[m] else None for m, _, _ in METRICS}
            err["attainment"] = sv["attainment"] - lv["attainment"]
            ok = [abs(e) <= within for m, e in err.items() if m != "attainment" and e is not None]
            row[name] = {"sim": sv, "error": err, "within": sum(ok), "of": len(ok),
                         "attainment_within_0.05": abs(err["attainment"]) <= 0.05}
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--live", type=Path, required=True, help="a bench folder with live records")
    ap.add_argument("--sim", action="append", required=True, metavar="NAME=FOLDER",
                    help="a bench folder with the simulator's records, named (repeatable)")
    ap.add_argument("--within", type=float, default=0.15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sims = {}
    for spec in args.sim:
        name, sep, folder = spec.partition("=")
        if not sep:
            ap.error(f"--sim {spec!r}: NAME=FOLDER")
        sims[name] = cells(Path(folder), "sim")
    live = cells(args.live, "live")
    if not live:
        ap.error(f"{args.live}/requests.jsonl has no live records")
    rows = compare(live, sims, args.within)
    pct = lambda e: "—" if e is None else f"{e:+.0%}"  # noqa: E731
    ms = lambda v: "—" if v is None else f"{v * 1e3:.0f}"  # noqa: E731
    print("| rate | trace | policy | model | TTFT p50 ms | TTFT p90 | TPOT p50 ms | TPOT p90 | attainment |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        lv = row["live"]
        print(f"| {row['rate']:g} | {row['trace']} | {row['policy']} | live | {ms(lv['ttft_p50_s'])} | "
              f"{ms(lv['ttft_p90_s'])} | {lv['tpot_p50_s'] * 1e3:.1f} | {lv['tpot_p90_s'] * 1e3:.1f} | "
              f"{lv['attainment']:.3f} |")
        for name in sims:
            if name not in row:
                continue
            sv, e = row[name]["sim"], row[name]["error"]
            print(f"| | | | {name} | {ms(sv['ttft_p50_s'])} ({pct(e['ttft_p50_s'])}) | {ms(sv['ttft_p90_s'])} "
                  f"({pct(e['ttft_p90_s'])}) | {sv['tpot_p50_s'] * 1e3:.1f} ({pct(e['tpot_p50_s'])}) | "
                  f"{sv['tpot_p90_s'] * 1e3:.1f} ({pct(e['tpot_p90_s'])}) | {sv['attainment']:.3f} "
                  f"({e['attainment']:+.3f}) |")
    for name in sims:
        got = [row[name] for row in rows if name in row]
        inside = sum(g["within"] for g in got)
        total = sum(g["of"] for g in got)
        att = sum(g["attainment_within_0.05"] for g in got)
        print(f"{name}: {inside} of {total} latency cells within {args.within:.0%}; attainment within 0.05 "
              f"in {att} of {len(got)}")
    if args.json:
        write_result(args.json, {"within": args.within, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
