"""Percentiles: the one definition behind every figure the project reports.

Linear interpolation between the two nearest ranks (numpy's default method, "linear", and
Hyndman & Fan's type 7), computed in plain Python: the simulator's and the bench's summaries,
the load generator's send lag, calibration's held-out errors, trace statistics and the
benchmarks all call `percentile`, so a p99 means the same thing in every table of docs/.
The arithmetic is the simulator's own (`xs[lo] + (xs[hi] - xs[lo]) * frac`), which the published
figures were computed with; numpy's `np.percentile` computes the upper half of each interval from
the other end and can differ from it in the last bit (a relative 1e-15).

Pure and standard library only: the core, the simulator and the CLI may all import it.
"""

from __future__ import annotations

import math
from typing import Iterable, TypeVar

T = TypeVar("T")


def percentile(values: Iterable[float], q: float, *, empty: T = math.nan) -> float | T:
    """The q-th percentile (q in [0, 100]) of `values`, linearly interpolated; `empty` when there
    are none (NaN by default; None where the result is written as JSON)."""
    xs = sorted(values)
    if not xs:
        return empty
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
