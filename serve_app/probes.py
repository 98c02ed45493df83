"""Calibration's two measurements of one engine, timed where the engine runs.

Used by every engine replica's `probe` (`disagg calibrate --live`, on the running fleet through
`/admin/probe`) and, for the decode step, by offline calibration (`calibration.measure`, on
engines it starts itself, where a prefill is timed on its way to the hand-off instead):
- `first_output_s`: a lone prompt's time to its first output token (a prefill, plus sampling);
- `median_step_s`: the median gap between streamed tokens while `batch` streams decode together,
  counted only once every stream of the batch is running (a step with fewer is another concurrency).
Prompts are random token ids (`random_prompt`), so no prefix-cache hit shortens a prefill.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import AsyncIterator, Callable, Sequence

FIRST_TOKEN_ID = 10  # below it: the tiny vocabularies' special tokens


def random_prompt(rng: random.Random, tokens: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, max(FIRST_TOKEN_ID + 1, vocab)) for _ in range(tokens)]


async def first_output_s(stream: AsyncIterator[Sequence]) -> float:
    """Seconds from now to the stream's first output, then the stream is closed (which aborts the
    request, if anything is left of it)."""
    t0 = time.perf_counter()
    try:
        async for _ in stream:
            return time.perf_counter() - t0
    finally:
        await stream.aclose()
    raise RuntimeError("the probe's completion produced no token")


async def median_step_s(start: Callable[[], AsyncIterator], batch: int) -> float:
    """Median inter-token gap while all `batch` streams run together. `start()` opens one stream
    of chunks, each with `token_ids`."""
    gaps: list[float] = []
    started = 0
    all_running = asyncio.Event()

    async def one() -> None:
        nonlocal started
        last = None
        async for chunk in start():
            now = time.perf_counter()
            if last is None:
                started += 1
                if started == batch:
                    all_running.set()
            elif all_running.is_set():
                gaps.append((now - last) / max(1, len(chunk.token_ids)))
            last = now

    await asyncio.gather(*(one() for _ in range(batch)))
    if not gaps:
        raise RuntimeError(f"no decode steps observed at concurrency {batch}")
    return statistics.median(gaps)
