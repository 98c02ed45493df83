"""The live session's last word: nothing failed that no test failed on purpose.

Hosts differ (a CPU feature on one, a slow core on another), and the router hides a dying engine
well: a fallback serves the request, Serve replaces the replica. So the suite ends with a check
of what only a fault moves — the router's fallback and retry counters, the engine processes and
replicas that were there at the start — against what the tests provoked (`stack.provoked`).
"""

from __future__ import annotations

from collections.abc import Mapping

# Router counters that only an engine fault, a platform bug or a routing bug moves.
UNPROVOKED = {"prefill_retries": 0, "local_prefill_fallbacks": 0, "decode_retries": 0, "migrations": 0,
              "misrouted": 0, "failed": 0, "instances_lost": 0}


def unprovoked_failures(counters: Mapping[str, int], provoked: Mapping[str, int], engines_before: set[int],
                        engines_after: set[int], instances_before: set[str], instances_after: set[str],
                        kv_events_missed: Mapping[str, int] | None = None) -> list[str]:
    """Every departure from a clean session, described; empty when there is none.
    `kv_events_missed`: per instance, KV-event batches or blocks its replica lost (the routers' prefix
    state would silently drift from the engine's)."""
    problems = [f"{k}={counters.get(k)} (provoked: {provoked[k]})" for k in UNPROVOKED
                if counters.get(k) != provoked[k]]
    if dead := engines_before - engines_after:
        problems.append(f"engine processes died: {sorted(dead)}")
    if gone := instances_before - instances_after:
        problems.append(f"engine replicas left or were replaced: {sorted(gone)}")
    if missed := {k: v for k, v in (kv_events_missed or {}).items() if v}:
        problems.append(f"KV events were lost: {missed}")
    return problems


def provoked(stack, before: Mapping[str, int], after: Mapping[str, int], expected: Mapping[str, int],
             may_move: tuple[str, ...] = ()) -> dict[str, int]:
    """A test that caused faults on purpose: between its `before` and `after` readings the fault
    counters moved by exactly `expected`, or by any amount for those in `may_move` (where the
    fault's timing decides), and by nothing else; the session's tally of what was provoked takes
    that in. Returns how much each moved."""
    moved = {k: after[k] - before[k] for k in UNPROVOKED if after[k] != before[k]}
    exact = {k: v for k, v in moved.items() if k not in may_move}
    assert exact == {k: v for k, v in expected.items() if v}, f"fault counters moved by {moved}, expected {expected}"
    for k, v in moved.items():
        stack.provoked[k] += v
    return moved


def killed_on_purpose(stack, engine_pids: set[int], instance: str) -> None:
    """A test killed this replica's engine (and Serve replaced the replica): its processes and its
    instance leave the session's baseline; its replacement is held to the same check from now on."""
    stack.engines_at_start -= engine_pids
    stack.instances_at_start.discard(instance)
