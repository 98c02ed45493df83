"""Request traces: read public production traces, write our own, reshape them for experiments.

A trace is a list of :class:`TraceRequest`, sorted by arrival (stable for ties), with arrivals in
seconds relative to the first request (the first arrival is 0.0). Every reader returns that shape
whatever the source format, so the simulator never sees wall-clock time.

Formats read by :func:`read_trace` (``fmt="auto"`` picks one from the header line, or from the first
line being a JSON object):

``azure``
    Azure LLM inference traces (Splitwise, ISCA'24). CSV, header
    ``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps like ``2023-11-16 18:17:03.9799600``
    (any number of fractional digits, no zone; treated as one fixed clock). The file may lack a
    trailing newline. Timestamps are parsed by a fixed pattern, not ``strptime`` (several times
    faster); the date part goes through real calendar arithmetic, cached per distinct date, so
    rows that cross midnight or a month end stay correctly ordered.
``mooncake``
    Mooncake (FAST'25) JSON lines:
    ``{"timestamp": <ms>, "input_length": N, "output_length": N, "hash_ids": [...]}``.
    ``hash_ids`` (prefix-block hashes, 512 tokens each) become ``prefix_hashes``; it may be absent.
``burstgpt``
    BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``;
    ``Timestamp`` is in seconds. Only the timestamp and the two token columns are used.
``native``
    This project's CSV, written by :func:`write_native`: header
    ``arrival_s,prompt_tokens,output_tokens`` optionally followed by ``slo_class`` (``tight``,
    ``loose`` or empty) and ``prefix_hashes`` (space-separated integers, may be empty).

CSV columns are found by header name; unknown extra columns are ignored, but every row must have
as many fields as the header.

Validation. A missing, non-integer or negative token count, a bad timestamp or an unparseable row
raises :class:`TraceError` naming file, line and field, e.g.
``azure.csv:17: field 'ContextTokens': expected a non-negative integer, got '-3'``.
An empty trace (no file content, or no usable request) is an error too.

Zero-token rule. A simulated request needs ``prompt_tokens >= 1`` and ``output_tokens >= 1``.
In the foreign formats (azure, mooncake, burstgpt) a row with a zero token count is a request that
the logged service failed or cancelled (BurstGPT records failures as ``Response tokens`` 0); such
rows are *skipped*, never clamped, and counted in :class:`TraceReadInfo` (see
:func:`read_trace_info`). The two Azure 2023 traces contain no such row. In the ``native`` format
a zero is an error: :func:`write_native` never writes one, so it means a corrupted file.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import itertools
import json
import math
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import IO, Any

import numpy as np

from disagg.core.types import SloClass
from disagg.files import atomic_write
from disagg.stats import percentile

__all__ = [
    "KNOWN_FORMATS",
    "TraceError",
    "TraceReadInfo",
    "TraceRequest",
    "assign_slo_classes",
    "read_trace",
    "read_trace_info",
    "rescale_to_rate",
    "slice_trace",
    "trace_stats",
    "write_native",
]

KNOWN_FORMATS: tuple[str, ...] = ("azure", "burstgpt", "mooncake", "native")

# Required CSV columns per format, in the order the fields are read: (arrival, prompt, output).
_CSV_COLUMNS: dict[str, tuple[str, str, str]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    "native": ("arrival_s", "prompt_tokens", "output_tokens"),
}
_NATIVE_HEADER = ("arrival_s", "prompt_tokens", "output_tokens", "slo_class")

_AZURE_TS = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives and how much work it carries."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    slo_class: SloClass | None = None  # None: not decided yet (see assign_slo_classes)
    prefix_hashes: tuple[int, ...] = ()  # prompt prefix-block hashes, when the trace has them

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0.0):
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s!r}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens!r}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens!r}")
        if self.slo_class is not None and not isinstance(self.slo_class, SloClass):
            raise ValueError(f"slo_class must be a SloClass or None, got {self.slo_class!r}")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names file, line and field."""

    def __init__(self, path: str | os.PathLike[str], line: int | None, field: str | None,
                 reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        what = f"field {field!r}: {reason}" if field else reason
        super().__init__(f"{where}: {what}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the structured fields across pickling (e.g. multiprocessing workers).
        return (type(self), (self.path, self.line, self.field, self.reason))


@dataclass(frozen=True, slots=True)
class TraceReadInfo:
    """What :func:`read_trace_info` did besides returning the requests."""

    format: str
    rows: int  # data rows / JSON lines seen (blank lines excluded)
    skipped_zero_prompt: int  # rows dropped because the prompt had 0 tokens
    skipped_zero_output: int  # rows dropped because the response had 0 tokens (failed requests)

    @property
    def skipped(self) -> int:
        return self.skipped_zero_prompt + self.skipped_zero_output


# ----------------------------------------------------------------------------------------------
# Reading


def read_trace(path: str | os.PathLike[str], fmt: str = "auto") -> list[TraceRequest]:
    """Read a trace file (optionally gzip-compressed, by a ``.gz`` suffix); see the module doc."""
    return read_trace_info(path, fmt)[0]


def read_trace_info(path: str | os.PathLike[str],
                    fmt: str = "auto") -> tuple[list[TraceRequest], TraceReadInfo]:
    """Like :func:`read_trace`, also returning the detected format and the skipped-row counts."""
    p = Path(path)
    name = str(path)
    wanted = fmt.strip().lower()
    if wanted != "auto" and wanted not in KNOWN_FORMATS:
        raise TraceError(name, None, None, f"unknown trace format {fmt!r}; known formats: "
                                           f"auto, {', '.join(KNOWN_FORMATS)}")
    try:
        handle = _open_text(p)
    except OSError as exc:
        raise TraceError(name, None, None, f"cannot open: {exc.strerror or exc}") from None
    with handle as f:
        first_line_no, first = _first_nonblank(f)
        if first is None:
            raise TraceError(name, 1, None, "empty trace file")
        detected = _detect(name, first_line_no, first, wanted)
        lines = itertools.chain([first], f)
        if detected == "mooncake":
            raw, info = _read_mooncake(name, lines, first_line_no)
        else:
            raw, info = _read_csv(name, lines, first_line_no, detected)
    if not raw:
        skipped = f" ({info.skipped} zero-token rows skipped)" if info.skipped else ""
        raise TraceError(name, None, None, f"trace holds no requests{skipped}")
    return _finish(raw), info


def _open_text(p: Path) -> IO[str]:
    # utf-8-sig drops a BOM left by spreadsheet exports; newline="" is what the csv module wants.
    if p.suffix == ".gz":
        return gzip.open(p, "rt", encoding="utf-8-sig", newline="")
    return open(p, encoding="utf-8-sig", newline="")


def _first_nonblank(f: IO[str]) -> tuple[int, str | None]:
    for line_no, line in enumerate(f, 1):
        if line.strip():
            return line_no, line
    return 0, None


def _detect(name: str, line_no: int, first: str, wanted: str) -> str:
    if first.lstrip().startswith("{"):
        detected = "mooncake"
    else:
        header = {h.strip() for h in next(csv.reader([first]))}
        detected = next((fmt for fmt, cols in _CSV_COLUMNS.items() if set(cols) <= header), "")
    if wanted == "auto":
        if not detected:
            raise TraceError(name, line_no, "header",
                             f"unrecognized trace format (first line {first.strip()[:80]!r}); "
                             f"known formats: {', '.join(KNOWN_FORMATS)}")
        return detected
    if detected != wanted:
        expected = ("a JSON object per line" if wanted == "mooncake"
                    else "columns " + ", ".join(_CSV_COLUMNS[wanted]))
        raise TraceError(name, line_no, "header",
                         f"not a {wanted!r} trace: expected {expected}, "
                         f"got {first.strip()[:80]!r}")
    return wanted


# A raw row before re-basing: (arrival_s, prompt, output, slo_class, prefix_hashes).
_Raw = tuple[float, int, int, "SloClass | None", "tuple[int, ...]"]


def _finish(raw: list[_Raw]) -> list[TraceRequest]:
    raw.sort(key=lambda r: r[0])  # list.sort is stable: ties keep file order
    t0 = raw[0][0]
    return [TraceRequest(t - t0, p, o, s, h) for t, p, o, s, h in raw]


def _read_csv(name: str, lines: Iterable[str], first_line_no: int,
              fmt: str) -> tuple[list[_Raw], TraceReadInfo]:
    reader = csv.reader(lines)
    offset = first_line_no - 1  # csv counts from the header line we handed it
    header = [h.strip() for h in next(reader)]
    width = len(header)
    i_time, i_prompt, i_output = (header.index(c) for c in _CSV_COLUMNS[fmt])
    f_time, f_prompt, f_output = _CSV_COLUMNS[fmt]
    i_slo = header.index("slo_class") if fmt == "native" and "slo_class" in header else -1
    i_hash = header.index("prefix_hashes") if fmt == "native" and "prefix_hashes" in header else -1
    strict_zero = fmt == "native"
    parse_time = _AzureClock(name).seconds if fmt == "azure" else None

    raw: list[_Raw] = []
    rows = zero_prompt = zero_output = 0
    for row in reader:
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # blank line (e.g. a trailing newline)
        line = reader.line_num + offset
        rows += 1
        if len(row) != width:
            if len(row) < width:
                raise TraceError(name, line, header[len(row)], "missing value")
            raise TraceError(name, line, "row",
                             f"{len(row)} fields, header declares {width}")
        if parse_time is not None:
            t = parse_time(row[i_time], line, f_time)
        else:
            t = _parse_seconds(name, line, f_time, row[i_time])
        prompt = _parse_count(name, line, f_prompt, row[i_prompt], strict_zero)
        output = _parse_count(name, line, f_output, row[i_output], strict_zero)
        if prompt == 0:  # a row with both zero counts once, as a zero prompt
            zero_prompt += 1
            continue
        if output == 0:
            zero_output += 1
            continue
        slo = None
        if i_slo >= 0 and row[i_slo].strip():
            try:
                slo = SloClass.parse(row[i_slo])
            except ValueError as exc:
                raise TraceError(name, line, "slo_class", str(exc)) from None
        hashes: tuple[int, ...] = ()
        if i_hash >= 0 and row[i_hash].strip():
            try:
                hashes = tuple(int(x) for x in row[i_hash].split())
            except ValueError:
                reason = f"expected space-separated integers, got {row[i_hash]!r}"
                raise TraceError(name, line, "prefix_hashes", reason) from None
        raw.append((t, prompt, output, slo, hashes))
    return raw, TraceReadInfo(fmt, rows, zero_prompt, zero_output)


def _read_mooncake(name: str, lines: Iterable[str],
                   first_line_no: int) -> tuple[list[_Raw], TraceReadInfo]:
    raw: list[_Raw] = []
    rows = zero_prompt = zero_output = 0
    for line, text in enumerate(lines, first_line_no):
        if not text.strip():
            continue
        rows += 1
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(name, line, None, f"invalid JSON: {exc.msg} at column {exc.colno}") \
                from None
        if not isinstance(obj, dict):
            raise TraceError(name, line, None, f"expected a JSON object, got {text.strip()[:40]!r}")
        ts = _json_field(name, line, obj, "timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
                or ts < 0:
            raise TraceError(name, line, "timestamp",
                             f"expected a non-negative number of milliseconds, got {ts!r}")
        prompt = _json_count(name, line, obj, "input_length")
        output = _json_count(name, line, obj, "output_length")
        hashes_obj = obj.get("hash_ids", [])
        if not isinstance(hashes_obj, list) or any(
                isinstance(h, bool) or not isinstance(h, int) for h in hashes_obj):
            raise TraceError(name, line, "hash_ids",
                             f"expected a list of integers, got {str(hashes_obj)[:40]!r}")
        if prompt == 0:  # a row with both zero counts once, as a zero prompt
            zero_prompt += 1
            continue
        if output == 0:
            zero_output += 1
            continue
        raw.append((ts / 1000.0, prompt, output, None, tuple(hashes_obj)))
    return raw, TraceReadInfo("mooncake", rows, zero_prompt, zero_output)


def _json_field(name: str, line: int, obj: dict[str, Any], field: str) -> Any:
    if field not in obj:
        raise TraceError(name, line, field, "missing value")
    return obj[field]


def _json_count(name: str, line: int, obj: dict[str, Any], field: str) -> int:
    value = _json_field(name, line, obj, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(name, line, field, f"expected a non-negative integer, got {value!r}")
    return value


def _parse_count(name: str, line: int, field: str, text: str, strict_zero: bool) -> int:
    stripped = text.strip()
    if not stripped:
        raise TraceError(name, line, field, "missing value")
    try:
        value = int(stripped)
    except ValueError:
        value = -1
    if value < 0:
        raise TraceError(name, line, field, f"expected a non-negative integer, got {text!r}")
    if value == 0 and strict_zero:
        raise TraceError(name, line, field, "expected a positive integer, got '0'")
    return value


def _parse_seconds(name: str, line: int, field: str, text: str) -> float:
    stripped = text.strip()
    if not stripped:
        raise TraceError(name, line, field, "missing value")
    try:
        value = float(stripped)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0.0):
        raise TraceError(name, line, field,
                         f"expected a non-negative number of seconds, got {text!r}")
    return value


class _AzureClock:
    """Parses ``YYYY-MM-DD hh:mm:ss.fffffff`` to seconds since the first date seen.

    Seconds are counted from midnight of the first row's date rather than from the Unix epoch:
    at 1.7e9 s a float64 keeps only ~0.2 µs, while the files carry 0.1 µs digits.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._day_offset: dict[str, float] = {}
        self._base: int | None = None

    def seconds(self, text: str, line: int, field: str) -> float:
        m = _AZURE_TS.fullmatch(text.strip())
        if m is None:
            raise TraceError(self._name, line, field, "expected a timestamp like "
                             f"'2023-11-16 18:17:03.9799600', got {text!r}")
        day, hh, mm, ss = m.groups()
        offset = self._day_offset.get(day)
        if offset is None:
            offset = self._new_day(day, text, line, field)
        hours, minutes, secs = int(hh), int(mm), float(ss)
        if hours > 23 or minutes > 59 or secs >= 60.0:
            raise TraceError(self._name, line, field, f"time of day out of range in {text!r}")
        return offset + hours * 3600 + minutes * 60 + secs

    def _new_day(self, day: str, text: str, line: int, field: str) -> float:
        try:
            ordinal = date.fromisoformat(day).toordinal()
        except ValueError:
            raise TraceError(self._name, line, field, f"invalid date in {text!r}") from None
        if self._base is None:
            self._base = ordinal
        offset = float((ordinal - self._base) * 86400)
        self._day_offset[day] = offset
        return offset


# ----------------------------------------------------------------------------------------------
# Writing


def write_native(path: str | os.PathLike[str], requests: Sequence[TraceRequest]) -> None:
    """Write ``requests`` as a native CSV trace, atomically (temp file in the same dir + rename).

    Arrivals are written with ``repr`` so that reading the file back gives the same floats.
    The ``prefix_hashes`` column is written only when some request has prefix hashes.
    """
    if not requests:
        raise ValueError("requests: cannot write an empty trace")
    p = Path(path)
    with_hashes = any(r.prefix_hashes for r in requests)
    header = _NATIVE_HEADER + (("prefix_hashes",) if with_hashes else ())
    with atomic_write(p, encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        for r in requests:
            row: list[Any] = [repr(float(r.arrival_s)), r.prompt_tokens, r.output_tokens,
                              r.slo_class.value if r.slo_class is not None else ""]
            if with_hashes:
                row.append(" ".join(str(h) for h in r.prefix_hashes))
            writer.writerow(row)


# ----------------------------------------------------------------------------------------------
# Reshaping


def _sorted(requests: Iterable[TraceRequest]) -> list[TraceRequest]:
    return sorted(requests, key=lambda r: r.arrival_s)


def rescale_to_rate(requests: Sequence[TraceRequest], rate_per_s: float) -> list[TraceRequest]:
    """Stretch or compress time so that the mean rate ``(n - 1) / span`` equals ``rate_per_s``.

    Every arrival is scaled by the same factor around the first one, so the burst shape (relative
    gaps, inter-arrival CV) is unchanged. The result is sorted and re-based to 0. A one-request
    trace is returned re-based; a trace whose requests all arrive at once has no rate to scale.
    """
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate: expected a positive finite requests/s, got {rate_per_s!r}")
    reqs = _sorted(requests)
    if not reqs:
        raise ValueError("requests: cannot rescale an empty trace")
    t0 = reqs[0].arrival_s
    if len(reqs) == 1:
        return [dataclasses.replace(reqs[0], arrival_s=0.0)]
    span = reqs[-1].arrival_s - t0
    if span <= 0:
        raise ValueError("requests: all arrive at the same instant; the rate is undefined")
    target_span = (len(reqs) - 1) / rate_per_s
    # (t - t0) / span first: the last arrival becomes exactly 1.0 * target_span.
    return [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) / span * target_span)
            for r in reqs]


def assign_slo_classes(requests: Sequence[TraceRequest], tight_share: float,
                       seed: int) -> list[TraceRequest]:
    """Give each request without a class TIGHT with probability ``tight_share``, else LOOSE.

    One draw is taken per request (classed or not), in order, from ``random.Random(seed)``: the
    class a request gets does not depend on which other requests already had one.
    """
    if not (0.0 <= tight_share <= 1.0):
        raise ValueError(f"tight_share: expected a value in [0, 1], got {tight_share!r}")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for r in requests:
        draw = rng.random()
        if r.slo_class is None:
            cls = SloClass.TIGHT if draw < tight_share else SloClass.LOOSE
            r = dataclasses.replace(r, slo_class=cls)
        out.append(r)
    return out


def slice_trace(requests: Sequence[TraceRequest], start_s: float = 0.0,
                duration_s: float | None = None,
                max_requests: int | None = None) -> list[TraceRequest]:
    """The requests arriving in ``[start_s, start_s + duration_s)``, at most ``max_requests``.

    Times are those of ``requests`` (normally already relative to its first request). The window
    is sorted and re-based so that its first request arrives at 0.0. An empty window is an error
    (it is almost always a wrong ``start_s``).
    """
    if not (math.isfinite(start_s) and start_s >= 0):
        raise ValueError(f"start_s: expected a finite value >= 0, got {start_s!r}")
    if duration_s is not None and not (duration_s > 0):
        raise ValueError(f"duration_s: expected a positive value or None, got {duration_s!r}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests: expected >= 1 or None, got {max_requests!r}")
    end = math.inf if duration_s is None else start_s + duration_s
    window = [r for r in _sorted(requests) if start_s <= r.arrival_s < end]
    if max_requests is not None:
        window = window[:max_requests]
    if not window:
        raise ValueError(f"window [{start_s}, {end}) s holds no requests")
    t0 = window[0].arrival_s
    return [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in window]


def trace_stats(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Summary numbers: count, span_s, mean_rate ((n-1)/span, 0 when undefined), prompt and
    output token mean/p50/p99 (linear-interpolated percentiles), interarrival_cv (std/mean of
    the gaps, population std; 0 when undefined) and tight_share (of the classed requests)."""
    if not requests:
        raise ValueError("requests: no statistics for an empty trace")
    arrivals = np.sort(np.fromiter((r.arrival_s for r in requests), float, len(requests)))
    prompts = np.fromiter((r.prompt_tokens for r in requests), float, len(requests))
    outputs = np.fromiter((r.output_tokens for r in requests), float, len(requests))
    span = float(arrivals[-1] - arrivals[0])
    gaps = np.diff(arrivals)
    gap_mean = float(gaps.mean()) if gaps.size else 0.0
    classed = [r.slo_class for r in requests if r.slo_class is not None]
    return {
        "count": len(requests),
        "span_s": span,
        "mean_rate": (len(requests) - 1) / span if span > 0 else 0.0,
        "prompt_mean": float(prompts.mean()),
        "prompt_p50": float(percentile(prompts.tolist(), 50)),
        "prompt_p99": float(percentile(prompts.tolist(), 99)),
        "output_mean": float(outputs.mean()),
        "output_p50": float(percentile(outputs.tolist(), 50)),
        "output_p99": float(percentile(outputs.tolist(), 99)),
        "interarrival_cv": float(gaps.std()) / gap_mean if gap_mean > 0 else 0.0,
        "tight_share": (sum(c is SloClass.TIGHT for c in classed) / len(classed)
                        if classed else 0.0),
    }
