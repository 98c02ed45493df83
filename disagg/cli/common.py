"""What the command groups share: a progress bar, a results table, a reachability check."""

from __future__ import annotations

import math
import sys

from disagg.user_input import UsageError


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = max(1, total), label, 0
        self.enabled = sys.stderr.isatty()
        self._shown = -1

    def __call__(self, n: int) -> None:
        self.done += n
        pct = int(100 * self.done / self.total)
        if self.enabled and pct != self._shown:
            self._shown = pct
            bar = "#" * (pct // 4)
            sys.stderr.write(f"\r{self.label:<20} [{bar:<25}] {pct:3d}%")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def fmt_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """rows of dicts → an aligned text table; columns are (key, header, format)."""
    head = [h for _, h, _ in columns]
    body = []
    for r in rows:
        line = []
        for key, _, fmt in columns:
            v = r.get(key)
            line.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt))
        body.append(line)
    widths = [max(len(head[i]), *(len(b[i]) for b in body)) if body else len(head[i]) for i in range(len(head))]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(out)


def check_reachable(url: str) -> None:
    """Before minutes of work that need the app: is it there and ready?"""
    from disagg.app_client import AppClient, AppError

    try:
        with AppClient(url) as app:
            app.health()
    except AppError as e:
        raise UsageError(str(e) if e.status is None else f"{e}; the app is not ready") from None


def live_fit_argv(url: str, model: str, out: str, shared_host: bool, settle_s: float) -> list[str]:
    """The command that fits `model`'s constants on the app's live engines and has its routers price
    with them (`disagg calibrate --live --quick ... --apply`, about 30 s on the CPU profile): the
    start-up fit of `make run`, and `disagg validate --refit`'s before each run. `out` must lie in
    the router's `cost_model_dir`, the one folder it may load from. `shared_host`: the engines share
    the host's processors (CPU), so its terms are measured too; GPUs own their devices."""
    host = ["--host", "--settle-s", f"{settle_s:g}"] if shared_host else []
    return [sys.executable, "-m", "disagg.cli", "calibrate", "--live", "--url", url, "--quick", "--url-requests", "8",
            "--model", model, "--out", out, "--apply", *host]


def as_typed(argv: list[str]) -> str:
    """What a user types for `argv` (a `live_fit_argv`): `disagg ...`, not the interpreter's path."""
    return " ".join(argv[2:]).replace("disagg.cli", "disagg", 1)
