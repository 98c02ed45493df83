"""One engine's cached prefixes, exact: vLLM's KV-cache events folded into the router's block hashes.

vLLM publishes every change to its prefix cache (`kv_events_config`): `BlockStored` when full
blocks of KV become reusable (a prefill's, a decode's, or blocks pulled over NIXL), `BlockRemoved`
when it evicts them (to make room for running requests, or LRU), `AllBlocksCleared` on a reset.
Its block hashes are its own (a SHA-256 chain per KV block); the router names prefixes with
`prompt_block_hashes` over coarser index blocks. A stored event carries its blocks' tokens and
its parent's hash, so the fold follows vLLM's chain and computes, at each index-block boundary,
the router's hash of the prefix ending there: the router then looks up a prompt as it always has,
and sees exactly what the engine holds.

An index block counts as held while the engine block that ends it is held. vLLM frees a
request's blocks tail first, so a prefix loses its end before its start and what is held stays a
usable prefix. Hashes of a block stored twice (vLLM may cache equal blocks twice) are counted.
Extra hash keys (LoRA, multimodal inputs, cache salts) are not in the router's hash: such blocks
are attributed to their plain token prefix.

Changes are kept as a net delta (`take_delta`) for the pushes to the routers, and `held` is the
whole set, for a router that (re)joins.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from disagg.core.prefix_index import prompt_block_hashes


@dataclass(frozen=True, slots=True)
class _Block:
    tokens_end: int  # tokens of the prefix up to this block's end
    anchor: int  # the router's hash of the prefix up to the last index-block boundary at or before the end
    tail: tuple[int, ...]  # tokens after that boundary
    index_hash: int | None  # the router's hash, when this block ends an index block


class KvEventFold:
    """The router's block hashes an engine holds, kept from vLLM's KV events (see module docstring)."""

    def __init__(self, index_block_tokens: int) -> None:
        if index_block_tokens <= 0:
            raise ValueError(f"index_block_tokens must be > 0, got {index_block_tokens}")
        self.index_block_tokens = index_block_tokens
        self._blocks: dict[Hashable, tuple[_Block, int]] = {}  # vLLM's hash -> (block, copies held)
        self._held: dict[int, int] = {}  # router's hash -> engine blocks that end it
        self._added: set[int] = set()
        self._removed: set[int] = set()
        self.unattributed = 0  # blocks stored under a parent the fold never saw (events were missed)

    @property
    def held(self) -> frozenset[int]:
        """Every router hash the engine holds now."""
        return frozenset(self._held)

    def stored(self, parent: Hashable | None, block_hashes: Sequence[Hashable], token_ids: Sequence[int],
               block_size: int) -> None:
        """vLLM's `BlockStored`: full blocks, in order, after `parent` (None: at the prompt's start)."""
        if parent is None:
            end, anchor, tail = 0, 0, ()
        elif (p := self._blocks.get(parent)) is not None:
            end, anchor, tail = p[0].tokens_end, p[0].anchor, p[0].tail
        else:
            self.unattributed += len(block_hashes)
            return
        for i, h in enumerate(block_hashes):
            tail += tuple(token_ids[i * block_size:(i + 1) * block_size])
            end += block_size
            index_hash = None
            if len(tail) >= self.index_block_tokens:  # index blocks are whole engine blocks
                anchor = index_hash = hash((anchor, *tail))
                tail = ()
            block = _Block(end, anchor, tail, index_hash)
            known = self._blocks.get(h)
            self._blocks[h] = (block, known[1] + 1 if known else 1)
            if index_hash is not None:
                self._hold(index_hash)

    def removed(self, block_hashes: Sequence[Hashable]) -> None:
        """vLLM's `BlockRemoved`: these blocks were evicted."""
        for h in block_hashes:
            known = self._blocks.get(h)
            if known is None:
                continue
            block, copies = known
            if copies > 1:
                self._blocks[h] = (block, copies - 1)
            else:
                del self._blocks[h]
            if block.index_hash is not None:
                self._release(block.index_hash)

    def cleared(self) -> None:
        """vLLM's `AllBlocksCleared` (a prefix-cache reset)."""
        for h in list(self._held):
            self._held[h] = 1
            self._release(h)
        self._blocks.clear()

    def held_tokens(self, token_ids: Sequence[int]) -> int:
        """The leading tokens of a prompt the engine holds, in whole index blocks (vLLM recomputes a
        prompt's last token, so at most the blocks before it)."""
        n, held = 0, self._held
        for h in prompt_block_hashes(token_ids[:-1], self.index_block_tokens):
            if h not in held:
                break
            n += 1
        return n * self.index_block_tokens

    def take_delta(self) -> tuple[frozenset[int], frozenset[int]]:
        """(router hashes added, removed) since the previous call; net: none is in both."""
        out = frozenset(self._added), frozenset(self._removed)
        self._added.clear()
        self._removed.clear()
        return out

    def _hold(self, h: int) -> None:
        n = self._held.get(h, 0)
        self._held[h] = n + 1
        if n == 0:
            if h in self._removed:
                self._removed.discard(h)
            else:
                self._added.add(h)

    def _release(self, h: int) -> None:
        n = self._held[h] - 1
        if n:
            self._held[h] = n
            return
        del self._held[h]
        if h in self._added:
            self._added.discard(h)
        else:
            self._removed.add(h)
