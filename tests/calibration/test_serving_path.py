"""`disagg calibrate --url` times lone requests through an app: against a stub streaming at known times."""

import asyncio

import pytest

from bench.test_loadgen import StubServer
from calibration.measure import app_ttfts


def test_app_ttfts_times_lone_requests_after_one_unmeasured():
    with StubServer(first_token_s=0.03) as stub:
        ttfts = asyncio.run(app_ttfts(stub.url, 64, 4))
        sent = list(stub.completions)
    assert len(ttfts) == 4 and len(sent) == 5  # the first wakes the path up and is not counted
    assert all(0.03 <= t < 0.03 + 0.05 for t in ttfts)
    prompts = [c["body"]["prompt"] for c in sent]
    assert all(len(p) == 64 for p in prompts) and len({tuple(p) for p in prompts}) == 5  # no prefix-cache hits


def test_an_app_that_fails_requests_is_an_error_not_a_figure():
    with StubServer(extra_tokens=1) as stub:  # answers one token more than asked: the client flags it
        with pytest.raises(RuntimeError, match="completion tokens"):
            asyncio.run(app_ttfts(stub.url, 16, 2))
