"""`disagg validate`: does the simulator predict the fleet it prices for?

The same trace slices run live and in the simulator, with the constants the router prices with (by
default the router's own: under `make run`, fitted on this machine at start). Every (repeat, rate)
is one `disagg bench --url ... --sim` run into its own folder, so each is resumable and has the
bench's gates and constants check; the repeats of a rate send the very same requests, and the
rates are swept in alternating directions (light → heavy, then heavy → light, ...) so that a drift
of the machine does not land on one rate.

Per (policy, trace, rate) it reports the live median of TTFT p50/p90, TPOT p50/p90 and
attainment over the repeats, their spread (the live-vs-live noise floor), the simulator's
prediction and its error. A latency cell passes within `within` (relative) or 1.5× the live
spread, whichever is wider; attainment within 0.05 or 1.5× its spread. Per (trace, rate) the
simulator must order the policies by attainment as live does, for every pair whose live medians
differ by more than their spread. Every cell is reported, passing or not, with a figure of
predicted against measured.

`resimulate` runs the simulator alone, with other constants, against the live runs of an earlier
validate: a calibration or a change of the model judged in seconds, without the app.

`refit` (`disagg validate --refit DIR`): before each live run the router's constants are fitted
again on the live engines, as `make run` fits them at start, and each repeat is simulated with its
own run's constants: the host's drift between one fit at start and a run half an hour later is
then not the model's error (docs/results.md: two fits of one host within an hour put its engines
on 0.84 and 1.08 cores).

`at_measured_speed` (both): the simulator runs every repeat, not once per rate, with the engines'
step times scaled to what that repeat's constants check measured just before its load. A shared host
drifts between the fit and a run, and simulating at the fitted speed counts that drift as the
model's error. It is a study option: the check's lone probes on an idle fleet swing more than the
drift they would correct (docs/results.md), so the figures of record are at the fitted constants.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from disagg.bench.constants_check import at_measured_speed as at_measured_speed_of
from disagg.bench.constants_check import rejudged
from disagg.bench.harness import COST_MODEL_FILE, BenchConfig, BenchError, run_bench
from disagg.bench.refit import before_run
from disagg.bench.records import LIVE, SIM
from disagg.core.cost_model import CostModel, CostModelError, load_profile
from disagg.files import json_safe, write_json_atomic, write_text_atomic
from disagg.stats import percentile

LATENCY = (("ttft_p50_s", "ttft", 50), ("ttft_p90_s", "ttft", 90), ("tpot_p50_s", "tpot", 50),
           ("tpot_p90_s", "tpot", 90))
ATTAINMENT_WITHIN = 0.05
NOISE_FACTOR = 1.5
RESULTS_JSON, RESULTS_MD, FIGURE = "validate.json", "validate.md", "predicted_vs_measured.png"
SIM_FOLDER = "sim"  # the simulator's runs at each repeat's measured speed, beside the live ones


@dataclass(frozen=True)
class ValidateConfig:
    url: str
    out: Path
    traces: tuple[str, ...]
    policies: tuple[str, ...]
    rates: tuple[float, ...]
    repeats: int = 2
    max_requests: int | None = 120
    cost_model: str | None = None  # None: the router's own constants (`disagg bench --cost-model app`)
    seed: int = 0
    within: float = 0.15
    realtime: bool = False
    request_timeout_s: float = 300.0
    # simulate every repeat at the engine speed its constants check measured just before it (the
    # host's drift between the fit and the run), not once per rate at the constants as fitted
    at_measured_speed: bool = False


def check(cfg: ValidateConfig) -> None:
    if not cfg.rates or any(not (math.isfinite(r) and r > 0) for r in cfg.rates):
        raise BenchError(f"--rates must be positive requests/s, got {list(cfg.rates)}")
    if len(set(cfg.rates)) != len(cfg.rates):
        raise BenchError(f"--rates lists a rate twice: {list(cfg.rates)}")
    if not 1 <= cfg.repeats <= 20:
        raise BenchError(f"--repeats must be in [1, 20], got {cfg.repeats} (2 or more give the noise floor)")
    if not 0 < cfg.within < 1:
        raise BenchError(f"--within is a relative error in (0, 1), got {cfg.within}")


def run_order(rates: tuple[float, ...], repeats: int) -> list[tuple[int, float]]:
    """(repeat, rate) in the order they run: each repeat sweeps the rates the other way round."""
    up = sorted(rates)
    return [(k, r) for k in range(repeats) for r in (up if k % 2 == 0 else up[::-1])]


def folder(out: Path, repeat: int, rate: float) -> Path:
    return out / f"rate-{rate:g}" / f"repeat-{repeat + 1}"


def figures(records: list[dict]) -> dict:
    """Attainment and the latency percentiles of one run's request records."""
    fig = {"requests": len(records),
           "attainment": sum(bool(r.get("slo_met")) for r in records) / len(records) if records else None}
    for name, field, q in LATENCY:
        xs = [r[f"{field}_s"] for r in records if r.get(f"{field}_s") is not None]
        fig[name] = percentile(xs, q) if xs else None
    return fig


