"""disagg.bench.sse: the one SSE parser of the clients (load generator, benchmarks, tests)."""

from __future__ import annotations

import pytest

from disagg.bench.sse import DONE, SseDecoder, sse_data

CASES = [
    # (stream, the data of its events)
    (b'data: {"a":1}\n\ndata: [DONE]\n\n', ['{"a":1}', DONE]),
    (b": keep-alive\n\ndata: x\n\n: another comment\ndata: y\n\n", ["x", "y"]),  # comments never dispatch
    (b"data:no-space\n\n", ["no-space"]),
    (b"data:  two spaces\n\n", [" two spaces"]),  # only one leading space is dropped
    (b"data: first\ndata: second\n\n", ["first\nsecond"]),  # one event, two data lines
    (b"event: message\nid: 7\nretry: 10\ndata: z\n\n", ["z"]),  # other fields skipped
    (b"data: crlf\r\n\r\ndata: [DONE]\r\n\r\n", ["crlf", DONE]),
    (b"data\n\n", [""]),  # a data field without a colon: empty data, still an event
    (b"id: 1\n\n\n\n", []),  # no data field, blank lines: nothing
    (b"data: 1\n\ndata: cut off", ["1"]),  # the stream ended inside an event: that event is dropped
    ('data: {"text":"héllo ✓"}\n\n'.encode(), ['{"text":"héllo ✓"}']),
]


@pytest.mark.parametrize("stream, expected", CASES)
def test_one_chunk(stream, expected):
    assert SseDecoder().feed(stream) == expected


@pytest.mark.parametrize("stream, expected", CASES)
def test_split_anywhere_gives_the_same_events(stream, expected):
    """Events split across chunks at every byte (also inside a line ending or a UTF-8 character)."""
    for cut in range(len(stream) + 1):
        d = SseDecoder()
        assert d.feed(stream[:cut]) + d.feed(stream[cut:]) == expected, cut
    d = SseDecoder()
    assert [x for i in range(len(stream)) for x in d.feed(stream[i:i + 1])] == expected


def test_an_event_is_reported_when_its_blank_line_arrives():
    d = SseDecoder()
    assert d.feed(b"data: tok") == []
    assert d.feed(b"en\n") == []
    assert d.feed(b"\n") == ["token"]


@pytest.mark.parametrize("stream, expected", CASES)
def test_lines_as_httpx_gives_them(stream, expected):
    lines = stream.decode().replace("\r\n", "\n").split("\n")
    assert list(sse_data(lines)) == expected


def test_str_chunks_too():
    assert SseDecoder().feed("data: a\n\n") == ["a"]
