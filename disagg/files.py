"""Writing output files so that no crash, full disk or Ctrl-C ever leaves half of one.

Every file this project writes (traces, results, reports, figures, evaluations, downloads) goes
through `atomic_write`: the bytes go to a temporary file beside the target, are flushed to disk,
and only then renamed over it. A reader sees the old file or the new one, never a mixture; on an
error the target keeps its old content and the temporary file is removed.

Light on purpose (standard library only): the pure core, the simulator and the CLI all use it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

PRIVATE = 0o600  # what tempfile.mkstemp creates
SHARED = 0o644  # reports and figures meant for anyone on the machine


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = None,
                 newline: str | None = None, permissions: int = PRIVATE) -> Iterator[IO[Any]]:
    """Open `path` for writing through a temporary file; it replaces `path` when the block ends
    without an exception. `mode` is "w" (text) or "wb"; `encoding` and `newline` are `open`'s.
    The parent folder is created if missing."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # same folder as the target: os.replace is atomic only within one filesystem
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the file
            if permissions != PRIVATE:
                os.fchmod(f.fileno(), permissions)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str, *, permissions: int = PRIVATE) -> None:
    with atomic_write(path, permissions=permissions) as f:
        f.write(text)


def write_figure(fig: Any, path: str | os.PathLike[str], **savefig: Any) -> None:
    """A matplotlib figure as a PNG anyone on the machine may read (`savefig` adds options)."""
    with atomic_write(path, "wb", permissions=SHARED) as f:
        fig.savefig(f, format="png", dpi=110, **savefig)


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Indented JSON and a final newline. NaN is written as JSON's invalid `NaN`: pass `json_safe(data)`."""
    with atomic_write(path) as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def json_safe(obj: Any) -> Any:
    """NaN and infinities are not JSON: write null (recursively through dicts and lists)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj
