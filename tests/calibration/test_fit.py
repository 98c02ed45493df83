"""The fit recovers known constants from noisy synthetic measurements, and refuses nonsense."""

import random

import numpy as np
import pytest

from calibration.fit import (
    LOOSE_FACTOR, REFERENCE_PROMPT, SLO_HEADROOM, CalibrationError, Measurements, Sample, fit_cost_model, fit_linear,
    held_out_error, nnls, serving_overhead,
)
from disagg.core.types import SloClass

TRUE = dict(base=0.0017, overhead=0.004, tau_pre=1.05e-5, tau_seq=2.0e-5, xfer_lat=0.006, xfer_bw=400_000.0)


def synthetic(noise: float, seed: int = 0, **override) -> Measurements:
    t = {**TRUE, **override}
    rng = random.Random(seed)
    jitter = lambda x: x * (1 + rng.uniform(-noise, noise))  # noqa: E731
    prefill = [Sample(p, jitter(t["overhead"] + t["base"] + t["tau_pre"] * p)) for p in (64, 256, 512, 1024, 1536)
               for _ in range(3)]
    decode = [Sample(b, jitter(t["base"] + t["tau_seq"] * b)) for b in (1, 2, 4, 8, 16, 32)]
    transfer = [Sample(p, jitter(t["xfer_lat"] + p / t["xfer_bw"])) for p in (64, 256, 512, 1024, 1536)
                for _ in range(3)]
    return Measurements(prefill, decode, transfer, kv_capacity_tokens=131072, model="tiny:tiny")


def test_fit_linear_exact():
    f = fit_linear([Sample(x, 2 + 3 * x) for x in (1, 2, 3, 4)], "line")
    assert f.slope == pytest.approx(3) and f.intercept == pytest.approx(2) and f.r2 == pytest.approx(1)
    assert f.residual_p90 == pytest.approx(0, abs=1e-12)


@pytest.mark.parametrize("noise", [0.0, 0.02, 0.05])
def test_recovers_known_constants(noise):
    cm, report = fit_cost_model(synthetic(noise), "t")
    tol = 0.0001 if noise == 0 else 4 * noise
    e = cm.engine
    assert e.prefill_token_s == pytest.approx(TRUE["tau_pre"], rel=tol)
    assert e.step_base_s == pytest.approx(TRUE["base"], rel=tol)
    assert e.decode_seq_s == pytest.approx(TRUE["tau_seq"], rel=max(tol, 0.0001) * 3)
    assert e.prefill_overhead_s == pytest.approx(TRUE["overhead"], rel=3 * tol + 0.0001)
    assert cm.transfer.tokens_per_s == pytest.approx(TRUE["xfer_bw"], rel=3 * tol + 0.0001)
    assert cm.transfer.latency_s == pytest.approx(TRUE["xfer_lat"], rel=3 * tol + 0.0001)
    assert cm.calibrated and cm.model == "tiny:tiny" and e.kv_capacity_tokens == 131072
    assert report.prefill.r2 > 0.95


def test_slo_rule():
    cm, _ = fit_cost_model(synthetic(0.0), "t")
    e = cm.engine
    tight = cm.slo[SloClass.TIGHT]
    expected_ttft = SLO_HEADROOM * (e.prefill_s(REFERENCE_PROMPT) + cm.transfer.transfer_s(REFERENCE_PROMPT)
                                    + e.decode_token_s(1))
    assert tight.ttft_s == pytest.approx(expected_ttft)
    assert tight.tpot_s == pytest.approx(SLO_HEADROOM * e.decode_token_s(32))
    assert cm.slo[SloClass.LOOSE].ttft_s == pytest.approx(LOOSE_FACTOR * tight.ttft_s)


def test_held_out_error_is_small_for_a_good_fit_and_large_for_a_bad_one():
    m = synthetic(0.02)
    cm, _ = fit_cost_model(m, "t")
    fresh = synthetic(0.02, seed=9)
    good = held_out_error(cm.engine, fresh.prefill, fresh.decode)
    assert good["median_rel_error"] < 0.05
    slow = synthetic(0.0, tau_pre=5e-5, base=0.004)
    bad = held_out_error(cm.engine, slow.prefill, slow.decode)
    assert bad["median_rel_error"] > 0.3


@pytest.mark.parametrize("override, match", [
    ({"tau_pre": -1e-6}, "prefill latency does not grow"),
    ({"tau_seq": -4e-5}, "falls with concurrency"),
    ({"xfer_bw": -1e6}, "KV transfer time does not grow"),
])
def test_nonsense_is_refused(override, match):
    with pytest.raises(CalibrationError, match=match):
        fit_cost_model(synthetic(0.0, **override), "t")


