"""Run policies through the simulator on one trace; find the saturation rate and each policy's SLO capacity.

Saturation rule (the paper drives each workload where round robin is mid-collapse):
1. g_lo = round robin's goodput at a light rate (1/20 of the trace's own mean rate, floor
   0.05 req/s); starting from the trace's own rate, double the rate until round robin's goodput is
   at most 0.2 (or 2^12× the start): that rate gives g_hi;
2. the saturation rate is where round robin's goodput equals (g_lo + g_hi) / 2, found by bisection
   on log(rate), 10 iterations, between the two neighbouring probed rates that bracket that
   target: the lowest probed rate whose goodput is at or below it, and the probed rate just below
   that one. (The last two doubling points do not always bracket it: a collapse that starts before
   the trace's own rate leaves the target below both. `bracketed` is false only when round robin's
   goodput never fell below its light-load value; the result is then the last probed rate.)
3. each probe simulates the trace (its first `probe_requests` requests, by default all of it)
   rescaled to the probed rate, with the same seed, so the rule is deterministic and the rate is
   the collapse point of the very requests that are then run.

SLO capacity (DistServe's measure) of a policy: the highest arrival rate at which at least
`attainment` of all requests meet both their SLO class's TTFT and TPOT targets (the goodput of
`metrics.summarize`). Found per policy by `capacity_steps`:
1. probe the trace's own mean rate; if it meets the attainment, double the rate until one does
   not, else halve it until one does — at most `max_doublings` times either way;
2. bisect on log(rate) between the highest passing and the lowest failing rate, `steps` times;
3. the capacity is the highest probed rate that passed (a lower bound, within the final bracket);
   `crossing_rps` is where the attainment, taken as linear in log(rate) between the final
   bracket's two probes, crosses the target (`attainment_crossing`). The grid's step, 2^(2^-steps)
   (1.19× at 2 steps), is the bracket reading's resolution, too coarse to judge a 1.2× win by; the
   crossing reads between its points from the same probes.
Each probe runs the same requests and SLO classes (same seed) rescaled to the probed rate, so the
search is deterministic. Bisection assumes attainment falls as the rate rises; a trace too short
to be past its warm-up may not, and the result is then one of the crossings.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

from disagg.core.cost_model import CostModel
from disagg.core.policies import build_policy, parse_policy_spec
from disagg.core.predictor import BucketMeanPredictor, NoisyPredictor
from disagg.sim.autoscaling import Scaler
from disagg.sim.metrics import summarize
from disagg.sim.simulator import SimResult, Simulator, Topology
from disagg.sim.traces import TraceRequest, assign_slo_classes, rescale_to_rate, trace_stats
from disagg.stats import percentile


def prepare_trace(trace: Sequence[TraceRequest], rate: float | None, tight_share: float, seed: int) -> list[TraceRequest]:
    out = list(trace)
    if rate is not None:
        out = rescale_to_rate(out, rate)
    return assign_slo_classes(out, tight_share, seed)


def clamp_to_context(trace: Sequence[TraceRequest], max_len: int) -> tuple[list[TraceRequest], int]:
    """Cap outputs so prompt + output fits the model context (vLLM would stop at max_model_len).

    Returns the trace and how many requests were capped. Prompts that alone exceed the context
    are kept: the router rejects them and they count as failures.
    """
    out, capped = [], 0
    for r in trace:
        room = max_len - r.prompt_tokens
        if 1 <= room < r.output_tokens:
            out.append(replace(r, output_tokens=room))
            capped += 1
        else:
            out.append(r)
    return out, capped


def simulate(
    trace: Sequence[TraceRequest],
    cost_model: CostModel,
    topology: Topology,
    policy_name: str,
    *,
    policy_params: dict | None = None,
    predictor_error: float = 0.0,
    seed: int = 0,
    poll_interval_s: float = 0.05,
    router_cost_model: CostModel | None = None,
    progress: Callable[[int], None] | None = None,
    routers: int = 1,
    others_totals: bool = True,
    peer_notify_s: float | None = None,
    scaler: Scaler | None = None,
    startup_s: float = 60.0,
    push_s: float | None = None,
    slo_scale: float | None = None,
    known_output: bool = False,
) -> tuple[dict, SimResult]:
    """One policy through the simulator (`policy_name` may carry parameters: `parse_policy_spec`;
    `policy_params` add to them). `router_cost_model` lets the router believe other
    constants than the engines really have (the miscalibration study). `routers` router replicas
    share the arrivals in turn; `others_totals=False` hides the engines' received-call ledgers
    from them, `peer_notify_s` adds the routers' notices to each other, `push_s` replaces the polls
    with the engines' pushes, seen that long after each change; `slo_scale` judges each request
    by that many times its own unloaded latency instead of its class's targets, `known_output` routes
    with each request's true output length as the live router routes the bench's requests (see
    `Simulator`). With a `scaler` the pools' widths change (disagg.sim.autoscaling), `topology`
    being each pool's most."""
    name, spec_params = parse_policy_spec(policy_name)  # a name, or NAME:key=value...
    policy = build_policy(name, router_cost_model or cost_model, {**spec_params, **(policy_params or {})})
    predictor = BucketMeanPredictor()
    if predictor_error > 0:
        predictor = NoisyPredictor(predictor, predictor_error, seed=seed)
    sim = Simulator(cost_model, topology, policy, predictor, poll_interval_s=poll_interval_s, routers=routers,
                    others_totals=others_totals, peer_notify_s=peer_notify_s, scaler=scaler, startup_s=startup_s,
                    push_s=push_s, slo_scale=slo_scale, known_output=known_output)
    trace, capped = clamp_to_context(trace, cost_model.engine.kv_capacity_tokens)
    result = sim.run(trace, progress=progress)
    summary = summarize(result.records, result.instance_tokens)
    summary["decision_us_p50"] = percentile(result.decision_us, 50)
    summary["decision_us_p99"] = percentile(result.decision_us, 99)
    summary["preemptions"] = result.preemptions
    summary["outputs_capped_to_context"] = capped
    if "prefix_cache" in result.extra:  # only traces with prefix hashes: other summaries stay as they were
        summary["prefix_cache"] = result.extra["prefix_cache"]
    summary["sim_wall_s"] = result.sim_wall_s
    summary["sim_requests_per_s"] = len(trace) / result.sim_wall_s if result.sim_wall_s > 0 else math.inf
    return summary, result


