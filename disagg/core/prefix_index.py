"""The live router's index of which prompt prefixes each engine instance holds cached.

Exact where the engines publish vLLM's KV-cache events (`engine.kv_events`, the default): each
engine folds them into these hashes (`disagg.core.kv_event_fold`) and pushes what changed with its
state, so the index follows the engine, evictions under load included (`apply`). Until an engine's
events confirm a prompt it was just sent, the prompt counts as held for `PENDING_S` (a burst
sharing a prefix lands together).

Where events are off the index is a model: like Ray Serve LLM's and llm-d's approximate prefix
routers, the router remembers what it sent where. A prompt is cut into blocks of `block_tokens` tokens and each full
block gets a hash naming the whole prefix up to its end (`prompt_block_hashes`), the convention of
the simulator's traces, so the same `PrefixCache` model (LRU over blocks) serves both.

What an instance is taken to hold:
* when a request is routed, its prompt's full blocks on the prefill instance (it computes them)
  and on the decode instance (it receives or computes them) — at once, so a burst of requests
  sharing a prefix lands together;
* when a request finishes, the full blocks of its prompt *and output* on the decode instance that
  produced it: vLLM caches generated blocks too, and the next turn of a conversation starts with
  them.

Several router replicas each route part of the traffic; each shares what it records with the
others (`outbox`, sent in batches by the ingress, `record(..., share=False)` on arrival), so a
conversation's next turn finds its prefix whichever replica it reaches.

Each instance's index holds at most its KV capacity in blocks. It is an estimate: vLLM evicts
under load (cached blocks live only in the KV that running requests leave free), a peer's records
arrive a batch later, and an engine restart empties the engine but not the index until the
replica's id changes (it does: ids name Serve replicas). A wrong guess costs a prefill
or a transfer the policy thought unnecessary, never correctness; the request log sets the guess
(`cached_tokens_predicted`) beside what the prefill engine reports (`prefill_cached_tokens`).

`block_tokens` should be a multiple of the engines' KV block size (a block the engine holds only
in part is not reusable); `index_block_tokens` picks one from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.core.prefix_cache import PrefixCache
from disagg.core.types import PrefixLookup

PENDING_S = 2.0  # a prompt routed to an instance with exact state counts as held this long unless confirmed
MIN_INDEX_BLOCK_TOKENS = 64  # hash at least this many tokens per block: bounds hashing work on 16-token KV blocks
OUTBOX_LIMIT = 4096  # records kept for the peers while none answers; the oldest are dropped beyond it

# One record, as shared between router replicas: (instance id, block hashes, its KV capacity in tokens).
Record = tuple[str, tuple[int, ...], int]


def index_block_tokens(engine_block_tokens: int) -> int:
    """The index's block: the smallest multiple of the engines' KV block of at least
    `MIN_INDEX_BLOCK_TOKENS` tokens. Coarser than the engine only ever under-counts a hit."""
    if engine_block_tokens <= 0:
        raise ValueError(f"engine block size must be > 0, got {engine_block_tokens}")
    return engine_block_tokens * max(1, -(-MIN_INDEX_BLOCK_TOKENS // engine_block_tokens))


def prompt_block_hashes(token_ids: Sequence[int], block_tokens: int, known: tuple[int, ...] = ()) -> tuple[int, ...]:
    """One hash per full `block_tokens`-token block of `token_ids`, each naming the whole prefix up
    to its block's end (a chain: equal hashes mean equal prefixes, up to hash collisions).
    `known`: the hashes of the leading blocks, already computed (a prompt's, when hashing the prompt
    and its output); only the blocks after them are hashed.

    Python's hash of a tuple of ints is not salted per process, so the value is stable across the
    router replicas that share records."""
    hashes = list(known)
    h = known[-1] if known else 0
    for start in range(len(known) * block_tokens, len(token_ids) - block_tokens + 1, block_tokens):
        h = hash((h, *token_ids[start:start + block_tokens]))
        hashes.append(h)
    return tuple(hashes)


class PrefixGap(Exception):
    """An instance's prefix update does not follow the version the index holds (updates were lost)."""


