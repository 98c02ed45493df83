"""Trace readers, writer and reshaping helpers (disagg.sim.traces)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from disagg.core.types import SloClass
from disagg.sim.traces import (
    KNOWN_FORMATS,
    TraceError,
    TraceRequest,
    assign_slo_classes,
    read_trace,
    read_trace_info,
    rescale_to_rate,
    slice_trace,
    trace_stats,
    write_native,
)

TRACE_DIR = Path(os.environ.get("DISAGG_TRACE_DIR") or Path(__file__).resolve().parents[2] / "data" / "traces")
needs_real_traces = pytest.mark.skipif(
    not TRACE_DIR.is_dir(),
    reason=f"real trace dir {TRACE_DIR} absent (set DISAGG_TRACE_DIR to run these)")

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8", newline="")
    return p


# ------------------------------------------------------------------------------------------------
# Real files: numbers published with the traces. `wc -l` reports 19366 / 8819 because the
# files have no final newline: one header line + 19366 / 8819 data rows.

REAL = [
    # file, rows, span_s, prompt mean/p50/p99, output mean/p50/p99, mean rate, interarrival CV
    ("azure_conv_2023.csv", 19366, 3502, (1155, 1020, 4142), (211, 129, 601), 5.5, 1.1),
    ("azure_code_2023.csv", 8819, 3436, (2048, 1469, 7436), (28, 13, 252), 2.6, 13.0),
]


@needs_real_traces
@pytest.mark.parametrize("name,rows,span,prompt,output,rate,cv", REAL, ids=[r[0] for r in REAL])
def test_real_azure_trace(name, rows, span, prompt, output, rate, cv):
    reqs, info = read_trace_info(TRACE_DIR / name)
    assert info.format == "azure"
    assert info.rows == rows and info.skipped == 0
    assert len(reqs) == rows
    assert reqs[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert all(r.slo_class is None and r.prefix_hashes == () for r in reqs)
    s = trace_stats(reqs)
    assert s["span_s"] == pytest.approx(span, abs=1.0)
    assert s["mean_rate"] == pytest.approx(rate, rel=0.05)
    for key, want in zip(("prompt_mean", "prompt_p50", "prompt_p99"), prompt):
        assert s[key] == pytest.approx(want, rel=0.01), key
    for key, want in zip(("output_mean", "output_p50", "output_p99"), output):
        assert s[key] == pytest.approx(want, rel=0.01), key
    assert s["interarrival_cv"] == pytest.approx(cv, rel=0.1)


@needs_real_traces
def test_real_trace_first_row_matches_file():
    path = TRACE_DIR / "azure_conv_2023.csv"
    with open(path, encoding="utf-8") as f:
        f.readline()
        first, second = f.readline().strip().split(","), f.readline().strip().split(",")
    reqs = read_trace(path, "azure")
    assert (reqs[0].prompt_tokens, reqs[0].output_tokens) == (int(first[1]), int(first[2]))
    # 18:15:46.6805900 -> 18:15:50.9951690
    assert reqs[1].arrival_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert (reqs[1].prompt_tokens, reqs[1].output_tokens) == (int(second[1]), int(second[2]))


# ------------------------------------------------------------------------------------------------
# Broken files: every error names the file, the line and the field.

BROKEN = [
    # id, file name, content, fmt, line, field, words expected in the message
    ("azure-bad-int", "a.csv", AZURE_HEADER + "2023-11-16 18:00:00.0000000,12x,5\n",
     "auto", 2, "ContextTokens", "non-negative integer"),
    ("azure-negative", "a.csv",
     AZURE_HEADER + "2023-11-16 18:00:00.0,5,5\n2023-11-16 18:00:01.0,-3,5\n",
     "azure", 3, "ContextTokens", "'-3'"),
    ("azure-float-tokens", "a.csv", AZURE_HEADER + "2023-11-16 18:00:00.0,5,2.5\n",
     "auto", 2, "GeneratedTokens", "non-negative integer"),
    ("azure-missing-field", "a.csv", AZURE_HEADER + "2023-11-16 18:00:00.0,5\n",
     "auto", 2, "GeneratedTokens", "missing"),
    ("azure-empty-field", "a.csv", AZURE_HEADER + "2023-11-16 18:00:00.0,,7\n",
     "auto", 2, "ContextTokens", "missing"),
    ("azure-extra-field", "a.csv", AZURE_HEADER + "2023-11-16 18:00:00.0,5,5,9\n",
     "auto", 2, "row", "4 fields"),
    ("azure-bad-timestamp", "a.csv", AZURE_HEADER + "16/11/2023 18:00:00,5,5\n",
     "auto", 2, "TIMESTAMP", "timestamp"),
    ("azure-bad-date", "a.csv", AZURE_HEADER + "2023-02-30 18:00:00.0,5,5\n",
     "auto", 2, "TIMESTAMP", "invalid date"),
    ("azure-bad-hour", "a.csv", AZURE_HEADER + "2023-11-16 25:00:00.0,5,5\n",
     "auto", 2, "TIMESTAMP", "out of range"),
    ("unknown-format", "x.csv", "time,tokens_in,tokens_out\n1,2,3\n",
     "auto", 1, "header", "known formats: azure, burstgpt, mooncake, native"),
    ("wrong-explicit-format", "a.csv", AZURE_HEADER + "2023-11-16 18:00:00.0,5,5\n",
     "native", 1, "header", "not a 'native' trace"),
    ("mooncake-bad-json", "m.jsonl",
     '{"timestamp": 0, "input_length": 5, "output_length": 5}\n{"timestamp": 1,\n',
     "auto", 2, None, "invalid JSON"),
    ("mooncake-missing-field", "m.jsonl",
     '{"timestamp": 0, "input_length": 5, "output_length": 5}\n\n'
     '{"timestamp": 10, "input_length": 5}\n',
     "auto", 3, "output_length", "missing"),
    ("mooncake-negative", "m.jsonl", '{"timestamp": 0, "input_length": -1, "output_length": 5}\n',
     "mooncake", 1, "input_length", "non-negative integer"),
    ("mooncake-bad-hashes", "m.jsonl",
     '{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": [1, "a"]}\n',
     "auto", 1, "hash_ids", "list of integers"),
    ("mooncake-bad-timestamp", "m.jsonl",
     '{"timestamp": "soon", "input_length": 5, "output_length": 5}\n',
     "auto", 1, "timestamp", "milliseconds"),
    ("burstgpt-non-int", "b.csv",
     "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "5,ChatGPT,abc,10,20,Conversation log\n",
     "auto", 2, "Request tokens", "non-negative integer"),
    ("burstgpt-bad-time", "b.csv",
     "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "-5,ChatGPT,10,10,20,Conversation log\n",
     "auto", 2, "Timestamp", "non-negative number of seconds"),
    ("native-bad-slo", "n.csv", "arrival_s,prompt_tokens,output_tokens,slo_class\n0.0,5,5,urgent\n",
     "auto", 2, "slo_class", "unknown SLO class"),
    ("native-zero-output", "n.csv", "arrival_s,prompt_tokens,output_tokens\n0.0,5,0\n",
     "auto", 2, "output_tokens", "positive integer"),
    ("native-bad-hashes", "n.csv",
     "arrival_s,prompt_tokens,output_tokens,slo_class,prefix_hashes\n0.0,5,5,,1 x\n",
     "auto", 2, "prefix_hashes", "integers"),
    ("empty-file", "e.csv", "", "auto", 1, None, "empty"),
    ("blank-lines-only", "e.csv", "\n\n  \n", "auto", 1, None, "empty"),
]


@pytest.mark.parametrize("name,text,fmt,line,field,words", [b[1:] for b in BROKEN],
                         ids=[b[0] for b in BROKEN])
def test_broken_file_error_names_file_line_field(tmp_path, name, text, fmt, line, field, words):
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError) as info:
        read_trace(path, fmt)
    err, msg = info.value, str(info.value)
    assert msg.startswith(f"{path}:{line}: "), msg
    assert (err.path, err.line, err.field) == (str(path), line, field)
    if field is not None:
        assert f"field {field!r}" in msg
    assert words in msg


@pytest.mark.parametrize("name,text", [
    ("h.csv", AZURE_HEADER),
    ("z.csv", AZURE_HEADER + "2023-11-16 18:00:00.0,5,0\n"),
])
def test_trace_without_requests_is_an_error(tmp_path, name, text):
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError, match="no requests") as info:
        read_trace(path)
    assert str(path) in str(info.value)


def test_unknown_fmt_argument_lists_known_formats(tmp_path):
    path = _write(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:00:00.0,5,5\n")
    with pytest.raises(TraceError, match="known formats: auto, azure, burstgpt, mooncake, native"):
        read_trace(path, "sharegpt")
    assert KNOWN_FORMATS == ("azure", "burstgpt", "mooncake", "native")


def test_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot open"):
        read_trace(tmp_path / "nope.csv")


def test_trace_error_is_value_error_and_pickles():
    err = TraceError("azure.csv", 17, "ContextTokens", "expected a non-negative integer, got '-3'")
    assert isinstance(err, ValueError)
    assert str(err) == ("azure.csv:17: field 'ContextTokens': "
                        "expected a non-negative integer, got '-3'")
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.line, back.field) == (str(err), 17, "ContextTokens")


# ------------------------------------------------------------------------------------------------
# Small well-formed files in every format.

def test_azure_relative_sorted_no_trailing_newline_crlf(tmp_path):
    text = (AZURE_HEADER.replace("\n", "\r\n")
            + "2023-11-16 18:00:02.5000000,30,3\r\n"
            + "2023-11-16 18:00:01.2500000,10,1\r\n"
            + "2023-11-16 18:00:02.5000000,20,2")  # tie with row 1: file order kept
    reqs = read_trace(_write(tmp_path, "a.csv", text))
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 10, 1), (1.25, 30, 3), (1.25, 20, 2)]


@pytest.mark.parametrize("first,second,gap", [
    ("2023-11-16 23:59:59.5000000", "2023-11-17 00:00:00.2500000", 0.75),   # midnight
    ("2023-11-30 23:59:59.0", "2023-12-01 00:00:01.0", 2.0),                # month end
    ("2023-12-31 23:59:59.9", "2024-01-01 00:00:00.1", 0.2),                # year end
    ("2024-02-28 12:00:00", "2024-03-01 12:00:00", 2 * 86400.0),            # leap day between
])
def test_azure_timestamps_cross_day_boundaries(tmp_path, first, second, gap):
    text = AZURE_HEADER + f"{second},2,2\n{first},1,1\n"
    reqs = read_trace(_write(tmp_path, "a.csv", text))
    assert [r.prompt_tokens for r in reqs] == [1, 2]
    assert reqs[1].arrival_s == pytest.approx(gap, abs=1e-9)


def test_azure_zero_token_rows_are_skipped_and_counted(tmp_path):
    text = (AZURE_HEADER + "2023-11-16 18:00:00.0,5,5\n2023-11-16 18:00:01.0,5,0\n"
            + "2023-11-16 18:00:02.0,0,4\n2023-11-16 18:00:03.0,6,6\n")
    reqs, info = read_trace_info(_write(tmp_path, "a.csv", text))
    assert [r.arrival_s for r in reqs] == [0.0, 3.0]
    assert (info.rows, info.skipped_zero_output, info.skipped_zero_prompt, info.skipped) == (
        4, 1, 1, 2)


def test_mooncake_reader(tmp_path):
    text = ('{"timestamp": 27482, "input_length": 6955, "output_length": 52, '
            '"hash_ids": [46, 47, 48]}\n'
            '{"timestamp": 27000, "input_length": 600, "output_length": 1, "hash_ids": [46]}\n'
            '\n'
            '{"timestamp": 30000.5, "input_length": 7, "output_length": 0, "hash_ids": []}\n'
            '{"timestamp": 30001, "input_length": 8, "output_length": 9}')
    reqs, info = read_trace_info(_write(tmp_path, "m.jsonl", text))
    assert info.format == "mooncake" and info.rows == 4 and info.skipped_zero_output == 1
    got = [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.prefix_hashes) for r in reqs]
    assert got == [
        (0.0, 600, 1, (46,)),
        (pytest.approx(0.482), 6955, 52, (46, 47, 48)),
        (pytest.approx(3.001), 8, 9, ()),
    ]


def test_burstgpt_reader_skips_failed_requests(tmp_path):
    text = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,472,18,490,Conversation log\n"
            "45,ChatGPT,1087,0,1087,Conversation log\n"  # failed request: 0 response tokens
            "118.5,GPT-4,417,276,693,API log\n")
    reqs, info = read_trace_info(_write(tmp_path, "burst.csv", text))
    assert info.format == "burstgpt"
    assert (info.rows, info.skipped_zero_output) == (3, 1)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 472, 18), (113.5, 417, 276)]


def test_native_reader_optional_columns(tmp_path):
    text = ("arrival_s,prompt_tokens,output_tokens,slo_class\n"
            "2.0,10,5,TIGHT\n1.0,20,6,\n1.5,30,7,loose\n")
    reqs = read_trace(_write(tmp_path, "n.csv", text), "native")
    assert reqs == [TraceRequest(0.0, 20, 6), TraceRequest(0.5, 30, 7, SloClass.LOOSE),
                    TraceRequest(1.0, 10, 5, SloClass.TIGHT)]
    bare = read_trace(_write(tmp_path, "m.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,1\n"))
    assert bare == [TraceRequest(0.0, 1, 1)]


def test_gzip_input(tmp_path):
    import gzip
    path = tmp_path / "a.csv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(AZURE_HEADER + "2023-11-16 18:00:00.0,5,5\n2023-11-16 18:00:04.0,6,6")
    assert [r.arrival_s for r in read_trace(path)] == [0.0, 4.0]


@pytest.mark.parametrize("reqs", [
    [TraceRequest(0.0, 5, 3), TraceRequest(0.1 + 0.2, 7, 1, SloClass.TIGHT),
     TraceRequest(1e-7 * 3, 2, 2, SloClass.LOOSE)],
    [TraceRequest(0.0, 5, 3, None, (1, 2, -3)), TraceRequest(1 / 3, 7, 1, SloClass.TIGHT, ())],
], ids=["classes", "prefix-hashes"])
def test_write_native_round_trip_is_exact(tmp_path, reqs):
    path = tmp_path / "out.csv"
    write_native(path, sorted(reqs, key=lambda r: r.arrival_s))
    assert read_trace(path) == sorted(reqs, key=lambda r: r.arrival_s)
    assert [p.name for p in tmp_path.iterdir()] == ["out.csv"]  # no temp file left behind


def test_write_native_replaces_atomically_and_refuses_empty(tmp_path):
    path = tmp_path / "out.csv"
    path.write_text("old content")
    write_native(path, [TraceRequest(0.0, 1, 1)])
    assert path.read_text().splitlines() == ["arrival_s,prompt_tokens,output_tokens,slo_class",
                                             "0.0,1,1,"]
    with pytest.raises(ValueError, match="empty"):
        write_native(path, [])
    assert read_trace(path) == [TraceRequest(0.0, 1, 1)]


# ------------------------------------------------------------------------------------------------
# TraceRequest and reshaping helpers.

@pytest.mark.parametrize("kwargs,words", [
    (dict(arrival_s=-1.0, prompt_tokens=1, output_tokens=1), "arrival_s"),
    (dict(arrival_s=float("nan"), prompt_tokens=1, output_tokens=1), "arrival_s"),
    (dict(arrival_s=0.0, prompt_tokens=0, output_tokens=1), "prompt_tokens"),
    (dict(arrival_s=0.0, prompt_tokens=1, output_tokens=0), "output_tokens"),
    (dict(arrival_s=0.0, prompt_tokens=1, output_tokens=1, slo_class="tight"), "slo_class"),
])
def test_trace_request_validates(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TraceRequest(**kwargs)


def _trace(arrivals: list[float]) -> list[TraceRequest]:
    return [TraceRequest(a, 10 + i, 1 + i) for i, a in enumerate(arrivals)]


@pytest.mark.parametrize("arrivals,rate", [
    ([0.0, 1.0, 1.5, 10.0], 2.0),
    ([0.0, 0.001, 0.002, 100.0, 100.0, 250.0], 0.37),
    ([5.0, 6.0], 1000.0),
])
def test_rescale_gives_exact_mean_rate_and_keeps_shape(arrivals, rate):
    out = rescale_to_rate(_trace(arrivals), rate)
    assert out[0].arrival_s == 0.0
    assert trace_stats(out)["mean_rate"] == pytest.approx(rate, rel=1e-12)
    factor = out[-1].arrival_s / (arrivals[-1] - arrivals[0])
    for before, after in zip(arrivals, out):
        want = (before - arrivals[0]) * factor
        assert after.arrival_s == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert [r.prompt_tokens for r in out] == [10 + i for i in range(len(arrivals))]


@needs_real_traces
def test_rescale_real_trace_keeps_burstiness():
    reqs = read_trace(TRACE_DIR / "azure_code_2023.csv")
    before, after = trace_stats(reqs), trace_stats(rescale_to_rate(reqs, 10.0))
    assert after["mean_rate"] == pytest.approx(10.0, rel=1e-12)
    assert after["interarrival_cv"] == pytest.approx(before["interarrival_cv"], rel=1e-9)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan"), float("inf")])
def test_rescale_rejects_bad_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        rescale_to_rate(_trace([0.0, 1.0]), rate)


def test_rescale_edge_cases():
    assert rescale_to_rate([TraceRequest(3.0, 1, 1)], 5.0) == [TraceRequest(0.0, 1, 1)]
    with pytest.raises(ValueError, match="same instant"):
        rescale_to_rate(_trace([2.0, 2.0]), 1.0)
    with pytest.raises(ValueError, match="empty"):
        rescale_to_rate([], 1.0)


def test_assign_slo_classes_deterministic_share_and_keeps_existing():
    reqs = _trace([i * 0.1 for i in range(20000)])
    reqs[0] = TraceRequest(0.0, 1, 1, SloClass.LOOSE)
    reqs[1] = TraceRequest(0.1, 1, 1, SloClass.TIGHT)
    a = assign_slo_classes(reqs, 0.3, seed=7)
    assert a == assign_slo_classes(reqs, 0.3, seed=7)
    assert a != assign_slo_classes(reqs, 0.3, seed=8)
    assert (a[0].slo_class, a[1].slo_class) == (SloClass.LOOSE, SloClass.TIGHT)
    assert all(r.slo_class is not None for r in a)
    assert trace_stats(a)["tight_share"] == pytest.approx(0.3, abs=0.015)
    # Pre-set classes do not shift the draws of the others.
    plain = assign_slo_classes(_trace([i * 0.1 for i in range(20000)]), 0.3, seed=7)
    assert [r.slo_class for r in a[2:]] == [r.slo_class for r in plain[2:]]


@pytest.mark.parametrize("share,expected", [(0.0, SloClass.LOOSE), (1.0, SloClass.TIGHT)])
def test_assign_slo_classes_extremes(share, expected):
    assert {r.slo_class for r in assign_slo_classes(_trace([0, 1, 2, 3]), share, 1)} == {expected}


@pytest.mark.parametrize("share", [-0.01, 1.01, float("nan")])
def test_assign_slo_classes_rejects_bad_share(share):
    with pytest.raises(ValueError, match="tight_share"):
        assign_slo_classes(_trace([0.0]), share, 1)


@pytest.mark.parametrize("kwargs,arrivals,prompts", [
    (dict(), [0.0, 1.0, 2.5, 4.0, 7.0], [10, 11, 12, 13, 14]),
    (dict(start_s=1.0, duration_s=3.0), [0.0, 1.5], [11, 12]),
    (dict(start_s=2.5), [0.0, 1.5, 4.5], [12, 13, 14]),
    (dict(max_requests=2), [0.0, 1.0], [10, 11]),
    (dict(start_s=0.5, duration_s=100.0, max_requests=3), [0.0, 1.5, 3.0], [11, 12, 13]),
])
def test_slice_trace(kwargs, arrivals, prompts):
    out = slice_trace(_trace([0.0, 1.0, 2.5, 4.0, 7.0]), **kwargs)
    assert [r.arrival_s for r in out] == arrivals
    assert [r.prompt_tokens for r in out] == prompts


@pytest.mark.parametrize("kwargs,words", [
    (dict(start_s=-1.0), "start_s"),
    (dict(duration_s=0.0), "duration_s"),
    (dict(max_requests=0), "max_requests"),
    (dict(start_s=100.0), "no requests"),
])
def test_slice_trace_rejects(kwargs, words):
    with pytest.raises(ValueError, match=words):
        slice_trace(_trace([0.0, 1.0]), **kwargs)


def test_trace_stats_small():
    s = trace_stats(_trace([0.0, 1.0, 2.0, 3.0]))
    assert s["count"] == 4 and s["span_s"] == 3.0 and s["mean_rate"] == 1.0
    assert s["interarrival_cv"] == 0.0
    assert (s["prompt_mean"], s["prompt_p50"], s["output_mean"]) == (11.5, 11.5, 2.5)
    one = trace_stats([TraceRequest(0.0, 4, 2)])
    assert (one["mean_rate"], one["interarrival_cv"], one["prompt_p99"]) == (0.0, 0.0, 4.0)
    with pytest.raises(ValueError):
        trace_stats([])
