"""The simulator studies, one command each (`disagg study NAME`), printing a Markdown table.

- `width`: decode-pool width sweep (3 to 8 decode instances, prefill pool fixed) at a fixed rate;
- `noise`: output-length predictor error 0–150% (the paper's robustness claim);
- `miscalibration`: the router's τ_dec off by 7.4× (both directions) while the engines keep the
  true constants — the paper's "constants from the simulator" failure;
- `sizing`: the fewest decode instances each policy needs to reach a goodput target at a rate;
- `latency-routing`: a heterogeneous multi-model fleet routed by accuracy − λ·cost under per-query
  TTFT limits, against an accuracy/cost router and a load balancer (disagg.sim.latency_study);
- `planner`: pool widths that change during the run (disagg.sim.autoscaling): fixed widths, Ray
  Serve's default autoscaling and the SLO-driven planner on one trace, with replica start-up
  modelled — SLO attainment, GPU-hours, attainment per GPU-hour, widths (`planner_study`).

All studies use the same trace slice, seed and SLO mix, so their rows compare within one run.
Unless `--rate` is given, the rate is the saturation rate of the base topology (see runner); the
planner study runs the trace at its own times instead (`--rate` rescales it).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

from disagg.core.cost_model import CostModel, load_profile
from disagg.core.planner import Planner, PlannerConfig, Widths
from disagg.core.policies import PolicyError, policy_class
from disagg.files import SHARED, json_safe, write_figure, write_json_atomic, write_text_atomic
from disagg.sim import latency_study
from disagg.sim.autoscaling import FixedWidths, PlannerScaler, Scaler, ServeAutoscaling, ServeDefault
from disagg.sim.runner import compare, find_saturation, prepare_trace, simulate
from disagg.sim.simulator import Topology
from disagg.sim.traces import TraceRequest, read_trace, trace_stats
from disagg.user_input import UsageError, resolve_trace

STUDIES = ("width", "noise", "miscalibration", "sizing", "latency-routing", "planner")
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
    g = ap.add_argument_group("planner", "pool widths that change during the run; --out is the folder for "
                                         "results.json, results.md and widths.png")
    g.add_argument("--max-topology", default="4P8D", help="planner: the most instances of each pool (a fixed row too)")
    g.add_argument("--min-topology", default="1P1D", help="planner: the autoscalers' least widths, where they start")
    g.add_argument("--fixed", default="1P1D,1P2D,2P2D,2P4D", help="planner: fixed widths to run besides the max")
    g.add_argument("--startup-s", type=float, default=60.0,
                   help="planner: seconds from a scale-up to the new instance serving (weights load + warm-up)")
    g.add_argument("--policy", default="slo_goodput",
                   help="planner: the routing policy (slo_goodput, marginal_cost...)")
    g.add_argument("--interval-s", type=float, default=PlannerConfig().interval_s,
                   help="planner: seconds between plans")
    g.add_argument("--down-after", default="default,startup",
                   help="planner: windows in a row wanting fewer before a pool shrinks, one planner row each: "
                        "numbers, 'default' (PlannerConfig's) or 'startup' (the fewest windows longer than "
                        "--startup-s, so a lull shorter than a start-up sheds nothing)")
    g.add_argument("--serve-targets", default="2/32",
                   help="planner: Serve's target_ongoing_requests per prefill/decode replica, one Serve row per "
                        "comma-separated pair (2 = Ray's default; 32 = deployments/disagg.yaml's decode pool)")


def scaled_decode(cm: CostModel, factor: float) -> CostModel:
    """The same cost model with τ_dec (step base, per-sequence and per-context-token decode cost) scaled."""
    eng = cm.engine.model_copy(update={
        "step_base_s": cm.engine.step_base_s * factor,
        "decode_seq_s": cm.engine.decode_seq_s * factor,
        "decode_context_s": cm.engine.decode_context_s * factor,
    })
    return cm.model_copy(update={"engine": eng, "name": f"{cm.name} (τ_dec ×{factor:g})", "instances": {}})


def main(args) -> int:
    if args.name == "latency-routing":
        return latency_study.main(args)
    if args.name == "planner":
        return planner_main(args)
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


# --- planner: pool widths that change ---------------------------------------------------------------


def planner_scalers(cm: CostModel, *, max_topology: Topology, min_widths: Widths, fixed: Sequence[Widths],
                    serve_targets: Sequence[tuple[float, float]], interval_s: float,
                    down_after: Sequence[int]) -> list[tuple[str, Scaler]]:
    """The study's rows: (label, scaler). Every autoscaler starts at `min_widths` and stays within
    `min_widths`..`max_topology`."""
    top = Widths(max_topology.prefill, max_topology.decode)
    rows: list[tuple[str, Scaler]] = []
    for w in dict.fromkeys([*fixed, top]):  # in order, once each
        rows.append((f"fixed {w.prefill}P{w.decode}D", FixedWidths(w)))
    for p_target, d_target in serve_targets:
        pools = [ServeAutoscaling(target_ongoing_requests=t, min_replicas=lo, max_replicas=hi)
                 for t, lo, hi in ((p_target, min_widths.prefill, top.prefill),
                                   (d_target, min_widths.decode, top.decode))]
        rows.append((f"serve default ({p_target:g}/{d_target:g})", ServeDefault(*pools, initial=min_widths)))
    for n in down_after:
        cfg = PlannerConfig(interval_s=interval_s, down_after=n, min_prefill=min_widths.prefill,
                            max_prefill=top.prefill, min_decode=min_widths.decode, max_decode=top.decode)
        rows.append((f"planner (down_after {n})", PlannerScaler(Planner(cm, cfg), min_widths)))
    return rows


def run_planner_study(trace: Sequence[TraceRequest], cm: CostModel, scalers: Sequence[tuple[str, Scaler]], *,
                      max_topology: Topology, policy: str, startup_s: float) -> list[dict]:
    """One simulation per scaler on the same trace (SLO classes already drawn); a row of figures each."""
    rows = []
    for label, scaler in scalers:
        summary, res = simulate(trace, cm, max_topology, policy, scaler=scaler, startup_s=startup_s)
        a = res.extra["autoscaling"]
        row = {"scaler": label, "kind": type(scaler).__name__, "attainment": summary["goodput"],
               "attainment_tight": summary["goodput_tight"], "attainment_loose": summary["goodput_loose"],
               "gpu_hours": a["gpu_hours"],
               "attainment_per_gpu_hour": summary["goodput"] / a["gpu_hours"] if a["gpu_hours"] > 0 else math.nan,
               "ttft_p99_s": summary["ttft_p99_s"], "tpot_p99_s": summary["tpot_p99_s"], "failed": summary["failed"],
               **{k: v for k, v in a.items() if k not in ("series", "scaler")}}
        row["series"] = a["series"]
        if isinstance(scaler, PlannerScaler):
            row["plans"] = scaler.plans
        rows.append(row)
    return rows


PLANNER_COLUMNS = [
    ("scaler", "scaler", "s"), ("attainment", "attainment", ".3f"), ("gpu_hours", "GPU-h", ".3f"),
    ("attainment_per_gpu_hour", "attainment / GPU-h", ".3f"), ("prefill_provisioned_mean", "P mean", ".2f"),
    ("prefill_provisioned_max", "P max", "d"), ("decode_provisioned_mean", "D mean", ".2f"),
    ("decode_provisioned_max", "D max", "d"), ("scale_events", "scale events", "d"),
    ("attainment_tight", "tight", ".3f"), ("attainment_loose", "loose", ".3f"),
]


def planner_markdown(rows: list[dict]) -> str:
    def cell(v, fmt):
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    out = ["| " + " | ".join(h for _, h, _ in PLANNER_COLUMNS) + " |", "|" + "---|" * len(PLANNER_COLUMNS)]
    out += ["| " + " | ".join(cell(r.get(k), f) for k, _, f in PLANNER_COLUMNS) + " |" for r in rows]
    return "\n".join(out)


def plot_planner(result: dict, path: Path) -> None:
    """Provisioned widths over time (autoscalers) over the arrival rate, and attainment vs GPU-hours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    scaled = [r for r in rows if r["kind"] != "FixedWidths"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw={"width_ratios": [2, 2, 1.4]})
    arrivals = result["arrivals_per_interval"]
    for ax, col, pool in ((axes[0], 2, "prefill"), (axes[1], 4, "decode")):
        rate = ax.twinx()
        rate.bar([t for t, _ in arrivals], [n / result["rate_bin_s"] for _, n in arrivals], width=result["rate_bin_s"],
                 align="edge", color="0.85", zorder=0)
        rate.set_ylabel("arrivals (req/s)", color="0.5")
        ax.set_zorder(rate.get_zorder() + 1)
        ax.patch.set_visible(False)
        for r in scaled:
            pts = r["series"]["points"]
            ax.step([p[0] for p in pts] + [r["duration_s"]], [p[col] for p in pts] + [pts[-1][col]], where="post",
                    label=r["scaler"])
        ax.set(xlabel="time (s)", ylabel=f"{pool} instances provisioned", title=f"{pool} pool width")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fixed = [r for r in rows if r["kind"] == "FixedWidths"]
    ax = axes[2]
    ax.plot([r["gpu_hours"] for r in fixed], [r["attainment"] for r in fixed], "o-", color="0.4", label="fixed widths")
    for r in fixed:
        ax.annotate(r["scaler"].removeprefix("fixed "), (r["gpu_hours"], r["attainment"]), fontsize=7,
                    xytext=(3, -9), textcoords="offset points")
    for r in scaled:
        ax.plot([r["gpu_hours"]], [r["attainment"]], "D", label=r["scaler"])
    ax.set(xlabel="GPU-hours", ylabel="SLO attainment (TTFT and TPOT)", title="attainment vs cost")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"{result['trace']}: {result['requests']} requests, policy {result['policy']}, "
                 f"start-up {result['startup_s']:g} s, at most {result['max_topology']}", fontsize=10)
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)


