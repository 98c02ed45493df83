"""The router's own saturation signal: how late its event loop's timers fire, smoothed."""

from __future__ import annotations

import asyncio
import time

import pytest

from disagg.core.admission import shed_for_lag
from disagg.core.types import SloClass
from serve_app.loop_lag import LoopLag


def test_lag_is_the_smallest_lateness_of_the_horizon():
    lag = LoopLag(interval_s=0.02, horizon_s=1.0)
    t = 0.0
    for _ in range(20):  # a saturated loop: every tick 100-150 ms late
        t += 0.14
        lag.observe(0.1 + (t * 7 % 0.05), t)
    assert lag.lag_s == pytest.approx(0.1, abs=0.001) and lag.peak_s < 0.15
    t += 0.02
    lag.observe(0.0, t)  # one tick on time: the loop has caught up
    assert lag.lag_s == 0.0
    for _ in range(60):  # and stays on time: the late ticks leave the horizon
        t += 0.02
        lag.observe(0.001, t)
    assert lag.lag_s == pytest.approx(0.001)


def test_a_single_stall_is_not_a_backlog():
    lag = LoopLag(interval_s=0.02, horizon_s=1.0)
    lag.observe(0.5, 0.52)  # start-up work, a slow call: one tick half a second late
    assert lag.lag_s == 0.0  # one tick alone is no signal
    lag.observe(0.0, 0.54)  # ... and the next on time
    assert lag.lag_s == 0.0 and lag.peak_s == 0.5


def test_a_stall_longer_than_the_horizon_and_its_catch_up_are_not_a_backlog():
    lag = LoopLag(interval_s=0.02, horizon_s=1.0)
    t = 0.0
    for _ in range(10):  # on time
        t += 0.02
        lag.observe(0.0, t)
    t += 1.2
    lag.observe(1.18, t)  # a full garbage collection: no tick for 1.2 s
    for _ in range(2):  # the requests that arrived meanwhile are read: two ticks late
        t += 0.08
        lag.observe(0.06, t)
    assert lag.lag_s == 0.0  # the on-time tick before the stall still counts
    for _ in range(14):  # a loop still behind a second after the stall is a backlog
        t += 0.08
        lag.observe(0.06, t)
    assert lag.lag_s == pytest.approx(0.06)


def test_the_running_monitor_sees_a_blocked_loop():
    async def scenario():
        lag = LoopLag(interval_s=0.01, horizon_s=0.3)
        task = asyncio.get_running_loop().create_task(lag.run())
        await asyncio.sleep(0.1)
        for _ in range(6):
            time.sleep(0.1)  # the loop is kept busy: every tick fires late
            await asyncio.sleep(0)
        busy = lag.lag_s
        await asyncio.sleep(0.5)  # free again
        calm = lag.lag_s
        task.cancel()
        return busy, calm
    busy, calm = asyncio.run(scenario())
    assert busy > 0.05 and calm < busy / 2


def test_an_idle_router_ticks_at_the_idle_interval_and_a_busy_one_at_the_fast_one():
    async def ticks(busy: bool) -> int:
        lag = LoopLag(interval_s=0.01, horizon_s=10.0, idle_interval_s=0.1)
        task = asyncio.get_running_loop().create_task(lag.run(busy=lambda: busy))
        await asyncio.sleep(0.55)
        task.cancel()
        return len(lag._samples)
    assert asyncio.run(ticks(False)) <= 6  # the first tick at the fast interval, then 10 a second
    assert asyncio.run(ticks(True)) >= 25


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
