"""Output-length predictors: the bucket-mean learner and the noise injector for robustness studies."""

from __future__ import annotations

import math

import pytest

from disagg.core.predictor import BucketMeanPredictor, NoisyPredictor
from disagg.core.types import SloClass

LOOSE, TIGHT = SloClass.LOOSE, SloClass.TIGHT


class Fixed:
    """A predictor that always answers `value` and records what it was told."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.observed: list[tuple[int, SloClass, int]] = []

    def predict(self, prompt_tokens, slo_class):
        return self.value

    def observe(self, prompt_tokens, slo_class, output_tokens):
        self.observed.append((prompt_tokens, slo_class, output_tokens))


# --- BucketMeanPredictor ------------------------------------------------------------------------


@pytest.mark.parametrize("prior", [1.0, 128.0, 300.0])
@pytest.mark.parametrize("prompt", [0, 1, 100, 5_000, 1_000_000])
def test_cold_bucket_returns_the_prior(prior, prompt):
    p = BucketMeanPredictor(prior_tokens=prior, prior_weight=4.0)
    assert p.predict(prompt, LOOSE) == round(prior)
    assert p.predict(prompt, TIGHT) == round(prior)


@pytest.mark.parametrize(
    "prior, weight, outputs, expected",
    [
        # (w·prior + Σ outputs) / (w + n)
        (128.0, 4.0, [100, 200, 300], 159),  # (512 + 600) / 7 = 158.857…
        (128.0, 4.0, [1_000], 302),  # (512 + 1000) / 5 = 302.4
        (100.0, 1.0, [10, 10, 10, 10], 28),  # (100 + 40) / 5 = 28
        (100.0, 0.0, [10, 20, 33], 21),  # no shrinkage: the plain mean 21
        (50.0, 2.0, [400] * 98, 393),  # (100 + 39200) / 100 = 393 → the bucket's own mean dominates
    ],
)
def test_learns_bucket_mean_with_shrinkage(prior, weight, outputs, expected):
    p = BucketMeanPredictor(prior_tokens=prior, prior_weight=weight)
    for o in outputs:
        p.observe(100, LOOSE, o)
    assert p.predict(100, LOOSE) == expected


def test_zero_prior_weight_cold_bucket_is_the_prior():
    p = BucketMeanPredictor(prior_tokens=77.0, prior_weight=0.0)
    assert p.predict(100, LOOSE) == 77
    p.observe(100, LOOSE, 5)
    assert p.predict(100, LOOSE) == 5


@pytest.mark.parametrize(
    "seen, same, other",
    [
        # buckets are powers of two: 1 | 2-3 | 4-7 | ... | 64-127 | 128-255
        (100, [64, 127, 65], [63, 128, 1_000]),
        (1, [0, 1], [2, 3]),
        (2, [3], [1, 4]),
        (4_096, [8_191], [4_095, 8_192]),
    ],
)
def test_buckets_are_log2_of_the_prompt_length(seen, same, other):
    p = BucketMeanPredictor(prior_tokens=128.0, prior_weight=0.0)
    p.observe(seen, LOOSE, 1_000)
    for n in same:
        assert p.predict(n, LOOSE) == 1_000, n
    for n in other:
        assert p.predict(n, LOOSE) == 128, n


def test_slo_classes_are_learned_separately():
    p = BucketMeanPredictor(prior_tokens=128.0, prior_weight=4.0)
    for _ in range(4):
        p.observe(100, TIGHT, 32)
        p.observe(100, LOOSE, 1_024)
    assert p.predict(100, TIGHT) == 80  # (512 + 128) / 8
    assert p.predict(100, LOOSE) == 576  # (512 + 4096) / 8


def test_prediction_is_at_least_one_token():
    p = BucketMeanPredictor(prior_tokens=1.0, prior_weight=0.0)
    for _ in range(3):
        p.observe(10, LOOSE, 0)
    assert p.predict(10, LOOSE) == 1


@pytest.mark.parametrize("prior, weight", [(0.5, 4.0), (0.0, 1.0), (128.0, -1.0)])
def test_invalid_prior_raises(prior, weight):
    with pytest.raises(ValueError, match="prior"):
        BucketMeanPredictor(prior_tokens=prior, prior_weight=weight)


def test_memory_is_bounded_by_buckets_not_requests():
    p = BucketMeanPredictor()
    for i in range(20_000):
        p.observe(i % 4_096, LOOSE if i % 2 else TIGHT, 50)
    assert len(p._n) <= 2 * 13 and len(p._sum) == len(p._n)


# --- NoisyPredictor -----------------------------------------------------------------------------


def _draw(seed: int, err: float, n: int = 200, base: int = 1_000) -> list[int]:
    noisy = NoisyPredictor(Fixed(base), relative_error=err, seed=seed)
    return [noisy.predict(100, LOOSE) for _ in range(n)]


def test_noisy_is_deterministic_per_seed():
    assert _draw(7, 0.5) == _draw(7, 0.5)
    assert _draw(7, 0.5) != _draw(8, 0.5)


@pytest.mark.parametrize("err", [0.1, 0.5, 1.0, 1.5])
def test_noisy_relative_error_is_bounded_by_the_setting(err):
    base = 1_000
    got = _draw(3, err, n=2_000, base=base)
    rel = [abs(g - base) / base for g in got]
    # bounded by the setting (plus half a token of rounding), floored at one token
    assert max(rel) <= err + 0.5 / base
    assert min(got) >= 1
    # and the noise is really injected: the spread uses most of the allowed range
    assert max(rel) >= 0.9 * min(err, (base - 1) / base)
    assert len(set(got)) > 50


def test_noisy_large_error_floors_at_one_token():
    got = _draw(0, 3.0, n=2_000, base=10)
    assert min(got) == 1
    assert max(got) <= 40


def test_zero_error_is_the_inner_predictor():
    inner = BucketMeanPredictor(prior_tokens=128.0, prior_weight=4.0)
    noisy = NoisyPredictor(inner, relative_error=0.0, seed=123)
    reference = BucketMeanPredictor(prior_tokens=128.0, prior_weight=4.0)
    for i, (prompt, slo, out) in enumerate([(100, LOOSE, 300), (5, TIGHT, 7), (100, LOOSE, 90), (3000, LOOSE, 900)]):
        assert noisy.predict(prompt, slo) == reference.predict(prompt, slo)
        noisy.observe(prompt, slo, out)
        reference.observe(prompt, slo, out)
        assert noisy.predict(prompt, slo) == reference.predict(prompt, slo), i


def test_noisy_observe_reaches_the_inner_predictor():
    inner = Fixed(10)
    noisy = NoisyPredictor(inner, relative_error=1.5, seed=0)
    noisy.observe(100, TIGHT, 42)
    assert inner.observed == [(100, TIGHT, 42)]


@pytest.mark.parametrize("bad", [-0.01, 10.01, math.nan, math.inf, -math.inf])
def test_noisy_invalid_error_raises(bad):
    with pytest.raises(ValueError, match="relative_error"):
        NoisyPredictor(Fixed(10), relative_error=bad)


@pytest.mark.parametrize("ok", [0.0, 1.5, 10.0])
def test_noisy_accepts_the_documented_range(ok):
    assert NoisyPredictor(Fixed(10), relative_error=ok).relative_error == ok
