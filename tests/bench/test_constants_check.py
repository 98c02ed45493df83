"""The bench's check that the constants it judges with describe the app's hardware."""

from __future__ import annotations

import asyncio

import pytest

from disagg.bench.constants_check import (
    ROUNDS, TOLERANCE, check_constants, judge, mismatch, predicted_s, probe_sizes,
)
from disagg.core.cost_model import load_profile

CM = load_profile("cpu-tiny")


def hardware(factor: dict[str, float] | float, calls: list | None = None):
    """A fleet whose engines take `factor` × what CM predicts (per kind, or one factor for both)."""
    async def probe(body: dict) -> dict:
        if calls is not None:
            calls.append(body)
        f = factor if isinstance(factor, float) else factor[body["kind"]]
        return {"seconds": f * predicted_s(CM, body["instance"], body["kind"], body["size"])}
    return probe


def run(probe, cm=CM, instances=("p0", "d0", "d1"), pauses_s=(0.0, 0.0), log=lambda _: None):
    return asyncio.run(check_constants(probe, cm, list(instances), 2048, 64, pauses_s=pauses_s, log=log))


@pytest.mark.parametrize("factor,fits", [(1.0, True), (1.3, True), (0.7, True), (2.0, False), (0.5, False),
                                         ({"prefill": 1.0, "decode": 2.3}, False),
                                         ({"prefill": 0.4, "decode": 1.0}, False)])
def test_constants_fit_only_within_the_tolerance_for_both_kinds(factor, fits):
    verdict = run(hardware(factor))
    assert verdict.fits is fits
    for kind in ("prefill", "decode"):
        f = factor if isinstance(factor, float) else factor[kind]
        assert verdict.ratios[kind] == pytest.approx(f)


def test_every_instance_is_probed_at_every_point_each_round_after_a_warm_up():
    calls: list[dict] = []
    verdict = run(hardware(1.0, calls))
    sizes = probe_sizes(2048, 64)
    assert len(calls) == 3 + ROUNDS * 3 * len(sizes)  # one uncounted warm-up per instance
    assert {(p.instance, p.kind, p.size) for p in verdict.points} == {
        (i, k, n) for i in ("p0", "d0", "d1") for k, n in sizes}
    assert len({c["seed"] for c in calls[3:]}) == len(calls) - 3  # fresh prompts: no prefix-cache hit
    assert all(c["repeats"] >= 3 for c in calls[3:] if c["kind"] == "prefill")


def test_a_slow_spell_on_one_round_does_not_move_the_median():
    calls: list[dict] = []
    n = {"i": 0}

    async def probe(body):
        calls.append(body)
        n["i"] += 1
        slow = 5.0 if 3 < n["i"] <= 3 + 12 else 1.0  # the whole first round on the first instance
        return {"seconds": slow * predicted_s(CM, body["instance"], body["kind"], body["size"])}
    assert run(probe).fits


def test_a_failed_check_is_taken_again_and_a_slow_spell_that_passes_is_forgiven():
    """A shared host's slow spell lasting a whole attempt (seen live: decode 1.87× for seconds right
    after a burst, on constants that fitted a minute before) fails that attempt only."""
    calls: list[dict] = []
    per_attempt = 3 + ROUNDS * 3 * len(probe_sizes(2048, 64))

    async def probe(body):
        calls.append(body)
        slow = 2.0 if len(calls) <= per_attempt else 1.0
        return {"seconds": slow * predicted_s(CM, body["instance"], body["kind"], body["size"])}
    lines: list[str] = []
    verdict = run(probe, log=lines.append)
    assert verdict.fits and verdict.ratios == pytest.approx({"prefill": 1.0, "decode": 1.0})
    assert verdict.earlier == ({"decode": pytest.approx(2.0), "prefill": pytest.approx(2.0)},)
    assert len(calls) == 2 * per_attempt  # no third attempt once one fits
    counted = calls[3:per_attempt] + calls[per_attempt + 3:]  # after each attempt's warm-ups
    assert len({c["seed"] for c in counted}) == len(counted)  # the second attempt's prompts are fresh too
    assert len(lines) == 1 and "probing again" in lines[0] and "decode 2.00×" in lines[0]
    assert verdict.as_dict()["earlier_attempts"] == [verdict.earlier[0]]


