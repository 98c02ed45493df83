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
multi-turn chat           ~2300 [4, 16384]     ~250 [4, 1024]       shared prefixes (see below)
========================  ==================  ==================  ============================

:func:`multi_turn_chat` is the one workload whose requests share prompt prefixes, and the one that
carries prefix-block hashes (``TraceRequest.prefix_hashes``, as the Mooncake traces do), for the
simulator's prefix caches: each turn's prompt is the whole conversation so far.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from disagg.core.types import PREFIX_BLOCK_TOKENS
from disagg.sim.traces import TraceRequest

__all__ = [
    "WORKLOADS",
    "ConversationShape",
    "conversations",
    "generate",
    "long_context_chat",
    "long_prompt_short_answer",
    "mixed_bursty",
    "multi_turn_chat",
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


# multi_turn_chat: a system prompt per application, the user's text and the answer of each turn
_USER_TEXT = _Lengths(150, 0.9, 4, 2048)
_ANSWER = _Lengths(250, 0.7, 4, 1024)


@dataclass(frozen=True, slots=True)
class ConversationShape:
    """The knobs of :func:`conversations` and :func:`multi_turn_chat` (see there)."""

    system_prompts: int = 4  # distinct system prompts shared across conversations; 0: none
    mean_turns: float = 4.0
    max_turns: int = 16
    think_gaps: float = 100.0  # mean think time between turns, in mean inter-arrival gaps
    max_context_tokens: int = 16384
    # the system prompts' lengths: a clamped lognormal (mean, sigma, shortest, longest)
    system_tokens: tuple[float, float, int, int] = (1000.0, 0.3, 256, 4096)

    def __post_init__(self) -> None:
        if (self.system_prompts < 0 or self.mean_turns < 1 or self.max_turns < 1 or not self.think_gaps > 0
                or self.max_context_tokens < 2):
            raise ValueError(f"conversation shape: need system_prompts >= 0, mean_turns >= 1, max_turns >= 1, "
                             f"think_gaps > 0 and max_context_tokens >= 2; got {self}")


def conversations(seed: int, shape: ConversationShape = ConversationShape()) -> Iterator[list[TraceRequest]]:
    """An endless stream of multi-turn conversations with prefix-block hashes, the material of
    :func:`multi_turn_chat`; each is the list of its turns, whose ``arrival_s`` is the time since
    the conversation's first turn, in mean inter-arrival gaps (scaled to seconds by the caller).

    Turn k's prompt is the conversation so far: turn k-1's prompt + its answer + the user's new
    text (~150 tokens); answers are ~250 tokens. A conversation has 1 + Geometric turns (mean
    ``mean_turns``, at most ``max_turns``), and ends early rather than exceed
    ``max_context_tokens``. Turns follow each other after an exponential think time of mean
    ``think_gaps``. With ``system_prompts`` > 0, each conversation starts with one of that many
    system prompts (~1000 tokens; drawn with weights 1, 1/2, 1/3...: a few applications dominate),
    so prefixes are also shared across conversations; 0 means none.

    Hashes follow the Mooncake convention: one per ``PREFIX_BLOCK_TOKENS`` (512) tokens of the
    prompt, the last one for a partial block. A full block's hash names the whole prefix up to its
    end, so turn k+1's hashes start with all but a partial last one of turn k's (that block has
    grown into a different, full one), and conversations with the same system prompt share its
    full blocks. Hash ids are small integers, counted from 0 in the order the blocks are drawn.
    """
    rng = random.Random(seed)
    clock = random.Random(f"{seed}/think")  # times apart, so the token lengths do not depend on them
    block_ids = itertools.count()
    systems = []
    system_lengths = _Lengths(*shape.system_tokens)
    for _ in range(shape.system_prompts):
        tokens = system_lengths.draw(rng)
        systems.append((tokens, [next(block_ids) for _ in range(tokens // PREFIX_BLOCK_TOKENS)]))
    popularity = [1.0 / (k + 1) for k in range(shape.system_prompts)]
    while True:
        context, full = 0, []  # tokens so far; the hashes of their full blocks
        if systems:
            context, system_blocks = rng.choices(systems, popularity)[0]
            full = list(system_blocks)
        turns: list[TraceRequest] = []
        offset = 0.0
        for turn in range(shape.max_turns):
            if turn:
                if rng.random() < 1.0 / shape.mean_turns:
                    break
                offset += clock.expovariate(1.0 / shape.think_gaps)
            prompt, answer = context + _USER_TEXT.draw(rng), _ANSWER.draw(rng)
            if prompt + answer > shape.max_context_tokens:
                break
            while len(full) < prompt // PREFIX_BLOCK_TOKENS:
                full.append(next(block_ids))
            partial = (next(block_ids),) if prompt % PREFIX_BLOCK_TOKENS else ()
            turns.append(TraceRequest(offset, prompt, answer,
                                      prefix_hashes=(*full[:prompt // PREFIX_BLOCK_TOKENS], *partial)))
            context = prompt + answer
        if turns:  # the first turn alone may not fit the context
            yield turns


def multi_turn_chat(n: int, rate_per_s: float, seed: int,
                    shape: ConversationShape = ConversationShape()) -> list[TraceRequest]:
    """Multi-turn chat with shared prefixes: the turns of :func:`conversations`, conversations
    starting as a Poisson process.

    The process runs from well before 0 (``think_gaps × max_turns``), so the trace is a window of a
    steady state: conversations in progress at 0 contribute their later turns. Time is drawn in
    gap units (about one request per unit) and scaled so that the mean rate is exactly
    ``rate_per_s``; as with the other generators, a seed gives the same requests in the same order at
    every rate. Think times are in gaps, so they scale with the rate (100 gaps at 10 req/s: 10 s),
    as they would under :func:`disagg.sim.traces.rescale_to_rate`.
    """
    _check(n, rate_per_s)
    stream = conversations(seed, shape)
    starts = random.Random(f"{seed}/starts")
    start = -shape.think_gaps * shape.max_turns
    requests: list[tuple[float, int, TraceRequest]] = []  # (time, order drawn, turn)
    earliest: list[float] = []  # the n earliest times so far, negated: a max-heap
    while True:
        start += starts.expovariate(1.0 / shape.mean_turns)
        if len(earliest) == n and start > -earliest[0]:  # no later conversation reaches the n earliest
            break
        for turn in next(stream):
            t = start + turn.arrival_s
            if t < 0.0:
                continue
            requests.append((t, len(requests), turn))
            if len(earliest) < n:
                heapq.heappush(earliest, -t)
            elif t < -earliest[0]:
                heapq.heapreplace(earliest, -t)
    window = sorted(requests)[:n]
    t0, span = window[0][0], window[-1][0] - window[0][0]
    scale = (n - 1) / (span * rate_per_s) if span > 0 else 0.0
    return [dataclasses.replace(r, arrival_s=(t - t0) * scale) for t, _, r in window]


# long_context_chat: questions over long documents, 10-20k tokens each, a few follow-ups per document
LONG_CONTEXT = ConversationShape(system_prompts=16, system_tokens=(14000.0, 0.2, 10000, 20000), mean_turns=3.0,
                                 max_turns=8, max_context_tokens=32768)


def long_context_chat(n: int, rate_per_s: float, seed: int,
                      shape: ConversationShape = LONG_CONTEXT) -> list[TraceRequest]:
    """Questions over long documents: :func:`multi_turn_chat` whose conversations open with one of
    16 documents of 10-20k tokens (lognormal around 14k), shared across conversations, and go on
    for 3 turns on average within 32k tokens of context. The prefix caches hold most of each
    prompt; no fixed TTFT target fits a prefill this long (SLO scale is the measure for it)."""
    return multi_turn_chat(n, rate_per_s, seed, shape)


WORKLOADS: dict[str, Callable[[int, float, int], list[TraceRequest]]] = {
    "short_chat": short_chat,
    "long_prompt_short_answer": long_prompt_short_answer,
    "short_prompt_long_generation": short_prompt_long_generation,
    "mixed_bursty": mixed_bursty,
    "multi_turn_chat": multi_turn_chat,
    "long_context_chat": long_context_chat,
}


def generate(name: str, n: int, rate: float, seed: int, max_context_tokens: int | None = None) -> list[TraceRequest]:
    """Run the workload registered as ``name``; unknown names raise ValueError listing the known.
    ``max_context_tokens``: the longest conversation (prompt + answer) of the multi-turn workloads,
    e.g. the serving model's context; the other workloads take none."""
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}") \
            from None
    if max_context_tokens is None:
        return gen(n, rate, seed)
    if gen is multi_turn_chat:
        return multi_turn_chat(n, rate, seed, ConversationShape(max_context_tokens=max_context_tokens))
    if gen is long_context_chat:
        return long_context_chat(n, rate, seed, dataclasses.replace(LONG_CONTEXT, max_context_tokens=max_context_tokens))
    raise ValueError(f"max_context_tokens applies to the multi-turn workloads only, not {name!r}")
