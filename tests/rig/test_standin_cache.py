"""The engine stand-in's prefix cache: an LRU of KV blocks whose events reach the same fold the
real replicas use, so the rig's routers receive prefix state as a real fleet's do."""

from __future__ import annotations

from disagg.core.kv_event_fold import KvEventFold
from disagg.core.prefix_index import prompt_block_hashes
from serve_app.engine_standin import _PrefixCache


def test_stored_prompts_are_held_and_pushed_as_the_routers_hashes():
    fold = KvEventFold(64)
    cache = _PrefixCache(16, 16 * 100, fold)
    prompt = list(range(200))
    assert cache.cached_tokens(prompt) == 0
    cache.store(prompt)
    assert cache.cached_tokens(prompt) == 192  # 12 full blocks; the last token is always computed
    assert cache.cached_tokens(prompt[:100] + [7] * 100) == 96
    assert fold.held == frozenset(prompt_block_hashes(prompt, 64))


def test_past_capacity_the_least_recent_prefix_goes_from_its_tail_and_the_routers_hear_it():
    fold = KvEventFold(64)
    cache = _PrefixCache(16, 16 * 8, fold)  # 8 blocks
    old, new = list(range(128)), list(range(1000, 1064))  # 8 blocks, then 4
    cache.store(old)
    fold.take_delta()
    cache.store(new)
    assert cache.cached_tokens(old + [1]) == 64  # its first 4 blocks are left
    added, removed = fold.take_delta()
    assert added == frozenset(prompt_block_hashes(new, 64))
    assert removed == frozenset(prompt_block_hashes(old, 64)[1:])
    cache.clear()
    assert cache.cached_tokens(new + [1]) == 0 and fold.held == frozenset()
