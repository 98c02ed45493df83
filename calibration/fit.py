"""Fit the cost model's constants from measurements (pure: numpy only).

Inputs are what `measure` records on live engines:
- prefill latency of lone prompts over a ladder of lengths → τ_pre (the linear slope), the
  attention term (the quadratic one: a lone prompt of p tokens computes p²/2 token pairs) and the
  per-prefill overhead, by non-negative least squares on relative errors (the estimator is judged
  by its relative error, and the ladder's short prompts would weigh nothing in absolute terms);
- decode step time (median gap between streamed tokens) at several concurrencies → the step base
  and the per-sequence cost, i.e. τ_dec(b) = base + b·τ_seq; and at one concurrency with long
  prompts → the cost per token of context the sequences hold (`decode_context_s`: the median of
  those steps' excess over the short probes' at that concurrency, per token of context they held
  beyond theirs; 0 without such probes or when they ran no slower);
- KV hand-off time over prompt lengths (decode first token with remote KV minus one decode step)
  → transfer latency and bandwidth;
- the engine's KV capacity in tokens.

The attention term is kept only when the data identify it: at least four distinct prompt lengths,
a coefficient beyond three standard errors, and a share of at least `ATTENTION_MATERIAL` of the
longest prompt's prefill time. Otherwise it is 0 and the linear model is refitted without it: a
prefill time linear in the prompt gets no attention term, not one fitted to its noise.

Fits that cannot describe hardware are refused with the numbers that show it (a prefill time
that does not grow with the prompt, a decode step that clearly falls with concurrency, a transfer slope ≤ 0, too few points), and
no file is written. A decode curve that is flat within its noise is not refused: on a small CPU a
tiny model's step is dominated by fixed overhead, so its measured slope is as often slightly
negative as positive; τ_seq is then 0. "Clearly falls" means both beyond three standard errors
of the slope and by more than 10% of the step over the measured range. Likewise a KV transfer
time flat within its noise (a tiny model moves a few hundred bytes a token) is priced at the
slowest bandwidth the measurements allow (slope = 3 standard errors); only a transfer time that
falls with tokens beyond its noise is refused.

SLO rule (documented, derived from the same measurements):
- tight TTFT = 2 × (prefill of a 1,024-token prompt + its transfer + one decode step at batch 1
  + the serving path's overhead with its hand-off, when measured: `disagg calibrate --url`, `--live`);
- tight TPOT = 2 × the decode step at the largest measured concurrency;
- loose = 3 × tight, as in the calibration paper.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np

from disagg.core.cost_model import CostModel, EngineConstants, SloTarget, TransferConstants
from disagg.core.types import SloClass
from disagg.stats import percentile

REFERENCE_PROMPT = 1024
ATTENTION_MATERIAL = 0.02  # the attention term's least share of the longest prefill, to be kept
DECODE_CONTEXT_MAX_S = 1e-5  # the cost model's bound on `decode_context_s`
SLO_HEADROOM = 2.0
LOOSE_FACTOR = 3.0
# An instance this far from the median instance's speed is priced by its own fit (`fit_fleet`).
# Identical engines of one host, measured one after the other, came out 0.88–1.14× of their
# shared fit in ten live calibrations: the host's slow spells, not their hardware. Another
# hardware generation is 1.5–2× or more.
SPEED_MATERIAL = 0.3


class CalibrationError(ValueError):
    """Measurements that cannot be fitted into physical constants."""


@dataclass(frozen=True, slots=True)
class Sample:
    x: float  # prompt tokens, concurrency or transferred tokens
    seconds: float
    # decode: prompt tokens each stream held beyond a short probe's (0: a short probe, whose few
    # dozen tokens of context the step base and per-sequence cost include)
    extra_context: int = 0


@dataclass(frozen=True, slots=True)
class LinearFit:
    slope: float
    intercept: float
    r2: float
    n: int
    residual_p50: float  # relative |residual| / measured
    residual_p90: float
    slope_stderr: float = 0.0

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x

    def as_dict(self) -> dict:
        return asdict(self)


def _arrays(samples: list[Sample], what: str, min_points: int) -> tuple[np.ndarray, np.ndarray]:
    xs = np.array([s.x for s in samples], dtype=float)
    ys = np.array([s.seconds for s in samples], dtype=float)
    if len(samples) < min_points or len(set(xs.tolist())) < 2:
        raise CalibrationError(f"{what}: need at least {min_points} points at 2+ distinct x values, "
                               f"got {len(samples)} at {sorted(set(xs.tolist()))}")
    if not np.all(np.isfinite(ys)) or np.any(ys <= 0):
        raise CalibrationError(f"{what}: measured times must be positive and finite, got {ys.tolist()}")
    return xs, ys


def fit_linear(samples: list[Sample], what: str, min_points: int = 3) -> LinearFit:
    xs, ys = _arrays(samples, what, min_points)
    slope, intercept = np.polyfit(xs, ys, 1)
    pred = intercept + slope * xs
    ss_res = float(np.sum((ys - pred) ** 2))
    ss_tot = float(np.sum((ys - ys.mean()) ** 2))
    rel = np.abs(ys - pred) / ys
    sxx = float(np.sum((xs - xs.mean()) ** 2))
    stderr = float(np.sqrt(ss_res / (len(xs) - 2) / sxx)) if len(xs) > 2 else float("inf")
    return LinearFit(float(slope), float(intercept), 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0, len(samples),
                     percentile(rel.tolist(), 50), percentile(rel.tolist(), 90), stderr)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ‖a·x − b‖ subject to x ≥ 0, exactly, for the few columns of a fit: the optimum is the
    unconstrained least squares on one subset of the columns (the others at 0), so try them all."""
    n = a.shape[1]
    best, best_ss = np.zeros(n), float(b @ b)
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sub = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if np.any(sub < 0):
            continue
        x = np.zeros(n)
        x[cols] = sub
        r = a @ x - b
        if (ss := float(r @ r)) < best_ss:
            best, best_ss = x, ss
    return best


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """A lone prefill of p tokens: intercept + slope·p + attention·p²/2 (plus a step base for each
    chunk beyond the first). The intercept is a step base plus the per-prefill overhead."""

    slope: float  # τ_pre, s/token
    intercept: float
    attention: float  # s per (token, context token) pair; 0 when the data do not identify it
    attention_stderr: float  # of the unconstrained coefficient (inf: < 4 distinct lengths)
    r2: float
    n: int
    residual_p50: float  # relative |residual| / measured
    residual_p90: float

    def as_dict(self) -> dict:
        return asdict(self)


