"""Admission control: shed only when every decode candidate is past the class's queue bound;
loose before tight; Retry-After from the drain estimate, clamped."""

from __future__ import annotations

import pytest

from disagg.core.admission import shed
from disagg.core.types import SloClass
from factories import make_instances

LOOSE, TIGHT = SloClass.LOOSE, SloClass.TIGHT


@pytest.mark.parametrize("queued, slo, factor, expect_shed", [
    ([0, 0], LOOSE, 2.0, False),
    ([16, 15], LOOSE, 2.0, False),      # the least loaded (15) is under 2 × 8
    ([16, 16], LOOSE, 2.0, True),       # both at the bound
    ([16, 16], TIGHT, 2.0, False),      # tight is refused only from 2 × 16 = 32
    ([40, 32], TIGHT, 2.0, True),
    ([500, 500], LOOSE, 0.0, False),    # factor 0: shedding off
])
def test_shed_only_when_the_least_loaded_candidate_is_past_the_class_bound(queued, slo, factor, expect_shed):
    views = make_instances(queued=queued, backlog_s=[q * 0.5 for q in queued])
    assert (shed(views, max_num_seqs=8, slo=slo, queue_factor=factor) is not None) is expect_shed


def test_retry_after_is_the_drain_time_past_the_bound_clamped():
    # 40 queued, bound 16: 25 requests to drain, 8 at a time, 2 s each (backlog 80 s / 40) → 6.25 → 7 s
    s = shed(make_instances(queued=[40], backlog_s=[80.0]), max_num_seqs=8, slo=LOOSE, queue_factor=2.0)
    assert (s.retry_after_s, s.queued, s.bound) == (7, 40, 16)
    assert "retry after 7 s" in s.message()
    tiny = shed(make_instances(queued=[16], backlog_s=[0.01]), max_num_seqs=8, slo=LOOSE, queue_factor=2.0)
    huge = shed(make_instances(queued=[1000], backlog_s=[1e6]), max_num_seqs=8, slo=LOOSE, queue_factor=2.0)
    assert (tiny.retry_after_s, huge.retry_after_s) == (1, 60)


def test_no_candidates_is_left_to_routing():
    assert shed([], max_num_seqs=8, slo=LOOSE, queue_factor=2.0) is None
