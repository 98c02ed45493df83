"""The router's own saturation signal: how late its event loop's timers fire, smoothed."""

from __future__ import annotations

import asyncio
import time

import pytest

from disagg.core.admission import shed_for_lag
from disagg.core.types import SloClass
from serve_app.loop_lag import LoopLag


def test_lag_follows_a_sustained_lateness_and_forgets_a_past_one():
    lag = LoopLag(interval_s=0.02, horizon_s=0.5)
    for _ in range(200):  # 4 s of timers firing 100 ms late
        lag.observe(0.1, 0.12)
    assert lag.lag_s == pytest.approx(0.1, rel=0.01) and lag.peak_s == 0.1
    for _ in range(100):  # 2 s on time
        lag.observe(0.0, 0.02)
    assert lag.lag_s < 0.1 * 0.03  # e^(-4) of it is left
    assert lag.peak_s == 0.1


def test_a_single_hiccup_counts_by_the_time_it_covers():
    lag = LoopLag(interval_s=0.02, horizon_s=0.5)
    lag.observe(0.05, 0.07)  # one 50 ms stall: a fraction of it, not all
    assert 0.0 < lag.lag_s < 0.05 * 0.2


def test_the_running_monitor_sees_a_blocked_loop():
    async def scenario():
        lag = LoopLag(interval_s=0.01, horizon_s=0.2)
        task = asyncio.get_running_loop().create_task(lag.run())
        await asyncio.sleep(0.1)
        calm = lag.lag_s
        for _ in range(5):
            time.sleep(0.1)  # the loop is blocked: its timers fire late
            await asyncio.sleep(0)
        busy = lag.lag_s
        task.cancel()
        return calm, busy
    calm, busy = asyncio.run(scenario())
    assert calm < 0.02 and busy > 0.05


@pytest.mark.parametrize("lag, slo, refused", [
    (0.04, SloClass.LOOSE, False), (0.05, SloClass.LOOSE, True), (0.09, SloClass.TIGHT, False),
    (0.1, SloClass.TIGHT, True)])
def test_shed_for_lag_refuses_loose_first(lag, slo, refused):
    verdict = shed_for_lag(lag, 0.05, slo)
    assert (verdict is not None) == refused
    if refused:
        assert verdict.retry_after_s == 1 and "behind" in verdict.message()


def test_shed_for_lag_zero_bound_never_sheds_and_retry_after_grows_with_the_lag():
    assert shed_for_lag(100.0, 0.0, SloClass.LOOSE) is None
    assert shed_for_lag(7.2, 0.05, SloClass.LOOSE).retry_after_s == 8
    assert shed_for_lag(500.0, 0.05, SloClass.LOOSE).retry_after_s == 60