def cells(records_file: Path, system: str) -> dict[tuple[str, str], dict]:
    """(policy, trace) → `figures` of `system`'s records in one bench folder's requests.jsonl."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for line in records_file.read_text().splitlines():
        r = json.loads(line)
        if r.get("system") == system:
            groups[(r["policy"], r["trace"])].append(r)
    return {key: figures(recs) for key, recs in groups.items()}


def _figures_by_cell(folders: dict[tuple[int, float], Path], system: str) -> dict[tuple, list[dict]]:
    """(policy, trace, rate) → `figures` of `system`'s records in each of those bench folders."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for (_, rate), path in sorted(folders.items()):
        for (policy, trace), fig in cells(path / "requests.jsonl", system).items():
            out[(policy, trace, rate)].append(fig)
    return out


def _median_figures(figs: list[dict]) -> dict:
    out = {}
    for key in figs[0]:
        xs = [f[key] for f in figs if f.get(key) is not None]
        out[key] = statistics.median(xs) if xs else None
    return out


def _spread(xs: list[float], relative: bool) -> float | None:
    if len(xs) < 2:
        return None
    mid = statistics.median(xs)
    width = max(xs) - min(xs)
    return (width / mid if mid else None) if relative else width


def judge_cell(live_runs: list[dict], sim: dict, within: float) -> dict:
    """One (policy, trace, rate): the live medians and spreads over repeats, the simulator's values,
    its errors and whether each is inside what the cell allows."""
    out = {"live": {}, "live_spread": {}, "sim": {}, "error": {}, "allowed": {}, "passed": {}}
    for name, _, _ in LATENCY:
        xs = [r[name] for r in live_runs if r.get(name) is not None]
        live = statistics.median(xs) if xs else None
        spread = _spread(xs, relative=True)
        allowed = max(within, NOISE_FACTOR * spread) if spread is not None else within
        s = sim.get(name)
        err = (s - live) / live if s is not None and live else None
        out["live"][name], out["live_spread"][name], out["sim"][name] = live, spread, s
        out["error"][name], out["allowed"][name] = err, allowed
        out["passed"][name] = err is not None and abs(err) <= allowed
    xs = [r["attainment"] for r in live_runs if r.get("attainment") is not None]
    live = statistics.median(xs) if xs else None
    spread = _spread(xs, relative=False)
    allowed = max(ATTAINMENT_WITHIN, NOISE_FACTOR * spread) if spread is not None else ATTAINMENT_WITHIN
    s = sim.get("attainment")
    err = s - live if s is not None and live is not None else None
    out["live"]["attainment"], out["live_spread"]["attainment"], out["sim"]["attainment"] = live, spread, s
    out["error"]["attainment"], out["allowed"]["attainment"] = err, allowed
    out["passed"]["attainment"] = err is not None and abs(err) <= allowed
    return out


def order_of(group: list[dict], side: str) -> str:
    """The policies by attainment, best first; equal ones joined by '='."""
    ranked = sorted(group, key=lambda r: -(r[side]["attainment"] or 0.0))
    text = ranked[0]["policy"] if ranked else ""
    for prev, r in zip(ranked, ranked[1:]):
        text += (" = " if prev[side]["attainment"] == r[side]["attainment"] else " > ") + r["policy"]
    return text


