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


def test_the_kv_transfer_latency_is_the_decode_engines_first_token_less_its_step_and_the_bytes():
    from calibration.fit import transfer_latency
    from calibration.measure import LoneRequest
    from disagg.core.cost_model import load_profile

    cm = load_profile("cpu-tiny")
    fast = cm.engine.model_copy(update={"step_base_s": cm.engine.step_base_s / 2})
    cm = cm.model_copy(update={"instances": {"decode-fast": fast}})
    latency = 0.012

    def lone(decode_id, prompt):  # what a decode engine reports: the KV pull, then one step of one sequence
        step = cm.for_instance(decode_id).step_s(0, 1)
        first = latency + prompt / cm.transfer.tokens_per_s + step
        return LoneRequest(0.05, 0.01, first, decode_id, True, prompt)

    lones = [lone("decode-fast", 64), lone("decode-other", 64), lone("decode-fast", 1500)]
    assert transfer_latency(lones, cm) == pytest.approx(latency)
    colocated = [r._replace(disaggregated=False) for r in lones]
    assert transfer_latency(colocated, cm) is None  # nothing crossed: nothing to measure
    early = [r._replace(decode_first_s=0.0) for r in lones]
    assert transfer_latency(early, cm) == 0.0  # never negative
