"""Server-sent events (the OpenAI streaming format) → the data of each event. Pure: no HTTP.

The one SSE parser of the project's clients: the app's client (`disagg.app_client`, which the
benchmark scripts use), the load generator (`loadgen.send_one`) and the tests feed it what their
HTTP library gives them — raw chunks (`SseDecoder.feed`) or lines (`SseDecoder.line`, `sse_data`) —
so httpx, aiohttp or a test's recorded body all parse alike.

The rules kept from the SSE specification (WHATWG HTML, "event stream interpretation"):
- lines end in LF or CRLF (a lone CR, which no OpenAI server sends, is not a line end here);
- a blank line ends an event; an event is reported only if it had a `data` field;
- `data: x` and `data:x` both give `x` (one leading space is dropped); several `data` lines of
  one event are joined with a newline;
- a line starting with `:` is a comment (a keep-alive); other fields (`event`, `id`, `retry`)
  are not used by the OpenAI stream and are skipped;
- an event the stream ends in the middle of is dropped.
The OpenAI stream ends with the event `data: [DONE]` (`DONE`); every other event's data is JSON.
"""

from __future__ import annotations

from typing import Iterable, Iterator

DONE = "[DONE]"


class SseDecoder:
    """Incremental: feed it the stream piece by piece; it returns each event's data when the
    event's blank line arrives. One decoder per response."""

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""  # the start of a line whose end has not arrived yet
        self._data: list[str] | None = None  # the data lines of the event being read

    def feed(self, chunk: bytes | str) -> list[str]:
        """Raw bytes as they arrive (split anywhere, even inside a line or a UTF-8 character);
        the data of the events this chunk completes, in order."""
        self._buf += chunk.encode() if isinstance(chunk, str) else chunk
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for raw in lines:
            # decoded per line: a newline byte never occurs inside a UTF-8 character
            data = self.line(raw.decode("utf-8", errors="replace").removesuffix("\r"))
            if data is not None:
                out.append(data)
        return out

    def line(self, line: str) -> str | None:
        """One line without its line ending; the event's data if this blank line ends an event."""
        if not line:
            data, self._data = self._data, None
            return None if data is None else "\n".join(data)
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            if self._data is None:
                self._data = []
            self._data.append(value.removeprefix(" "))
        return None


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The data of each event of a stream read line by line (httpx's `iter_lines`), `DONE` included."""
    decoder = SseDecoder()
    for line in lines:
        data = decoder.line(line)
        if data is not None:
            yield data
