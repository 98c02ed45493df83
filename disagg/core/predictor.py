"""Output-length predictors: pluggable, learning online from finished requests.

The router calls `predict` at admission and `observe` when a request finishes; the simulator does
the same, in the same order. The marginal-cost scorer prices decode work as ô·τ_dec, which is
linear in ô, so predictors estimate the *mean* output length (not the median).
"""

from __future__ import annotations

import math
import random
from typing import Protocol

from disagg.core.types import SloClass


class OutputLengthPredictor(Protocol):
    def predict(self, prompt_tokens: int, slo_class: SloClass) -> int: ...

    def observe(self, prompt_tokens: int, slo_class: SloClass, output_tokens: int) -> None: ...


class BucketMeanPredictor:
    """Mean output length per (log2 prompt-length bucket, SLO class), shrunk toward a prior.

    With n observations of mean m in a bucket the prediction is
    (prior_weight·prior_tokens + n·m) / (prior_weight + n): a cold bucket answers the prior, a warm
    one its own mean. Buckets are powers of two of the prompt length (1, 2-3, 4-7, ...), so memory
    stays constant whatever the traffic.
    """

    def __init__(self, prior_tokens: float = 128.0, prior_weight: float = 4.0) -> None:
        if prior_tokens < 1 or prior_weight < 0:
            raise ValueError(f"prior_tokens must be >= 1 and prior_weight >= 0, got {prior_tokens}, {prior_weight}")
        self.prior_tokens = prior_tokens
        self.prior_weight = prior_weight
        self._sum: dict[tuple[int, SloClass], float] = {}
        self._n: dict[tuple[int, SloClass], int] = {}

    @staticmethod
    def _bucket(prompt_tokens: int) -> int:
        return max(1, prompt_tokens).bit_length()

    def predict(self, prompt_tokens: int, slo_class: SloClass) -> int:
        key = (self._bucket(prompt_tokens), slo_class)
        n = self._n.get(key, 0)
        s = self._sum.get(key, 0.0)
        est = (self.prior_weight * self.prior_tokens + s) / (self.prior_weight + n) if (n or self.prior_weight) else self.prior_tokens
        return max(1, round(est))

    def observe(self, prompt_tokens: int, slo_class: SloClass, output_tokens: int) -> None:
        key = (self._bucket(prompt_tokens), slo_class)
        self._n[key] = self._n.get(key, 0) + 1
        self._sum[key] = self._sum.get(key, 0.0) + output_tokens


class NoisyPredictor:
    """Wraps a predictor (or the truth) and injects relative error, for robustness studies.

    Each prediction is multiplied by (1 + e·u), u uniform in [-1, 1], floored at one token:
    `relative_error=1.5` is the paper's 150% predictor error. Seeded, so runs repeat.
    """

    def __init__(self, inner: OutputLengthPredictor, relative_error: float, seed: int = 0) -> None:
        if not (0.0 <= relative_error <= 10.0) or math.isnan(relative_error):
            raise ValueError(f"relative_error must be in [0, 10], got {relative_error!r}")
        self.inner = inner
        self.relative_error = relative_error
        self._rng = random.Random(seed)

    def predict(self, prompt_tokens: int, slo_class: SloClass) -> int:
        base = self.inner.predict(prompt_tokens, slo_class)
        return max(1, round(base * (1.0 + self.relative_error * self._rng.uniform(-1.0, 1.0))))

    def observe(self, prompt_tokens: int, slo_class: SloClass, output_tokens: int) -> None:
        self.inner.observe(prompt_tokens, slo_class, output_tokens)