def test_too_few_points_and_bad_times_are_refused():
    m = synthetic(0.0)
    m.decode = m.decode[:2]
    with pytest.raises(CalibrationError, match="at least 3 points"):
        fit_cost_model(m, "t")
    with pytest.raises(CalibrationError, match="positive and finite"):
        fit_linear([Sample(1, 0.1), Sample(2, -0.2), Sample(3, 0.3)], "x")
    with pytest.raises(CalibrationError, match="2\\+ distinct"):
        fit_linear([Sample(1, 0.1)] * 5, "x")


def test_a_flat_noisy_decode_curve_is_accepted():
    m = synthetic(0.0, tau_seq=0.0)
    m.decode = [Sample(b, TRUE["base"] * (1 + 0.03 * (-1) ** b)) for b in (1, 2, 4, 8)]
    cm, _ = fit_cost_model(m, "t")
    # a flat curve: a step costs its base at every batch size, and next to nothing per sequence
    # (least squares through ±3% noise gives 0.6% of the base per sequence)
    assert cm.engine.step_base_s == pytest.approx(TRUE["base"], rel=0.05)
    assert cm.engine.decode_seq_s < 0.01 * TRUE["base"]


def test_a_slow_first_point_on_a_flat_curve_is_noise_not_a_refusal():
    # As measured once on a busy 2-core machine: batch 1 caught a slow moment, the rest is flat.
    m = synthetic(0.0)
    m.decode = [Sample(1, 0.0060), Sample(4, 0.0052), Sample(16, 0.0053)]
    cm, report = fit_cost_model(m, "t")
    assert report.decode.slope < 0 and report.decode.slope_stderr > abs(report.decode.slope) / 3
    assert cm.engine.decode_seq_s == 0


def test_a_step_that_falls_consistently_across_repeats_is_refused():
    m = synthetic(0.0)
    rng = random.Random(1)
    m.decode = [Sample(b, (0.006 - 1e-4 * b) * (1 + rng.uniform(-0.02, 0.02))) for _ in range(3) for b in (1, 4, 16)]
    with pytest.raises(CalibrationError, match="falls with concurrency .* over 9 samples"):
        fit_cost_model(m, "t")


def test_a_transfer_time_flat_within_noise_gets_the_slowest_bandwidth_the_data_allow():
    m = synthetic(0.0)
    rng = random.Random(2)
    # latency-dominated, as a tiny model's KV on one machine: 6 ms ± 1 ms whatever the length
    m.transfer = [Sample(p, 0.006 + rng.uniform(-0.001, 0.001)) for p in (64, 256, 512, 1024, 1536) for _ in range(3)]
    cm, report = fit_cost_model(m, "t")
    bound = 3 * report.transfer.slope_stderr
    assert report.transfer.slope - bound <= 0  # not significantly positive
    assert cm.transfer.tokens_per_s == pytest.approx(1 / bound)
    # the priced transfer stays within the measured range over the measured lengths
    assert 0.004 < cm.transfer.transfer_s(64) < cm.transfer.transfer_s(1536) < 0.009


def test_the_serving_path_overhead_enters_the_ttft_targets_and_is_the_median_measured_gap():
    m = synthetic(0.0)
    bare, _ = fit_cost_model(m, "t")
    overhead = serving_overhead([0.020, 0.021, 0.019, 0.5])  # one outlier
    assert overhead == pytest.approx(0.0205)
    cm, _ = fit_cost_model(m, "t", serving_overhead_s=overhead)
    assert cm.serving_overhead_s == overhead
    for c in SloClass:
        assert cm.slo[c].ttft_s == pytest.approx(bare.slo[c].ttft_s + SLO_HEADROOM * overhead
                                                 * (LOOSE_FACTOR if c is SloClass.LOOSE else 1))
        assert cm.slo[c].tpot_s == bare.slo[c].tpot_s
    assert serving_overhead([-0.001, -0.002, 0.001]) == 0.0  # clock noise around zero: not negative
    with pytest.raises(CalibrationError, match="no requests"):
        serving_overhead([])


# --- the attention term: a lone prefill of p tokens = base + overhead + τ_pre·p + τ_attn·p²/2 ---

LADDER = (16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512, 724, 1024, 1448, 1984)  # Plan's, max_model_len 2048
# like tiny:small on a 2-core CPU: at 1,984 tokens the attention is ~40% of the prefill
QUADRATIC = dict(base=0.0028, overhead=0.001, tau_pre=3.0e-5, attn=2.0e-8)


def with_prefill(m: Measurements, noise: float, seed: int, lengths=LADDER, repeats: int = 3, **t) -> Measurements:
    rng = random.Random(seed)
    m.prefill = [Sample(p, (t["base"] + t["overhead"] + t["tau_pre"] * p + t["attn"] * p * p / 2)
                        * (1 + rng.uniform(-noise, noise))) for p in lengths for _ in range(repeats)]
    return m


