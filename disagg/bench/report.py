"""Summaries of a bench folder: results.json, results.md and two PNG plots, all written atomically
(the harness composes them: `disagg.bench.harness.write_results`).

Built from `requests.jsonl` alone (plus the run's settings and gate results), so a resumed or
repeated run reports every request once, whichever invocation sent it. Per (system, policy,
trace): goodput (overall and per SLO class), P50/P99 TTFT and TPOT, P50 e2e, failures, the rate,
and for live runs the generator's send lag (P50/P99) with `send_lag_exceeded` when its P99 is
above the bound (default 50 ms: past that the client, not the app, shapes the arrivals).

Goodput is the share of all requests that met both targets of their SLO class, the targets being
those of the cost-model YAML given with `--cost-model` (see `disagg.bench.harness`). The Markdown
file has one table per figure in the shape of the paper's Table II: a row per policy (simulated
rows marked "(sim)"), a column per trace, and the mean ± standard deviation across traces.
Plots: `goodput.png` (bars per policy, grouped by trace) and `ttft_cdf.png` (TTFT CDF per policy,
one panel per trace; simulator curves dashed). matplotlib runs with the Agg backend.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from disagg.bench.records import to_request_record
from disagg.core.types import SloClass
from disagg.files import write_figure
from disagg.sim.metrics import summarize
from disagg.stats import percentile

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
GOODPUT_PNG = "goodput.png"
TTFT_PNG = "ttft_cdf.png"
SIM_VS_LIVE_METRICS = ("goodput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
TABLE_METRICS = (("goodput", "Goodput (share of requests meeting both SLO targets)", ".3f"),
                 ("ttft_p50_s", "TTFT P50 (s)", ".3f"), ("ttft_p99_s", "TTFT P99 (s)", ".3f"),
                 ("tpot_p50_s", "TPOT P50 (s)", ".4f"), ("tpot_p99_s", "TPOT P99 (s)", ".4f"))


def row_label(system: str, policy: str) -> str:
    """Our policies by name, their simulated runs marked, a baseline system by its own name."""
    if system == "live":
        return policy
    return f"{policy} (sim)" if system == "sim" else system


def summarize_runs(records: Sequence[dict], *, expected: dict[str, int], lag_bound_s: float,
                   order: Sequence[tuple[str, str]], traces: Sequence[str]) -> list[dict]:
    """One summary per (system, policy, trace), in `order` × `traces` order."""
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["system"], r["policy"], r["trace"])].append(r)
    runs = []
    for system, policy in order:
        for trace in traces:
            recs = sorted(groups.get((system, policy, trace), []), key=lambda r: r["index"])
            if not recs:
                continue
            s = summarize([to_request_record(r) for r in recs])
            lags = [r["send_lag_s"] for r in recs if r.get("send_lag_s") is not None]
            lag_p99 = percentile(lags, 99)
            runs.append({
                "system": system, "policy": policy, "trace": trace, "rate": recs[0].get("rate"),
                "expected_requests": expected.get(trace), "complete": len(recs) == expected.get(trace),
                **s,
                "errors": _top_errors(recs),
                "send_lag_p50_s": percentile(lags, 50) if lags else None,
                "send_lag_p99_s": lag_p99 if lags else None,
                "send_lag_exceeded": bool(lags) and lag_p99 > lag_bound_s,
            })
    return runs


def _rel_error(sim, live):
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (sim, live)) and live > 0
    return (sim - live) / live if ok else None


def sim_vs_live(runs: Sequence[dict]) -> list[dict]:
    """Per (policy, trace) run in both systems: the simulator's error against the live measurement.

    TTFT and TPOT errors are signed relative errors of the simulated percentile against the
    measured one ((sim − live) / live: negative = the simulator is optimistic); the goodput
    difference is sim − live, in goodput points.
    """
    live = {(r["policy"], r["trace"]): r for r in runs if r["system"] == "live"}
    rows = []
    for r in runs:
        m = live.get((r["policy"], r["trace"])) if r["system"] == "sim" else None
        if m is None:
            continue
        rows.append({
            "policy": r["policy"], "trace": r["trace"],
            **{f"{k}_live": m.get(k) for k in SIM_VS_LIVE_METRICS},
            **{f"{k}_sim": r.get(k) for k in SIM_VS_LIVE_METRICS},
            "ttft_p50_error": _rel_error(r.get("ttft_p50_s"), m.get("ttft_p50_s")),
            "ttft_p99_error": _rel_error(r.get("ttft_p99_s"), m.get("ttft_p99_s")),
            "tpot_p50_error": _rel_error(r.get("tpot_p50_s"), m.get("tpot_p50_s")),
            "tpot_p99_error": _rel_error(r.get("tpot_p99_s"), m.get("tpot_p99_s")),
            "goodput_difference": (r["goodput"] - m["goodput"]
                                   if r.get("goodput") is not None and m.get("goodput") is not None else None),
        })
    return rows


def _top_errors(recs: Sequence[dict], n: int = 3) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for r in recs:
        if r.get("error"):
            counts[r["error"][:160]] += 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:n])


def table(runs: Sequence[dict], metric: str, traces: Sequence[str]) -> dict[str, dict]:
    """{row label: {trace: value, "mean": m, "spread": population std across traces}}."""
    rows: dict[str, dict] = {}
    for r in runs:
        rows.setdefault(row_label(r["system"], r["policy"]), {})[r["trace"]] = r.get(metric)
    for label, row in rows.items():
        vals = [row[t] for t in traces if isinstance(row.get(t), (int, float)) and math.isfinite(row[t])]
        row["mean"] = statistics.fmean(vals) if vals else None
        row["spread"] = statistics.pstdev(vals) if len(vals) > 1 else (0.0 if vals else None)
    return rows


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return format(v, spec)


def markdown(results: dict) -> str:
    traces = list(results["traces"])
    slo = results["cost_model"]["slo"]
    lines = ["# disagg bench", ""]
    s = results["settings"]
    mode = " + ".join(m for m in ("live", "sim") if s[m])
    lines.append(f"Mode: {mode}. Traces: " + ", ".join(
        f"{t} ({i['requests']} requests at {_fmt(i['rate'], '.3g')} req/s)" for t, i in results["traces"].items())
        + f". Seed {s['seed']}, tight share {s['tight_share']}.")
    if s.get("slo_scale") is not None:
        targets = (f"each request's targets {s['slo_scale']:g} × its own unloaded TTFT and TPOT by these "
                   f"constants (SLO scale)")
    else:
        targets = (f"tight TTFT {slo['tight']['ttft_s'] * 1e3:.0f} ms / TPOT {slo['tight']['tpot_s'] * 1e3:.1f} ms, "
                   f"loose TTFT {slo['loose']['ttft_s'] * 1e3:.0f} ms / TPOT {slo['loose']['tpot_s'] * 1e3:.1f} ms")
    lines.append(f"Goodput judged with cost model `{results['cost_model']['name']}`: {targets}."
                 + (f" Simulated topology {results['resolved'].get('topology')}." if s["sim"] else ""))
    lines.append("")
    if results["gates"]:
        lines += ["## Correctness gates", "", "| gate | passed | detail |", "| --- | --- | --- |"]
        lines += [f"| {g['name']} | {'yes' if g['passed'] else '**no**'} | {g['detail']} |" for g in results["gates"]]
        lines.append("")
    for metric, title, spec in TABLE_METRICS if results["runs"] else ():  # a --capacity run has none
        rows = results["tables"][metric]
        lines += [f"## {title}", "", "| policy or system | " + " | ".join(traces) + " | mean ± std |",
                  "| --- | " + " | ".join("---" for _ in traces) + " | --- |"]
        for label, row in rows.items():
            cells = [_fmt(row.get(t), spec) for t in traces]
            mean = _fmt(row["mean"], spec) + (f" ± {_fmt(row['spread'], spec)}" if row["spread"] is not None else "")
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {mean} |")
        lines.append("")
    lines += capacity_markdown(results["resolved"], traces)
    if results.get("sim_vs_live"):
        lines += ["## Simulated vs measured", "",
                  "Signed relative error of the simulator against the live app ((sim − live) / live; negative: "
                  "the simulator is optimistic); goodput as sim − live.", "",
                  "| policy | trace | TTFT p50 live → sim | error | TTFT p99 error | TPOT p50 live → sim | error "
                  "| TPOT p99 error | goodput live → sim | difference |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        pct = lambda v: _fmt(v * 100 if v is not None else None, "+.0f") + ("%" if v is not None else "")  # noqa: E731
        for d in results["sim_vs_live"]:
            lines.append(
                f"| {d['policy']} | {d['trace']} | {_fmt(d['ttft_p50_s_live'], '.3f')} → "
                f"{_fmt(d['ttft_p50_s_sim'], '.3f')} s | {pct(d['ttft_p50_error'])} | {pct(d['ttft_p99_error'])} | "
                f"{_fmt(d['tpot_p50_s_live'] * 1e3 if d['tpot_p50_s_live'] is not None else None, '.1f')} → "
                f"{_fmt(d['tpot_p50_s_sim'] * 1e3 if d['tpot_p50_s_sim'] is not None else None, '.1f')} ms | "
                f"{pct(d['tpot_p50_error'])} | {pct(d['tpot_p99_error'])} | {_fmt(d['goodput_live'], '.3f')} → "
                f"{_fmt(d['goodput_sim'], '.3f')} | {_fmt(d['goodput_difference'], '+.3f')} |")
        lines.append("")
    lines += ["## Runs", "", "| system | policy | trace | rate req/s | requests | failed | goodput | tight | loose "
              "| TTFT p50 s | TTFT p99 s | TPOT p50 s | TPOT p99 s | send lag p99 ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["runs"]:
        lag = _fmt(r["send_lag_p99_s"] * 1e3 if r["send_lag_p99_s"] is not None else None, ".1f")
        if r["send_lag_exceeded"]:
            lag = f"**{lag}** (over bound)"
        count = f"{r['requests']}" + ("" if r["complete"] else f" of {r['expected_requests']}")
        lines.append(f"| {r['system']} | {r['policy']} | {r['trace']} | {_fmt(r['rate'], '.3g')} | {count} | "
                     f"{r['failed']} | {_fmt(r['goodput'], '.3f')} | {_fmt(r['goodput_tight'], '.3f')} | "
                     f"{_fmt(r['goodput_loose'], '.3f')} | {_fmt(r['ttft_p50_s'], '.3f')} | "
                     f"{_fmt(r['ttft_p99_s'], '.3f')} | {_fmt(r['tpot_p50_s'], '.4f')} | "
                     f"{_fmt(r['tpot_p99_s'], '.4f')} | {lag} |")
    lines.append("")
    if results["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in results["warnings"]] + [""]
    return "\n".join(lines)


def capacity_markdown(resolved: dict, traces: Sequence[str]) -> list[str]:
    """The SLO-capacity table of a `--capacity` run: req/s per policy and trace, live and simulated."""
    live, sim = resolved.get("capacity") or {}, resolved.get("capacity_sim") or {}
    if not live and not sim:
        return []
    policies = list(dict.fromkeys([p for t in traces for p in live.get(t, {})] + [p for t in traces for p in sim.get(t, {})]))
    attainment = next((c.get("attainment") for d in (live, sim) for t in d.values() for c in t.values()
                       if c.get("attainment")), None)

    def cell(found: dict | None) -> str:
        if not found:
            return "–"
        if "capacity_rps" not in found:
            return f"unfinished ({len(found.get('probes', []))} probes)"
        cap = found["capacity_rps"]
        text = f"{cap:.3g}" if cap else "none"
        return text if found.get("bracketed") else f"{text} (not bracketed)"

    lines = [f"## SLO capacity (req/s at which ≥ {attainment:.0%} of requests meet both targets)", "",
             "| policy | " + " | ".join(f"{t} live | {t} sim" for t in traces) + " |",
             "| --- | " + " | ".join("--- | ---" for _ in traces) + " |"]
    for p in policies:
        lines.append(f"| {p} | " + " | ".join(f"{cell(live.get(t, {}).get(p))} | {cell(sim.get(t, {}).get(p))}"
                                             for t in traces) + " |")
    return lines + [""]


# --- files -------------------------------------------------------------------------------------


def plot_goodput(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["tables"]["goodput"]
    traces = list(results["traces"])
    groups = traces + (["mean"] if len(traces) > 1 else [])
    labels = list(rows)
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 1.0 * len(groups) * max(1, len(labels)) * 0.45), 4.2))
    cmap = plt.get_cmap("tab10")
    for k, label in enumerate(labels):
        vals = [rows[label].get(g) for g in groups]
        xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(groups))]
        ys = [v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0 for v in vals]
        ax.bar(xs, ys, width * 0.95, label=label, color=cmap(k % 10), hatch="//" if label.endswith("(sim)") else None,
               edgecolor="white" if not label.endswith("(sim)") else "black", linewidth=0.5)
        if len(groups) > 1 and rows[label]["spread"] is not None:
            ax.errorbar([xs[-1]], [ys[-1]], yerr=[rows[label]["spread"]], fmt="none", ecolor="black", capsize=3,
                        linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("goodput (share meeting both SLOs)")
    ax.set_title("Goodput per policy and trace")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    write_figure(fig, path, bbox_inches="tight")
    plt.close(fig)


def plot_ttft_cdf(records: Sequence[dict], results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(results["traces"])
    labels = list(results["tables"]["goodput"])
    fig, axes = plt.subplots(1, len(traces), figsize=(5.2 * len(traces), 4.0), squeeze=False)
    cmap = plt.get_cmap("tab10")
    by: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in records:
        if r.get("ttft_s") is not None:
            by[(row_label(r["system"], r["policy"]), r["trace"])].append(r["ttft_s"])
    slo = results["cost_model"]["slo"]
    scaled = results["settings"].get("slo_scale") is not None  # no one target line: each request has its own
    for ax, trace in zip(axes[0], traces):
        any_line = False
        for k, label in enumerate(labels):
            xs = sorted(by.get((label, trace), []))
            if not xs:
                continue
            any_line = True
            n = len(xs)
            ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=label, color=cmap(k % 10),
                    linestyle="--" if label.endswith("(sim)") else "-")
        for cls, ls in ((SloClass.TIGHT.value, ":"), (SloClass.LOOSE.value, "-.")) if not scaled else ():
            ax.axvline(slo[cls]["ttft_s"], color="grey", linestyle=ls, linewidth=0.8, label=f"{cls} TTFT target")
        if any_line:
            from matplotlib.ticker import NullFormatter

            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0, 1.01)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"TTFT CDF — {trace}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    write_figure(fig, path, bbox_inches="tight")
    plt.close(fig)
