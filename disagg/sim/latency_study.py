"""`disagg study latency-routing`: accuracy − λ·cost vs TTFT attainment over λ, one fleet, every
model-level router of the core's registry (disagg.core.model_routing: latency_aware, accuracy_cost,
load_balance).

The setting (every choice is a flag; `--rate` has no default, the README reports 10 req/s):
- fleet: colocated instances of two models on A40-class GPUs, `small:2,large:2`. `small` has the
  cost-model profile's engine constants (a40: Qwen2.5-3B). `large` is a model `--large-scale`× the
  size (2.5: a 7B-class model) on the same hardware: every step-time term scaled by that factor
  (prefill compute and weight reads grow with the parameter count), the same scheduler limits and
  the same 60k-token KV budget (a configured budget that a 7B model's free A40 memory still holds);
- prices (illustrative, in $ per token, about proportional to size): small $0.10 / $0.30 per
  million input / output tokens, large $0.30 / $0.90; λ is in accuracy per $;
- accuracy: an `AccuracyTable` trained on 4000 SYNTHETIC evaluations per model, drawn with the seed
  (disagg.sim.synthetic_accuracy: the large model more accurate, more so on long prompts), or
  `--accuracy` (a table saved by `disagg accuracy train`); served queries are scored with the
  synthetic ground truth;
- queries: a slice of a real trace per seed (seed s takes requests [s·n, (s+1)·n) of the trace),
  rescaled to `--rate`; each query's TTFT limit is its SLO class's target in the cost model (a40:
  tight 175 ms, loose 525 ms), the class drawn with `--tight-share` and the seed;
- the router sees each instance through a 50 ms poll plus the queries it sent since (as live).

Figures per (router, λ, seed), medians over seeds with min–max spread:
- utility = mean over all queries of accuracy(model, query) − λ·cost(model, query, true output);
- on-time utility = the same with the accuracy of a query that missed its TTFT limit counted as 0
  (a late answer is worth nothing; its cost is still paid);
- utility vs load_balance = the router's utility minus load_balance's at the same λ and seed;
- attainment = share of queries whose TTFT met their own limit;
- accuracy, cost per 1000 queries, share served by the large model;
- the estimator's error: for every query, the TTFT estimated for the chosen instance at routing
  time (by the router, or for `accuracy_cost` on the same snapshot for measurement) vs the TTFT
  the query got: MAPE, median APE and mean signed error. A second table separates the sources:
  the 50 ms poll (as deployed); the exact engine state (output-length prediction error left); the
  exact state and true output lengths (left: the step in flight — the estimator starts a fresh
  step at the decision, so the rest of a decode step in flight is missed and a prefill chunk in
  flight is counted again from the decision — and queries that arrive later and share the new
  query's steps); and the naive remaining-output rule (disagg.sim.latency_sim.remaining_output);
- the decision's cost: wall µs per router call (all candidates), p50 and p99, on this machine.
`load_balance` does not depend on λ: it runs once per seed and its utility is evaluated at each λ.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from disagg.core.cost_model import CostModel, load_profile
from disagg.core.latency_routing import ModelInstance
from disagg.core.model_routing import build_model_router, known_model_routers
from disagg.core.utility import AccuracyTable, EvaluationError, ModelPrices, cost_estimate
from disagg.files import SHARED, json_safe, write_figure, write_json_atomic, write_text_atomic
from disagg.sim.latency_sim import (
    FleetResult,
    make_fleet,
    naive_remaining_output,
    parse_fleet,
    remaining_output,
    simulate_fleet,
)
from disagg.sim.synthetic_accuracy import synthetic_evaluations, true_accuracy
from disagg.sim.metrics import percentile
from disagg.sim.traces import TraceRequest, assign_slo_classes, read_trace, rescale_to_rate
from disagg.user_input import UsageError, resolve_trace

PRICES = {"small": ModelPrices(0.10e-6, 0.30e-6), "large": ModelPrices(0.30e-6, 0.90e-6)}
DEFAULT_LAMBDAS = "0,250,500,750,1000,1500,3000"
EVALUATION_ROWS_PER_MODEL = 4000


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The study's own flags (the shared ones — trace, cost model, rate, seed... — are `disagg study`'s)."""
    g = ap.add_argument_group("latency-routing")
    g.add_argument("--fleet", default="small:2,large:2", help="latency-routing: model:count, comma-separated")
    g.add_argument("--large-scale", type=float, default=2.5,
                   help="latency-routing: the large model's step times = the profile's × this")
    g.add_argument("--lambdas", default=DEFAULT_LAMBDAS, help="latency-routing: λ values (accuracy per $)")
    g.add_argument("--seeds", help="latency-routing: comma-separated seeds (default: --seed only)")
    g.add_argument("--accuracy", help="latency-routing: an accuracy table saved by `disagg accuracy train` "
                                      "(default: trained on synthetic evaluations, per seed)")
    g.add_argument("--out", help="latency-routing: folder for results.json, results.md and utility_attainment.png")


