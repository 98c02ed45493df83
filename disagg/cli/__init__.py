"""The `disagg` command line: simulate, run studies, fetch traces, train the accuracy table, benchmark,
calibrate, check configs, build the tiny model.

Every subcommand validates all of its input before it does any work, and writes its output files
atomically: a bad flag or a bad trace row gives one clear message (file, line, field) and exit
status 2, never a traceback and never half a file.

One module per command group, each adding its own subparsers (`add_commands(sub)`): `sim` (and
`study`), `traces`, `accuracy` and `bench` here; the groups that need the serving stack or the
calibration code (`calibrate`; `check-config`, `tiny-model`) live beside that code and register through
the `disagg.commands` entry point (pyproject.toml), so this package imports nothing above it.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module
from importlib.metadata import entry_points
from typing import Sequence

from disagg.core.cost_model import CostModelError
from disagg.core.policies import PolicyError
from disagg.sim.traces import TraceError
from disagg.user_input import UsageError

GROUPS = ("disagg.cli.sim", "disagg.cli.traces", "disagg.cli.accuracy", "disagg.cli.bench")
ENTRY_POINT_GROUP = "disagg.commands"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="disagg", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = ap.add_subparsers(dest="command", required=True)
    for module in GROUPS:
        import_module(module).add_commands(sub)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        ep.load()(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, TraceError, CostModelError, PolicyError) as e:
        print(f"disagg: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("disagg: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
