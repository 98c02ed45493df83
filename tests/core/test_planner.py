"""The SLO-driven planner (disagg.core.planner): model sizing, feedback, slow scale-down, bounds."""

from __future__ import annotations

import pytest

from disagg.core.cost_model import load_profile
from disagg.core.planner import Planner, PlannerConfig, Widths, Window, WindowCounter, merge_window, ttft_floor_s
from disagg.core.types import SloClass

CM = load_profile("a40")
WIDE = PlannerConfig(max_prefill=32, max_decode=32)


def window(rate: float, prompt: float = 1000, output: float = 250, tight: bool = True, **kw) -> Window:
    n = round(rate * 10)
    return Window(10.0, n, prompt, output, tight_arrivals=n if tight else 0, **kw)


def test_the_model_grows_with_the_load_and_asks_nothing_of_an_idle_window():
    p = Planner(CM, WIDE)
    widths = [p.model_widths(window(r)) for r in (1, 5, 10, 20, 40, 80)]
    assert all(a.prefill <= b.prefill and a.decode <= b.decode for a, b in zip(widths, widths[1:]))
    assert widths[-1].prefill > widths[0].prefill and widths[-1].decode > widths[0].decode
    assert p.model_widths(Window(10.0, 0)) == Widths(0, 0)
    # loose targets need no more than tight ones
    loose = p.model_widths(window(40, tight=False))
    assert loose.prefill <= widths[4].prefill and loose.decode <= widths[4].decode


def test_the_prefill_width_is_the_smallest_that_keeps_the_predicted_ttft_within_headroom():
    p = Planner(CM, WIDE)
    w = window(40)
    n = p.model_widths(w).prefill
    s = CM.engine.prefill_s(1000)
    budget = WIDE.headroom * CM.target(SloClass.TIGHT).ttft_s - CM.transfer.transfer_s(1000)

    def ttft(width: int) -> float:
        u = w.rate * s / width
        return float("inf") if u >= 1 else s * (1 + u / (2 * (1 - u)))

    assert ttft(n) <= budget < ttft(n - 1)


def test_the_decode_width_is_the_smallest_whose_steady_batch_meets_tpot_and_fits_the_kv():
    p = Planner(CM, WIDE)
    e = CM.engine
    tpot = WIDE.headroom * CM.target(SloClass.TIGHT).tpot_s

    def fits(n: int, prompt: float) -> bool:
        x = 40 * 250 / n  # tokens per second per instance
        if x * e.decode_seq_s >= 1:
            return False
        b = x * e.step_base_s / (1 - x * e.decode_seq_s)
        return e.decode_token_s(1) - e.decode_seq_s + e.decode_seq_s * b <= tpot and \
            b * (prompt + 125) <= WIDE.kv_limit * e.kv_capacity_tokens

    d = p.model_widths(window(40)).decode
    assert fits(d, 1000) and (d == 1 or not fits(d - 1, 1000))
    long = p.model_widths(window(40, prompt=8000)).decode  # long prompts fill the KV first
    assert long > d and fits(long, 8000) and not fits(long - 1, 8000)


def test_the_context_decoding_sequences_hold_asks_for_more_decode_instances():
    # at 0.1 µs per token of context a sequence midway through a 1,000-token prompt and a 250-token
    # output adds 0.11 ms to each step (τ_seq 0.18 ms): a steady batch within the TPOT target needs
    # more instances
    e = CM.engine
    costly = CM.model_copy(update={"engine": e.model_copy(update={"decode_context_s": 1e-7})})
    plain, priced = Planner(CM, WIDE).model_widths(window(40)), Planner(costly, WIDE).model_widths(window(40))
    assert priced.decode > plain.decode
    per_seq = e.decode_seq_s + 1e-7 * (1000 + 125)
    tpot = WIDE.headroom * CM.target(SloClass.TIGHT).tpot_s

    def fits(n: int) -> bool:
        x = 40 * 250 / n
        return x * per_seq < 1 and e.step_base_s + per_seq * x * e.step_base_s / (1 - x * per_seq) <= tpot

    assert fits(priced.decode) and not fits(priced.decode - 1)


def test_hosted_decodes_leave_the_decode_pool_and_load_the_prefill_pool():
    p = Planner(CM, WIDE)
    alone = p.model_widths(window(40))
    half = p.model_widths(window(40, hosted_arrivals=200))  # half the arrivals served whole by prefill instances
    assert half.decode < alone.decode
    # the decode pool sized for half the tokens is the pool sized for half the rate
    assert half.decode == p.model_widths(window(20)).decode
    # each hosted token adds τ_seq to the prefill pool: a long-output load needs more prefill instances
    heavy = dict(prompt=200, output=4000)
    assert p.model_widths(window(40, hosted_arrivals=400, **heavy)).prefill > p.model_widths(window(40, **heavy)).prefill
    c = WindowCounter()
    c.admitted(100, SloClass.LOOSE)
    c.placed_hosted()
    assert merge_window([c.take()], 10.0, 0.0).hosted_arrivals == 1


@pytest.mark.parametrize("signal, grows", [(dict(ttft_met=0.5), "prefill"), (dict(tpot_met=0.5), "decode"),
                                           (dict(kv_pressure=0.95), "decode")])
def test_missed_targets_add_an_instance_to_the_pool_they_blame(signal, grows):
    p = Planner(CM, WIDE)
    w = window(1, finished=10, **signal)
    assert p.model_widths(w) == Widths(1, 1)
    plan = p.plan(w, Widths(2, 2))
    assert getattr(plan.widths, grows) == 3
    other = "decode" if grows == "prefill" else "prefill"
    assert getattr(plan.widths, other) == 2
    assert any(f"+1 {grows}" in r for r in plan.reasons)


def test_ttft_misses_no_width_can_fix_add_no_prefill_instance():
    """Half the finished missed their TTFT target, but every miss was a prompt whose prefill
    alone, on an idle instance, takes longer than the target: another instance cannot help."""
    p = Planner(CM, WIDE)
    hopeless = window(1, finished=10, ttft_met=0.5, ttft_unfixable=5)
    assert hopeless.ttft_met_fixable == 1.0
    assert p.plan(hopeless, Widths(2, 2)).widths == Widths(2, 2)
    # one fixable miss among them still counts (4 of 5 fixable met: 0.8 < the goal)
    some = window(1, finished=10, ttft_met=0.4, ttft_unfixable=5)
    assert some.ttft_met_fixable == pytest.approx(0.8)
    plan = p.plan(some, Widths(2, 2))
    assert plan.widths.prefill == 3 and any("5 misses no width fixes left out" in r for r in plan.reasons)


def test_the_ttft_floor_is_a_lone_prefill_and_the_counter_uses_it():
    target = CM.target(SloClass.TIGHT)
    assert ttft_floor_s(CM.engine, 1000) == CM.engine.prefill_s(1000)
    long = next(n for n in range(64, 1 << 20, 64) if ttft_floor_s(CM.engine, n) > target.ttft_s)
    c = WindowCounter()
    c.served(10, 2 * target.ttft_s, None, target, ttft_floor_s(CM.engine, long))  # unfixable miss
    c.served(10, 2 * target.ttft_s, None, target, ttft_floor_s(CM.engine, 100))  # a fixable miss
    c.served(10, target.ttft_s / 2, None, target, ttft_floor_s(CM.engine, long))  # met: not a miss at all
    w = merge_window([c.take()], 10.0, 0.0)
    assert (w.finished, w.ttft_unfixable) == (3, 1) and w.ttft_met_fixable == pytest.approx(1 / 2)


def test_pools_grow_at_once_and_shrink_one_at_a_time_after_a_streak():
    p = Planner(CM, PlannerConfig(max_prefill=32, max_decode=32, down_after=3))
    busy = p.plan(window(40), Widths(1, 1)).widths
    assert busy == p.model_widths(window(40))  # straight to the target
    widths, seen = busy, []
    for _ in range(7):
        widths = p.plan(window(1), widths).widths
        seen.append(widths)
    assert seen[0] == seen[1] == busy  # two quiet windows change nothing
    assert seen[2] == Widths(busy.prefill - 1, busy.decode - 1)
    assert seen[5] == Widths(busy.prefill - 2, busy.decode - 2)
    # a busy window in between resets the streak
    p2 = Planner(CM, PlannerConfig(max_prefill=32, max_decode=32, down_after=2))
    w = p2.plan(window(1), busy).widths
    w = p2.plan(window(40), w).widths
    assert p2.plan(window(1), w).widths == busy


def test_widths_stay_within_the_bounds():
    cfg = PlannerConfig(min_prefill=2, max_prefill=3, min_decode=1, max_decode=2, down_after=1)
    p = Planner(CM, cfg)
    assert p.plan(window(200), Widths(2, 1)).widths == Widths(3, 2)
    assert p.plan(Window(10.0, 0), Widths(2, 1)).widths == Widths(2, 1)


def test_bad_bounds_are_refused_naming_them():
    with pytest.raises(ValueError, match="min widths"):
        PlannerConfig(min_prefill=4, max_prefill=2)