def fit_prefill(samples: list[Sample], step_base_s: float, max_batched_tokens: int) -> PrefillFit:
    """Fit a lone prefill's time (see the module docstring) with every coefficient ≥ 0.

    Solved for the per-prefill overhead above the step bases (`step_base_s`, from the decode fit,
    per chunk), so that it fits the engine model as it will run: a prefill costs at least its steps."""
    xs, ys = _arrays(samples, "prefill latency vs prompt tokens", 3)
    chunks = np.ceil(xs / max_batched_tokens)
    # relative errors: every row divided by its measured time
    target = (ys - step_base_s * chunks) / ys
    cols = np.column_stack([np.ones_like(xs), xs, xs * xs / 2]) / ys[:, None]
    scale = np.linalg.norm(cols, axis=0)  # p²/2 is ~10⁶ × the constant: keep lstsq well conditioned
    a = cols / scale
    stderr, keep = float("inf"), False
    if len(set(xs.tolist())) >= 4:
        coef = nnls(a, target) / scale
        if len(xs) > 3:  # the attention coefficient's standard error, from the unconstrained fit
            free = np.linalg.lstsq(a, target, rcond=None)[0]
            resid = a @ free - target
            cov = float(resid @ resid) / (len(xs) - 3) * np.linalg.pinv(a.T @ a)
            stderr = float(np.sqrt(max(cov[2, 2], 0.0)) / scale[2])
        top = xs.max()
        share = coef[2] * top * top / 2 / float(ys[xs == top].mean())
        keep = coef[2] > 3 * stderr and share >= ATTENTION_MATERIAL
    if not keep:  # not identified: the linear model, refitted without the term
        coef = np.append(nnls(a[:, :2], target) / scale[:2], 0.0)
    overhead, slope, attention = (float(c) for c in coef)
    pred = step_base_s * chunks + overhead + slope * xs + attention * xs * xs / 2
    ss_res = float(np.sum((ys - pred) ** 2))
    ss_tot = float(np.sum((ys - ys.mean()) ** 2))
    rel = np.abs(ys - pred) / ys
    return PrefillFit(slope, step_base_s + overhead, attention, stderr, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
                      len(xs), percentile(rel.tolist(), 50), percentile(rel.tolist(), 90))


