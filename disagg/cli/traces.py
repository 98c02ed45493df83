"""`disagg traces download|generate|stats`."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from disagg.files import json_safe
from disagg.sim.traces import read_trace, trace_stats
from disagg.user_input import UsageError, data_dir, resolve_trace


def cmd_traces_download(args) -> int:
    from disagg.sim.download import download_traces

    for path in download_traces(Path(args.dest), args.name):
        print(path)
    return 0


def cmd_traces_generate(args) -> int:
    from disagg.sim.traces import write_native
    from disagg.sim.workloads import generate

    if args.requests < 1:
        raise UsageError(f"--requests must be >= 1, got {args.requests}")
    if not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be a positive finite req/s, got {args.rate}")
    try:
        trace = generate(args.workload, args.requests, args.rate, args.seed, args.max_context_tokens)
    except ValueError as e:  # an unknown name: the message lists the known ones
        raise UsageError(str(e)) from None
    write_native(Path(args.out), trace)
    print(f"{args.out}: {len(trace)} requests of {args.workload} at {args.rate:g} req/s (seed {args.seed})")
    return 0


def cmd_traces_stats(args) -> int:
    trace = read_trace(resolve_trace(args.trace), args.format)
    print(json.dumps(json_safe(trace_stats(trace)), indent=2))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`traces` and its subcommands."""
    tr = sub.add_parser("traces", help="fetch or inspect request traces")
    trs = tr.add_subparsers(dest="traces_command", required=True)
    dl = trs.add_parser("download", help="download the public Azure LLM traces")
    dl.add_argument("--dest", default=str(data_dir()))
    dl.add_argument("--name", action="append", help="azure_conv_2023, azure_code_2023 (default both)")
    dl.set_defaults(func=cmd_traces_download)
    gen = trs.add_parser("generate", help="write a generated workload (disagg.sim.workloads) as a native trace")
    gen.add_argument("workload", help="short_chat, long_prompt_short_answer, short_prompt_long_generation, "
                                      "mixed_bursty, multi_turn_chat (with prefix hashes)")
    gen.add_argument("--requests", type=int, default=4000)
    gen.add_argument("--rate", type=float, default=10.0, help="mean arrival rate (req/s)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-context-tokens", type=int, default=None,
                     help="multi_turn_chat: end conversations before prompt + answer exceed this (the model's context)")
    gen.add_argument("--out", required=True, help="native CSV to write (atomically)")
    gen.set_defaults(func=cmd_traces_generate)
    st = trs.add_parser("stats", help="summary statistics of a trace")
    st.add_argument("trace")
    st.add_argument("--format", default="auto")
    st.set_defaults(func=cmd_traces_stats)
