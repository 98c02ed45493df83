"""Synthetic, seeded workloads for the simulator.

Each generator has the signature ``(n, rate_per_s, seed) -> list[TraceRequest]`` and is fully
deterministic: the same arguments give the same trace (``random.Random`` streams derived from
``seed``). The same seed at another rate gives the same token lengths in the same order, with
time stretched, so a rate sweep compares like with like. Traces have exactly ``n`` requests,
sorted, the first arriving at 0.0; ``slo_class`` is left None (use
:func:`disagg.sim.traces.assign_slo_classes`).

Token lengths are lognormal, parameterised by their mean before clamping (``mu = ln(mean) -
sigma^2 / 2``), then rounded and clamped to a sensible range; the clamps move the realised means
by a few percent at most. Arrivals are Poisson at ``rate_per_s`` except in :func:`mixed_bursty`.

========================  ==================  ==================  ============================
family                    prompt mean [clamp]  output mean [clamp]  shape
========================  ==================  ==================  ============================
short chat                ~300 [8, 4096]       ~150 [4, 1024]       decode-bound, balanced
long prompt, short answer ~3000 [512, 16384]   ~40 [1, 256]         prefill-bound (RAG, summary)
short prompt, long gen    ~150 [8, 1024]       ~600 [64, 4096]      decode-bound (writing, code)
========================  ==================  ==================  ============================
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from disagg.sim.traces import TraceRequest

__all__ = [
    "WORKLOADS",
    "generate",
    "long_prompt_short_answer",
    "mixed_bursty",
    "short_chat",
    "short_prompt_long_generation",
]


@dataclass(frozen=True, slots=True)
class _Lengths:
    """A clamped lognormal token-length distribution, given by its (pre-clamp) mean."""

    mean: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma * self.sigma / 2.0
        return min(self.hi, max(self.lo, round(rng.lognormvariate(mu, self.sigma))))


@dataclass(frozen=True, slots=True)
class _Family:
    prompt: _Lengths
    output: _Lengths

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return self.prompt.draw(rng), self.output.draw(rng)


_SHORT_CHAT = _Family(_Lengths(300, 0.8, 8, 4096), _Lengths(150, 0.8, 4, 1024))
_LONG_PROMPT = _Family(_Lengths(3000, 0.5, 512, 16384), _Lengths(40, 0.7, 1, 256))
_LONG_GEN = _Family(_Lengths(150, 0.7, 8, 1024), _Lengths(600, 0.5, 64, 4096))

# mixed_bursty: the families' shares, and the on/off cycle. ON lasts 10 s at 3.4x the mean rate,
# OFF 30 s at 0.2x: 0.25 * 3.4 + 0.75 * 0.2 = 1.0, so the long-run rate is still rate_per_s.
_MIX: tuple[tuple[_Family, float], ...] = ((_SHORT_CHAT, 0.6), (_LONG_PROMPT, 0.25),
                                           (_LONG_GEN, 0.15))
_ON_S, _OFF_S = 10.0, 30.0
_ON_FACTOR, _OFF_FACTOR = 3.4, 0.2


def _check(n: int, rate_per_s: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate_per_s: expected a positive finite requests/s, got {rate_per_s!r}")


def _poisson(family: _Family, n: int, rate_per_s: float, seed: int) -> list[TraceRequest]:
    _check(n, rate_per_s)
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate_per_s)
        prompt, output = family.draw(rng)
        out.append(TraceRequest(t, prompt, output))
    return out


def short_chat(n: int, rate_per_s: float, seed: int) -> list[TraceRequest]:
    """Chat turns: prompt ~300 tokens, output ~150 tokens (lognormal), Poisson arrivals."""
    return _poisson(_SHORT_CHAT, n, rate_per_s, seed)


def long_prompt_short_answer(n: int, rate_per_s: float, seed: int) -> list[TraceRequest]:
    """RAG / summarisation: prompt ~3000 tokens, output ~40 tokens, Poisson arrivals."""
    return _poisson(_LONG_PROMPT, n, rate_per_s, seed)


def short_prompt_long_generation(n: int, rate_per_s: float, seed: int) -> list[TraceRequest]:
    """Long-form writing / code: prompt ~150 tokens, output ~600 tokens, Poisson arrivals."""
    return _poisson(_LONG_GEN, n, rate_per_s, seed)


def mixed_bursty(n: int, rate_per_s: float, seed: int) -> list[TraceRequest]:
    """On/off bursts mixing the three families (60% chat, 25% long prompt, 15% long generation).

    Time alternates between 10 s ON at 3.4x ``rate_per_s`` and 30 s OFF at 0.2x, starting ON;
    within a phase arrivals are Poisson. The long-run mean rate is ``rate_per_s`` and the
    inter-arrival CV is well above 1 (Poisson's). Mean prompt ~950, mean output ~190 tokens.
    """
    _check(n, rate_per_s)
    rng = random.Random(seed)
    # Arrivals get their own stream: the number of draws per gap depends on the rate (phase
    # crossings), and a shared stream would then change the token lengths across a rate sweep.
    clock = random.Random(f"{seed}/arrivals")
    families = [f for f, _ in _MIX]
    weights = [w for _, w in _MIX]
    out: list[TraceRequest] = []
    t = 0.0
    on = True
    phase_end = _ON_S
    for i in range(n):
        if i:
            # Piecewise-constant Poisson process: a draw that crosses the phase end is discarded
            # and redrawn from the boundary at the next phase's rate (exact by memorylessness).
            while True:
                rate = rate_per_s * (_ON_FACTOR if on else _OFF_FACTOR)
                nxt = t + clock.expovariate(rate)
                if nxt < phase_end:
                    t = nxt
                    break
                t = phase_end
                on = not on
                phase_end += _ON_S if on else _OFF_S
        family = rng.choices(families, weights)[0]
        prompt, output = family.draw(rng)
        out.append(TraceRequest(t, prompt, output))
    return out


WORKLOADS: dict[str, Callable[[int, float, int], list[TraceRequest]]] = {
    "short_chat": short_chat,
    "long_prompt_short_answer": long_prompt_short_answer,
    "short_prompt_long_generation": short_prompt_long_generation,
    "mixed_bursty": mixed_bursty,
}


def generate(name: str, n: int, rate: float, seed: int) -> list[TraceRequest]:
    """Run the workload registered as ``name``; unknown names raise ValueError listing the known."""
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}") \
            from None
    return gen(n, rate, seed)