def test_other_hardware_fails_every_attempt_and_the_refusal_says_so():
    calls: list[dict] = []
    verdict = run(hardware({"prefill": 1.0, "decode": 2.0}, calls))
    assert not verdict.fits and len(verdict.earlier) == 2
    assert len(calls) == 3 * (3 + ROUNDS * 3 * len(probe_sizes(2048, 64)))
    assert "on the last of 3 attempts, every one outside" in mismatch(verdict, "cpu-tiny", "http://127.0.0.1:8000")


def test_per_instance_constants_are_the_ones_judged():
    fast = CM.engine.model_copy(update={"step_base_s": CM.engine.step_base_s / 4,
                                        "prefill_token_s": CM.engine.prefill_token_s / 4,
                                        "decode_seq_s": CM.engine.decode_seq_s / 4})
    with_instance = CM.model_copy(update={"instances": {"d1": fast}})

    async def probe(body):  # d1 really is 4× faster; the pool's constants describe the others
        return {"seconds": predicted_s(with_instance, body["instance"], body["kind"], body["size"])}
    assert run(probe, cm=with_instance).fits
    assert min(p.ratio for p in run(probe).points) == pytest.approx(0.25)  # judged with the pool's: d1 is off


def test_probe_sizes_fit_the_context_and_the_batch_limit():
    assert probe_sizes(2048, 64) == [("prefill", 128), ("prefill", 1024), ("decode", 1), ("decode", 8)]
    small = probe_sizes(64, 4)
    assert all(n < 64 for k, n in small if k == "prefill") and ("decode", 4) in small


def test_the_refusal_names_the_worst_point_and_the_command_that_fixes_it():
    verdict = run(hardware({"prefill": 2.4, "decode": 1.1}))
    text = mismatch(verdict, "cpu-tiny", "http://127.0.0.1:8000")
    assert "'cpu-tiny'" in text and "prefill 2.40×" in text and "decode 1.10×" in text
    assert "disagg calibrate --live --url http://127.0.0.1:8000" in text and "--apply" in text
    assert "--accept-foreign-constants" in text
    assert f"{TOLERANCE:.2f}" in text


def test_judge_takes_the_median_of_rounds():
    measured = {("p0", "prefill", 128): [1.0, 100.0, 1.1]}
    v = judge(CM, measured)
    assert v.points[0].measured_s == 1.1


def test_at_the_measured_speed_the_constants_predict_what_the_check_measured():
    """A host 1.1× slower on decode steps and 1.2× on prefills since the fit: the rescaled constants
    predict what the check measured, decode steps and lone prefills alike."""
    from disagg.bench.constants_check import at_measured_speed, rejudged

    drifted = run(hardware({"prefill": 1.2, "decode": 1.1}))
    assert drifted.ratios == {"prefill": pytest.approx(1.2), "decode": pytest.approx(1.1)}
    at_speed = at_measured_speed(CM, drifted)
    again = rejudged(at_speed, drifted.as_dict())  # the recorded check, judged against the rescaled constants
    assert again.ratios["decode"] == pytest.approx(1.0)
    assert again.ratios["prefill"] == pytest.approx(1.0)
    assert all(p.ratio == pytest.approx(1.0) for p in again.points)
    e, d = CM.engine, at_speed.engine
    assert d.prefill_token_s == pytest.approx(1.2 * e.prefill_token_s)
    assert d.prefill_attention_s == pytest.approx(1.2 * e.prefill_attention_s)
    assert d.decode_seq_s == pytest.approx(1.1 * e.decode_seq_s) and d.step_base_s == pytest.approx(1.1 * e.step_base_s)
    assert at_speed.slo == CM.slo and at_speed.shared_host == CM.shared_host  # targets and host terms untouched
    # prefills faster where decode steps are slower: the overhead cannot go below zero
    apart = at_measured_speed(CM, run(hardware({"prefill": 0.8, "decode": 1.3})))
    assert apart.engine.prefill_overhead_s >= 0.0


def test_every_instance_moves_at_the_hosts_speed():
    from disagg.bench.constants_check import at_measured_speed

    fast = CM.engine.model_copy(update={"step_base_s": CM.engine.step_base_s / 4})
    with_instance = CM.model_copy(update={"instances": {"d1": fast}})
    slower = at_measured_speed(with_instance, run(hardware(1.2), cm=with_instance))
    assert slower.instances["d1"].step_base_s == pytest.approx(1.2 * fast.step_base_s)
    assert slower.engine.step_base_s == pytest.approx(1.2 * CM.engine.step_base_s)
