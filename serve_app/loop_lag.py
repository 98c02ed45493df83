"""How far behind this process's event loop is: the router's own saturation signal.

A timer set to fire every `interval_s` fires late by however long the loop was busy with other
callbacks; that lateness, smoothed over about `horizon_s`, is the time a newly arrived request
waits before the router even reads it. Engine queues cannot show this wait, so admission control
(`disagg.core.admission.shed_for_lag`) reads it here.
"""

from __future__ import annotations

import asyncio
import math
import time


class LoopLag:
    def __init__(self, interval_s: float = 0.02, horizon_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.horizon_s = horizon_s
        self.lag_s = 0.0  # smoothed lateness of the timer, seconds
        self.peak_s = 0.0  # the largest single lateness seen (since start)

    def observe(self, late_s: float, elapsed_s: float) -> None:
        """Fold one lateness in, weighted by the time it covers (a loop that is behind samples
        less often, and each of its samples counts for more)."""
        late_s = max(0.0, late_s)
        weight = 1.0 - math.exp(-max(elapsed_s, 0.0) / self.horizon_s)
        self.lag_s += weight * (late_s - self.lag_s)
        self.peak_s = max(self.peak_s, late_s)

    async def run(self) -> None:
        expected = time.monotonic() + self.interval_s
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.observe(now - expected, self.interval_s + max(0.0, now - expected))
            expected = now + self.interval_s