@dataclass(slots=True)
class Measurements:
    prefill: list[Sample]  # x = prompt tokens
    decode: list[Sample]  # x = concurrency, seconds = step time
    transfer: list[Sample]  # x = prompt tokens moved
    kv_capacity_tokens: int
    model: str
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048


@dataclass(slots=True)
class FitReport:
    prefill: PrefillFit
    decode: LinearFit
    transfer: LinearFit

    def as_dict(self) -> dict:
        return {"prefill": self.prefill.as_dict(), "decode": self.decode.as_dict(), "transfer": self.transfer.as_dict()}


def fit_engine(prefill_samples: list[Sample], decode_samples: list[Sample], kv_capacity_tokens: int,
               block_size: int, max_num_seqs: int, max_batched_tokens: int,
               measured_at: str | None = None) -> tuple[EngineConstants, PrefillFit, LinearFit]:
    """One engine's step model from its lone prefills and its decode steps (short probes, and any
    at long context); refuses a fit that cannot describe hardware (see the module docstring)."""
    long_context = [s for s in decode_samples if s.extra_context]
    decode_samples = [s for s in decode_samples if not s.extra_context]
    decode = fit_linear(decode_samples, "decode step time vs concurrency")
    step_base = max(decode.intercept, 1e-6)
    prefill = fit_prefill(prefill_samples, step_base, max_batched_tokens)
    if prefill.slope <= 0 and prefill.attention <= 0:
        short, long = min(prefill_samples, key=lambda s: s.x), max(prefill_samples, key=lambda s: s.x)
        raise CalibrationError(f"prefill latency does not grow with the prompt ({short.seconds:.3g} s at {short.x:g} "
                               f"tokens, {long.seconds:.3g} s at {long.x:g}: no slope ≥ 0 fits): the prompts were "
                               "too short to measure, or cached")
    # Tolerate measurement noise in a flat curve, refuse a clearly falling one.
    spread = max(s.x for s in decode_samples) - min(s.x for s in decode_samples)
    significant = decode.slope + 3 * decode.slope_stderr < 0
    material = decode.slope * spread < -0.1 * max(decode.intercept, 1e-9)
    if significant and material:
        raise CalibrationError(f"decode step time falls with concurrency (slope {decode.slope:.3g} "
                               f"± {decode.slope_stderr:.2g} s per sequence over {decode.n} samples)")
    if kv_capacity_tokens <= 0:
        raise CalibrationError(f"engine KV capacity must be positive, got {kv_capacity_tokens}")
    engine = EngineConstants(
        step_base_s=step_base,
        # a prefill time all attention (never seen: the MLPs are linear work) would leave τ_pre at
        # the bound 0, which no hardware has: the smallest positive slope instead
        prefill_token_s=max(prefill.slope, 1e-12),
        prefill_attention_s=prefill.attention,
        # what a lone prefill costs beyond one step (≥ 0 by the fit)
        prefill_overhead_s=min(max(prefill.intercept - step_base, 0.0), 1.0),
        decode_seq_s=max(decode.slope, 0.0),
        decode_context_s=fit_decode_context(long_context, decode_samples, decode),
        kv_capacity_tokens=kv_capacity_tokens,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        measured_at=measured_at,
    )
    return engine, prefill, decode


