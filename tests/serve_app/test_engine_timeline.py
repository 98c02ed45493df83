"""`EngineTimeline`: where an engine's time to a first token went, read from vLLM's own request stats."""

from __future__ import annotations

import pytest
from vllm.v1.metrics.stats import RequestStateStats

from serve_app.messages import EngineTimeline


def test_the_timeline_is_measured_from_the_call():
    stats = RequestStateStats(arrival_time=1e9, queued_ts=100.002, scheduled_ts=100.005, first_token_ts=100.011)
    t = EngineTimeline.of(stats, called_at=100.0)
    assert t.queued_s == pytest.approx(0.002) and t.scheduled_s == pytest.approx(0.005)
    assert t.first_token_s == pytest.approx(0.011)
    assert t.as_dict() == {"queued_s": t.queued_s, "scheduled_s": t.scheduled_s, "first_token_s": t.first_token_s}


@pytest.mark.parametrize("missing", ["queued_ts", "scheduled_ts", "first_token_ts"])
def test_no_timeline_before_every_event_is_seen(missing):
    stats = RequestStateStats(queued_ts=1.0, scheduled_ts=2.0, first_token_ts=3.0)
    setattr(stats, missing, 0.0)  # vLLM's "not yet"
    assert EngineTimeline.of(stats, called_at=0.5) is None


def test_no_timeline_without_stats():
    assert EngineTimeline.of(None, called_at=0.0) is None  # an engine with stats off