def quadratic(noise: float, seed: int = 0, **kw) -> Measurements:
    t = {**QUADRATIC, **kw}
    return with_prefill(synthetic(0.0, base=t["base"]), noise, seed, **t)


def test_the_plan_is_a_geometric_ladder_up_to_the_longest_prompt():
    from calibration.measure import Plan

    assert Plan.for_context(2048, 64, quick=False).prefill_lengths == LADDER
    quick = Plan.for_context(8192, 64, quick=True).prefill_lengths
    assert quick[0] == 16 and quick[-1] == 8192 - 64 and all(b <= 2 * a for a, b in zip(quick, quick[1:]))


@pytest.mark.parametrize("quick", [False, True])
def test_every_round_measures_every_fitted_and_held_out_point_in_a_rotated_order(quick):
    from collections import Counter

    from calibration.measure import Plan

    plan = Plan.for_context(2048, 64, quick=quick)
    rounds = plan.rounds(plan.prefill_lengths, plan.held_out_lengths)
    every = {(x, False) for x in plan.prefill_lengths} | {(x, True) for x in plan.held_out_lengths}
    assert plan.held_out_lengths and len(rounds) == plan.repeats >= 2
    assert all(Counter(r) == Counter(every) for r in rounds)  # each point once a round, held out too
    assert len({r[0] for r in rounds}) == plan.repeats  # a slow moment lands on other points each round
    decode = plan.rounds(plan.concurrencies, plan.held_out_concurrencies)
    assert all({b for b, held in r if held} == set(plan.held_out_concurrencies) for r in decode)
    # the progress bar counts each prefill probe, each concurrency and the probe at long context once
    assert plan.long_context == (16, 1024)  # half the model's context
    assert plan.steps() == sum(map(len, rounds)) + len(plan.concurrencies) + len(plan.held_out_concurrencies) + 1


@pytest.mark.parametrize("noise", [0.0, 0.01, 0.02])
def test_recovers_the_attention_term_from_a_quadratic_prefill(noise):
    for seed in range(5):
        cm, report = fit_cost_model(quadratic(noise, seed), "t")
        e = cm.engine
        tol = max(noise, 1e-6)  # ±2% noise: the attention term within 8%, a prefill's time within 2%
        assert e.prefill_attention_s == pytest.approx(QUADRATIC["attn"], rel=4 * tol)
        assert report.prefill.attention == e.prefill_attention_s
        assert e.prefill_token_s == pytest.approx(QUADRATIC["tau_pre"], rel=2 * tol)
        assert e.prefill_overhead_s == pytest.approx(QUADRATIC["overhead"], rel=3 * tol)
        for p in (40, 300, 1700):  # lengths not in the fit
            truth = QUADRATIC["base"] + QUADRATIC["overhead"] + QUADRATIC["tau_pre"] * p + QUADRATIC["attn"] * p * p / 2
            assert e.prefill_s(p) == pytest.approx(truth, rel=tol)


def test_the_attention_term_is_what_makes_a_quadratic_prefill_predictable():
    m = quadratic(0.02)
    cm, _ = fit_cost_model(m, "t")
    fresh = quadratic(0.02, seed=7)
    with_term = held_out_error(cm.engine, fresh.prefill, fresh.decode)
    linear = cm.model_copy(update={"engine": cm.engine.model_copy(update={"prefill_attention_s": 0.0})})
    without = held_out_error(linear.engine, fresh.prefill, fresh.decode)
    assert with_term["p90_rel_error"] < 0.03 < 0.2 < without["p90_rel_error"]


@pytest.mark.parametrize("noise", [0.0, 0.02, 0.05])
def test_a_linear_prefill_gets_no_attention_term(noise):
    for seed in range(5):
        m = with_prefill(synthetic(0.0), noise, seed, **TRUE, attn=0.0)
        cm, report = fit_cost_model(m, "t")
        assert cm.engine.prefill_attention_s == 0.0 == report.prefill.attention
        assert cm.engine.prefill_token_s == pytest.approx(TRUE["tau_pre"], rel=max(noise, 1e-6))


def test_too_few_lengths_to_identify_the_term_fit_the_linear_model():
    # three lengths (and one repeat: no noise estimate) cannot tell a curve from its chord
    m = with_prefill(synthetic(0.0, base=QUADRATIC["base"]), 0.0, 0, lengths=(64, 512, 1984), **QUADRATIC)
    cm, report = fit_cost_model(m, "t")
    assert cm.engine.prefill_attention_s == 0.0 and report.prefill.attention_stderr == float("inf")
    assert cm.engine.prefill_token_s > QUADRATIC["tau_pre"]  # the chord's slope


