"""The session-end check flags every kind of unprovoked failure, and nothing in a clean session."""

from __future__ import annotations

import pytest

from unprovoked import UNPROVOKED, unprovoked_failures

CLEAN = dict.fromkeys(UNPROVOKED, 0)


def test_a_clean_session_passes():
    assert unprovoked_failures(CLEAN, CLEAN, {1, 2}, {1, 2, 3}, {"decode-a"}, {"decode-a", "decode-b"}) == []


@pytest.mark.parametrize("counter", sorted(UNPROVOKED))
def test_each_fallback_or_retry_counter_fails_the_session_unless_provoked(counter):
    seen = {**CLEAN, counter: 1}
    assert unprovoked_failures(seen, CLEAN, set(), set(), set(), set()) == [f"{counter}=1 (provoked: 0)"]
    assert unprovoked_failures(seen, {**CLEAN, counter: 1}, set(), set(), set(), set()) == []


def test_a_counter_the_router_does_not_report_fails_too():
    seen = {k: v for k, v in CLEAN.items() if k != "instances_lost"}
    assert unprovoked_failures(seen, CLEAN, set(), set(), set(), set()) == ["instances_lost=None (provoked: 0)"]


def test_a_dead_engine_process_and_a_replaced_replica_fail_the_session():
    problems = unprovoked_failures(CLEAN, CLEAN, {11, 12}, {12, 99}, {"decode-a", "prefill-b"}, {"prefill-b", "decode-c"})
    assert problems == ["engine processes died: [11]", "engine replicas left or were replaced: ['decode-a']"]


def test_lost_kv_events_fail_the_session():
    """A replica that lost events leaves the routers' prefix state drifting from its engine's."""
    problems = unprovoked_failures(CLEAN, CLEAN, set(), set(), set(), set(), {"decode-a": 0, "prefill-b": 3})
    assert problems == ["KV events were lost: {'prefill-b': 3}"]
    assert unprovoked_failures(CLEAN, CLEAN, set(), set(), set(), set(), {"decode-a": 0}) == []