def fit_decode_context(samples: list[Sample], short: list[Sample], decode: LinearFit) -> float:
    """Seconds per step per token of context a decoding sequence holds, from decode steps at long
    context: the median of each step's excess over the short probes' median at its concurrency (the
    line's value where none was measured there) per token of context its streams held beyond
    theirs. Medians: a handful of probes on a shared host, one of which may catch a slow spell, and
    the line's error at one concurrency would otherwise land whole on the term. 0 without such
    steps, or when they ran no slower: a term the data do not show."""
    if not samples:
        return 0.0
    at: dict[float, list[float]] = {}
    for s in short:
        at.setdefault(s.x, []).append(s.seconds)
    reference = {x: float(np.median(v)) for x, v in at.items()}
    excess = [(s.seconds - reference.get(s.x, decode.predict(s.x))) / (s.x * s.extra_context) for s in samples]
    return min(max(float(np.median(excess)), 0.0), DECODE_CONTEXT_MAX_S)


def fit_transfer(samples: list[Sample]) -> tuple[TransferConstants, LinearFit]:
    transfer = fit_linear(samples, "KV transfer time vs tokens")
    if transfer.slope + 3 * transfer.slope_stderr < 0 or (transfer.slope <= 0 and transfer.slope_stderr == 0):
        raise CalibrationError(f"KV transfer time does not grow with tokens (slope {transfer.slope:.3g} "
                               f"± {transfer.slope_stderr:.2g} s/token over {transfer.n} samples)")
    xfer_slope, xfer_latency = transfer.slope, transfer.intercept
    if transfer.slope - 3 * transfer.slope_stderr <= 0:
        # Flat within noise (a small model's KV is a few hundred bytes a token): price it at the
        # slowest bandwidth the measurements allow, and the latency that leaves on average.
        xfer_slope = 3 * transfer.slope_stderr  # > 0 here: a noiseless slope ≤ 0 was refused above
        xfer_latency = float(np.mean([s.seconds - xfer_slope * s.x for s in samples]))
    return TransferConstants(latency_s=max(xfer_latency, 0.0), tokens_per_s=1.0 / xfer_slope), transfer


def slo_targets(engine: EngineConstants, xfer: TransferConstants, biggest_concurrency: int,
                serving_overhead_s: float) -> dict[SloClass, SloTarget]:
    """The documented rule (module docstring)."""
    ttft = SLO_HEADROOM * (engine.prefill_s(REFERENCE_PROMPT) + xfer.transfer_s(REFERENCE_PROMPT)
                           + engine.decode_token_s(1) + serving_overhead_s)
    tpot = SLO_HEADROOM * engine.decode_token_s(biggest_concurrency)
    return {SloClass.TIGHT: SloTarget(ttft_s=ttft, tpot_s=tpot),
            SloClass.LOOSE: SloTarget(ttft_s=LOOSE_FACTOR * ttft, tpot_s=LOOSE_FACTOR * tpot)}


def fit_cost_model(m: Measurements, name: str, serving_overhead_s: float = 0.0, handoff_overhead_s: float = 0.0,
                   between_prefill_steps: bool = False) -> tuple[CostModel, FitReport]:
    """The cost model of one engine pair's measurements. `between_prefill_steps`: the engines move KV
    only between the prefill engine's steps (NIXL without a progress thread: the CPU platform)."""
    engine, prefill, decode = fit_engine(m.prefill, m.decode, m.kv_capacity_tokens, m.block_size, m.max_num_seqs,
                                         m.max_batched_tokens)
    xfer, transfer = fit_transfer(m.transfer)
    xfer = xfer.model_copy(update={"between_prefill_steps": between_prefill_steps})
    biggest = int(max(s.x for s in m.decode if not s.extra_context))
    slo = slo_targets(engine, xfer, biggest, serving_overhead_s + handoff_overhead_s)
    cm = CostModel(name=name, model=m.model, engine=engine, transfer=xfer, slo=slo,
                   serving_overhead_s=serving_overhead_s, handoff_overhead_s=handoff_overhead_s, calibrated=True)
    return cm, FitReport(prefill, decode, transfer)