def test_a_negligible_attention_term_is_dropped():
    # a real but tiny curve (< 2% of the longest prefill) is not worth a constant
    m = quadratic(0.0, attn=1e-10)
    assert fit_cost_model(m, "t")[0].engine.prefill_attention_s == 0.0


def test_chunked_prompts_pay_a_step_base_per_chunk():
    m = with_prefill(synthetic(0.0, base=QUADRATIC["base"]), 0.0, 0, lengths=(64, 256, 1024, 2048, 4096, 8128),
                     **QUADRATIC)
    for s in m.prefill:  # the engine's chunked prefill: one more step base per 2,048 tokens
        object.__setattr__(s, "seconds", s.seconds + QUADRATIC["base"] * (-(-s.x // 2048) - 1))
    cm, _ = fit_cost_model(m, "t")
    assert cm.engine.prefill_attention_s == pytest.approx(QUADRATIC["attn"], rel=1e-6)
    assert all(cm.engine.prefill_s(int(s.x)) == pytest.approx(s.seconds, rel=1e-6) for s in m.prefill)


def test_nnls_is_exact_on_the_boundary():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(a, np.array([1.0, 2.0, 3.0])) == pytest.approx([1.0, 2.0])
    # unconstrained: x = (-1, 2); constrained: x0 = 0 and x1 fits what is left
    x = nnls(a, np.array([-1.0, 2.0, 1.0]))
    assert x[0] == 0.0 and x[1] == pytest.approx(1.5)


TAU_CTX = 9e-8  # s per step per token of context a decoding sequence holds (as measured on the CPU profile)


def with_long_context(m: Measurements, noise: float, seed: int = 1, tau_ctx: float = TAU_CTX) -> Measurements:
    """`m` with three decode probes of 16 streams holding 1,008 tokens more than the short ones."""
    rng = random.Random(seed)
    step = TRUE["base"] + TRUE["tau_seq"] * 16 + tau_ctx * 16 * 1008
    m.decode = m.decode + [Sample(16, step * (1 + rng.uniform(-noise, noise)), extra_context=1008) for _ in range(3)]
    return m


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_recovers_the_cost_of_the_context_decoding_sequences_hold(noise):
    plain, _ = fit_cost_model(synthetic(noise), "t")
    cm, report = fit_cost_model(with_long_context(synthetic(noise), noise), "t")
    # the long-context term is 1.45 ms of a 3.0 ms step: ±2% noise on the step is ±4% on the term
    assert cm.engine.decode_context_s == pytest.approx(TAU_CTX, rel=0.0001 if noise == 0 else 0.1)
    # the short probes' line is what it was without them: they judge the term, not the line
    assert (cm.engine.step_base_s, cm.engine.decode_seq_s) == (plain.engine.step_base_s, plain.engine.decode_seq_s)
    assert report.decode.n == 6
    assert plain.engine.decode_context_s == 0.0  # no probe at long context: no term
    # the SLO rule's concurrency is the short probes' largest, as before
    assert cm.slo[SloClass.TIGHT].tpot_s == plain.slo[SloClass.TIGHT].tpot_s


def test_long_context_probes_no_slower_than_the_line_give_no_term():
    cm, _ = fit_cost_model(with_long_context(synthetic(0.0), 0.0, tau_ctx=-1e-8), "t")
    assert cm.engine.decode_context_s == 0.0


def test_the_probe_at_long_context_takes_half_the_models_context_within_bounds():
    from calibration.measure import long_context_point

    assert long_context_point(2048, 64) == (16, 1024)
    assert long_context_point(32768, 256) == (16, 2048)  # enough to show the term, quick to prefill
    assert long_context_point(2048, 8) == (8, 1024)  # no more streams than the engine runs
    assert long_context_point(100, 64) is None  # too short a context to tell from the short probes'


def test_the_context_term_is_judged_against_the_short_probes_at_its_own_concurrency():
    # the short probes at 16 streams ran 20% above the line through 1, 2, 4, 8 and 32 (a slow spell):
    # the long-context probes, taken beside them, are judged against them, not against the line
    m = synthetic(0.0)
    slow = 1.2 * (TRUE["base"] + TRUE["tau_seq"] * 16)
    m.decode = [s if s.x != 16 else Sample(16, slow) for s in m.decode]
    m.decode += [Sample(16, slow + TAU_CTX * 16 * 1008, extra_context=1008) for _ in range(3)]
    cm, _ = fit_cost_model(m, "t")
    assert cm.engine.decode_context_s == pytest.approx(TAU_CTX, rel=1e-6)
