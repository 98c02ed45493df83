"""Do the constants a bench judges with describe the hardware it measures?

Goodput is the share of requests within SLO targets, and those targets come from a cost model's
constants. Constants fitted on other hardware give targets no request meets (or every request
meets), and then the figure says nothing about routing. So before a live run sends its load, the
bench times a few lone probes on every instance through `POST /admin/probe` (timed inside the
engine replica, as `disagg calibrate --live` does): prefills at two prompt lengths and decode steps
at two concurrencies, `ROUNDS` rounds each. Per kind (prefill, decode), the median over instances
and sizes of measured ÷ predicted must lie within `TOLERANCE`× of 1. A check that fails is taken
again after a pause (`PAUSES_S`): a slow spell of a shared host (CPU steal, a burst's aftermath)
passes, other hardware does not. Only when every attempt fails does the bench stop, naming the
command that fits this host. A few seconds on an idle fleet.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Awaitable, Callable

from disagg.core.cost_model import CostModel, EngineConstants

ROUNDS = 3
TOLERANCE = 1.5  # held-out error of a live fit is 3–7%; constants of another CPU generation were off 2×+
DECODE_TOKENS = 12
PREFILL_REPEATS = 3
PAUSES_S = (2.0, 6.0)  # before the second and third attempt of a failed check: a spell seen live lasted seconds


@dataclass(frozen=True, slots=True)
class ProbePoint:
    instance: str
    kind: str  # "prefill" (seconds to the first token of a lone prompt) | "decode" (seconds per token)
    size: int  # prompt tokens | sequences decoding together
    measured_s: float  # median of the rounds
    predicted_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


@dataclass(frozen=True, slots=True)
class Verdict:
    points: tuple[ProbePoint, ...]
    ratios: dict[str, float]  # kind → median measured ÷ predicted
    earlier: tuple[dict[str, float], ...] = ()  # the ratios of failed attempts before this one

    @property
    def fits(self) -> bool:
        return all(1.0 / TOLERANCE <= r <= TOLERANCE for r in self.ratios.values())

    def as_dict(self) -> dict:
        return {"fits": self.fits, "tolerance": TOLERANCE, "ratios": self.ratios,
                "earlier_attempts": list(self.earlier), "points": [asdict(p) for p in self.points]}


def probe_sizes(max_model_len: int, max_num_seqs: int) -> list[tuple[str, int]]:
    """Two prompt lengths (the step base and the per-token cost both show) and two concurrencies."""
    long = max(2, min(1024, max_model_len // 2))
    short = max(1, min(128, long // 4))
    return [("prefill", short), ("prefill", long), ("decode", 1), ("decode", max(1, min(8, max_num_seqs)))]


def predicted_s(cm: CostModel, instance: str, kind: str, size: int) -> float:
    e = cm.for_instance(instance)
    return e.prefill_s(size) if kind == "prefill" else e.decode_token_s(size)


def judge(cm: CostModel, measured: dict[tuple[str, str, int], list[float]]) -> Verdict:
    """`measured[(instance, kind, size)]` → every round's seconds."""
    points = tuple(ProbePoint(i, k, n, statistics.median(xs), predicted_s(cm, i, k, n))
                   for (i, k, n), xs in sorted(measured.items()))
    kinds = sorted({p.kind for p in points})
    return Verdict(points, {k: statistics.median(p.ratio for p in points if p.kind == k) for k in kinds})


def rejudged(cm: CostModel, check: dict) -> Verdict:
    """A recorded check (`Verdict.as_dict()`, as results.json holds it) judged again against `cm`."""
    return judge(cm, {(p["instance"], p["kind"], p["size"]): [p["measured_s"]] for p in check["points"]})


def at_measured_speed(cm: CostModel, verdict: Verdict) -> CostModel:
    """`cm` with its engines' step times scaled to the speed `verdict` measured: decode steps (step
    base, per-sequence and per-context-token cost) by the decode ratio, lone prefills by the
    prefill ratio (per-token and attention terms by it, the prefill overhead so that a one-chunk
    prefill, step base included, scales by it too). One factor per kind for the whole host (the median over instances and sizes):
    a shared host drifts as one, and a single engine's two probe points are noisier than the drift."""
    pre, dec = verdict.ratios.get("prefill", 1.0), verdict.ratios.get("decode", 1.0)

    def scaled(e: EngineConstants) -> EngineConstants:
        return e.model_copy(update={
            "prefill_token_s": e.prefill_token_s * pre, "prefill_attention_s": e.prefill_attention_s * pre,
            "prefill_overhead_s": max(0.0, pre * (e.prefill_overhead_s + e.step_base_s) - dec * e.step_base_s),
            "step_base_s": e.step_base_s * dec, "decode_seq_s": e.decode_seq_s * dec,
            "decode_context_s": e.decode_context_s * dec})

    return cm.model_copy(update={"engine": scaled(cm.engine),
                                 "instances": {k: scaled(e) for k, e in cm.instances.items()}})