class ExactPrefixes:
    """One instance's prefix cache as its engine reports it, and what was routed there since."""

    __slots__ = ("held", "pending", "seq")

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.pending: dict[int, float] = {}  # hash -> when it was routed here (monotonic s)
        self.seq = 0  # the engine's prefix version held

    def __len__(self) -> int:
        return len(self.held) + sum(h not in self.held for h in self.pending)

    def leading_hits(self, hashes: Sequence[int], limit: int | None = None) -> int:
        held, pending = self.held, self.pending
        n = 0
        for h in hashes if limit is None else hashes[:limit]:
            if h not in held and h not in pending:
                break
            n += 1
        return n

    def expire(self, now: float) -> None:
        if self.pending:
            cutoff = now - PENDING_S
            self.pending = {h: t for h, t in self.pending.items() if t > cutoff}


class PrefixIndex:
    """Per instance, the prefix blocks it holds: exact from its engine's events, else an LRU model
    (see the module docstring)."""

    def __init__(self, block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = block_tokens
        self._caches: dict[str, PrefixCache | ExactPrefixes] = {}
        # one bound lookup per instance, kept: the ledger reuses a view while its lookup `is` the same
        self._lookups: dict[str, PrefixLookup] = {}
        self.outbox: list[Record] = []  # recorded here, not yet sent to the other router replicas

    def lookup(self, instance_id: str) -> PrefixLookup | None:
        """What a policy calls for this instance (`InstanceView.prefix_lookup`); None if nothing is known."""
        return self._lookups.get(instance_id)

    def exact(self, instance_id: str) -> bool:
        """Whether the instance's entry follows its engine's KV events."""
        return isinstance(self._caches.get(instance_id), ExactPrefixes)

    def apply(self, instance_id: str, *, seq: int, since: int, added: frozenset[int], removed: frozenset[int],
              snapshot: bool, now: float) -> None:
        """The engine's prefix cache moved from version `since` to `seq`: `added` and `removed` hashes,
        or with `snapshot` all it holds. Raises `PrefixGap` for a delta that does not follow the
        version held (the caller resubscribes and gets a snapshot)."""
        cache = self._caches.get(instance_id)
        if not isinstance(cache, ExactPrefixes):
            if not snapshot:
                raise PrefixGap(f"{instance_id}: a prefix delta from version {since} before any snapshot")
            cache = self._caches[instance_id] = ExactPrefixes()
            self._lookups[instance_id] = cache.leading_hits
        if snapshot:
            cache.held = set(added)
        elif since != cache.seq:
            raise PrefixGap(f"{instance_id}: a prefix delta from version {since}, the index holds {cache.seq}")
        else:
            cache.held.difference_update(removed)
            cache.held.update(added)
        cache.seq = seq
        for h in added:
            cache.pending.pop(h, None)
        cache.expire(now)

    def record(self, instance_id: str, hashes: tuple[int, ...], kv_capacity_tokens: int, now: float,
               share: bool = True) -> None:
        """`instance_id` now holds the KV of these blocks (all of them: the hashes are of full blocks),
        as of `now` (monotonic s). `share`: also queue the record for the other router replicas
        (False for theirs)."""
        if not hashes:
            return
        if share:
            self.outbox.append((instance_id, hashes, kv_capacity_tokens))
            if len(self.outbox) > OUTBOX_LIMIT:
                del self.outbox[:len(self.outbox) - OUTBOX_LIMIT]
        cache = self._caches.get(instance_id)
        if isinstance(cache, ExactPrefixes):
            cache.expire(now)
            for h in hashes:
                if h not in cache.held:
                    cache.pending[h] = now
            return
        capacity = max(0, kv_capacity_tokens // self.block_tokens)
        if cache is None:
            cache = self._caches[instance_id] = PrefixCache(capacity)
            self._lookups[instance_id] = cache.leading_hits
        else:
            cache.capacity_blocks = capacity  # the engine may report a new size after a restart
        cache.touch(hashes, len(hashes))

    def take_outbox(self) -> list[Record]:
        """The records not yet shared; the outbox is empty afterwards."""
        out, self.outbox = self.outbox, []
        return out

    def forget(self, instance_id: str) -> None:
        """The instance left: its cache went with it."""
        self._caches.pop(instance_id, None)
        self._lookups.pop(instance_id, None)

    def clear(self) -> None:
        """Every engine's prefix cache was reset (those with events report it too, and keep their version)."""
        for iid in [i for i, c in self._caches.items() if not isinstance(c, ExactPrefixes)]:
            self.forget(iid)
        for c in self._caches.values():
            c.held.clear()
            c.pending.clear()
        self.outbox.clear()

    def blocks_held(self) -> dict[str, int]:
        """{instance: blocks the index believes it holds} for `/admin/state`."""
        return {iid: len(c) for iid, c in self._caches.items()}