def ranking(rows: list[dict]) -> list[dict]:
    """Per (trace, rate): does the simulator order the policies by attainment as live does? Only
    pairs whose live medians differ by more than the wider of their spreads are counted."""
    out = []
    by: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        by[(row["trace"], row["rate"])].append(row)
    for (trace, rate), group in sorted(by.items()):
        pairs = agree = 0
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                la, lb = a["live"]["attainment"], b["live"]["attainment"]
                sa, sb = a["sim"]["attainment"], b["sim"]["attainment"]
                noise = max(a["live_spread"]["attainment"] or 0.0, b["live_spread"]["attainment"] or 0.0)
                if None in (la, lb, sa, sb) or abs(la - lb) <= noise:
                    continue
                pairs += 1
                agree += (la - lb) * (sa - sb) > 0
        out.append({"trace": trace, "rate": rate, "live_order": order_of(group, "live"),
                    "sim_order": order_of(group, "sim"),
                    "separated_pairs": pairs, "agreeing_pairs": agree, "agrees": agree == pairs})
    return out


def summarize(runs: dict[tuple[int, float], Path], within: float,
              sims: dict[tuple[int, float], Path] | None = None) -> dict:
    """The report from the finished bench folders (`runs[(repeat, rate)]`); the simulator's records
    are the first repeat's, or those of `sims[(repeat, rate)]` (a rate simulated for several repeats
    counts the median of each figure)."""
    if sims is None:
        sims = {(repeat, rate): path for (repeat, rate), path in runs.items() if repeat == 0}
    live, simulated = _figures_by_cell(runs, LIVE), _figures_by_cell(sims, SIM)
    sim = {key: _median_figures(figs) for key, figs in simulated.items()}
    rows = []
    for key in sorted(live, key=lambda k: (k[2], k[1], k[0])):
        policy, trace, rate = key
        rows.append({"policy": policy, "trace": trace, "rate": rate, "repeats": len(live[key]),
                     **judge_cell(live[key], sim.get(key, {}), within)})
    latency = [ok for r in rows for m, ok in r["passed"].items() if m != "attainment"]
    attain = [r["passed"]["attainment"] for r in rows]
    order = ranking(rows)
    return {"within": within, "noise_factor": NOISE_FACTOR, "attainment_within": ATTAINMENT_WITHIN, "rows": rows,
            "ranking": order, "summary": {"latency_cells": len(latency), "latency_passed": sum(latency),
                                          "attainment_cells": len(attain), "attainment_passed": sum(attain),
                                          "rankings": len(order), "rankings_agree": sum(o["agrees"] for o in order),
                                          "pairs": sum(o["separated_pairs"] for o in order),
                                          "pairs_agree": sum(o["agreeing_pairs"] for o in order)}}