def _planner_settings(args) -> dict:
    """The planner study's flags, checked before any work."""
    try:
        max_top, min_top = Topology.parse(args.max_topology), Topology.parse(args.min_topology)
        fixed = [Topology.parse(t) for t in args.fixed.split(",") if t.strip()]
    except ValueError as e:
        raise UsageError(f"--max-topology / --min-topology / --fixed: {e}") from None
    for t in (min_top, *fixed):
        if t.prefill > max_top.prefill or t.decode > max_top.decode:
            raise UsageError(f"{t} exceeds --max-topology {max_top}: a pool cannot have more instances than exist")
    if not (math.isfinite(args.startup_s) and args.startup_s >= 0):
        raise UsageError(f"--startup-s must be a finite number of seconds >= 0, got {args.startup_s}")
    if not (math.isfinite(args.interval_s) and args.interval_s > 0):
        raise UsageError(f"--interval-s must be a finite number of seconds > 0, got {args.interval_s}")
    try:
        policy_class(args.policy)
    except PolicyError as e:
        raise UsageError(f"--policy: {e}") from None
    targets = []
    for pair in args.serve_targets.split(","):
        try:
            p, d = (float(x) for x in pair.split("/"))
        except ValueError:
            raise UsageError(f"--serve-targets: each entry is PREFILL/DECODE ongoing requests per replica, e.g. 2/32; "
                             f"got {pair!r}") from None
        if not (p > 0 and d > 0 and math.isfinite(p) and math.isfinite(d)):
            raise UsageError(f"--serve-targets: targets must be finite and > 0, got {pair!r}")
        targets.append((p, d))
    down = []
    for x in args.down_after.split(","):
        x = x.strip()
        if x == "default":
            down.append(PlannerConfig().down_after)
        elif x == "startup":  # the fewest whole windows that outlast a start-up
            down.append(max(1, math.floor(args.startup_s / args.interval_s) + 1))
        elif x.isdigit() and int(x) >= 1:
            down.append(int(x))
        else:
            raise UsageError(f"--down-after: each entry is a whole number >= 1, 'default' or 'startup'; got {x!r}")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be a finite number > 0, got {args.rate}")
    if not 0.0 <= args.tight_share <= 1.0:
        raise UsageError(f"--tight-share must be in [0, 1], got {args.tight_share}")
    if args.max_requests < 0:
        raise UsageError(f"--max-requests must be >= 0 (0 = all), got {args.max_requests}")
    return {"max_topology": max_top, "min_widths": Widths(min_top.prefill, min_top.decode),
            "fixed": [Widths(t.prefill, t.decode) for t in fixed], "serve_targets": targets,
            "down_after": list(dict.fromkeys(down))}