@dataclass(slots=True)
class InstanceSamples:
    """What `disagg calibrate --live` measured on one running instance."""

    prefill: list[Sample]
    decode: list[Sample]
    held_out_prefill: list[Sample]
    held_out_decode: list[Sample]
    kv_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class InstanceFit:
    engine: EngineConstants  # what the instance is priced with: the shared fit, or its own
    own: EngineConstants  # the instance's own fit, whichever it is priced with, and its reports:
    prefill: PrefillFit
    decode: LinearFit
    held_out: dict  # of `engine`
    speed: float  # its samples' time over the shared fit's prediction (1: as fast as the typical instance)
    shared: bool  # priced by the fit shared by the instances of typical speed

    def as_dict(self) -> dict:
        return {"prefill": self.prefill.as_dict(), "decode": self.decode.as_dict(), "held_out": self.held_out,
                "speed": self.speed, "shared": self.shared}


def speed_of(engine: EngineConstants, prefill: list[Sample], decode: list[Sample]) -> float:
    """The factor s by which `engine` scaled best predicts these samples, in relative error (least
    squares of s·predicted/measured − 1): above 1, they ran slower than `engine` says."""
    r = np.array([engine.prefill_s(int(x.x)) / x.seconds for x in prefill]
                 + [decode_step_s(engine, x) / x.seconds for x in decode])
    return float(r.sum() / (r * r).sum())


def fit_fleet(samples: dict[str, InstanceSamples], base: CostModel, name: str, model: str,
              serving_overhead_s: float, measured_at: str,
              handoff_overhead_s: float | None = None) -> tuple[CostModel, dict[str, InstanceFit]]:
    """The live fleet's cost model. Instances of one model that run at the same speed share one
    fit over all their samples: a few probes per instance leave the fit's terms trading off
    (τ_pre against attention, the step base against the prefill overhead), so each identical
    engine's own fit differs from the next by more than the hardware does. An instance whose speed
    against the median instance's is off by more than `SPEED_MATERIAL` (other hardware, a sick
    device) is priced by its own fit. Each instance keeps its own KV capacity and `instances`
    lists them all. The pool-wide default (for an instance started later) is the shared fit.
    KV transfer and per-pair constants are kept from `base` (probes move no KV), the hand-off's
    serving path too unless measured (`handoff_overhead_s`), SLO targets by the documented rule
    from the shared fit. Any instance whose own fit is refused refuses the whole."""
    if not samples:
        raise CalibrationError("no instance was measured")
    e = base.engine
    limits = (e.block_size, e.max_num_seqs, e.max_batched_tokens)
    own: dict[str, tuple[EngineConstants, PrefillFit, LinearFit]] = {}
    for iid, s in samples.items():
        try:
            own[iid] = fit_engine(s.prefill, s.decode, s.kv_capacity_tokens, *limits, measured_at)
        except CalibrationError as err:
            raise CalibrationError(f"instance {iid}: {err}") from None

    def shared_fit(ids: list[str]) -> EngineConstants:
        group = [samples[i] for i in ids]
        return fit_engine([x for s in group for x in s.prefill], [x for s in group for x in s.decode],
                          min(s.kv_capacity_tokens for s in group), *limits, measured_at)[0]

    pool = shared_fit(list(samples))
    speed = {iid: speed_of(pool, s.prefill, s.decode) for iid, s in samples.items()}
    typical = statistics.median(speed.values())
    alike = [iid for iid in samples if abs(speed[iid] / typical - 1.0) <= SPEED_MATERIAL]
    if alike and len(alike) < len(samples):  # the shared fit over the alike ones only: an odd one would bend it
        pool = shared_fit(alike)
        speed = {iid: speed_of(pool, s.prefill, s.decode) for iid, s in samples.items()}
    fits: dict[str, InstanceFit] = {}
    for iid, s in samples.items():
        alone, prefill, decode = own[iid]
        shared = iid in alike
        engine = pool.model_copy(update={"kv_capacity_tokens": s.kv_capacity_tokens}) if shared else alone
        fits[iid] = InstanceFit(engine, alone, prefill, decode,
                                held_out_error(engine, s.held_out_prefill, s.held_out_decode), speed[iid], shared)
    every = list(samples.values())
    biggest = int(max(x.x for s in every for x in s.decode if not x.extra_context))
    handoff = base.handoff_overhead_s if handoff_overhead_s is None else handoff_overhead_s
    cm = base.model_copy(update={
        "name": name, "model": model, "engine": pool, "instances": {iid: f.engine for iid, f in fits.items()},
        "slo": slo_targets(pool, base.transfer, biggest, serving_overhead_s + handoff),
        "serving_overhead_s": serving_overhead_s, "handoff_overhead_s": handoff, "calibrated": True})
    return CostModel.model_validate(cm.model_dump()), fits


