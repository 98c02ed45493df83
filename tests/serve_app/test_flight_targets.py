"""A request's latency targets on the router: its class's, or (X-SLO-Scale) a multiple of its own
unloaded latency, the same in what its P/D policy prices and in what the request log and the
metrics count (`Flight.features`, `Flight.target`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from disagg.core.cost_model import load_profile
from disagg.core.types import SloClass
from serve_app.flight import Flight

CM = load_profile("cpu-tiny")


def flight(slo_scale: float | None, prompt_tokens: int = 900, slo: SloClass = SloClass.TIGHT) -> Flight:
    f = Flight("cmpl-1", False, slo, list(range(prompt_tokens)), SimpleNamespace(n=1, max_tokens=16),
               SimpleNamespace(cost_model=CM))
    f.slo_scale = slo_scale
    return f


def test_with_a_scale_the_policy_prices_the_targets_the_log_counts():
    f = flight(2.5)
    own = CM.unloaded(900)
    feats = f.features(16, 64)
    assert (feats.ttft_target_s, feats.tpot_target_s) == pytest.approx((2.5 * own.ttft_s, 2.5 * own.tpot_s))
    assert (f.target().ttft_s, f.target().tpot_s) == (feats.ttft_target_s, feats.tpot_target_s)
    assert feats.prompt_tokens == 900 and feats.predicted_output_tokens == 16 and feats.prefix_block_tokens == 64


def test_without_one_the_class_decides_and_the_policy_reads_it_from_the_class():
    f = flight(None)
    feats = f.features(16, 64)
    assert feats.ttft_target_s is None and feats.tpot_target_s is None and feats.slo_class is SloClass.TIGHT
    assert f.target() == CM.target(SloClass.TIGHT)
    assert flight(None, slo=SloClass.LOOSE).target() == CM.target(SloClass.LOOSE)
