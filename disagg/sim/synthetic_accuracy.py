"""A SYNTHETIC evaluation table for the latency-routing study: no real model was evaluated.

The study needs, for each model of the fleet, how accurate it is on a query. No real table of
query-model evaluations ships with this project, so this module makes one up, documentedly, with
the one property the routing problem needs: the large model is more accurate, and more so on
long prompts. The ground truth is a per-model success probability falling with log2 of the prompt
length::

    p_small(n) = 0.80 − 0.050 · log2(n / 64)        p_large(n) = 0.88 − 0.020 · log2(n / 64)

(n clamped to [16, 16384]): at 64 tokens 0.80 vs 0.88, at 1024 tokens 0.60 vs 0.80. An evaluation
row is one query of a lognormal prompt length (mean 1000 tokens, σ = 1, clamped to [8, 16384]),
answered by one model, scored 1 with probability p_model(n) else 0 (pass/fail, as most benchmark
graders). The router learns `AccuracyTable` from these rows and never sees the formulas; the study
scores what it served with the formulas themselves (`true_accuracy`).
"""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path
from typing import Sequence

from disagg.core.utility import EVALUATION_COLUMNS, EvaluationRow
from disagg.files import atomic_write

# model → (accuracy at 64 prompt tokens, loss per doubling of the prompt)
TRUE_ACCURACY: dict[str, tuple[float, float]] = {"small": (0.80, 0.050), "large": (0.88, 0.020)}
_PROMPT_MEAN, _PROMPT_SIGMA, _PROMPT_MIN, _PROMPT_MAX = 1000.0, 1.0, 8, 16384


def true_accuracy(model: str, prompt_tokens: int) -> float:
    """The synthetic ground truth: probability that `model` answers a query of `prompt_tokens` correctly."""
    try:
        at64, per_doubling = TRUE_ACCURACY[model]
    except KeyError:
        raise ValueError(f"no synthetic accuracy for model {model!r}; known: {', '.join(TRUE_ACCURACY)}") from None
    n = min(16384, max(16, prompt_tokens))
    return min(1.0, max(0.0, at64 - per_doubling * math.log2(n / 64)))


def synthetic_evaluations(rows_per_model: int, seed: int, models: Sequence[str] = ("small", "large")) -> list[EvaluationRow]:
    """`rows_per_model` pass/fail evaluations per model, each on its own random prompt length. Seeded."""
    if rows_per_model < 1:
        raise ValueError(f"rows_per_model must be >= 1, got {rows_per_model!r}")
    rng = random.Random(seed)
    mu = math.log(_PROMPT_MEAN) - _PROMPT_SIGMA ** 2 / 2
    out = []
    for _ in range(rows_per_model):
        for m in models:
            n = min(_PROMPT_MAX, max(_PROMPT_MIN, round(rng.lognormvariate(mu, _PROMPT_SIGMA))))
            out.append(EvaluationRow(n, m, 1.0 if rng.random() < true_accuracy(m, n) else 0.0))
    return out


def write_evaluations(path: str | Path, rows: Sequence[EvaluationRow]) -> None:
    """Write rows as the evaluations CSV `read_evaluations` reads, atomically."""
    with atomic_write(path, newline="") as f:
        w = csv.writer(f)
        w.writerow(EVALUATION_COLUMNS)
        for r in rows:
            w.writerow((r.prompt_tokens, r.model, f"{r.score:g}"))