@dataclass(frozen=True, slots=True)
class RunFigures:
    router: str
    lam: float
    seed: int
    utility: float
    utility_on_time: float
    attainment: float
    accuracy: float
    cost_per_1k: float
    large_share: float
    mape: float
    median_ape: float
    bias: float
    failed: int
    decision_us_p50: float
    decision_us_p99: float

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def fleet_models(cm: CostModel, large_scale: float) -> dict:
    return {"small": (cm.engine, PRICES["small"]), "large": (cm.engine.scaled(large_scale), PRICES["large"])}


def figures(result: FleetResult, fleet: Sequence[ModelInstance], router: str, lam: float, seed: int) -> RunFigures:
    """The run's figures (see the module docstring); a failed query scores accuracy 0 and cost 0."""
    records = result.records
    prices = {m.model: m.prices for m in fleet}
    n = len(records)
    acc = cost = on_time = 0.0
    large = 0
    apes, errs = [], []
    for r in records:
        if r.model is None:
            continue
        a = true_accuracy(r.model, r.prompt_tokens)
        acc += a
        on_time += a if r.met_limit else 0.0
        cost += cost_estimate(prices[r.model], r.prompt_tokens, r.output_tokens)
        large += r.model == "large"
        if r.estimated_ttft_s is not None and r.ttft_s:
            e = (r.estimated_ttft_s - r.ttft_s) / r.ttft_s
            errs.append(e)
            apes.append(abs(e))
    return RunFigures(router, lam, seed, (acc - lam * cost) / n, (on_time - lam * cost) / n,
                      sum(r.met_limit for r in records) / n, acc / n,
                      1000 * cost / n, large / n, statistics.fmean(apes), statistics.median(apes),
                      statistics.fmean(errs), sum(r.model is None for r in records),
                      percentile(result.decision_us, 50), percentile(result.decision_us, 99))


def seed_slice(trace: Sequence[TraceRequest], n: int, seed: int, rate: float, tight_share: float) -> list[TraceRequest]:
    """Requests [seed·n, (seed+1)·n) of the trace, rescaled to `rate`, SLO classes drawn with `seed`."""
    start = seed * n
    if n < 2 or start + n > len(trace):
        raise ValueError(f"seed {seed} needs requests [{start}, {start + n}) of the trace, which has {len(trace)}; "
                         "use fewer requests per seed or smaller seeds")
    return assign_slo_classes(rescale_to_rate(trace[start:start + n], rate), tight_share, seed)


