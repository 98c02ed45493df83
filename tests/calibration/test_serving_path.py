"""`disagg calibrate --url` times lone requests through an app: against a stub streaming at known
times and reporting known engine times in its route header."""

import asyncio

import pytest

from bench.test_loadgen import StubServer
from calibration.measure import serving_path_gaps


def test_the_serving_path_is_the_client_ttft_minus_the_engines_own_times():
    with StubServer(first_token_s=0.03, engine_s=(0.010, 0.005)) as stub:
        gaps = asyncio.run(serving_path_gaps(stub.url, 64, 4))
        sent = list(stub.completions)
    assert len(gaps) == 4 and len(sent) == 5  # the first wakes the path up and is not counted
    for g in gaps:
        assert 0.03 <= g.ttft_s < 0.03 + 0.05
        assert g.outside_s == pytest.approx(g.ttft_s - 0.015)
        assert g.decode_first_s == 0.005 and g.disaggregated and g.prompt_tokens == 64
    prompts = [c["body"]["prompt"] for c in sent]
    assert all(len(p) == 64 for p in prompts) and len({tuple(p) for p in prompts}) == 5  # no prefix-cache hits


def test_an_app_that_fails_requests_is_an_error_not_a_figure():
    with StubServer(extra_tokens=1, engine_s=(0.01, 0.01)) as stub:  # one token more than asked: flagged
        with pytest.raises(RuntimeError, match="completion tokens"):
            asyncio.run(serving_path_gaps(stub.url, 16, 2))


def test_an_app_that_reports_no_engine_times_is_an_error_not_a_guess():
    with StubServer() as stub:
        with pytest.raises(RuntimeError, match="no engine times"):
            asyncio.run(serving_path_gaps(stub.url, 16, 2))


def test_lone_requests_at_several_lengths_alternate_and_count_per_length():
    with StubServer(first_token_s=0.01, engine_s=(0.004, 0.002)) as stub:
        gaps = asyncio.run(serving_path_gaps(stub.url, (16, 48), 3))
        sent = [len(c["body"]["prompt"]) for c in stub.completions]
    assert sent == [16, 16, 48, 16, 48, 16, 48]  # one unmeasured first, then in turn
    assert [g.prompt_tokens for g in gaps] == [16, 48, 16, 48, 16, 48]


def _cm_with_a_fast_decode():
    from disagg.core.cost_model import load_profile

    cm = load_profile("cpu-tiny")
    fast = cm.engine.model_copy(update={"step_base_s": cm.engine.step_base_s / 2})
    return cm.model_copy(update={"instances": {"decode-fast": fast}})


def _lone(cm, decode_id, prompt, latency, tokens_per_s):
    """What a decode engine reports: the KV pull, then one step of one sequence."""
    from calibration.measure import LoneRequest

    first = latency + prompt / tokens_per_s + cm.for_instance(decode_id).step_s(0, 1)
    return LoneRequest(0.05, 0.01, first, decode_id, True, prompt)


def test_two_prompt_lengths_measure_the_kv_transfers_fixed_cost_and_bandwidth():
    from calibration.fit import live_transfer

    cm = _cm_with_a_fast_decode()
    lones = [_lone(cm, d, p, 0.012, 150_000.0) for d in ("decode-fast", "decode-other") for p in (64, 1024, 1024)]
    lones.append(lones[0]._replace(decode_first_s=lones[0].decode_first_s + 0.5))  # an outlier moves no median
    xfer, measured = live_transfer(lones, cm)
    assert measured and xfer.latency_s == pytest.approx(0.012, abs=1e-6)
    assert xfer.tokens_per_s == pytest.approx(150_000.0, rel=1e-3)
    assert xfer.between_prefill_steps  # how the profile's KV moves (NIXL on CPU) is kept, not measured away


def test_a_hand_off_is_what_crossing_adds_to_the_one_engine_serving_path():
    from calibration.fit import handoff_overhead, serving_overhead

    alone = serving_overhead([0.008, 0.007, 0.009, 0.030])  # a slow outlier moves no median
    assert alone == pytest.approx(0.0085)
    assert handoff_overhead([0.012, 0.013, 0.011, 0.1], alone) == pytest.approx(0.0125 - 0.0085)
    assert handoff_overhead([0.005], alone) == 0.0  # never negative
    assert handoff_overhead([], alone) is None  # nothing crossed: not measured


def test_one_length_or_a_falling_line_keeps_the_bandwidth_and_measures_the_fixed_cost():
    from calibration.fit import live_transfer

    cm = _cm_with_a_fast_decode()
    bw = cm.transfer.tokens_per_s
    one = [_lone(cm, "decode-fast", 64, 0.012, bw), _lone(cm, "decode-other", 64, 0.012, bw)]
    xfer, measured = live_transfer(one, cm)
    assert not measured and xfer.latency_s == pytest.approx(0.012) and xfer.tokens_per_s == bw
    # the long prompts came back faster than the short ones: noise, not a bandwidth
    falling = [_lone(cm, "decode-fast", 64, 0.020, bw), _lone(cm, "decode-fast", 1024, 0.010, bw)]
    xfer, measured = live_transfer(falling, cm)
    assert not measured and xfer.tokens_per_s == bw and xfer.latency_s == pytest.approx(0.015)


def test_no_crossing_no_transfer_and_never_a_negative_cost():
    from calibration.fit import live_transfer

    cm = _cm_with_a_fast_decode()
    lones = [_lone(cm, "decode-fast", p, 0.012, 150_000.0) for p in (64, 1024)]
    assert live_transfer([r._replace(disaggregated=False) for r in lones], cm) is None  # nothing crossed
    early = [r._replace(decode_first_s=0.0) for r in lones]
    assert live_transfer(early, cm)[0].latency_s == 0.0


def test_the_short_lone_requests_take_both_paths_whatever_the_long_ones_take():
    """The serving path and the hand-off are measured on the short lone requests: a policy that
    disaggregates only the long prompts still leaves the hand-off to measure with `round_robin`."""
    from calibration.measure import SERVING_PROBE_TOKENS, LoneRequest, detours

    def lone(tokens: int, disaggregated: bool) -> LoneRequest:
        return LoneRequest(0.05, 0.01, 0.03, "decode-1", disaggregated, tokens)

    whole, split = lone(SERVING_PROBE_TOKENS, False), lone(SERVING_PROBE_TOKENS, True)
    long_split = lone(1024, True)
    assert detours([whole, whole, long_split], splits=True) == ["round_robin"]
    assert detours([whole, split, long_split], splits=True) == []
    assert detours([split, split], splits=True) == ["colocated"]
    assert detours([whole], splits=False) == []  # no prefill engine: nothing crosses one
