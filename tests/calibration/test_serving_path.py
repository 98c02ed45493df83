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
    for ttft, outside in gaps:
        assert 0.03 <= ttft < 0.03 + 0.05
        assert outside == pytest.approx(ttft - 0.015)
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