def held_out_of_fleet(fits: dict[str, InstanceFit]) -> tuple[float, float]:
    """(median, p90) relative error over every held-out point of every instance, each predicted by
    the constants its instance is priced with."""
    rel = [r for f in fits.values() for r in f.held_out["rel_errors"]]
    return float(np.median(rel)), percentile(rel, 90)


def serving_overhead(outside_engines_s: list[float]) -> float:
    """The unloaded time outside the engines: the median over lone requests through the app of
    the client's TTFT minus the engines' own time for that request (`measure.serving_path_gaps`)."""
    if not outside_engines_s:
        raise CalibrationError("no requests through the app were measured")
    return max(float(np.median(outside_engines_s)), 0.0)


def handoff_overhead(crossed_outside_s: list[float], serving_overhead_s: float) -> float | None:
    """What a hand-off adds to the serving path, unloaded: the median time outside the engines of lone
    requests that went through a prefill engine (its reply, then the decode call) less the one-engine
    path's (`serving_overhead`); never negative. None when no request went through a prefill engine."""
    if not crossed_outside_s:
        return None
    return max(float(np.median(crossed_outside_s)) - serving_overhead_s, 0.0)


def live_transfer(lone: list, cm: CostModel) -> tuple[TransferConstants, bool] | None:
    """The KV transfer on the running app, from lone disaggregated requests (`measure.LoneRequest`):
    the decode engine's own time to its first token, less the step that makes it (one sequence, by
    the constants of the instance that decoded it), is the pull of the prompt's KV. Probes move no
    KV, so this is the only live measure of it. With two or more prompt lengths, the line through
    each length's median gives the fixed cost and the bandwidth; where that line does not rise (the
    bandwidth lost in the noise) or with one length, `cm`'s bandwidth is kept and the median of
    what is left is the fixed cost. Returns (constants, bandwidth measured), None when no request
    went through a prefill engine (a colocated app); never a negative cost."""
    pulls = [(r.prompt_tokens, r.decode_first_s - cm.for_instance(r.decode_id).step_s(0, 1))
             for r in lone if r.disaggregated]
    if not pulls:
        return None
    by_length: dict[int, list[float]] = {}
    for tokens, seconds in pulls:
        by_length.setdefault(tokens, []).append(seconds)
    if len(by_length) >= 2:
        xs = sorted(by_length)
        slope, intercept = np.polyfit(xs, [float(np.median(by_length[x])) for x in xs], 1)
        if slope > 0:  # what the profile says of how the transfer moves (`between_prefill_steps`) is kept
            return cm.transfer.model_copy(update={"latency_s": round(max(float(intercept), 0.0), 6),
                                                  "tokens_per_s": 1.0 / slope}), True
    fixed = float(np.median([s - t / cm.transfer.tokens_per_s for t, s in pulls]))
    return cm.transfer.model_copy(update={"latency_s": round(max(fixed, 0.0), 6)}), False


def decode_step_s(engine: EngineConstants, s: Sample) -> float:
    """The decode step `engine` predicts for a decode sample (its streams' extra context included)."""
    return engine.decode_token_s(int(s.x), int(s.x) * s.extra_context)


def held_out_error(engine: EngineConstants, prefill: list[Sample], decode: list[Sample]) -> dict:
    """Predicted vs measured on samples the fit did not see: median and p90 relative error."""
    rel = [abs(engine.prefill_s(int(s.x)) - s.seconds) / s.seconds for s in prefill]
    rel += [abs(decode_step_s(engine, s) - s.seconds) / s.seconds for s in decode]
    if not rel:
        raise CalibrationError("no held-out samples")
    return {"n": len(rel), "median_rel_error": float(np.median(rel)), "p90_rel_error": percentile(rel, 90),
            "rel_errors": rel}
