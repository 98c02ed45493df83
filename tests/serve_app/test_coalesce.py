"""Token batching on the engine side of the token path (pure asyncio, no engines)."""

import asyncio

import pytest

pytest.importorskip("ray.serve")

from serve_app.engine_server import coalesce  # noqa: E402


async def ticking(n, every_s, fail_at=None, closed=None):
    try:
        for i in range(n):
            await asyncio.sleep(every_s)
            if i == fail_at:
                raise RuntimeError("engine died")
            yield i
    finally:
        if closed is not None:
            closed.append(True)


def collect(stream, interval):
    async def go():
        t0 = asyncio.get_running_loop().time()
        out = []
        async for batch in coalesce(stream, interval):
            out.append((asyncio.get_running_loop().time() - t0, batch))
        return out
    return asyncio.run(go())


def test_first_item_alone_then_batches_with_nothing_lost_or_reordered():
    out = collect(ticking(40, 0.002), 0.03)
    assert out[0][1] == [0]
    assert [i for _, b in out for i in b] == list(range(40))
    assert len(out) < 20  # batched: far fewer messages than tokens


def test_zero_interval_passes_every_item_alone():
    out = collect(ticking(5, 0.001), 0.0)
    assert [b for _, b in out] == [[0], [1], [2], [3], [4]]


def test_errors_surface_after_the_items_before_them():
    seen = []

    async def go():
        async for batch in coalesce(ticking(10, 0.001, fail_at=6), 0.02):
            seen.extend(batch)
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(go())
    assert seen == list(range(6))


def test_closing_early_closes_the_source():
    closed = []

    async def go():
        gen = coalesce(ticking(1000, 0.001, closed=closed), 0.01)
        async for _ in gen:
            break
        await gen.aclose()
    asyncio.run(go())
    assert closed == [True]


def test_the_interval_is_read_before_every_batch():
    intervals = iter([0.05] * 5 + [0.001] * 100)

    async def go():
        t0 = asyncio.get_running_loop().time()
        out = []
        async for batch in coalesce(ticking(60, 0.002), lambda: next(intervals)):
            out.append((asyncio.get_running_loop().time() - t0, batch))
        return out
    out = asyncio.run(go())
    assert [i for _, b in out for i in b] == list(range(60))
    assert len(out[1][1]) >= 10  # a 50 ms interval gathers many 2 ms tokens


@pytest.mark.parametrize("streams, expect", [(0, 0.02), (1, 0.02), (4, 0.02), (8, 0.04), (16, 0.08), (64, 0.08)])
def test_the_engines_interval_grows_with_its_open_streams_up_to_the_cap(streams, expect):
    from serve_app.engine_server import EngineServer

    server = EngineServer.__new__(EngineServer)  # the interval rule alone, no engine
    server.stream_interval_base_s, server.stream_interval_max_s, server.streams = 0.02, 0.08, streams
    assert server._stream_interval_s() == pytest.approx(expect)
