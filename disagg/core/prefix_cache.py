"""One engine instance's prefix cache as a model: an LRU set of prompt-block hashes.

Blocks are `PREFIX_BLOCK_TOKENS` (512) tokens, the Mooncake traces' `hash_ids` convention, and a
block's hash names the whole prefix up to its end, so "the first k blocks are cached" is the
question that matters (`leading_hits`). The simulator asks it when a prefill starts, and skips the
cached share of the prompt; it `touch`es a prompt's full blocks when the instance has computed (or
received) their KV. Every operation is O(blocks of the request).

Like vLLM's, the cache holds full blocks only, and a request's blocks are touched last-first: its
first block becomes the most recently used, so under pressure a prefix is evicted from its tail,
and what remains is still a usable prefix (vLLM frees a request's blocks in reverse order for the
same reason).

Simplification: the cache holds up to the instance's KV capacity in blocks whatever is running.
vLLM keeps cached blocks only in the KV blocks that running requests leave free, so under load this
cache is more generous than the real one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class PrefixCache:
    """LRU set of at most `capacity_blocks` block hashes; the most recently used at the end."""

    __slots__ = ("capacity_blocks", "_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def lru_order(self) -> list[int]:
        """The cached hashes, least recently used first (the next to be evicted)."""
        return list(self._blocks)

    def leading_hits(self, hashes: Sequence[int], limit: int | None = None) -> int:
        """How many leading blocks of `hashes` (at most `limit`) are cached. Side-effect free:
        this is what policies call through `InstanceView.cached_prefix_blocks`."""
        blocks = self._blocks
        n = 0
        for h in hashes if limit is None else hashes[:limit]:
            if h not in blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int], count: int) -> None:
        """The first `count` blocks of `hashes` were just used: cache them as the most recently used
        (first block last, so eviction takes a prefix's tail first) and evict the least recent beyond
        capacity."""
        blocks = self._blocks
        for i in range(min(count, len(hashes)) - 1, -1, -1):
            h = hashes[i]
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