async def check_constants(probe: Callable[[dict], Awaitable[dict]], cm: CostModel, instances: list[str],
                          max_model_len: int, max_num_seqs: int, seed: int = 0,
                          pauses_s: tuple[float, ...] | None = None,
                          log: Callable[[str], None] = lambda _: None) -> Verdict:
    """Probe every instance (`probe(body)` is the `/admin/probe` call) and judge `cm` by it; a
    failed judgement is taken again after each pause of `pauses_s` (default `PAUSES_S`), and the
    first attempt that fits (else the last) is the verdict, carrying the earlier attempts' ratios."""
    earlier: list[dict[str, float]] = []

    async def attempt() -> Verdict:
        return await _probe_and_judge(probe, cm, instances, max_model_len, max_num_seqs,
                                      seed * 1_000_003 + len(earlier) * 100_003)  # fresh prompts each attempt

    for pause in PAUSES_S if pauses_s is None else pauses_s:
        verdict = await attempt()
        if verdict.fits:
            return replace(verdict, earlier=tuple(earlier))
        earlier.append(verdict.ratios)
        log(f"measured ÷ predicted is {_ratios_text(verdict.ratios)}, outside {1 / TOLERANCE:.2f}–{TOLERANCE:.2f}×: "
            f"probing again in {pause:g} s, in case the host was in a slow spell")
        await asyncio.sleep(pause)
    return replace(await attempt(), earlier=tuple(earlier))  # the last attempt's verdict, fitting or not


async def _probe_and_judge(probe: Callable[[dict], Awaitable[dict]], cm: CostModel, instances: list[str],
                           max_model_len: int, max_num_seqs: int, seed: int) -> Verdict:
    """One attempt. The first probe on each instance is a warm-up and not counted: an idle engine
    wakes up first."""
    sizes = probe_sizes(max_model_len, max_num_seqs)
    measured: dict[tuple[str, str, int], list[float]] = {}
    n = 0
    for inst in instances:
        await probe({"instance": inst, "kind": "prefill", "size": sizes[0][1], "seed": seed})
    for r in range(ROUNDS):
        for inst in instances:
            for kind, size in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:  # a slow spell moves between points
                n += 1
                body = {"instance": inst, "kind": kind, "size": size, "seed": seed + n}
                body.update({"repeats": PREFILL_REPEATS} if kind == "prefill" else {"tokens": DECODE_TOKENS})
                reply = await probe(body)
                measured.setdefault((inst, kind, size), []).append(float(reply["seconds"]))
    return judge(cm, measured)


def _ratios_text(ratios: dict[str, float]) -> str:
    return ", ".join(f"{k} {r:.2f}×" for k, r in ratios.items())


def mismatch(verdict: Verdict, cm_name: str, url: str) -> str:
    """Why the bench refuses, and the commands that fix it."""
    worst = max(verdict.points, key=lambda p: abs(math.log(p.ratio)))
    what = {"prefill": f"a lone prefill of {worst.size} tokens", "decode": f"a decode step of {worst.size} "
            "sequence" + ("s" if worst.size > 1 else "")}[worst.kind]
    attempts = f" on the last of {len(verdict.earlier) + 1} attempts, every one outside" if verdict.earlier else ""
    return (f"cost model {cm_name!r} does not describe the hardware at {url}: measured ÷ predicted is "
            f"{_ratios_text(verdict.ratios)}{attempts} (allowed {1 / TOLERANCE:.2f}–{TOLERANCE:.2f}×; "
            f"e.g. {what} on {worst.instance}: predicted "
            f"{worst.predicted_s * 1e3:.2f} ms, measured {worst.measured_s * 1e3:.2f} ms). Its SLO targets describe "
            f"other hardware, so goodput against them would say nothing about routing. Fit this host: "
            f"`disagg calibrate --live --url {url} --host --out runs/host.yaml --apply` (--host where the engines "
            f"share the machine's cores, as on the CPU profile; the router prices with the file from then on), then "
            f"bench again; or --accept-foreign-constants to report anyway")