def markdown(report: dict) -> str:
    pct = lambda e: "—" if e is None else f"{e:+.0%}"  # noqa: E731
    ms = lambda v: "—" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    mark = lambda ok: "" if ok else " ✗"  # noqa: E731
    lines = ["| rate | trace | policy | TTFT p50 ms live / sim | TTFT p90 | TPOT p50 ms | TPOT p90 | attainment |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        cols = []
        for m, _, _ in LATENCY:
            spread = r["live_spread"][m]
            noise = f" ±{spread / 2:.0%}" if spread is not None else ""
            cols.append(f"{ms(r['live'][m])}{noise} / {ms(r['sim'][m])} ({pct(r['error'][m])}){mark(r['passed'][m])}")
        a, sa, e = r["live"]["attainment"], r["sim"]["attainment"], r["error"]["attainment"]
        fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
        cols.append(f"{fmt(a)} / {fmt(sa)} ({'—' if e is None else f'{e:+.3f}'}){mark(r['passed']['attainment'])}")
        lines.append(f"| {r['rate']:g} | {r['trace']} | {r['policy']} | " + " | ".join(cols) + " |")
    s = report["summary"]
    lines += ["", f"Latency cells within {report['within']:.0%} (or {report['noise_factor']:g}× the live spread): "
              f"{s['latency_passed']} of {s['latency_cells']}. Attainment within {report['attainment_within']} "
              f"(or {report['noise_factor']:g}× its spread): {s['attainment_passed']} of {s['attainment_cells']}. "
              f"Policy order as live: {s['rankings_agree']} of {s['rankings']} (trace, rate) groups, "
              f"{s['pairs_agree']} of the {s['pairs']} pairs live separates beyond its spread.", "",
              "| rate | trace | live order | simulated order | separated pairs agreeing |", "|---|---|---|---|---|"]
    for o in report["ranking"]:
        lines.append(f"| {o['rate']:g} | {o['trace']} | {o['live_order']} | {o['sim_order']} "
                     f"| {o['agreeing_pairs']} of {o['separated_pairs']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Predicted against measured, one panel per latency metric, with y = x and the ±within band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from disagg.files import write_figure

    fig, axes = plt.subplots(1, len(LATENCY) + 1, figsize=(4.0 * (len(LATENCY) + 1), 4.0))
    policies = sorted({r["policy"] for r in report["rows"]})
    cmap = plt.get_cmap("tab10")
    for ax, (name, _, _) in zip(axes, LATENCY):
        pts = [(r["live"][name], r["sim"][name], r["policy"], r["live_spread"][name]) for r in report["rows"]
               if r["live"][name] and r["sim"][name]]
        for k, p in enumerate(policies):
            mine = [(x * 1e3, y * 1e3, s) for x, y, q, s in pts if q == p]
            if mine:
                ax.errorbar([x for x, _, _ in mine], [y for _, y, _ in mine],
                            xerr=[[x * (s or 0) / 2 for x, _, s in mine], [x * (s or 0) / 2 for x, _, s in mine]],
                            fmt="o", color=cmap(k % 10), label=p, markersize=4, capsize=2, linewidth=0.8)
        if pts:
            lo = min(min(x, y) for x, y, _, _ in pts) * 1e3 * 0.7
            hi = max(max(x, y) for x, y, _, _ in pts) * 1e3 * 1.4
            xs = [lo, hi]
            ax.plot(xs, xs, color="black", linewidth=0.8)
            w = report["within"]
            ax.fill_between(xs, [x * (1 - w) for x in xs], [x * (1 + w) for x in xs], color="grey", alpha=0.2)
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_title(name.replace("_s", "").replace("_", " "))
        ax.set_xlabel("measured (ms)")
        ax.set_ylabel("simulated (ms)")
    ax = axes[-1]
    for k, p in enumerate(policies):
        mine = [(r["live"]["attainment"], r["sim"]["attainment"], r["live_spread"]["attainment"] or 0.0)
                for r in report["rows"] if r["policy"] == p and r["sim"]["attainment"] is not None]
        if mine:
            ax.errorbar([x for x, _, _ in mine], [y for _, y, _ in mine], xerr=[s / 2 for _, _, s in mine], fmt="o",
                        color=cmap(k % 10), label=p, markersize=4, capsize=2, linewidth=0.8)
    ax.plot([0, 1], [0, 1], color="black", linewidth=0.8)
    ax.fill_between([0, 1], [-ATTAINMENT_WITHIN, 1 - ATTAINMENT_WITHIN], [ATTAINMENT_WITHIN, 1 + ATTAINMENT_WITHIN],
                    color="grey", alpha=0.2)
    ax.set(xlim=(0, 1.02), ylim=(0, 1.02), title="attainment", xlabel="measured", ylabel="simulated")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)


def run_validate(cfg: ValidateConfig, log: Callable[[str], None], progress=None,
                 refit: Callable[[], None] | None = None) -> dict:
    """Every (repeat, rate) bench run (resumed where a folder holds one), then the report files.

    `refit`: fits the router's constants on the live engines again (`disagg validate --refit`),
    called before each run that has not begun (`refit.before_run`: a finished run is kept as it is,
    one begun and not finished is refused). Each repeat is then simulated with the constants its
    run judged with, minutes old rather than as old as the app, and a cell's prediction is the
    median over its repeats: the host's drift between a fit and a run, and one fit's noise, are
    not counted as the model's error."""
    check(cfg)
    if refit is not None and cfg.cost_model is not None:
        raise BenchError("--refit re-fits the router's own constants: drop --cost-model")
    slices = {"url": cfg.url, "traces": list(cfg.traces), "policies": list(cfg.policies), "rates": list(cfg.rates),
              "repeats": cfg.repeats, "max_requests": cfg.max_requests, "seed": cfg.seed,
              "cost_model": cfg.cost_model or "app"}
    per_repeat = cfg.at_measured_speed or refit is not None
    runs, sims = {}, {}
    for repeat, rate in run_order(cfg.rates, cfg.repeats):
        out = folder(cfg.out, repeat, rate)
        done = before_run(out, refit, log) if refit is not None else None
        log(f"repeat {repeat + 1} of {cfg.repeats}, {rate:g} req/s → {out}")
        if done is None:
            run_bench(BenchConfig(
                out=out, traces=cfg.traces, policies=cfg.policies, url=cfg.url, rate=rate,
                max_requests=cfg.max_requests, seed=cfg.seed, sim=repeat == 0 and not per_repeat,
                cost_model=cfg.cost_model, realtime=cfg.realtime, request_timeout_s=cfg.request_timeout_s),
                progress=progress, log=log)
        runs[(repeat, rate)] = out
        if per_repeat:  # the constants this run judged with (at the speed its check measured, if asked)
            sims[(repeat, rate)] = simulate_live_run(out, slices, load_profile(out / COST_MODEL_FILE),
                                                     folder(cfg.out / SIM_FOLDER, repeat, rate),
                                                     cfg.at_measured_speed, log)
    report = summarize(runs, cfg.within, sims or None)
    report["settings"] = {**slices, "at_measured_speed": cfg.at_measured_speed, "refit": refit is not None}
    return _write(report, cfg.out)


def _write(report: dict, out: Path) -> dict:
    report = json_safe(report)
    write_json_atomic(out / RESULTS_JSON, report)
    write_text_atomic(out / RESULTS_MD, markdown(report))
    plot(report, out / FIGURE)
    return report


def simulate_live_run(live: Path, slices: dict, cm: CostModel, out: Path, at_measured_speed: bool,
                      log: Callable[[str], None]) -> Path:
    """The simulator alone on a finished live bench run of a validate (`slices`: its settings, the
    traces, policies, request count and seed), at the run's rate, topology and router replicas, with
    `cm`'s constants judged against the run's SLO targets (so attainment compares like with like).
    `at_measured_speed`: with the engines' step times scaled to what the run's constants check
    measured just before its load (`constants_check.at_measured_speed`). Returns `out`."""
    results = live / "results.json"
    try:
        run = json.loads(results.read_text())
        slo, resolved, rate = run["cost_model"]["slo"], run["resolved"], run["settings"]["rate"]
        topology, context = resolved["topology"], resolved["max_model_len"]
        check_record = run["cost_model"].get("constants_check")
    except (OSError, ValueError, KeyError) as e:
        raise BenchError(f"{results} is not a finished live bench run ({e})") from None
    try:
        judged = CostModel.from_dict({**cm.to_dict(), "slo": slo})
    except CostModelError as e:
        raise BenchError(f"{results}: the run's SLO targets: {e}") from None
    speed = ""
    if at_measured_speed:
        if not check_record:
            raise BenchError(f"{results}: the run has no constants check to take the engines' speed from")
        verdict = rejudged(judged, check_record)
        judged = at_measured_speed_of(judged, verdict)
        speed = " at " + ", ".join(f"{k} {r:.2f}×" for k, r in verdict.ratios.items())
    out.mkdir(parents=True, exist_ok=True)
    constants = out / COST_MODEL_FILE
    judged.save(constants)
    log(f"{rate:g} req/s: the simulator with {cm.name}{speed} on {topology} → {out}")
    run_bench(BenchConfig(out=out, traces=tuple(slices["traces"]), policies=tuple(slices["policies"]),
                          rate=rate, max_requests=slices["max_requests"], seed=slices["seed"], sim=True,
                          cost_model=str(constants), topology=topology, routers=resolved.get("routers"),
                          max_model_len=context), log=log)
    return out


def resimulate(measured: Path, cost_model: str, out: Path, log: Callable[[str], None],
               at_measured_speed: bool = False) -> dict:
    """The simulator alone, with other constants, against the live runs of an earlier `disagg
    validate` in `measured`: the same slices at the same rates and topology, judged against the
    SLO targets the live runs were judged with. Compares calibrations, or a changed model, in
    seconds without the app. Once per rate (its first repeat's run), or, `at_measured_speed`, once
    per repeat at the speed its constants check measured."""
    try:
        earlier = json.loads((measured / RESULTS_JSON).read_text())
        settings, within = earlier["settings"], earlier["within"]
    except (OSError, ValueError, KeyError) as e:
        raise BenchError(f"--resimulate {measured}: not the folder of a finished `disagg validate` ({e})") from None
    cm = load_profile(cost_model)  # CostModelError names the file and field
    runs = {(repeat, rate): folder(measured, repeat, rate)
            for repeat in range(settings["repeats"]) for rate in settings["rates"]}
    sims = {(repeat, rate): simulate_live_run(path, settings, cm, folder(out, repeat, rate), at_measured_speed, log)
            for (repeat, rate), path in runs.items() if at_measured_speed or repeat == 0}
    report = summarize(runs, within, sims)
    report["settings"] = {**settings, "cost_model": cost_model, "measured": str(measured),
                          "at_measured_speed": at_measured_speed}
    return _write(report, out)