def run_study(trace: Sequence[TraceRequest], cm: CostModel, *, fleet_spec: str, large_scale: float,
              lambdas: Sequence[float], seeds: Sequence[int], rate: float, max_requests: int, tight_share: float,
              accuracy: AccuracyTable | None = None, estimator_lambda: float | None = None) -> dict:
    """Every (router, λ, seed) run and the estimator-error breakdown; plain data for JSON."""
    fleet = make_fleet(parse_fleet(fleet_spec), fleet_models(cm, large_scale))
    limit = lambda r: cm.target(r.slo_class).ttft_s  # noqa: E731 - the query's own limit: its class's target
    runs: list[RunFigures] = []
    estimator: list[dict] = []
    est_lam = estimator_lambda if estimator_lambda is not None else sorted(lambdas)[len(lambdas) // 2]
    for seed in seeds:
        queries = seed_slice(trace, max_requests, seed, rate, tight_share)
        table = accuracy or AccuracyTable().train(synthetic_evaluations(EVALUATION_ROWS_PER_MODEL, seed))
        lb = simulate_fleet(queries, fleet, build_model_router("load_balance", 0.0, table), limit)
        for lam in lambdas:
            runs.append(figures(lb, fleet, "load_balance", lam, seed))  # λ-blind: one run serves every λ
            for name in known_model_routers():
                if name != "load_balance":
                    res = simulate_fleet(queries, fleet, build_model_router(name, lam, table), limit)
                    runs.append(figures(res, fleet, name, lam, seed))
        for label, poll, rem, truth in (
                ("50 ms poll (as deployed)", 0.05, remaining_output, False),
                ("exact engine state", None, remaining_output, False),
                ("exact engine state, true output lengths", None, naive_remaining_output, True),
                ("50 ms poll, naive remaining output", 0.05, naive_remaining_output, False)):
            res = simulate_fleet(queries, fleet, build_model_router("latency_aware", est_lam, table), limit,
                                 poll_interval_s=poll, remaining=rem, true_outputs=truth)
            f = figures(res, fleet, "latency_aware", est_lam, seed)
            estimator.append({"snapshot": label, "seed": seed, "lam": est_lam, "mape": f.mape,
                              "median_ape": f.median_ape, "bias": f.bias, "attainment": f.attainment})
    return {"fleet": [{"instance": m.instance_id, "model": m.model, **m.constants.model_dump(),
                       "input_per_token": m.prices.input_per_token, "output_per_token": m.prices.output_per_token}
                      for m in fleet],
            "rate": rate, "requests_per_seed": max_requests, "seeds": list(seeds), "lambdas": list(lambdas),
            "tight_share": tight_share, "ttft_limits_s": {c.value: t.ttft_s for c, t in cm.slo.items()},
            "runs": [r.as_dict() for r in runs], "estimator": estimator}


# --- aggregation and output ----------------------------------------------------------------------


def _med(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def summary_rows(result: dict) -> list[dict]:
    """One row per (λ, router): the median over seeds of each figure, with min–max for the two main ones."""
    rows = []
    for lam in result["lambdas"]:
        for router in known_model_routers():
            rs = [r for r in result["runs"] if r["router"] == router and r["lam"] == lam]
            row = {"lam": lam, "router": router}
            lb = {r["seed"]: r["utility"] for r in result["runs"] if r["router"] == "load_balance" and r["lam"] == lam}
            row["utility_vs_lb"], row["utility_vs_lb_min"], row["utility_vs_lb_max"] = _med(
                [r["utility"] - lb[r["seed"]] for r in rs])
            for k in ("utility", "utility_on_time", "attainment", "accuracy", "cost_per_1k", "large_share", "mape", "decision_us_p50",
                      "decision_us_p99"):
                row[k], row[f"{k}_min"], row[f"{k}_max"] = _med([r[k] for r in rs])
            rows.append(row)
    return rows


def estimator_rows(result: dict) -> list[dict]:
    rows = []
    for label in dict.fromkeys(e["snapshot"] for e in result["estimator"]):
        es = [e for e in result["estimator"] if e["snapshot"] == label]
        row = {"snapshot": label, "lam": es[0]["lam"]}
        for k in ("mape", "median_ape", "bias", "attainment"):
            row[k], row[f"{k}_min"], row[f"{k}_max"] = _med([e[k] for e in es])
        rows.append(row)
    return rows


def _spread(row: dict, k: str, fmt: str, n_seeds: int) -> str:
    v = format(row[k], fmt)
    if n_seeds > 1:
        v += f" ({format(row[k + '_min'], fmt)}–{format(row[k + '_max'], fmt)})"
    return v


def markdown(result: dict) -> str:
    ns = len(result["seeds"])
    spread = " (min–max over seeds)" if ns > 1 else ""
    out = [f"| λ | router | utility{spread} | vs load_balance | TTFT attainment{spread} | on-time utility | "
           f"accuracy | cost $/1k queries | large-model share | estimator MAPE | decision µs p50 / p99 |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary_rows(result):
        out.append(f"| {r['lam']:g} | {r['router']} | {_spread(r, 'utility', '.3f', ns)} | "
                   f"{r['utility_vs_lb']:+.3f} | {_spread(r, 'attainment', '.3f', ns)} | {r['utility_on_time']:.3f} | "
                   f"{r['accuracy']:.3f} | {r['cost_per_1k']:.3f} | {r['large_share']:.2f} | {r['mape']:.1%} | "
                   f"{r['decision_us_p50']:.0f} / {r['decision_us_p99']:.0f} |")
    out += ["", f"Estimator error, `latency_aware` at λ = {result['estimator'][0]['lam']:g}{spread}:", "",
            "| router's snapshot | MAPE | median APE | mean signed error | TTFT attainment |",
            "|---|---:|---:|---:|---:|"]
    for r in estimator_rows(result):
        out.append(f"| {r['snapshot']} | {_spread(r, 'mape', '.1%', ns)} | {r['median_ape']:.1%} | "
                   f"{r['bias']:+.1%} | {r['attainment']:.3f} |")
    return "\n".join(out)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary_rows(result)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = {"latency_aware": "tab:blue", "accuracy_cost": "tab:orange", "load_balance": "tab:gray"}
    for router in known_model_routers():
        rs = [r for r in rows if r["router"] == router]
        x, y, lam = [r["attainment"] for r in rs], [r["utility"] for r in rs], [r["lam"] for r in rs]
        axes[0].plot(x, y, "o-", color=colors.get(router), label=router)
        if router != "load_balance":  # its points differ only by λ; labels would pile up
            for xi, yi, li in zip(x, y, lam):
                axes[0].annotate(f"λ={li:g}", (xi, yi), fontsize=7, xytext=(-28 if router == "latency_aware" else 3, 3),
                                 textcoords="offset points")
        for ax, key in ((axes[1], "utility_vs_lb"), (axes[2], "attainment")):
            ax.plot(lam, [r[key] for r in rs], "o-", color=colors.get(router), label=router)
            ax.fill_between(lam, [r[key + "_min"] for r in rs], [r[key + "_max"] for r in rs],
                            color=colors.get(router), alpha=0.15)
    axes[0].set(xlabel="TTFT attainment (share of queries within their limit)",
                ylabel="utility = accuracy − λ·cost", title="utility vs TTFT attainment, over λ")
    axes[1].set(xlabel="λ (accuracy per $)", ylabel="utility − load_balance's utility",
                title="utility gain over load balancing (same λ, same seed)")
    axes[2].set(xlabel="λ (accuracy per $)", ylabel="TTFT attainment", title="TTFT attainment")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"fleet {', '.join(sorted({m['model'] for m in result['fleet']}))} "
                 f"({len(result['fleet'])} instances), {result['rate']:g} req/s, "
                 f"medians of {len(result['seeds'])} seed(s); accuracy is synthetic", fontsize=10)
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)


def main(args) -> int:
    try:
        lambdas = [float(x) for x in args.lambdas.split(",") if x.strip()]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else [args.seed]
    except ValueError as e:
        raise UsageError(f"--lambdas / --seeds: {e}") from None
    if not lambdas or any(not (lam >= 0.0 and lam < float("inf")) for lam in lambdas):
        raise UsageError(f"--lambdas must be finite numbers >= 0, got {args.lambdas!r}")
    if not seeds or any(s < 0 for s in seeds):
        raise UsageError(f"--seeds must be integers >= 0, got {args.seeds!r}")
    if not (args.large_scale > 0):
        raise UsageError(f"--large-scale must be > 0, got {args.large_scale!r}")
    if args.rate is None or not (args.rate > 0):
        raise UsageError("latency-routing needs --rate (mean arrival rate in req/s, > 0)")
    cm = load_profile(args.cost_model)
    try:
        make_fleet(parse_fleet(args.fleet), fleet_models(cm, args.large_scale))
    except ValueError as e:
        raise UsageError(f"--fleet: {e}") from None
    table = None
    if args.accuracy:
        try:
            table = AccuracyTable.load(args.accuracy)
        except EvaluationError as e:
            raise UsageError(str(e)) from None
    trace = read_trace(resolve_trace(args.trace))
    for seed in seeds:
        try:
            seed_slice(trace, args.max_requests, seed, args.rate, args.tight_share)
        except ValueError as e:
            raise UsageError(str(e)) from None
    result = run_study(trace, cm, fleet_spec=args.fleet, large_scale=args.large_scale, lambdas=lambdas, seeds=seeds,
                       rate=args.rate, max_requests=args.max_requests, tight_share=args.tight_share, accuracy=table)
    result.update({"trace": str(args.trace), "cost_model": cm.name, "large_scale": args.large_scale,
                   "accuracy": args.accuracy or "synthetic (disagg.sim.synthetic_accuracy)"})
    md = markdown(result)
    print(f"study=latency-routing trace={args.trace} requests/seed={min(args.max_requests, len(trace))} "
          f"rate={args.rate:g} req/s fleet={args.fleet} large_scale={args.large_scale:g} cost_model={cm.name} "
          f"seeds={','.join(map(str, seeds))}")
    print(md)
    if args.json:
        write_json_atomic(Path(args.json), json_safe(result))
    if args.out:
        out = Path(args.out)
        write_json_atomic(out / "results.json", json_safe(result))
        write_text_atomic(out / "results.md", md + "\n", permissions=SHARED)
        plot(result, out / "utility_attainment.png")
        print(f"\nwrote {out}/results.json, results.md, utility_attainment.png")
    return 0
