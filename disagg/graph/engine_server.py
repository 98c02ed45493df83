"""The engine deployment: one Serve replica = one in-process vLLM engine (`VllmEngine`).

Called by the router deployment through the pool's handle with `replica=<this replica's id>`
(see `pinned_router`):
- `prefill(call)`: run the prompt, keep its KV for a remote decode; returns where the KV is;
- `decode(call)`: a stream of token chunks; pulls the KV over NIXL when `kv_transfer_params` is
  given, prefills locally when it is None (colocated, or the fallback after a failed prefill);
- `state()`: load signals, polled by the router every `poll_interval_s`;
- `abort(request_id)`, `reset_prefix_cache()`: control plane.
Every reply names the replica that produced it, so the router can verify the pinning.

Each replica picks a free NIXL side-channel port at start (replicas come and go with
autoscaling, so ports cannot be assigned in the config file).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, AsyncIterator

from ray import serve

from disagg.core.types import Role
from disagg.graph.config import AppConfig
from disagg.graph.engine import EngineSpec, VllmEngine

logger = logging.getLogger("ray.serve")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_model(source: str) -> str:
    """'tiny:tiny' / 'tiny:small' → the offline tiny model's folder (built once); else as given."""
    if source.startswith("tiny:"):
        from disagg.graph.tiny_model import build_tiny_model

        return str(build_tiny_model(size=source.split(":", 1)[1]))
    return source


def engine_spec(cfg: AppConfig, role: Role, side_channel_host: str, port: int) -> EngineSpec:
    e = cfg.engine
    return EngineSpec(
        model=resolve_model(cfg.model.source),
        role=role,
        kv_buffer_device=e.device,
        side_channel_port=port,
        side_channel_host=side_channel_host,
        max_model_len=cfg.model.max_model_len,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        kv_cache_memory_bytes=e.kv_cache_memory_bytes,
        gpu_memory_utilization=e.gpu_memory_utilization,
        block_size=e.block_size,
        enforce_eager=e.enforce_eager,
        seed=e.seed,
        engine_kwargs=e.engine_kwargs,
    )


def _with_cause(e: Exception) -> RuntimeError:
    """vLLM wraps the real error (EngineGenerateError from ...); name it, since Ray drops the chain."""
    logger.exception("engine call failed")
    cause = e.__cause__ or e.__context__
    return RuntimeError(f"{type(e).__name__}: {e}" + (f" (cause: {type(cause).__name__}: {cause})" if cause else ""))


_END = object()


async def coalesce(stream: AsyncIterator, interval_s: float) -> AsyncIterator[list]:
    """The first item at once (time to first token is sacred), then everything that arrived,
    at most once per `interval_s`.

    Every message on the token path crosses two Serve hops (engine → router → proxy), and on a
    small machine each costs more than a decode step: batching tokens per interval, as Ray
    Serve LLM does, keeps the hops off the critical path. Closing the returned iterator closes
    `stream` (which aborts the request in vLLM).
    """
    if interval_s <= 0:
        async for item in stream:
            yield [item]
        return
    queue: asyncio.Queue = asyncio.Queue()
    first_done = False

    async def pump() -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as e:  # handed to the consumer, raised there
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_END)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        item = await queue.get()  # the first token: no waiting
        while item is not _END:
            if isinstance(item, Exception):
                raise item
            batch, pending = [item], None
            if not first_done:
                first_done = True
            else:
                await asyncio.sleep(interval_s)  # let the rest of this interval's tokens arrive
                while pending is None and not queue.empty():
                    nxt = queue.get_nowait()
                    if nxt is _END or isinstance(nxt, Exception):
                        pending = nxt  # the end (or the error) comes after this batch
                    else:
                        batch.append(nxt)
            yield batch
            item = pending if pending is not None else await queue.get()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class EngineServer:
    async def __init__(self, config: dict, role: str) -> None:
        cfg = AppConfig.model_validate(config)
        self.role = Role(role)
        self.stream_interval_s = cfg.engine.stream_interval_s
        host = cfg.engine.side_channel_host
        if host == "auto":
            import ray

            host = ray.util.get_node_ip_address()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = VllmEngine(engine_spec(cfg, self.role, host, free_port(host)))
        await self.engine.start()

    async def prefill(self, call: dict, replica: str | None = None) -> dict:
        try:
            r = await self.engine.prefill(call["request_id"], call["prompt_token_ids"], call["sampling"])
        except Exception as e:
            raise _with_cause(e) from e
        return {"kv_transfer_params": r.kv_transfer_params, "first_token_id": r.first_token_id,
                "engine_ttft_s": r.engine_ttft_s, "replica": self.replica_id}

    async def decode(self, call: dict, replica: str | None = None) -> AsyncIterator[dict]:
        first = True
        t0 = time.perf_counter()
        stream = self.engine.decode(call["request_id"], call["prompt_token_ids"], call["sampling"],
                                    call.get("kv_transfer_params"))
        try:
            async for chunks in coalesce(stream, self.stream_interval_s):
                out: dict[str, Any] = {"t": tuple(t for c in chunks for t in c.token_ids),
                                       "x": "".join(c.text for c in chunks), "f": chunks[-1].finish_reason}
                if first:  # who served it, and the engine-side time to the first token
                    out["r"] = self.replica_id
                    out["e"] = time.perf_counter() - t0
                    first = False
                yield out
        except Exception as e:
            raise _with_cause(e) from e

    async def abort(self, request_id: str, replica: str | None = None) -> None:
        await self.engine.abort(request_id)

    async def state(self) -> dict:
        s = await self.engine.state()
        return {"replica": self.replica_id, "role": self.role.value, "running": s.running, "waiting": s.waiting,
                "kv_used_tokens": s.kv_used_tokens, "kv_capacity_tokens": s.kv_capacity_tokens,
                "prefix_cache_hits": s.prefix_cache_hits, "prefix_cache_queries": s.prefix_cache_queries,
                "kv_transfers_ok": s.kv_transfers_ok, "kv_transfers_failed": s.kv_transfers_failed,
                "kv_received_tokens": s.kv_received_tokens}

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def check_health(self) -> None:
        await asyncio.wait_for(self.engine.state(), timeout=5.0)

    async def __del__(self) -> None:
        await self.engine.shutdown()
