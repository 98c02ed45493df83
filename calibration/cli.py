"""`disagg calibrate`: a command group of the `disagg` CLI, registered through the `disagg.commands`
entry point (pyproject.toml), so that `disagg` itself never imports this package."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from disagg.cli.common import Progress, check_reachable, fmt_table
from disagg.core.types import Role, SloClass
from disagg.files import write_json_atomic
from disagg.user_input import UsageError


def cmd_calibrate(args) -> int:
    if args.host and not args.live:
        raise UsageError("--host measures the machine a running app is on: use it with --live --url")
    if args.live:
        return cmd_calibrate_live(args)
    if args.config is None:
        raise UsageError("--config is required (the Serve config whose engine settings to calibrate), "
                         "unless --live measures a running app's own engines")
    return cmd_calibrate_engines(args)


def cmd_calibrate_live(args) -> int:
    """`disagg calibrate --live`: every running instance of one model, through the app (`calibration.live`)."""
    import asyncio
    from datetime import datetime, timezone

    from calibration.fit import (
        CalibrationError,
        fit_fleet,
        handoff_overhead,
        held_out_of_fleet,
        live_transfer,
        serving_overhead,
    )
    from calibration.live import LiveCalibrationError, calibrate_fleet
    from calibration.measure import SERVING_PROBE_TOKENS, TRANSFER_PROBE_TOKENS, detours, serving_path_gaps

    if args.url is None:
        raise UsageError("--live measures a running app: give its --url")
    if args.config is not None:
        raise UsageError("--live reads the fleet from the app itself (/admin/state): leave out --config")
    if not 0.0 <= args.settle_s <= 600.0:
        raise UsageError(f"--settle-s must be in [0, 600] s, got {args.settle_s!r}")
    if not 0.0 <= args.pause_s <= 2.0:
        raise UsageError(f"--pause-s must be in [0, 2] s, got {args.pause_s!r}")
    if not 0.0 < args.budget_s <= 3600.0:
        raise UsageError(f"--budget-s must be in (0, 3600] s, got {args.budget_s!r}")
    if args.url_requests < 3:
        raise UsageError(f"--url-requests must be >= 3, got {args.url_requests}")
    url = args.url.rstrip("/")
    check_reachable(url)
    out = Path(args.out)
    idle_cores = None
    if args.settle_s:
        if not args.host:
            raise UsageError("--settle-s waits for this machine to go quiet: use it with --host, on the app's machine")
        from calibration.host import settle

        _, idle_cores = asyncio.run(settle(args.settle_s, log=lambda m: print(f"host: {m}", file=sys.stderr)))
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        fleet, samples, seconds = asyncio.run(calibrate_fleet(
            url, args.model, args.quick, args.pause_s, args.budget_s, args.seed,
            lambda total: Progress(total, "calibrating the fleet")))
        # short prompts for the serving path, and long ones beside them for the KV transfer's bandwidth
        long = min(TRANSFER_PROBE_TOKENS, fleet.max_model_len // 2)
        lengths = (SERVING_PROBE_TOKENS, long) if long > SERVING_PROBE_TOKENS else (SERVING_PROBE_TOKENS,)
        gaps = asyncio.run(serving_path_gaps(url, lengths, args.url_requests, seed=args.seed))
        # each path on lone requests that take it: a policy that colocates lone requests sends none
        # through a prefill engine, one that disaggregates none through one engine alone
        detoured = detours(gaps, splits="prefill" in fleet.instances.values())
        for n, policy in enumerate(detoured, 1):
            with _routed_with(url, fleet.model, policy):
                gaps += asyncio.run(serving_path_gaps(url, lengths, args.url_requests, seed=args.seed + n))
        alone = [g.outside_s for g in gaps if not g.disaggregated and g.prompt_tokens == SERVING_PROBE_TOKENS]
        overhead = serving_overhead(alone)
        handoff = handoff_overhead([g.outside_s for g in gaps if g.disaggregated
                                    and g.prompt_tokens == SERVING_PROBE_TOKENS], overhead)
        name = args.name or f"live-{fleet.model}"
        cm, fits = fit_fleet(samples, fleet.cost_model, name, fleet.source, overhead, measured_at, handoff)
        transfer = live_transfer(gaps, cm)
        if transfer is not None:  # the KV transfer as measured here; the SLO targets follow it
            base = fleet.cost_model.model_copy(update={"transfer": transfer[0]})
            cm, fits = fit_fleet(samples, base, name, fleet.source, overhead, measured_at, handoff)
        host_report = None
        if args.host:
            host, host_report = asyncio.run(_measure_host(url, fleet, cm, args.seed, args.quick, idle_cores))
            cm = cm.model_copy(update={"shared_host": host.model_copy(update={"measured_at": measured_at})})
    except CalibrationError as e:
        raise UsageError(f"calibration failed, nothing written: {e}") from None
    except (LiveCalibrationError, RuntimeError, OSError) as e:
        raise UsageError(f"measuring the fleet failed, nothing written: {e}") from None
    cm.save(out)
    rows = [{"instance": iid, "role": fleet.instances[iid], "tau_pre": f.engine.prefill_token_s * 1e6,
             "attention": f.engine.prefill_attention_s * 1e9, "base": f.engine.step_base_s * 1e3,
             "seq": f.engine.decode_seq_s * 1e6, "r2": f.prefill.r2, "speed": f.speed,
             "priced": "shared fit" if f.shared else "own fit", "held": f.held_out["median_rel_error"],
             "held90": f.held_out["p90_rel_error"]} for iid, f in fits.items()]
    print(fmt_table(rows, [("instance", "instance", "s"), ("role", "role", "s"), ("tau_pre", "τ_pre µs/tok", ".2f"),
                           ("attention", "attn ns/pair", ".3g"), ("base", "step base ms", ".3f"),
                           ("seq", "τ_seq µs", ".1f"), ("r2", "own prefill R²", ".4f"), ("speed", "speed", ".2f"),
                           ("priced", "priced by", "s"), ("held", "held-out p50", ".1%"),
                           ("held90", "held-out p90", ".1%")]))
    held, held90 = held_out_of_fleet(fits)
    t, l = cm.slo[SloClass.TIGHT], cm.slo[SloClass.LOOSE]
    print(f"\nserving path: {overhead * 1e3:.1f} ms outside the engines (median of {len(alone)} lone "
          f"{SERVING_PROBE_TOKENS}-token requests on one engine)"
          + (f"; a hand-off {cm.handoff_overhead_s * 1e3:.1f} ms more" if handoff is not None else ""))
    if detoured:
        print(f"lone requests routed with {' and '.join(detoured)} to measure every path, the app's own policy "
              "restored after")
    print(f"SLO tight TTFT {t.ttft_s * 1e3:.0f} ms / TPOT {t.tpot_s * 1e3:.1f} ms; "
          f"loose TTFT {l.ttft_s * 1e3:.0f} ms / TPOT {l.tpot_s * 1e3:.1f} ms")
    kept = f"kept from {fleet.cost_model.name!r}"
    xfer = cm.transfer
    if transfer is None:
        print(f"KV transfer: {xfer.latency_s * 1e3:.1f} ms fixed cost and bandwidth {kept} "
              "(no request crossed from a prefill engine)")
    else:
        how = (f"{xfer.tokens_per_s:,.0f} tokens/s (measured: medians of lone requests at "
               f"{' and '.join(map(str, lengths))} tokens)" if transfer[1]
               else f"bandwidth {kept} ({xfer.tokens_per_s:,.0f} tokens/s: not measurable through the noise)")
        print(f"KV transfer: {xfer.latency_s * 1e3:.1f} ms fixed cost, {how}")
    points = sum(f.held_out["n"] for f in fits.values())
    print(f"held-out relative error over {points} points of {len(fits)} instances: median {held:.1%}, p90 {held90:.1%}")
    if cm.shared_host is not None:
        h = cm.shared_host
        print(f"shared host: {h.cores:g} cores, engines on {h.engine_cores:g} ({h.mixed_cores or h.engine_cores:g} "
              f"while one prefills), a prefill's weight beside a decode {h.prefill_weight:g}; serving path "
              f"{h.step_cpu_s * 1e6:.0f} µs CPU per engine step, {h.event_cpu_s * 1e6:.0f} µs per message of "
              f"tokens, {h.request_cpu_s * 1e3:.1f} ms per request, "
              f"{h.idle_cores:.2f} cores idle")
    print(f"wrote {out} ({len(fits)} instances of {fleet.model}, measured {measured_at}) in {seconds:.0f} s of probes")
    if args.report:
        write_json_atomic(Path(args.report), {"instances": {iid: f.as_dict() for iid, f in fits.items()},
                                              "held_out_median": held, "held_out_p90": held90, "seconds": seconds,
                                              "serving_overhead_s": overhead, "shared_host": host_report,
                                              "cost_model": cm.to_dict()})
    if args.apply:
        _apply_cost_model(url, out, fleet.model)
    return 0


@contextlib.contextmanager
def _routed_with(url: str, model: str, policy: str):
    """The app routes `model` with `policy` (`round_robin`: every request through a prefill engine and
    the KV hand-off; `colocated`: every request on one engine) while the block runs, then with its
    own policy again, whatever happens."""
    from disagg.app_client import AppClient, AppError

    try:
        with AppClient(url, timeout_s=60.0) as app:
            own = app.state()["models"][model]
            app.set_policy(policy, {}, model)
    except (AppError, KeyError) as e:
        raise RuntimeError(f"routing {model!r} with {policy} to measure the serving path: {e}") from None
    try:
        yield
    finally:
        try:
            with AppClient(url, timeout_s=60.0) as app:
                app.set_policy(own["policy"], own["policy_params"], model)
        except AppError as e:  # say what the app is left with, and how to put it back
            raise RuntimeError(f"giving {model!r} its policy {own['policy']!r} back after measuring the serving "
                               f"path ({e}); it routes with {policy} until POST {url}/admin/policy "
                               f"sets it") from None


async def _measure_host(url: str, fleet, cm, seed: int, quick: bool, idle_cores: float | None):
    """`--host`: the shared host's constants (`calibration.host`), with the constants just fitted;
    `idle_cores`: the app at rest as `--settle-s` measured it (None: measured there)."""
    from calibration.host import HostPlan, engine_steps, measure_host
    from disagg.app_client import AppError, AsyncAppClient
    from calibration.live import LiveCalibrationError, PROBE_TIMEOUT_S

    peers = len(fleet.engines or fleet.instances)
    async with AsyncAppClient(url, timeout_s=PROBE_TIMEOUT_S, max_connections=peers) as app:
        async def post(body: dict) -> dict:
            try:
                return await app.probe(body)
            except AppError as e:
                raise LiveCalibrationError(f"{e} (probe {body})") from None

        async def steps() -> int:  # every engine's on the host, of any model
            try:
                instances = (await app.state())["instances"]
            except AppError as e:
                raise LiveCalibrationError(f"reading the engines' steps: {e}") from None
            return engine_steps(instances, hosted)

        hosted = set(fleet.engines or fleet.instances)
        return await measure_host(url, fleet.model, fleet.instances, cm.engine, post,
                                  HostPlan.quick() if quick else HostPlan(), seed=seed,
                                  log=lambda m: print(f"host: {m}", file=sys.stderr), engines=fleet.engines,
                                  idle_cores=idle_cores, engine_pids=fleet.engine_pids,
                                  replica_pids=fleet.replica_pids, read_steps=steps,
                                  stream_intervals=fleet.stream_intervals)


def _apply_cost_model(url: str, path: Path, model: str) -> None:
    """Have every router replica reload the file it was just written to (`POST /admin/cost_model`)."""
    from disagg.app_client import AppClient, AppError

    try:
        with AppClient(url, timeout_s=60.0) as app:
            routers = app.set_cost_model(str(path.resolve()), model).get("routers", [])
    except AppError as e:
        raise UsageError(f"wrote {path}, but the router did not load it: {e}") from None
    print(f"applied: router replicas {', '.join(routers)} price with {path} now")


def cmd_calibrate_engines(args) -> int:
    import asyncio
    import statistics

    from calibration.fit import (
        CalibrationError,
        fit_cost_model,
        handoff_overhead,
        held_out_error,
        serving_overhead,
    )
    from calibration.measure import (
        SERVING_PROBE_TOKENS,
        Calibrator,
        GpuShortage,
        Plan,
        gpu_assignment,
        serving_path_gaps,
        visible_gpus,
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
        check_reachable(args.url.rstrip("/"))
    if args.url_requests < 3:
        raise UsageError(f"--url-requests must be >= 3, got {args.url_requests}")
    plan = Plan.for_context(cfg.model.max_model_len, cfg.engine.max_num_seqs, args.quick)
    bar = Progress(plan.steps(), "calibrating")
    print(f"calibrating {cfg.model.source} on {cfg.engine.device} ({'quick' if args.quick else 'full'}): "
          f"prompts {plan.prefill_lengths} ×{plan.repeats}, concurrency {plan.concurrencies}", file=sys.stderr)
    try:
        result = asyncio.run(Calibrator(cfg, seed=args.seed).run(plan, bar))
        name = args.name or f"calibrated-{cfg.model.served_name}"
        # vLLM's NIXL agents run without a progress thread on CPU (serve_app.vllm_plugin)
        between_steps = cfg.engine.device == "cpu"
        cm, report = fit_cost_model(result.measurements, name=name, between_prefill_steps=between_steps)
        held = held_out_error(cm.engine, result.held_out_prefill, result.held_out_decode)
        if args.url:
            gaps = asyncio.run(serving_path_gaps(args.url.rstrip("/"), SERVING_PROBE_TOKENS, args.url_requests,
                                                 seed=args.seed))
            ttfts = [g.ttft_s for g in gaps]
            # the one-engine path's time, and what a hand-off adds where the app's policy made both kinds;
            # where it made only hand-offs, their whole time is the serving path's (the hand-off unmeasured)
            alone = [g.outside_s for g in gaps if not g.disaggregated]
            overhead = serving_overhead(alone or [g.outside_s for g in gaps])
            handoff = handoff_overhead([g.outside_s for g in gaps if g.disaggregated], overhead) if alone else None
            cm, report = fit_cost_model(result.measurements, name=name, serving_overhead_s=overhead,
                                        handoff_overhead_s=handoff or 0.0, between_prefill_steps=between_steps)
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
          f"serving path {cm.serving_overhead_s * 1e3:.1f} ms"
          + (f", a hand-off {cm.handoff_overhead_s * 1e3:.1f} ms more" if cm.handoff_overhead_s else "")
          + ("" if args.url else " (not measured: no --url)"))
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


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`calibrate`."""
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
    cal.add_argument("--url-requests", type=int, default=16,
                     help="lone requests through the app for --url (with --live: that many at each of two prompt "
                          "lengths, which also measure the KV transfer)")
    cal.add_argument("--model", help="the served model to calibrate, in a config (or app) that serves several")
    cal.add_argument("--live", action="store_true",
                     help="measure every running instance of the app at --url through its router (/admin/probe) "
                          "instead of starting engines; writes per-instance constants")
    cal.add_argument("--pause-s", type=float, default=0.02,
                     help="--live: pause after every probe, so the fleet's own traffic is served (default 0.02)")
    cal.add_argument("--budget-s", type=float, default=120.0,
                     help="--live: stop with nothing written past this many seconds of probing (default 120)")
    cal.add_argument("--host", action="store_true",
                     help="--live, on the app's own machine: also measure how its engines share the host's "
                          "processors and the serving path's CPU per token and per request (the CPU profile; "
                          "not for engines that own their GPUs)")
    cal.add_argument("--settle-s", type=float, default=0.0,
                     help="--host: first wait up to this many seconds for the machine to go quiet (a stack "
                          "that has just started is still busy); default 0")
    cal.add_argument("--apply", action="store_true",
                     help="--live: then have the router reload the file (it must lie inside router.cost_model_dir)")
    cal.set_defaults(func=cmd_calibrate)
