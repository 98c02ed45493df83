"""The `disagg` command line: simulate, run studies, fetch traces, train the accuracy table, build the tiny model.

Every subcommand validates all of its input before it does any work, and writes its output files
atomically: a bad flag or a bad trace row gives one clear message (file, line, field) and exit
status 2, never a traceback and never half a file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from disagg.core.cost_model import CostModelError, load_profile
from disagg.core.policies import PolicyError, known_policies
from disagg.core.types import Role, SloClass
from disagg.files import json_safe, write_json_atomic
from disagg.sim import studies
from disagg.sim.simulator import Topology
from disagg.sim.traces import TraceError, read_trace, trace_stats
from disagg.user_input import UsageError, data_dir, parse_policies, resolve_trace

DEFAULT_POLICIES = "round_robin,least_loaded,length_heuristic,marginal_cost,oracle"


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = max(1, total), label, 0
        self.enabled = sys.stderr.isatty()
        self._shown = -1

    def __call__(self, n: int) -> None:
        self.done += n
        pct = int(100 * self.done / self.total)
        if self.enabled and pct != self._shown:
            self._shown = pct
            bar = "#" * (pct // 4)
            sys.stderr.write(f"\r{self.label:<20} [{bar:<25}] {pct:3d}%")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def fmt_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """rows of dicts → an aligned text table; columns are (key, header, format)."""
    head = [h for _, h, _ in columns]
    body = []
    for r in rows:
        line = []
        for key, _, fmt in columns:
            v = r.get(key)
            line.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt))
        body.append(line)
    widths = [max(len(head[i]), *(len(b[i]) for b in body)) if body else len(head[i]) for i in range(len(head))]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(out)


SIM_COLUMNS = [
    ("policy", "policy", "s"),
    ("goodput", "goodput", ".3f"),
    ("ttft_p50_s", "TTFT p50 s", ".3f"),
    ("ttft_p99_s", "TTFT p99 s", ".3f"),
    ("tpot_p50_s", "TPOT p50 s", ".4f"),
    ("tpot_p99_s", "TPOT p99 s", ".4f"),
    ("failed", "failed", "d"),
    ("decision_us_p50", "decide µs p50", ".1f"),
]


# --- subcommands -----------------------------------------------------------------------------


CAPACITY_BOUND = "oracle"  # true output lengths: what a perfect predictor would reach


def capacity_label(cap: dict) -> str:
    """The table cell of one capacity search: the rate, or which side of the bracket it fell off."""
    if cap["capacity_rps"] is None:
        return f"<{cap['bracket'][1]:.2f}"
    return f"{cap['capacity_rps']:.2f}" if cap["bracketed"] else f">={cap['capacity_rps']:.2f}"


def check_sim_args(args) -> None:
    """Refuse bad `disagg sim` flags before any work, naming the flag."""
    if args.routers < 1:
        raise UsageError(f"--routers must be an integer >= 1 (router replicas sharing the arrivals), "
                         f"got {args.routers}")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be a finite number > 0, got {args.rate}")
    if args.max_requests < 0:
        raise UsageError(f"--max-requests must be >= 0 (0 = all), got {args.max_requests}")
    if not 0.0 <= args.tight_share <= 1.0:
        raise UsageError(f"--tight-share must be in [0, 1], got {args.tight_share}")
    if not 0.0 <= args.predictor_error <= 10.0:
        raise UsageError(f"--predictor-error must be in [0, 10], got {args.predictor_error}")


def capacity_settings(args) -> tuple[float, int] | None:
    """(attainment, bisection steps) of `disagg sim --capacity`, None without it; bad values refused.
    The flags default to None so that one given without --capacity is caught, not silently ignored."""
    if not args.capacity:
        for flag, value in (("--attainment", args.attainment), ("--capacity-steps", args.capacity_steps)):
            if value is not None:
                raise UsageError(f"{flag} needs --capacity")
        return None
    attainment = 0.9 if args.attainment is None else args.attainment
    steps = 8 if args.capacity_steps is None else args.capacity_steps
    if not 0.0 < attainment <= 1.0:
        raise UsageError(f"--attainment must be a share in (0, 1], got {attainment}")
    if not 0 <= steps <= 30:
        raise UsageError(f"--capacity-steps must be an integer in [0, 30], got {steps}")
    return attainment, steps


def cmd_sim(args) -> int:
    from disagg.sim.runner import CAPACITY_MAX_DOUBLINGS, compare, find_capacity, find_saturation

    check_sim_args(args)
    cap_settings = capacity_settings(args)
    policies = parse_policies(args.policies)
    bound_added = cap_settings is not None and CAPACITY_BOUND not in policies
    if bound_added:
        policies.append(CAPACITY_BOUND)
    try:
        topology = Topology.parse(args.topology)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cost_model = load_profile(args.cost_model)
    trace = read_trace(resolve_trace(args.trace), args.format)
    if args.max_requests:
        trace = trace[: args.max_requests]
    if cap_settings and trace_stats(trace)["mean_rate"] <= 0:
        raise UsageError(f"--capacity: the trace has no arrival rate to start from ({len(trace)} requests, "
                         "span 0 s); it needs at least 2 requests arriving at different times")
    saturation = None
    rate = args.rate
    if args.saturation:
        saturation = find_saturation(trace, cost_model, topology, tight_share=args.tight_share, seed=args.seed)
        rate = saturation["rate"]
        print(f"saturation rate (round robin mid-collapse): {rate:.2f} req/s", file=sys.stderr)
    bar = Progress(len(trace) * len(policies), "simulating")
    results = compare(trace, cost_model, topology, policies, rate=rate, tight_share=args.tight_share,
                      seed=args.seed, predictor_error=args.predictor_error, progress=bar, routers=args.routers)
    effective_rate = rate if rate is not None else trace_stats(trace)["mean_rate"]
    columns, capacity = SIM_COLUMNS, None
    if cap_settings:
        attainment, steps = cap_settings
        for name in policies:
            cap = find_capacity(trace, cost_model, topology, name, attainment=attainment,
                                steps=steps, tight_share=args.tight_share, seed=args.seed,
                                predictor_error=args.predictor_error, routers=args.routers)
            cap["bound"] = name == CAPACITY_BOUND
            results[name]["capacity_rps"] = cap["capacity_rps"]
            results[name]["capacity"] = cap
            print(f"capacity {name}: {capacity_label(cap)} req/s ({len(cap['probes'])} probes)", file=sys.stderr)
        capacity = {"attainment": attainment, "steps": steps,
                    "max_doublings": CAPACITY_MAX_DOUBLINGS, "start_rps": trace_stats(trace)["mean_rate"],
                    "bound_policy": CAPACITY_BOUND, "bound_added": bound_added}
        columns = [*SIM_COLUMNS, ("capacity_cell", "capacity req/s", "s")]
    rows = [{"policy": f"{n} (bound)" if capacity and n == CAPACITY_BOUND else n, **s,
             **({"capacity_cell": capacity_label(s["capacity"])} if capacity else {})}
            for n, s in results.items()]
    print(f"trace={args.trace} requests={len(trace)} topology={topology} rate={effective_rate:.2f} req/s "
          f"cost_model={cost_model.name} seed={args.seed} routers={args.routers}")
    if capacity:
        print(f"capacity = highest rate with >= {attainment:.0%} of requests meeting both TTFT and TPOT "
              f"targets (from {capacity['start_rps']:.2f} req/s, {steps} bisection steps); "
              f"{CAPACITY_BOUND} (true output lengths) is the bound" + (", added to the run" if bound_added else ""))
    print(fmt_table(rows, columns))
    if args.json:
        total_req = sum(s["requests"] for s in results.values())
        total_wall = sum(s["sim_wall_s"] for s in results.values())
        write_json_atomic(Path(args.json), json_safe({
            "trace": str(args.trace), "topology": str(topology), "cost_model": cost_model.name,
            "seed": args.seed, "rate": effective_rate, "saturation": saturation, "routers": args.routers,
            "capacity": capacity, "policies": results,
            "sim_requests_per_s": total_req / total_wall if total_wall else None,
        }))
    return 0


def cmd_traces_download(args) -> int:
    from disagg.sim.download import download_traces

    for path in download_traces(Path(args.dest), args.name):
        print(path)
    return 0


def cmd_traces_generate(args) -> int:
    from disagg.sim.traces import write_native
    from disagg.sim.workloads import generate

    if args.requests < 1:
        raise UsageError(f"--requests must be >= 1, got {args.requests}")
    if not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be a positive finite req/s, got {args.rate}")
    try:
        trace = generate(args.workload, args.requests, args.rate, args.seed, args.max_context_tokens)
    except ValueError as e:  # an unknown name: the message lists the known ones
        raise UsageError(str(e)) from None
    write_native(Path(args.out), trace)
    print(f"{args.out}: {len(trace)} requests of {args.workload} at {args.rate:g} req/s (seed {args.seed})")
    return 0


def cmd_traces_stats(args) -> int:
    trace = read_trace(resolve_trace(args.trace), args.format)
    print(json.dumps(json_safe(trace_stats(trace)), indent=2))
    return 0


def cmd_study(args) -> int:
    return studies.main(args)


def cmd_accuracy_train(args) -> int:
    """Train an AccuracyTable from an evaluations CSV; every row is checked before anything is written."""
    from disagg.core.utility import AccuracyTable, EvaluationError, read_evaluations

    if not (args.shrinkage >= 0 and math.isfinite(args.shrinkage)):
        raise UsageError(f"--shrinkage must be a finite number >= 0, got {args.shrinkage!r}")
    if not (0.0 <= args.default_prior <= 1.0):
        raise UsageError(f"--default-prior must be in [0, 1], got {args.default_prior!r}")
    try:
        rows = read_evaluations(args.evaluations)
        if not rows:
            raise UsageError(f"{args.evaluations}: no evaluation rows (only a header)")
        table = AccuracyTable(shrinkage=args.shrinkage, default_prior=args.default_prior).train(rows)
    except EvaluationError as e:
        raise UsageError(str(e)) from None
    table.save(args.out)
    per_model = ", ".join(f"{m}: {table.count(m)} rows, mean {table.model_mean(m):.3f}" for m in table.models)
    print(f"wrote {args.out} ({len(rows)} evaluations; {per_model})")
    return 0


def cmd_accuracy_synth(args) -> int:
    from disagg.sim.synthetic_accuracy import synthetic_evaluations, write_evaluations

    if args.rows_per_model < 1:
        raise UsageError(f"--rows-per-model must be >= 1, got {args.rows_per_model}")
    rows = synthetic_evaluations(args.rows_per_model, args.seed)
    write_evaluations(args.out, rows)
    print(f"wrote {args.out} ({len(rows)} SYNTHETIC evaluations, seed {args.seed})")
    return 0


def _check_reachable(url: str) -> None:
    """Before minutes of work that need the app: is it there and ready?"""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            if r.status == 200:
                return
            raise UsageError(f"{url}/health answered {r.status}; the app is not ready")
    except urllib.error.HTTPError as e:
        raise UsageError(f"{url}/health answered {e.code}; the app is not ready") from None
    except (urllib.error.URLError, OSError) as e:
        raise UsageError(f"cannot reach {url}: {e}") from None


def cmd_calibrate(args) -> int:
    if args.live:
        return cmd_calibrate_live(args)
    if args.config is None:
        raise UsageError("--config is required (the Serve config whose engine settings to calibrate), "
                         "unless --live measures a running app's own engines")
    return cmd_calibrate_engines(args)


def cmd_calibrate_live(args) -> int:
    """`disagg calibrate --live`: every running instance of one model, through the app (`calibration.live`)."""
    import asyncio
    import statistics
    from datetime import datetime, timezone

    from calibration.fit import CalibrationError, fit_fleet, serving_overhead
    from calibration.live import LiveCalibrationError, calibrate_fleet
    from calibration.measure import SERVING_PROBE_TOKENS, serving_path_gaps

    if args.url is None:
        raise UsageError("--live measures a running app: give its --url")
    if args.config is not None:
        raise UsageError("--live reads the fleet from the app itself (/admin/state): leave out --config")
    if not 0.0 <= args.pause_s <= 2.0:
        raise UsageError(f"--pause-s must be in [0, 2] s, got {args.pause_s!r}")
    if not 0.0 < args.budget_s <= 3600.0:
        raise UsageError(f"--budget-s must be in (0, 3600] s, got {args.budget_s!r}")
    if args.url_requests < 3:
        raise UsageError(f"--url-requests must be >= 3, got {args.url_requests}")
    url = args.url.rstrip("/")
    _check_reachable(url)
    out = Path(args.out)
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        fleet, samples, seconds = asyncio.run(calibrate_fleet(
            url, args.model, args.quick, args.pause_s, args.budget_s, args.seed,
            lambda total: Progress(total, "calibrating the fleet")))
        gaps = asyncio.run(serving_path_gaps(url, SERVING_PROBE_TOKENS, args.url_requests, seed=args.seed))
        overhead = serving_overhead([g for _, g in gaps])
        cm, fits = fit_fleet(samples, fleet.cost_model, args.name or f"live-{fleet.model}", fleet.source,
                             overhead, measured_at)
    except CalibrationError as e:
        raise UsageError(f"calibration failed, nothing written: {e}") from None
    except (LiveCalibrationError, RuntimeError, OSError) as e:
        raise UsageError(f"measuring the fleet failed, nothing written: {e}") from None
    cm.save(out)
    rows = [{"instance": iid, "role": fleet.instances[iid], "tau_pre": f.engine.prefill_token_s * 1e6,
             "attention": f.engine.prefill_attention_s * 1e9, "base": f.engine.step_base_s * 1e3,
             "seq": f.engine.decode_seq_s * 1e6, "r2": f.prefill.r2, "held": f.held_out["median_rel_error"],
             "held90": f.held_out["p90_rel_error"]} for iid, f in fits.items()]
    print(fmt_table(rows, [("instance", "instance", "s"), ("role", "role", "s"), ("tau_pre", "τ_pre µs/tok", ".2f"),
                           ("attention", "attn ns/pair", ".3g"), ("base", "step base ms", ".3f"),
                           ("seq", "τ_seq µs", ".1f"), ("r2", "prefill R²", ".4f"),
                           ("held", "held-out p50", ".1%"), ("held90", "held-out p90", ".1%")]))
    held = statistics.median(f.held_out["median_rel_error"] for f in fits.values())
    t, l = cm.slo[SloClass.TIGHT], cm.slo[SloClass.LOOSE]
    print(f"\nserving path: {overhead * 1e3:.1f} ms outside the engines (median of {len(gaps)} lone requests)")
    print(f"SLO tight TTFT {t.ttft_s * 1e3:.0f} ms / TPOT {t.tpot_s * 1e3:.1f} ms; "
          f"loose TTFT {l.ttft_s * 1e3:.0f} ms / TPOT {l.tpot_s * 1e3:.1f} ms; KV transfer kept from "
          f"{fleet.cost_model.name!r}")
    print(f"held-out median relative error, median over {len(fits)} instances: {held:.1%}")
    print(f"wrote {out} ({len(fits)} instances of {fleet.model}, measured {measured_at}) in {seconds:.0f} s of probes")
    if args.report:
        write_json_atomic(Path(args.report), {"instances": {iid: f.as_dict() for iid, f in fits.items()},
                                              "held_out_median": held, "seconds": seconds,
                                              "serving_overhead_s": overhead, "cost_model": cm.to_dict()})
    if args.apply:
        _apply_cost_model(url, out, fleet.model)
    return 0


def _apply_cost_model(url: str, path: Path, model: str) -> None:
    """Have every router replica reload the file it was just written to (`POST /admin/cost_model`)."""
    import httpx

    from disagg.bench.loadgen import AppAuth, error_message

    try:
        r = httpx.post(f"{url}/admin/cost_model", json={"cost_model": str(path.resolve()), "model": model},
                       auth=AppAuth(), trust_env=False, timeout=60.0)
    except httpx.HTTPError as e:
        raise UsageError(f"wrote {path}, but could not apply it: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise UsageError(f"wrote {path}, but the router refused to load it ({r.status_code}): {error_message(r)}")
    print(f"applied: router replicas {', '.join(r.json().get('routers', []))} price with {path} now")


def cmd_calibrate_engines(args) -> int:
    import asyncio

    import statistics

    from calibration.fit import CalibrationError, fit_cost_model, held_out_error, serving_overhead
    from calibration.measure import (
        SERVING_PROBE_TOKENS, Calibrator, GpuShortage, Plan, gpu_assignment, serving_path_gaps, visible_gpus,
    )
    from serve_app.config import ConfigError, load_serve_config

    try:
        apps = load_serve_config(args.config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    served = {cfg.model.served_name: cfg for _, cfg in apps}
    if args.model is not None:
        if args.model not in served:
            raise UsageError(f"--model {args.model!r}: {args.config} serves {', '.join(served)}")
        cfg = served[args.model]
    elif len(served) > 1:
        raise UsageError(f"{args.config} serves {len(served)} models ({', '.join(served)}); each is calibrated "
                         "on its own engines: pick one with --model")
    else:
        cfg = apps[0][1]
    out = Path(args.out)
    if cfg.engine.device == "cuda":  # refused before anything starts: two engines on one GPU fail late
        try:
            gpu_assignment(visible_gpus(), cfg.pool_of(Role.PREFILL).tensor_parallel_size,
                           cfg.pool_of(Role.DECODE).tensor_parallel_size)
        except GpuShortage as e:
            raise UsageError(str(e)) from None
    if args.url is not None:
        _check_reachable(args.url.rstrip("/"))
    if args.url_requests < 3:
        raise UsageError(f"--url-requests must be >= 3, got {args.url_requests}")
    plan = Plan.for_context(cfg.model.max_model_len, cfg.engine.max_num_seqs, args.quick)
    bar = Progress(plan.steps(), "calibrating")
    print(f"calibrating {cfg.model.source} on {cfg.engine.device} ({'quick' if args.quick else 'full'}): "
          f"prompts {plan.prefill_lengths} ×{plan.repeats}, concurrency {plan.concurrencies}", file=sys.stderr)
    try:
        result = asyncio.run(Calibrator(cfg, seed=args.seed).run(plan, bar))
        name = args.name or f"calibrated-{cfg.model.served_name}"
        cm, report = fit_cost_model(result.measurements, name=name)
        held = held_out_error(cm.engine, result.held_out_prefill, result.held_out_decode)
        if args.url:
            gaps = asyncio.run(serving_path_gaps(args.url.rstrip("/"), SERVING_PROBE_TOKENS, args.url_requests,
                                                 seed=args.seed))
            ttfts = [t for t, _ in gaps]
            overhead = serving_overhead([g for _, g in gaps])
            cm, report = fit_cost_model(result.measurements, name=name, serving_overhead_s=overhead)
            print(f"serving path ({args.url}): median client TTFT {statistics.median(ttfts) * 1e3:.1f} ms over "
                  f"{len(ttfts)} lone {SERVING_PROBE_TOKENS}-token requests, of which outside the engines "
                  f"{overhead * 1e3:.1f} ms", file=sys.stderr)
    except CalibrationError as e:
        raise UsageError(f"calibration failed, nothing written: {e}") from None
    except (RuntimeError, OSError) as e:
        raise UsageError(f"measuring the serving path failed, nothing written: {e}") from None
    cm.save(out)
    print(fmt_table([{"fit": k, **fit} for k, fit in report.as_dict().items()],
                    [("fit", "fit", "s"), ("slope", "slope", ".3g"), ("intercept", "intercept s", ".3g"),
                     ("r2", "R²", ".4f"), ("n", "points", "d"), ("residual_p50", "|resid| p50", ".1%"),
                     ("residual_p90", "|resid| p90", ".1%")]))
    e = cm.engine
    print(f"\nτ_pre {e.prefill_token_s * 1e6:.2f} µs/token, attention {e.prefill_attention_s * 1e9:.3g} ns per "
          f"(token, context token), step base {e.step_base_s * 1e3:.3f} ms, "
          f"τ_seq {e.decode_seq_s * 1e6:.1f} µs/sequence, KV {e.kv_capacity_tokens} tokens, "
          f"transfer {cm.transfer.latency_s * 1e3:.2f} ms + {cm.transfer.tokens_per_s:,.0f} tokens/s, "
          f"serving path {cm.serving_overhead_s * 1e3:.1f} ms" + ("" if args.url else " (not measured: no --url)"))
    t, l = cm.slo[SloClass.TIGHT], cm.slo[SloClass.LOOSE]
    print(f"SLO tight TTFT {t.ttft_s * 1e3:.0f} ms / TPOT {t.tpot_s * 1e3:.1f} ms; "
          f"loose TTFT {l.ttft_s * 1e3:.0f} ms / TPOT {l.tpot_s * 1e3:.1f} ms")
    print(f"held-out ({held['n']} requests not in the fit): median relative error {held['median_rel_error']:.1%}, "
          f"p90 {held['p90_rel_error']:.1%}")
    print(f"wrote {out} in {result.seconds:.0f} s")
    if args.report:
        write_json_atomic(Path(args.report), {"fit": report.as_dict(), "held_out": held, "seconds": result.seconds,
                                              "cost_model": cm.to_dict()})
    return 0


def cmd_check_config(args) -> int:
    from serve_app.config import ConfigError, load_serve_config

    try:
        apps = load_serve_config(args.config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for name, cfg in apps:
        pools = " + ".join(f"{pool.num_replicas} {role}" + (f" (TP {pool.tensor_parallel_size})"
                                                             if pool.tensor_parallel_size > 1 else "")
                           for role, pool in cfg.pools().items())
        cm = cfg.router.cost_model
        cm = f"{cm.get('name', '?')} (inline)" if isinstance(cm, dict) else cm
        print(f"{args.config}: application {name!r} ok: {pools} on {cfg.engine.device}, model {cfg.model.source}, "
              f"policy {cfg.router.policy}, cost model {cm}")
    return 0


def cmd_tiny_model(args) -> int:
    from serve_app.tiny_model import build_tiny_model

    print(build_tiny_model(Path(args.dest) if args.dest else None, size=args.size))
    return 0


def cmd_bench(args) -> int:
    """`disagg bench`: policies against the live app and/or the simulator (disagg/bench/harness.py)."""
    from disagg.bench.harness import BenchConfig, BenchError, GateFailed, parse_baseline, run_bench
    from disagg.bench.report import capacity_markdown

    if args.url is None and not args.sim:
        raise UsageError("give --url (the live app) and/or --sim")
    if args.rate is not None and args.rate <= 0:
        raise UsageError(f"--rate must be > 0, got {args.rate}")
    traces = [str(resolve_trace(t)) for spec in args.trace for t in spec.split(",") if t.strip()]
    try:
        baselines = tuple(parse_baseline(b) for b in args.baseline)
    except BenchError as e:
        raise UsageError(str(e)) from None
    cfg = BenchConfig(
        out=Path(args.out), traces=tuple(traces), policies=tuple(parse_policies(args.policies)),
        url=args.url.rstrip("/") if args.url else None, fmt=args.format, rate=args.rate,
        saturation=args.saturation, duration_s=args.duration, max_requests=args.max_requests or None,
        tight_share=args.tight_share, seed=args.seed, sim=args.sim, cost_model=args.cost_model,
        topology=args.topology, max_model_len=args.max_model_len, request_timeout_s=args.request_timeout,
        lag_bound_s=args.lag_bound_ms / 1e3, probe_requests=args.probe_requests,
        probe_seconds=args.probe_seconds, probe_iterations=args.probe_iterations, realtime=args.realtime,
        baselines=baselines, capacity=args.capacity, capacity_steps=args.capacity_steps,
    )
    try:
        results = run_bench(cfg, progress=lambda total, label: Progress(total, label))
    except GateFailed as e:
        print(f"disagg: {e}", file=sys.stderr)
        return 1
    except BenchError as e:
        raise UsageError(str(e)) from None
    traces = list(results["traces"])
    rows = []
    for label, row in results["tables"]["goodput"].items():
        rows.append({"policy": label, **{t: row.get(t) for t in traces}, "mean": row.get("mean"),
                     "spread": row.get("spread")})
    if results["runs"]:  # none in a --capacity run
        print("goodput (share of requests meeting both SLO targets of cost model "
              f"{results['cost_model']['name']}):")
        print(fmt_table(rows, [("policy", "policy", "s"), *((t, t, ".3f") for t in traces), ("mean", "mean", ".3f"),
                               ("spread", "± std", ".3f")]))
        print()
        print(fmt_table(results["runs"], [("system", "system", "s"), ("policy", "policy", "s"), ("trace", "trace", "s"),
                                          ("requests", "requests", "d"), ("failed", "failed", "d"),
                                          ("goodput", "goodput", ".3f"), ("ttft_p50_s", "TTFT p50 s", ".3f"),
                                          ("ttft_p99_s", "TTFT p99 s", ".3f"), ("tpot_p50_s", "TPOT p50 s", ".4f"),
                                          ("tpot_p99_s", "TPOT p99 s", ".4f"), ("send_lag_p99_s", "lag p99 s", ".4f")]))
    capacity = capacity_markdown(results["resolved"], traces)
    if capacity:
        print("\n" + "\n".join(capacity))
    for w in results["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(f"\nwrote {cfg.out}/results.json, results.md, requests.jsonl, goodput.png, ttft_cdf.png")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="disagg", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("sim", help="compare routing policies in the discrete-event simulator")
    sim.add_argument("--trace", required=True, help="trace file, or a name in $DISAGG_TRACE_DIR")
    sim.add_argument("--format", default="auto", help="azure|mooncake|burstgpt|native|auto (default)")
    sim.add_argument("--topology", default="2P4D", help="e.g. 2P4D: 2 prefill and 4 decode instances")
    sim.add_argument("--policies", default=DEFAULT_POLICIES,
                     help=f"comma-separated NAME or NAME:key=value[:key=value] (e.g. slo_goodput:allow_hosted=false); "
                          f"known: {','.join(known_policies())}")
    rate = sim.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="rescale the trace to this mean arrival rate (req/s)")
    rate.add_argument("--saturation", action="store_true", help="run at the rate where round robin is mid-collapse")
    sim.add_argument("--cost-model", default="a40", help="shipped profile name (a40, cpu-tiny) or a YAML file")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--tight-share", type=float, default=0.5, help="share of requests in the tight SLO class")
    sim.add_argument("--predictor-error", type=float, default=0.0, help="relative output-length error (1.5 = 150%%)")
    sim.add_argument("--max-requests", type=int, default=0, help="use only the first N requests (0 = all)")
    sim.add_argument("--routers", type=int, default=1,
                     help="router replicas sharing the arrivals in turn, each with its own ledger and 50 ms-stale "
                          "polls of the others' work (default 1); the saturation rate is still one router's")
    sim.add_argument("--capacity", action="store_true",
                     help="also find each policy's SLO capacity: the highest rate (req/s) at which --attainment of "
                          "requests meet both TTFT and TPOT targets; adds the oracle policy as the bound")
    sim.add_argument("--attainment", type=float,
                     help="with --capacity: the share of requests that must meet their SLO (default 0.9)")
    sim.add_argument("--capacity-steps", type=int,
                     help="with --capacity: bisection steps after the doubling bracket (default 8)")
    sim.add_argument("--json", help="write the results here (atomically)")
    sim.set_defaults(func=cmd_sim)

    tr = sub.add_parser("traces", help="fetch or inspect request traces")
    trs = tr.add_subparsers(dest="traces_command", required=True)
    dl = trs.add_parser("download", help="download the public Azure LLM traces")
    dl.add_argument("--dest", default=str(data_dir()))
    dl.add_argument("--name", action="append", help="azure_conv_2023, azure_code_2023 (default both)")
    dl.set_defaults(func=cmd_traces_download)
    gen = trs.add_parser("generate", help="write a generated workload (disagg.sim.workloads) as a native trace")
    gen.add_argument("workload", help="short_chat, long_prompt_short_answer, short_prompt_long_generation, "
                                      "mixed_bursty, multi_turn_chat (with prefix hashes)")
    gen.add_argument("--requests", type=int, default=4000)
    gen.add_argument("--rate", type=float, default=10.0, help="mean arrival rate (req/s)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-context-tokens", type=int, default=None,
                     help="multi_turn_chat: end conversations before prompt + answer exceed this (the model's context)")
    gen.add_argument("--out", required=True, help="native CSV to write (atomically)")
    gen.set_defaults(func=cmd_traces_generate)
    st = trs.add_parser("stats", help="summary statistics of a trace")
    st.add_argument("trace")
    st.add_argument("--format", default="auto")
    st.set_defaults(func=cmd_traces_stats)

    study = sub.add_parser("study", help="the simulator studies (pool width, predictor noise, miscalibration, sizing, "
                                         "latency-aware routing across models, autoscaling: planner vs Serve)")
    studies.add_arguments(study)
    study.set_defaults(func=cmd_study)

    cal = sub.add_parser("calibrate", help="measure this hardware with real engines and write a cost model")
    cal.add_argument("--config", help="the Serve config whose engine settings to calibrate (on engines started "
                                      "for it); not with --live")
    cal.add_argument("--out", required=True, help="cost-model YAML to write (atomically, only if the fit is sane)")
    cal.add_argument("--quick", action="store_true", help="fewer points (CI); seconds instead of a minute")
    cal.add_argument("--name", help="name recorded in the file")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--report", help="also write the fit report as JSON")
    cal.add_argument("--url", help="a running app (e.g. http://127.0.0.1:8000): with --live, the app to calibrate; "
                                   "either way, also measure the serving path's overhead outside the engines, for "
                                   "the simulator and the TTFT targets")
    cal.add_argument("--url-requests", type=int, default=16, help="lone requests through the app for --url")
    cal.add_argument("--model", help="the served model to calibrate, in a config (or app) that serves several")
    cal.add_argument("--live", action="store_true",
                     help="measure every running instance of the app at --url through its router (/admin/probe) "
                          "instead of starting engines; writes per-instance constants")
    cal.add_argument("--pause-s", type=float, default=0.02,
                     help="--live: pause after every probe, so the fleet's own traffic is served (default 0.02)")
    cal.add_argument("--budget-s", type=float, default=120.0,
                     help="--live: stop with nothing written past this many seconds of probing (default 120)")
    cal.add_argument("--apply", action="store_true",
                     help="--live: then have the router reload the file (it must lie inside router.cost_model_dir)")
    cal.set_defaults(func=cmd_calibrate)

    acc = sub.add_parser("accuracy", help="the accuracy estimator of latency-aware routing: train it, or make "
                                          "synthetic evaluations")
    accs = acc.add_subparsers(dest="accuracy_command", required=True)
    at = accs.add_parser("train", help="train an accuracy table from an evaluations CSV (prompt_tokens,model,score)")
    at.add_argument("--evaluations", required=True, help="CSV with a header holding prompt_tokens, model, score")
    at.add_argument("--out", required=True, help="accuracy-table JSON to write (atomically; nothing on bad input)")
    at.add_argument("--shrinkage", type=float, default=8.0, help="rows of weight the model mean has in each bucket")
    at.add_argument("--default-prior", type=float, default=0.5, help="accuracy of a model with no rows")
    at.set_defaults(func=cmd_accuracy_train)
    asy = accs.add_parser("synth", help="write SYNTHETIC evaluations (small vs large model; see "
                                        "disagg/sim/synthetic_accuracy.py)")
    asy.add_argument("--out", required=True)
    asy.add_argument("--rows-per-model", type=int, default=1000)
    asy.add_argument("--seed", type=int, default=0)
    asy.set_defaults(func=cmd_accuracy_synth)

    cc = sub.add_parser("check-config", help="validate a Serve config file of this app (file:line: field errors)")
    cc.add_argument("config")
    cc.set_defaults(func=cmd_check_config)

    bench = sub.add_parser("bench", help="measure routing policies on the live app (and/or the simulator) "
                                         "with a trace; resumable")
    bench.add_argument("--url", help="the app, e.g. http://127.0.0.1:8000 (omit with --sim for a simulator-only run)")
    bench.add_argument("--trace", action="append", required=True,
                       help="trace file or name in $DISAGG_TRACE_DIR; repeat (or comma-separate) for several")
    bench.add_argument("--format", default="auto", help="azure|mooncake|burstgpt|native|auto (default)")
    bench.add_argument("--policies", default="round_robin,least_loaded,length_heuristic,marginal_cost",
                       help=f"comma-separated NAME or NAME:key=value[:key=value]; known: {','.join(known_policies())}")
    brate = bench.add_mutually_exclusive_group()
    brate.add_argument("--rate", type=float, help="rescale each trace slice to this mean arrival rate (req/s)")
    brate.add_argument("--saturation", action="store_true",
                       help="find round robin's mid-collapse rate first (live: slow probing; see --probe-*)")
    bench.add_argument("--capacity", type=float, nargs="?", const=0.9, default=None, metavar="ATTAINMENT",
                       help="instead of fixed-rate runs, search each policy's SLO capacity: the highest rate at which "
                            "this share (default 0.9) of requests meet both SLO targets (probes sized by --probe-*; "
                            "--rate is the search's start)")
    bench.add_argument("--capacity-steps", type=int, default=3, help="bisection steps of the capacity search")
    bench.add_argument("--duration", type=float, help="cut each slice at this many seconds (after rescaling)")
    bench.add_argument("--max-requests", type=int, default=0, help="use only the first N requests of each trace")
    bench.add_argument("--tight-share", type=float, default=0.5, help="share of requests in the tight SLO class")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", required=True, help="output folder (a rerun with the same settings resumes it)")
    bench.add_argument("--sim", action="store_true", help="also run the simulator on the same slices")
    bench.add_argument("--cost-model", default="cpu-tiny",
                       help="cost-model profile or YAML: SLO targets for goodput, and the simulator's constants")
    bench.add_argument("--topology", help="simulated topology (default: the live app's, else 1P2D)")
    bench.add_argument("--max-model-len", type=int,
                       help="context to fit requests to in a simulator-only run (live: read from /v1/models)")
    bench.add_argument("--request-timeout", type=float, default=300.0, help="per-request limit in seconds")
    bench.add_argument("--lag-bound-ms", type=float, default=50.0, help="flag runs whose send-lag P99 exceeds this")
    bench.add_argument("--probe-requests", type=int, default=20, help="live saturation: fewest requests per probe")
    bench.add_argument("--probe-seconds", type=float, default=20.0,
                       help="live saturation: each probe sends rate × this many seconds of the trace")
    bench.add_argument("--probe-iterations", type=int, default=5, help="live saturation: bisection steps")
    bench.add_argument("--realtime", action="store_true",
                       help="run the load generator under SCHED_FIFO (needs root) so a busy app cannot delay its "
                            "sends; recommended when the app shares the machine's cores")
    bench.add_argument("--baseline", action="append", default=[], metavar="NAME=URL",
                       help="another OpenAI-compatible system on the same trace slices, run after our policies on "
                            "every trace (repeatable), e.g. ray_serve_llm=http://127.0.0.1:8000/raylm")
    bench.set_defaults(func=cmd_bench)

    tm = sub.add_parser("tiny-model", help="build the offline tiny model (idempotent)")
    tm.add_argument("--dest")
    tm.add_argument("--size", default="tiny", choices=["tiny", "small"])
    tm.set_defaults(func=cmd_tiny_model)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, TraceError, CostModelError, PolicyError) as e:
        print(f"disagg: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("disagg: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