def rr_goodput(trace, cost_model, topology, rate, tight_share, seed, slo_scale: float | None = None) -> float:
    t = prepare_trace(trace, rate, tight_share, seed)
    summary, _ = simulate(t, cost_model, topology, "round_robin", seed=seed, slo_scale=slo_scale)
    return summary["goodput"]


def find_saturation(
    trace: Sequence[TraceRequest],
    cost_model: CostModel,
    topology: Topology,
    *,
    tight_share: float,
    seed: int,
    probe_requests: int | None = None,
    iterations: int = 10,
    slo_scale: float | None = None,
) -> dict:
    """The rate at which round robin's goodput is midway through its collapse (see module doc)."""
    probe = list(trace[:probe_requests] if probe_requests else trace)
    if len(probe) < 2:
        raise ValueError("saturation search needs a trace of at least 2 requests")
    span = probe[-1].arrival_s - probe[0].arrival_s
    own_rate = (len(probe) - 1) / span if span > 0 else 1.0
    return saturation_search(lambda r: rr_goodput(probe, cost_model, topology, r, tight_share, seed, slo_scale),
                             own_rate, iterations)


def saturation_steps(own: float, iterations: int, max_doublings: int = 12):
    """The saturation rule (module doc) as a generator: it yields the rates to probe and is sent
    round robin's goodput at each, then returns the result dict. A generator so that the very
    same steps drive the simulator's search and the live harness's asynchronous one."""
    r_lo = max(0.05, own / 20)
    probed = {r_lo: (yield r_lo)}
    hi = own
    probed[hi] = yield hi
    for _ in range(max_doublings):
        if probed[hi] <= 0.2:
            break
        hi *= 2
        probed[hi] = yield hi
    g_lo, g_hi = probed[r_lo], probed[hi]
    target = (g_lo + g_hi) / 2
    rates = sorted(probed)
    bracketed = g_lo > target  # else round robin never fell from its light-load goodput
    upper = next(r for r in rates if r > r_lo and probed[r] <= target) if bracketed else hi
    lower = max((r for r in rates if r < upper and probed[r] > target), default=upper)
    a, b = math.log(lower), math.log(upper)
    for _ in range(iterations if bracketed else 0):
        mid = (a + b) / 2
        if (yield math.exp(mid)) > target:
            a = mid
        else:
            b = mid
    return {"rate": math.exp((a + b) / 2), "goodput_light": g_lo, "goodput_overload": g_hi, "target_goodput": target,
            "light_rate": r_lo, "overload_rate": hi, "bracket": [math.exp(a), math.exp(b)], "bracketed": bracketed}


def saturation_search(goodput: Callable[[float], float], own: float, iterations: int) -> dict:
    steps = saturation_steps(own, iterations)
    try:
        rate = next(steps)
        while True:
            rate = steps.send(goodput(rate))
    except StopIteration as stop:
        return stop.value


CAPACITY_MAX_DOUBLINGS = 6  # the bracket reaches 64× above or below the trace's own rate


