"""The simulator studies, one command each (`disagg study NAME`), printing a Markdown table.

- `width`: decode-pool width sweep (3 to 8 decode instances, prefill pool fixed) at a fixed rate;
- `noise`: output-length predictor error 0–150% (the paper's robustness claim);
- `miscalibration`: the router's τ_dec off by 7.4× (both directions) while the engines keep the
  true constants — the paper's "constants from the simulator" failure;
- `sizing`: the fewest decode instances each policy needs to reach a goodput target at a rate;
- `latency-routing`: a heterogeneous multi-model fleet routed by accuracy − λ·cost under per-query
  TTFT limits, against an accuracy/cost router and a load balancer (disagg.sim.latency_study).

All studies use the same trace slice, seed and SLO mix, so their rows compare within one run.
Unless `--rate` is given, the rate is the saturation rate of the base topology (see runner).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg.core.cost_model import CostModel, load_profile
from disagg.files import json_safe, write_json_atomic
from disagg.sim import latency_study
from disagg.sim.runner import compare, find_saturation
from disagg.sim.simulator import Topology
from disagg.sim.traces import read_trace
from disagg.user_input import UsageError, resolve_trace

STUDIES = ("width", "noise", "miscalibration", "sizing", "latency-routing")
BASELINES = ["round_robin", "least_loaded", "length_heuristic", "marginal_cost"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("name", choices=STUDIES)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--cost-model", default="a40")
    ap.add_argument("--topology", default="2P4D", help="base topology (width and sizing vary its decode pool)")
    ap.add_argument("--rate", type=float, help="mean arrival rate; default: saturation of the base topology")
    ap.add_argument("--max-requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tight-share", type=float, default=0.5)
    ap.add_argument("--goodput-target", type=float, default=0.9, help="sizing: goodput to reach")
    ap.add_argument("--json", help="also write the rows as JSON")
    latency_study.add_arguments(ap)


def scaled_decode(cm: CostModel, factor: float) -> CostModel:
    """The same cost model with τ_dec (step base and per-sequence decode cost) scaled."""
    eng = cm.engine.model_copy(update={
        "step_base_s": cm.engine.step_base_s * factor,
        "decode_seq_s": cm.engine.decode_seq_s * factor,
    })
    return cm.model_copy(update={"engine": eng, "name": f"{cm.name} (τ_dec ×{factor:g})", "instances": {}})


def main(args) -> int:
    if args.name == "latency-routing":
        return latency_study.main(args)
    cm = load_profile(args.cost_model)
    try:
        base = Topology.parse(args.topology)
    except ValueError as e:
        raise UsageError(str(e)) from None
    trace = read_trace(resolve_trace(args.trace))[: args.max_requests]
    rate = args.rate or find_saturation(trace, cm, base, tight_share=args.tight_share, seed=args.seed)["rate"]
    common = dict(tight_share=args.tight_share, seed=args.seed)
    rows: list[dict] = []

    if args.name == "width":
        for d in range(3, 9):
            topo = Topology(base.prefill, d)
            res = compare(trace, cm, topo, BASELINES, rate=rate, **common)
            rows.append({"topology": str(topo), **{p: res[p]["goodput"] for p in BASELINES}})
        cols = ["topology", *BASELINES]
    elif args.name == "noise":
        for err in (0.0, 0.25, 0.5, 1.0, 1.5):
            res = compare(trace, cm, base, ["marginal_cost"], rate=rate, predictor_error=err, **common)
            ref = compare(trace, cm, base, ["round_robin", "least_loaded"], rate=rate, **common)
            rows.append({"predictor_error": f"{err:.0%}", "marginal_cost": res["marginal_cost"]["goodput"],
                         "round_robin": ref["round_robin"]["goodput"], "least_loaded": ref["least_loaded"]["goodput"]})
        cols = ["predictor_error", "marginal_cost", "round_robin", "least_loaded"]
    elif args.name == "miscalibration":
        for label, factor in (("calibrated", 1.0), ("τ_dec ÷7.4", 1 / 7.4), ("τ_dec ×7.4", 7.4)):
            router_cm = cm if factor == 1.0 else scaled_decode(cm, factor)
            res = compare(trace, cm, base, ["marginal_cost"], rate=rate, router_cost_model=router_cm, **common)
            s = res["marginal_cost"]
            rows.append({"router constants": label, "goodput": s["goodput"], "ttft_p99_s": s["ttft_p99_s"],
                         "tpot_p99_s": s["tpot_p99_s"]})
        cols = ["router constants", "goodput", "ttft_p99_s", "tpot_p99_s"]
    else:  # sizing
        need: dict[str, int | None] = {}
        for p in BASELINES:
            need[p] = None
            for d in range(1, 17):
                res = compare(trace, cm, Topology(base.prefill, d), [p], rate=rate, **common)
                if res[p]["goodput"] >= args.goodput_target:
                    need[p] = d
                    break
            rows.append({"policy": p, "decode instances needed": need[p],
                         "total instances": None if need[p] is None else need[p] + base.prefill})
        cols = ["policy", "decode instances needed", "total instances"]

    print(f"study={args.name} trace={args.trace} requests={len(trace)} rate={rate:.2f} req/s "
          f"base={base} cost_model={cm.name} seed={args.seed}")
    print(markdown(rows, cols))
    if args.json:
        write_json_atomic(Path(args.json), json_safe({"study": args.name, "rate": rate, "rows": rows}))
    return 0


def markdown(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        if v is None:
            return "—"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
