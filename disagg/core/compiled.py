"""Refuses a compiled module built from other source than the one beside it.

setup.py builds some modules as C extensions, which Python imports in preference to the source
file beside them. In an editable install, editing or checking out that source leaves the old
extension in place, so the old code would run: this check (at `disagg.core`'s import) turns that
into a clear error instead."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).parent
DIGESTS = HERE / "compiled-sources.json"


class StaleBuild(ImportError):
    pass


def stale_sources(directory: Path = HERE) -> list[str]:
    """The sources in `directory` whose compiled extension was built from other content."""
    digests_file = directory / DIGESTS.name
    if not digests_file.exists():
        return []
    digests = json.loads(digests_file.read_text())
    stale = []
    for name, digest in digests.items():
        source = directory / name
        built = list(directory.glob(f"{source.stem}.*.so")) + list(directory.glob(f"{source.stem}.*.pyd"))
        if built and source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            stale.append(name)
    return stale


def check_compiled_sources(directory: Path = HERE) -> None:
    stale = stale_sources(directory)
    if stale:
        raise StaleBuild(f"{', '.join(str(directory / s) for s in stale)} changed since it was compiled, so the old "
                         f"code would run: rebuild with `make install` (or `pip install --no-deps -e .`)")