def attainment_crossing(probes: Sequence[Sequence[float]], bracket: Sequence[float | None],
                        attainment: float) -> float | None:
    """The rate where the attainment crosses `attainment` inside the final bracket [lo, hi] of a
    capacity search, linear in log(rate) between the attainments probed at lo and hi (the last
    probe of each, as the search judged them). None when the search did not bracket; lo when the
    failing side measured nothing (NaN)."""
    lo, hi = bracket
    if not lo or hi is None:
        return None
    at_lo = next(a for r, a in reversed(probes) if r == lo)
    at_hi = next(a for r, a in reversed(probes) if r == hi)
    if not math.isfinite(at_hi) or at_lo <= at_hi:
        return lo
    return lo * (hi / lo) ** ((at_lo - attainment) / (at_lo - at_hi))


def capacity_steps(start_rps: float, attainment: float, steps: int,
                   max_doublings: int = CAPACITY_MAX_DOUBLINGS):
    """The SLO-capacity search (module doc) as a generator: it yields the rates to probe, is sent
    the share of requests meeting their SLO at each, and returns the result dict. A generator for
    the same reason as `saturation_steps`: the search does not care who measures.

    Result: `capacity_rps` (highest passing rate, None if none passed), `bracket` [highest
    passing or 0, lowest failing or None], `bracketed` (a pass and a fail were both seen),
    `crossing_rps` (`attainment_crossing`, None unless bracketed) and `probes` ([rate, attainment]
    in probing order). At most 1 + max_doublings + steps probes."""
    if not (math.isfinite(start_rps) and start_rps > 0):
        raise ValueError(f"start rate: expected a positive finite requests/s, got {start_rps!r}")
    if not 0.0 < attainment <= 1.0:
        raise ValueError(f"attainment: expected a share in (0, 1], got {attainment!r}")
    if steps < 0 or max_doublings < 0:
        raise ValueError(f"steps and max_doublings must be >= 0, got {steps} and {max_doublings}")
    probes: list[list[float]] = []
    lo: float | None = None  # highest rate that met the attainment
    hi: float | None = None  # lowest rate that did not

    rate = start_rps
    for _ in range(1 + max_doublings):
        got = yield rate
        probes.append([rate, got])
        if got >= attainment:  # NaN (no requests) counts as a miss
            lo = rate
        else:
            hi = rate
        if lo is not None and hi is not None:
            break
        rate = rate * 2 if hi is None else rate / 2
    for _ in range(steps if lo is not None and hi is not None else 0):
        rate = math.sqrt(lo * hi)
        got = yield rate
        probes.append([rate, got])
        if got >= attainment:
            lo = rate
        else:
            hi = rate
    return {"capacity_rps": lo, "bracket": [lo or 0.0, hi], "bracketed": lo is not None and hi is not None,
            "crossing_rps": attainment_crossing(probes, [lo, hi], attainment), "probes": probes}


def find_capacity(
    trace: Sequence[TraceRequest],
    cost_model: CostModel,
    topology: Topology,
    policy_name: str,
    *,
    attainment: float,
    steps: int,
    tight_share: float,
    seed: int,
    predictor_error: float = 0.0,
    routers: int = 1,
    max_doublings: int = CAPACITY_MAX_DOUBLINGS,
    slo_scale: float | None = None,
    known_output: bool = False,
    push_s: float | None = None,
) -> dict:
    """One policy's SLO capacity on `trace` (module doc), starting from the trace's own mean rate;
    `known_output` and `push_s` as in `simulate`."""
    stats = trace_stats(trace) if trace else {"mean_rate": 0.0}
    if stats["mean_rate"] <= 0:
        raise ValueError("the capacity search needs a trace of at least 2 requests arriving at different times")

    def attained(rate: float) -> float:
        t = prepare_trace(trace, rate, tight_share, seed)
        summary, _ = simulate(t, cost_model, topology, policy_name, predictor_error=predictor_error, seed=seed,
                              routers=routers, slo_scale=slo_scale, known_output=known_output, push_s=push_s)
        return summary["goodput"]

    search = capacity_steps(stats["mean_rate"], attainment, steps, max_doublings)
    try:
        rate = next(search)
        while True:
            rate = search.send(attained(rate))
    except StopIteration as stop:
        return {**stop.value, "start_rps": stats["mean_rate"], "attainment": attainment}


def compare(
    trace: Sequence[TraceRequest],
    cost_model: CostModel,
    topology: Topology,
    policies: Sequence[str],
    *,
    rate: float | None,
    tight_share: float,
    seed: int,
    predictor_error: float = 0.0,
    router_cost_model: CostModel | None = None,
    progress: Callable[[int], None] | None = None,
    routers: int = 1,
    slo_scale: float | None = None,
) -> dict[str, dict]:
    t = prepare_trace(trace, rate, tight_share, seed)
    out = {}
    for name in policies:
        summary, _ = simulate(t, cost_model, topology, name, predictor_error=predictor_error, seed=seed,
                              router_cost_model=router_cost_model, progress=progress, routers=routers,
                              slo_scale=slo_scale)
        out[name] = summary
    return out
