"""The engine replica's subscriber to its EngineCore's KV-cache events.

vLLM publishes batches of `BlockStored` / `BlockRemoved` / `AllBlocksCleared` on a ZeroMQ PUB
socket (`kv_events_config`; the endpoint is an IPC socket in the engine's runtime folder). The
replica subscribes before any request runs, folds every batch into its `KvEventFold` and pokes
the state publisher, which pushes the net change to the routers with the next state version.

PUB/SUB drops rather than blocks when a reader falls behind: batches carry consecutive sequence
numbers, and a gap is counted (`missed`, reported as `kv_events_missed`), never silent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from disagg.core.kv_event_fold import KvEventFold

logger = logging.getLogger("ray.serve")


class KvEventFollower:
    """Follows one engine's KV events into `fold`; calls `changed()` after every batch."""

    def __init__(self, endpoint: str, fold: KvEventFold, changed: Callable[[], None]) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        self.fold = fold
        self.missed = 0  # batches lost between two received (sequence gaps)
        self.batches = 0
        self._changed = changed
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._last_seq: int | None = None
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                _topic, seq_bytes, payload = await self._sub.recv_multipart()
                self._take(int.from_bytes(seq_bytes, "big", signed=True), self._decoder.decode(payload))
        except asyncio.CancelledError:
            raise
        except Exception:  # a broken socket or payload: the routers fall back to their own model of the cache
            logger.exception("engine: the KV event subscriber stopped")

    def _take(self, seq: int, batch) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if self._last_seq is not None and seq > self._last_seq + 1:
            self.missed += seq - self._last_seq - 1
        self._last_seq = seq
        self.batches += 1
        fold = self.fold
        for e in batch.events:
            if isinstance(e, BlockStored):
                fold.stored(e.parent_block_hash, e.block_hashes, e.token_ids, e.block_size)
            elif isinstance(e, BlockRemoved):
                fold.removed(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                fold.cleared()
        self._changed()

    def close(self) -> None:
        self._task.cancel()
        self._sub.close(linger=0)
        self._ctx.term()
