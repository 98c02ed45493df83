"""What the user typed: the usage error and the lookups of the names given on a command line.

The CLI (`disagg.cli`) and the modules it runs (studies, the bench harness) and the benchmark
scripts share these; none of them imports the CLI. `disagg.cli.main` prints a `UsageError` as one
line with exit status 2.
"""

from __future__ import annotations

import os
from pathlib import Path

from disagg.core.policies import PolicyError, parse_policy_spec


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def data_dir() -> Path:
    """Where real traces live: $DISAGG_TRACE_DIR, else ./data/traces."""
    return Path(os.environ.get("DISAGG_TRACE_DIR", "data/traces"))


def resolve_trace(name_or_path: str) -> Path:
    """A path, or a bare trace name looked up in the data directory (`azure_conv_2023`)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    for candidate in (data_dir() / name_or_path, data_dir() / f"{name_or_path}.csv"):
        if candidate.exists():
            return candidate
    raise UsageError(
        f"trace {name_or_path!r} not found (looked in {data_dir()}; set DISAGG_TRACE_DIR, "
        "or fetch the public traces with `disagg traces download`)"
    )


def parse_policies(text: str) -> list[str]:
    """A comma-separated list of registered policy names, each optionally with parameters
    (`parse_policy_spec`: `slo_goodput:allow_hosted=false`); an unknown one is refused."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError("--policies is empty")
    for n in names:
        try:
            parse_policy_spec(n)
        except PolicyError as e:
            raise UsageError(str(e)) from None
    return names
