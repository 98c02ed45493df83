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
calibration are judged on one set of measurements. With two runs or more, `stability` judges
every run's fit by the typical time of each point over all runs (see `stability`). Prints medians
and ranges over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from calibration.fit import fit_fleet, held_out_error
from calibration.live import LivePlan, calibrate_fleet
from disagg.bench.script import write_result
from disagg.core.cost_model import CostModel, EngineConstants
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
               "tau_pre_s": own.prefill_token_s, "step_base_s": own.step_base_s, "decode_seq_s": own.decode_seq_s,
               "priced_engine": f.engine.model_dump(mode="json"),
               # the measurements themselves: `stability` judges every run's fit by every run's probes
               "samples": {k: [[x.x, x.seconds] for x in getattr(s, k)]
                           for k in ("prefill", "decode", "held_out_prefill", "held_out_decode")}}
        if compare is not None:
            row["compare"] = held_out_error(compare.engine, s.held_out_prefill, s.held_out_decode)
        out["instances"][iid] = row
    for kind in ("priced", "own", *(("compare",) if compare is not None else ())):
        rel = [x for r in out["instances"].values() for x in r[kind]["rel_errors"]]
        out[kind] = {"median_rel_error": statistics.median(rel), "p90_rel_error": percentile(rel, 90), "n": len(rel)}
    return out


def stability(runs: list[dict]) -> dict:
    """How far each run's fit lies from what every run measured: per probed point (prefill length,
    decode concurrency, fitted and held-out alike), the median of all runs' samples of every
    instance (alike instances, one host) is the point's typical time; each run's priced constants
    of each instance are judged against it. A fit that holds still from one run to the next has a
    small error here and a max/min near 1, whatever the noise of any single run's held-out points."""
    seen: dict[tuple[str, float], list[float]] = {}
    for r in runs:
        for c in r["instances"].values():
            for kind, xs in c["samples"].items():
                for x, seconds in xs:
                    seen.setdefault((kind.removeprefix("held_out_"), x), []).append(seconds)
    typical = {k: statistics.median(v) for k, v in seen.items()}
    errors: list[float] = []
    predicted: dict[tuple[str, float], list[float]] = {k: [] for k in typical}
    for r in runs:
        for c in r["instances"].values():
            e = EngineConstants.model_validate(c["priced_engine"])
            for (kind, x), t in typical.items():
                p = e.prefill_s(int(x)) if kind == "prefill" else e.decode_token_s(int(x))
                errors.append(abs(p / t - 1.0))
                predicted[(kind, x)].append(p)
    span = {kind: statistics.median(max(v) / min(v) for (k, _), v in predicted.items() if k == kind)
            for kind in ("prefill", "decode")}
    # what even constants that knew each point's typical time would miss one probe by: the host's
    # own repeatability, a floor under any estimator's per-request error on it
    floor = {kind: statistics.mean(abs(x / typical[(k, n)] - 1.0) for (k, n), xs in seen.items() if k == kind
                                   for x in xs) for kind in ("prefill", "decode")}
    return {"median_rel_error": statistics.median(errors), "p90_rel_error": percentile(errors, 90),
            "max_over_min": span, "repeatability_mape": floor, "points": len(typical)}


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
    if len(runs) > 1:
        steady = stability(runs)
        print(f"stability: each run's fit against the median of every run's probes ({steady['points']} points): "
              f"median {steady['median_rel_error']:.1%}, p90 {steady['p90_rel_error']:.1%}; "
              f"predictions' max/min over runs (median over points): prefill {steady['max_over_min']['prefill']:.2f}, "
              f"decode {steady['max_over_min']['decode']:.2f}")
        print(f"repeatability: one probe's error against its point's typical time (mean): prefill (a median of "
              f"{LivePlan.for_context(2048, 64, True).prefill_repeats} back to back) "
              f"{steady['repeatability_mape']['prefill']:.1%}, decode {steady['repeatability_mape']['decode']:.1%}")
    for iid in runs[0]["instances"]:
        cells = [r["instances"][iid] for r in runs if iid in r["instances"]]
        errs = "; ".join(f"{k} {spread([c[k]['median_rel_error'] * 100 for c in cells])} %" for k in kinds)
        print(f"{iid} ({cells[0]['role']}): speed {spread([c['speed'] for c in cells])}, shared fit in "
              f"{sum(c['shared'] for c in cells)} of {len(cells)} runs; own τ_pre "
              f"{spread([c['tau_pre_s'] * 1e6 for c in cells])} µs/token, own step base "
              f"{spread([c['step_base_s'] * 1e3 for c in cells])} ms; held-out median error: {errs}")
    if args.json:
        write_result(args.json, {"runs": runs, "quick": args.quick, "pause_s": args.pause_s, "compare": args.compare,
                                 "stability": stability(runs) if len(runs) > 1 else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
