"""Live calibration of the running fleet, repeated: wall time, held-out error, and how well other
constants predict the same engines.

Usage (the app running, e.g. `make run`):

    .venv/bin/python benchmarks/calibrate_live.py --url http://127.0.0.1:8000 --runs 3 \
        [--quick] [--compare runs/cpu-calibrated.yaml] --json runs/calibrate-live.json

Each run is what `disagg calibrate --live` does (`calibration.live.calibrate_fleet`, then
`calibration.fit.fit_fleet`), without writing or applying a cost model. Per run it reports the
seconds of probing, and the held-out relative error (median and p90 over every held-out point of
every instance) of two pricings of the same samples: `priced`, the constants `fit_fleet` gives
each instance (the fit shared by the instances of typical speed), and `own`, each instance's
own fit alone (what `fit_fleet` gave before instances shared a fit). With `--compare FILE` (a
cost model, e.g. from `disagg calibrate --config`, measured on engines started apart from the
app), the same held-out samples are also predicted by that file's constants, so the two kinds of
calibration are judged on one set of measurements. Prints medians and ranges over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from calibration.fit import fit_fleet, held_out_error
from calibration.live import calibrate_fleet
from disagg.bench.script import write_result
from disagg.core.cost_model import CostModel
from disagg.stats import percentile


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}, {max(xs):.3g}]"


def one_run(url: str, quick: bool, pause_s: float, seed: int, compare: CostModel | None) -> dict:
    t0 = time.monotonic()
    fleet, samples, probing_s = asyncio.run(calibrate_fleet(url, None, quick, pause_s, 600.0, seed))
    cm, fits = fit_fleet(samples, fleet.cost_model, "bench", fleet.source, 0.0, "bench")
    out = {"probing_s": probing_s, "wall_s": time.monotonic() - t0, "instances": {}}
    for iid, f in fits.items():
        s, own = samples[iid], f.own
        row = {"role": fleet.instances[iid], "speed": f.speed, "shared": f.shared, "priced": f.held_out,
               "own": held_out_error(own, s.held_out_prefill, s.held_out_decode),
               # what each pricing says of the longest prompt probed and of the biggest decode batch
               "predicted_s": {k: {"prefill": e_.prefill_s(int(max(x.x for x in s.prefill))),
                                   "decode": e_.decode_token_s(int(max(x.x for x in s.decode)))}
                               for k, e_ in (("priced", f.engine), ("own", own))},
               "tau_pre_s": own.prefill_token_s, "step_base_s": own.step_base_s, "decode_seq_s": own.decode_seq_s}
        if compare is not None:
            row["compare"] = held_out_error(compare.engine, s.held_out_prefill, s.held_out_decode)
        out["instances"][iid] = row
    for kind in ("priced", "own", *(("compare",) if compare is not None else ())):
        rel = [x for r in out["instances"].values() for x in r[kind]["rel_errors"]]
        out[kind] = {"median_rel_error": statistics.median(rel), "p90_rel_error": percentile(rel, 90), "n": len(rel)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pause-s", type=float, default=0.02)
    ap.add_argument("--compare", help="a cost-model YAML whose constants also predict the held-out samples")
    ap.add_argument("--json", help="write every run here (atomically)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    compare = CostModel.load(args.compare) if args.compare else None
    runs = []
    for k in range(args.runs):
        runs.append(one_run(args.url.rstrip("/"), args.quick, args.pause_s, seed=k, compare=compare))
        r = runs[-1]
        print(f"run {k + 1}: {r['probing_s']:.1f} s probing, held-out error over {r['priced']['n']} points: "
              f"priced median {r['priced']['median_rel_error']:.1%} p90 {r['priced']['p90_rel_error']:.1%}; "
              f"own fits median {r['own']['median_rel_error']:.1%} p90 {r['own']['p90_rel_error']:.1%}",
              file=sys.stderr)
    print(f"probing seconds: {spread([r['probing_s'] for r in runs])}")
    kinds = ["priced", "own"] + (["compare"] if compare else [])
    for k in kinds:
        print(f"held-out error, {k}: median {spread([r[k]['median_rel_error'] * 100 for r in runs])} %, "
              f"p90 {spread([r[k]['p90_rel_error'] * 100 for r in runs])} %")
    for k in ("priced", "own"):  # identical engines of one host should be priced alike, run after run
        for what in ("prefill", "decode"):
            xs = [c["predicted_s"][k][what] * 1e3 for r in runs for c in r["instances"].values()]
            print(f"{k}: predicted {what} (longest prompt / biggest batch probed) over every instance and run: "
                  f"{spread(xs)} ms, max/min {max(xs) / min(xs):.2f}")
    for iid in runs[0]["instances"]:
        cells = [r["instances"][iid] for r in runs if iid in r["instances"]]
        errs = "; ".join(f"{k} {spread([c[k]['median_rel_error'] * 100 for c in cells])} %" for k in kinds)
        print(f"{iid} ({cells[0]['role']}): speed {spread([c['speed'] for c in cells])}, shared fit in "
              f"{sum(c['shared'] for c in cells)} of {len(cells)} runs; own τ_pre "
              f"{spread([c['tau_pre_s'] * 1e6 for c in cells])} µs/token, own step base "
              f"{spread([c['step_base_s'] * 1e3 for c in cells])} ms; held-out median error: {errs}")
    if args.json:
        write_result(args.json, {"runs": runs, "quick": args.quick, "pause_s": args.pause_s, "compare": args.compare})
    return 0


if __name__ == "__main__":
    sys.exit(main())
