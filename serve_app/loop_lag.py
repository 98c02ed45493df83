"""How far behind this process's event loop is: the router's own saturation signal.

A timer set to fire every `interval_s` fires late by however long the loop was busy with other
callbacks. A saturated loop is late at every tick; a loop that merely stalled once (a slow call,
start-up work, a busy moment of the host) is late at one tick and on time at the next. So the
signal is the *smallest* lateness over the last `horizon_s`: it rises only when the loop has been
behind for the whole horizon, which is the wait a newly arrived request then has before the router
even reads it. Engine queues cannot show this wait, so admission control
(`disagg.core.admission.shed_for_lag`) reads it here.

A tick's lateness describes the loop until the next tick, so the last tick before the horizon
counts too. That matters after a stall longer than the horizon (a full garbage collection, the host
taking the core for a second): only the ticks after it lie inside the horizon, and without the
on-time tick before it the brief catch-up that follows would read as a backlog.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable


class LoopLag:
    def __init__(self, interval_s: float = 0.02, horizon_s: float = 1.0, idle_interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.horizon_s = horizon_s
        self.peak_s = 0.0  # the largest single lateness seen (since start)
        self._samples: deque[tuple[float, float]] = deque()  # (when, lateness), the last horizon_s of them

    @property
    def lag_s(self) -> float:
        """The smallest lateness of the ticks of the last `horizon_s` and of the one before them
        (0 until there are two: one late tick is a stall, not a backlog)."""
        if len(self._samples) < 2:
            return 0.0
        return min(late for _, late in self._samples)

    def observe(self, late_s: float, now: float) -> None:
        """One tick, `late_s` behind its schedule, seen at `now`."""
        late_s = max(0.0, late_s)
        self._samples.append((now, late_s))
        # drop the oldest tick once the next one also predates the horizon: the last tick before the
        # horizon still holds at its start (and a loop far behind keeps its last two ticks)
        while len(self._samples) > 2 and self._samples[1][0] < now - self.horizon_s:
            self._samples.popleft()
        self.peak_s = max(self.peak_s, late_s)

    async def run(self, busy: Callable[[], bool] | None = None) -> None:
        """Tick every `interval_s`; every `idle_interval_s` while `busy()` says nothing is being served
        (an idle router then wakes 4 times a second, not 50, and a loop that falls behind still shows
        it within the horizon)."""
        interval = self.interval_s
        expected = time.monotonic() + interval
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            self.observe(now - expected, now)
            interval = self.interval_s if busy is None or busy() else self.idle_interval_s
            expected = now + interval