def planner_main(args) -> int:
    settings = _planner_settings(args)
    cm = load_profile(args.cost_model)
    trace = read_trace(resolve_trace(args.trace))
    if args.max_requests:
        trace = trace[: args.max_requests]
    if len(trace) < 2:
        raise UsageError(f"{args.trace}: the planner study needs at least 2 requests, got {len(trace)}")
    trace = prepare_trace(trace, args.rate, args.tight_share, args.seed)
    scalers = planner_scalers(cm, max_topology=settings["max_topology"], min_widths=settings["min_widths"],
                              fixed=settings["fixed"], serve_targets=settings["serve_targets"],
                              interval_s=args.interval_s, down_after=settings["down_after"])
    rows = run_planner_study(trace, cm, scalers, max_topology=settings["max_topology"], policy=args.policy,
                             startup_s=args.startup_s)
    bin_s = args.interval_s
    counts: dict[int, int] = {}
    for r in trace:
        counts[int(r.arrival_s // bin_s)] = counts.get(int(r.arrival_s // bin_s), 0) + 1
    stats = trace_stats(trace)
    result = {"study": "planner", "trace": str(args.trace), "requests": len(trace), "policy": args.policy,
              "cost_model": cm.name, "seed": args.seed, "tight_share": args.tight_share,
              "rate": stats["mean_rate"], "rescaled_to": args.rate, "span_s": stats.get("span_s"),
              "startup_s": args.startup_s, "interval_s": args.interval_s, "max_topology": str(settings["max_topology"]),
              "min_topology": args.min_topology, "rate_bin_s": bin_s,
              "arrivals_per_interval": [[k * bin_s, counts[k]] for k in sorted(counts)], "rows": rows}
    md = planner_markdown(rows)
    head = (f"study=planner trace={args.trace} requests={len(trace)} rate={stats['mean_rate']:.2f} req/s "
            f"policy={args.policy} startup={args.startup_s:g}s interval={args.interval_s:g}s "
            f"widths {args.min_topology}..{settings['max_topology']} cost_model={cm.name} seed={args.seed}")
    print(head)
    print(md)
    if args.json:
        write_json_atomic(Path(args.json), json_safe(result))
    if args.out:
        out = Path(args.out)
        write_json_atomic(out / "results.json", json_safe(result))
        write_text_atomic(out / "results.md", f"{head}\n\n{md}\n", permissions=SHARED)
        plot_planner(result, out / "widths.png")
        print(f"\nwrote {out}/results.json, results.md, widths.png", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
