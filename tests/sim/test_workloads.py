"""Seeded synthetic workloads (disagg.sim.workloads)."""

from __future__ import annotations

import pytest

from disagg.sim.traces import trace_stats
from disagg.sim.workloads import (
    WORKLOADS,
    generate,
    long_context_chat,
    long_prompt_short_answer,
    mixed_bursty,
    multi_turn_chat,
    short_chat,
    short_prompt_long_generation,
)

N = 3000
RATE = 4.0

# name, documented prompt mean, output mean (within 10%), prompt clamp, output clamp, CV range
TABLE = [
    ("short_chat", 300, 150, (8, 4096), (4, 1024), (0.85, 1.15)),
    ("long_prompt_short_answer", 3000, 40, (512, 16384), (1, 256), (0.85, 1.15)),
    ("short_prompt_long_generation", 150, 600, (8, 1024), (64, 4096), (0.85, 1.15)),
    ("mixed_bursty", 950, 190, (8, 16384), (1, 4096), (1.8, 4.0)),
    ("multi_turn_chat", 2300, 250, (4, 16384), (4, 1024), (0.85, 1.15)),
    ("long_context_chat", 14600, 250, (10000, 32768), (4, 1024), (0.85, 1.15)),
]


def test_registry_holds_the_generators():
    assert WORKLOADS == {
        "short_chat": short_chat,
        "long_prompt_short_answer": long_prompt_short_answer,
        "short_prompt_long_generation": short_prompt_long_generation,
        "mixed_bursty": mixed_bursty,
        "multi_turn_chat": multi_turn_chat,
        "long_context_chat": long_context_chat,
    }
    assert {row[0] for row in TABLE} == set(WORKLOADS)


@pytest.mark.parametrize("name,prompt,output,pclamp,oclamp,cv", TABLE, ids=[t[0] for t in TABLE])
def test_workload_shape(name, prompt, output, pclamp, oclamp, cv):
    reqs = generate(name, N, RATE, seed=11)
    assert len(reqs) == N
    assert reqs[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert all(pclamp[0] <= r.prompt_tokens <= pclamp[1] for r in reqs)
    assert all(oclamp[0] <= r.output_tokens <= oclamp[1] for r in reqs)
    assert all(r.slo_class is None for r in reqs)
    s = trace_stats(reqs)
    assert s["mean_rate"] == pytest.approx(RATE, rel=0.1)
    assert s["prompt_mean"] == pytest.approx(prompt, rel=0.1)
    assert s["output_mean"] == pytest.approx(output, rel=0.1)
    assert cv[0] <= s["interarrival_cv"] <= cv[1]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_deterministic_per_seed(name):
    gen = WORKLOADS[name]
    a = gen(500, 2.0, 3)
    assert a == gen(500, 2.0, 3)
    assert a != gen(500, 2.0, 4)
    # The same seed at another rate gives the same token lengths, only time is stretched.
    b = gen(500, 4.0, 3)
    assert [(r.prompt_tokens, r.output_tokens) for r in a] == [
        (r.prompt_tokens, r.output_tokens) for r in b]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("n", [1, 2, 17])
def test_workload_respects_n(name, n):
    reqs = generate(name, n, 1.0, seed=0)
    assert len(reqs) == n and reqs[0].arrival_s == 0.0


@pytest.mark.parametrize("n,rate,words", [
    (0, 1.0, "n"),
    (-5, 1.0, "n"),
    (2.5, 1.0, "n"),
    (10, 0.0, "rate_per_s"),
    (10, -1.0, "rate_per_s"),
    (10, float("inf"), "rate_per_s"),
])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_rejects_bad_arguments(name, n, rate, words):
    with pytest.raises(ValueError, match=words):
        generate(name, n, rate, seed=0)


def test_generate_unknown_name_lists_known():
    known = ("long_context_chat, long_prompt_short_answer, mixed_bursty, multi_turn_chat, short_chat, "
             "short_prompt_long_generation")
    with pytest.raises(ValueError, match=f"unknown workload 'chat'; known: {known}"):
        generate("chat", 10, 1.0, 0)
