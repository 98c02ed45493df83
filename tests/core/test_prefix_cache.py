"""The prefix cache model (disagg.core.prefix_cache): an LRU set of block hashes, used by the simulated engines and the live router."""

from __future__ import annotations

import pytest

from disagg.core.prefix_cache import PrefixCache


def test_evicts_the_least_recently_used_block():
    c = PrefixCache(3)
    for h in (1, 2, 3):
        c.touch((h,), 1)
    c.touch((1,), 1)  # 1 is used again: 2 is now the least recent
    c.touch((4,), 1)
    assert c.lru_order() == [3, 1, 4]
    assert 2 not in c


@pytest.mark.parametrize("capacity", [0, 1, 5, 12])
def test_never_holds_more_than_its_capacity(capacity):
    c = PrefixCache(capacity)
    for start in range(0, 60, 7):
        c.touch(tuple(range(start, start + 9)), 9)
        assert len(c) <= capacity
    assert len(c) == capacity


def test_a_prefix_is_touched_first_block_last_so_eviction_takes_its_tail():
    c = PrefixCache(3)
    c.touch((10, 11, 12), 3)
    assert c.lru_order() == [12, 11, 10]
    c.touch((20, 21), 2)  # two blocks must go: the prefix's tail, 12 then 11
    assert c.lru_order() == [10, 21, 20]
    assert c.leading_hits((10, 11, 12)) == 1


def test_a_prefix_longer_than_the_cache_keeps_its_leading_blocks():
    c = PrefixCache(3)
    c.touch((1, 2, 3, 4, 5), 5)
    assert c.leading_hits((1, 2, 3, 4, 5)) == 3
    assert 4 not in c and 5 not in c


def test_touch_takes_only_the_first_count_blocks():
    c = PrefixCache(10)
    c.touch((1, 2, 3), 2)
    assert c.lru_order() == [2, 1]
    c.touch((7, 8), 5)  # a count beyond the hashes takes them all
    assert c.lru_order() == [2, 1, 8, 7]


def test_leading_hits_counts_up_to_the_first_miss_and_the_limit_without_side_effects():
    c = PrefixCache(10)
    c.touch((1, 2, 3, 5), 4)
    before = c.lru_order()
    assert c.leading_hits((1, 2, 3, 4, 5)) == 3  # 5 is cached but follows a miss
    assert c.leading_hits((1, 2, 3), limit=2) == 2
    assert c.leading_hits((1, 2, 3), limit=0) == 0
    assert c.leading_hits((9, 1)) == 0
    assert c.leading_hits(()) == 0
    assert c.lru_order() == before  # a lookup is not a use


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixCache(-1)
