"""Accuracy − λ·cost under a TTFT limit: the objective of the second routing mode.

"Beyond accuracy and cost: latency-aware LLM query routing" routes each query among heterogeneous
model instances by the utility

    U(i) = acĉ(model(i), query) − λ · cost̂(model(i), query)

maximised over the instances whose estimated TTFT (disagg.core.ttft_estimator) is within the
query's limit. This module holds the pure pieces:

- `ModelPrices` and `cost_estimate`: per-token input/output price → the query's expected cost;
- `AccuracyTable`: acĉ from historical query-model evaluations, a per-model mean per log2
  prompt-length bucket shrunk toward the model's mean (a per-model prior when it has no history),
  saved and loaded as JSON; `read_evaluations` reads the evaluations from CSV;
- `choose_instance`: the constrained argmax, returning a `Choice` that carries every candidate's
  terms, so a decision can be explained term by term.

Who calls: the router (or a simulator policy) once per query, after estimating each candidate's
TTFT, accuracy and cost. Pure: no I/O except `save`/`load`/`read_evaluations`, no clocks, never
mutates its arguments; deterministic (ties go to the first candidate).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from disagg.core.types import NoCapacity
from disagg.files import atomic_write

# --- cost ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelPrices:
    """Price per token of one model, in any one currency unit (λ is per that unit)."""

    input_per_token: float
    output_per_token: float

    def __post_init__(self) -> None:
        for name in ("input_per_token", "output_per_token"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def cost_estimate(prices: ModelPrices, prompt_tokens: int, predicted_output_tokens: float) -> float:
    """Expected cost of a query: its prompt at the input price plus its predicted output at the output price."""
    if prompt_tokens < 0 or predicted_output_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got prompt_tokens={prompt_tokens!r}, "
                         f"predicted_output_tokens={predicted_output_tokens!r}")
    return prices.input_per_token * prompt_tokens + prices.output_per_token * predicted_output_tokens


# --- accuracy ------------------------------------------------------------------------------------


class EvaluationError(ValueError):
    """A bad evaluation row, CSV file or saved accuracy table; the message names file, line and field."""


@dataclass(frozen=True, slots=True)
class EvaluationRow:
    """One historical evaluation: a query of `prompt_tokens` tokens answered by `model`, scored in [0, 1]."""

    prompt_tokens: int
    model: str
    score: float


def prompt_bucket(prompt_tokens: int) -> int:
    """log2 bucket of a prompt length: bucket b holds lengths 2^(b-1) .. 2^b − 1 (0 and 1 are bucket 1)."""
    return max(1, prompt_tokens).bit_length()


def _check_row(prompt_tokens: Any, model: Any, score: Any, where: str) -> EvaluationRow:
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        raise EvaluationError(f"{where}field 'prompt_tokens': {prompt_tokens!r} is not an integer >= 0")
    if not isinstance(model, str) or not model.strip():
        raise EvaluationError(f"{where}field 'model': {model!r} is not a model name")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not (0.0 <= score <= 1.0):
        raise EvaluationError(f"{where}field 'score': {score!r} is outside [0, 1]")
    return EvaluationRow(prompt_tokens, model.strip(), float(score))


class AccuracyTable:
    """acĉ(model, prompt length): per-model mean score per log2 prompt-length bucket, shrunk to the model mean.

    With n rows of mean m in (model, bucket) and the model's mean M over all its rows::

        acĉ = (shrinkage · M + n · m) / (shrinkage + n)

    so a cold bucket answers M and a warm one its own mean. A model with no rows answers its prior
    (`priors[model]`, else `default_prior`). Memory is constant whatever the history: sums and
    counts only. `train` adds rows (call it on a fresh table to train from scratch).
    """

    VERSION = 1

    def __init__(self, shrinkage: float = 8.0, default_prior: float = 0.5,
                 priors: dict[str, float] | None = None) -> None:
        if not (math.isfinite(shrinkage) and shrinkage >= 0.0):
            raise ValueError(f"shrinkage must be a finite number >= 0, got {shrinkage!r}")
        if not (0.0 <= default_prior <= 1.0):
            raise ValueError(f"default_prior must be in [0, 1], got {default_prior!r}")
        for m, p in (priors or {}).items():
            if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
                raise ValueError(f"priors[{m!r}] must be in [0, 1], got {p!r}")
        self.shrinkage = float(shrinkage)
        self.default_prior = float(default_prior)
        self.priors: dict[str, float] = {m: float(p) for m, p in (priors or {}).items()}
        self._n: dict[str, int] = {}
        self._sum: dict[str, float] = {}
        self._bn: dict[tuple[str, int], int] = {}
        self._bsum: dict[tuple[str, int], float] = {}

    def train(self, rows: Iterable[EvaluationRow | tuple[int, str, float]]) -> "AccuracyTable":
        """Add evaluation rows ((prompt_tokens, model, score) tuples or EvaluationRow); returns self.

        Every row is checked before any is added: a bad row (named by its index) leaves the table as it was.
        """
        checked = []
        for i, row in enumerate(rows):
            if isinstance(row, EvaluationRow):
                p, m, s = row.prompt_tokens, row.model, row.score
            else:
                try:
                    p, m, s = row
                except (TypeError, ValueError):
                    raise EvaluationError(f"row {i}: expected (prompt_tokens, model, score), got {row!r}") from None
            checked.append(_check_row(p, m, s, f"row {i}: "))
        for r in checked:
            key = (r.model, prompt_bucket(r.prompt_tokens))
            self._n[r.model] = self._n.get(r.model, 0) + 1
            self._sum[r.model] = self._sum.get(r.model, 0.0) + r.score
            self._bn[key] = self._bn.get(key, 0) + 1
            self._bsum[key] = self._bsum.get(key, 0.0) + r.score
        return self

    def prior(self, model: str) -> float:
        return self.priors.get(model, self.default_prior)

    def model_mean(self, model: str) -> float:
        """The model's mean score over all its rows; its prior when it has none."""
        n = self._n.get(model, 0)
        return self._sum[model] / n if n else self.prior(model)

    def count(self, model: str, prompt_tokens: int | None = None) -> int:
        """Rows seen for a model (in the bucket of `prompt_tokens` when given)."""
        if prompt_tokens is None:
            return self._n.get(model, 0)
        return self._bn.get((model, prompt_bucket(prompt_tokens)), 0)

    def predict(self, model: str, prompt_tokens: int) -> float:
        """acĉ for a query of `prompt_tokens` tokens answered by `model`, in [0, 1]."""
        mean = self.model_mean(model)
        key = (model, prompt_bucket(prompt_tokens))
        n = self._bn.get(key, 0)
        if n == 0:
            return mean
        return (self.shrinkage * mean + self._bsum[key]) / (self.shrinkage + n)

    @property
    def models(self) -> list[str]:
        return sorted(self._n)

    # --- JSON edge -------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        models: dict[str, dict] = {}
        for m in sorted(self._n):
            buckets = {str(b): {"n": self._bn[(mm, b)], "sum": self._bsum[(mm, b)]}
                       for (mm, b) in sorted(self._bn) if mm == m}
            models[m] = {"n": self._n[m], "sum": self._sum[m], "buckets": buckets}
        return {"version": self.VERSION, "shrinkage": self.shrinkage, "default_prior": self.default_prior,
                "priors": dict(sorted(self.priors.items())), "models": models}

    @classmethod
    def from_dict(cls, data: Any, where: str = "accuracy table") -> "AccuracyTable":
        def bad(field: str, msg: str) -> EvaluationError:
            return EvaluationError(f"{where}: field '{field}': {msg}")

        if not isinstance(data, dict):
            raise EvaluationError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("version") != cls.VERSION:
            raise bad("version", f"{data.get('version')!r} is not supported (expected {cls.VERSION})")
        unknown = set(data) - {"version", "shrinkage", "default_prior", "priors", "models"}
        if unknown:
            raise bad(sorted(unknown)[0], "unknown field; allowed: version, shrinkage, default_prior, priors, models")
        priors = data.get("priors", {})
        if not isinstance(priors, dict):
            raise bad("priors", "expected an object of model name → prior score")
        try:
            table = cls(_num(data.get("shrinkage", 8.0)), _num(data.get("default_prior", 0.5)), priors)
        except (ValueError, TypeError) as e:
            raise EvaluationError(f"{where}: {e}") from None
        models = data.get("models", {})
        if not isinstance(models, dict):
            raise bad("models", "expected an object of model name → statistics")
        for m, st in models.items():
            f = f"models.{m}"
            if not isinstance(st, dict):
                raise bad(f, "expected an object with n, sum, buckets")
            n, s = _count(st.get("n"), bad, f"{f}.n"), _score_sum(st.get("sum"), st.get("n"), bad, f"{f}.sum")
            buckets = st.get("buckets", {})
            if not isinstance(buckets, dict):
                raise bad(f"{f}.buckets", "expected an object of bucket → {n, sum}")
            bn_total = 0
            for b, bst in buckets.items():
                fb = f"{f}.buckets.{b}"
                if not (isinstance(b, str) and b.isdigit() and int(b) >= 1):
                    raise bad(fb, "bucket keys are integers >= 1")
                if not isinstance(bst, dict):
                    raise bad(fb, "expected an object with n and sum")
                bn = _count(bst.get("n"), bad, f"{fb}.n")
                table._bn[(m, int(b))] = bn
                table._bsum[(m, int(b))] = _score_sum(bst.get("sum"), bn, bad, f"{fb}.sum")
                bn_total += bn
            if bn_total != n:
                raise bad(f"{f}.n", f"{n} rows but its buckets hold {bn_total}")
            table._n[m], table._sum[m] = n, s
        return table

    def save(self, path: str | Path) -> None:
        """Write atomically (`disagg.files.atomic_write`): a reader never sees half a table."""
        with atomic_write(path) as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | Path) -> "AccuracyTable":
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise EvaluationError(f"{path}: no such accuracy-table file") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise EvaluationError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
        return cls.from_dict(data, str(path))


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {v!r}")
    return float(v)


def _count(v: Any, bad, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise bad(field, f"{v!r} is not an integer >= 1")
    return v


def _score_sum(v: Any, n: Any, bad, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= v <= (n if isinstance(n, int) else 0)):
        raise bad(field, f"{v!r} is not a sum of scores in [0, 1] over {n!r} rows")
    return float(v)


EVALUATION_COLUMNS = ("prompt_tokens", "model", "score")


def read_evaluations(path: str | Path) -> list[EvaluationRow]:
    """Read a CSV of evaluations with a header holding `prompt_tokens,model,score` (other columns ignored).

    Errors name the file, the line and the field: a missing column, a non-integer prompt length, a
    score that is not a number or lies outside [0, 1], an empty model name, a short row.
    """
    path = Path(path)
    try:
        f = path.open(newline="")
    except FileNotFoundError:
        raise EvaluationError(f"{path}: no such evaluations file") from None
    rows: list[EvaluationRow] = []
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise EvaluationError(f"{path}: empty; expected a header {','.join(EVALUATION_COLUMNS)}") from None
        except csv.Error as e:
            raise EvaluationError(f"{path}:{reader.line_num}: not valid CSV: {e}") from None
        names = [h.strip() for h in header]
        missing = [c for c in EVALUATION_COLUMNS if c not in names]
        if missing:
            raise EvaluationError(f"{path}:{reader.line_num}: missing column(s) {missing}; "
                                  f"the header has {names}")
        ip, im, isc = (names.index(c) for c in EVALUATION_COLUMNS)
        width = max(ip, im, isc) + 1
        while True:
            try:
                rec = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                raise EvaluationError(f"{path}:{reader.line_num}: not valid CSV: {e}") from None
            where = f"{path}:{reader.line_num}: "
            if not rec or all(not x.strip() for x in rec):
                continue  # blank line
            if len(rec) < width:
                field = min((i, c) for c, i in zip(EVALUATION_COLUMNS, (ip, im, isc)) if i >= len(rec))[1]
                raise EvaluationError(f"{where}field '{field}': missing (the row has {len(rec)} of "
                                      f"{len(names)} columns)")
            p_text, model, s_text = rec[ip].strip(), rec[im], rec[isc].strip()
            try:
                p = int(p_text)
            except ValueError:
                raise EvaluationError(f"{where}field 'prompt_tokens': {p_text!r} is not an integer") from None
            try:
                s = float(s_text)
            except ValueError:
                raise EvaluationError(f"{where}field 'score': {s_text!r} is not a number") from None
            rows.append(_check_row(p, model, s, where))
    return rows


# --- the choice ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """One instance priced for one query: its model, estimated TTFT (s), acĉ in [0, 1] and cost̂ (≥ 0)."""

    instance_id: str
    model: str
    ttft_s: float
    accuracy: float
    cost: float


@dataclass(frozen=True, slots=True)
class Query:
    """What `choose_instance` needs of a query: its TTFT limit in seconds (a positive finite number)."""

    ttft_limit_s: float
    request_id: str = ""

    def __post_init__(self) -> None:
        _check_limit(self.ttft_limit_s)


@dataclass(frozen=True, slots=True)
class CandidateTerms:
    """One candidate's terms in a choice: U = accuracy − λ·cost, feasible = ttft_s ≤ the limit."""

    instance_id: str
    model: str
    ttft_s: float
    accuracy: float
    cost: float
    utility: float
    feasible: bool

    def as_dict(self) -> dict:
        return {"instance": self.instance_id, "model": self.model, "ttft_s": round(self.ttft_s, 6),
                "accuracy": round(self.accuracy, 6), "cost": self.cost, "utility": self.utility,
                "feasible": self.feasible}


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen instance and why: every candidate's terms, in candidate order.

    `feasible=False` means no candidate met the TTFT limit and the one with the smallest estimated
    TTFT was taken instead (its utility is still reported).
    """

    instance_id: str
    model: str
    index: int
    feasible: bool
    utility: float
    lam: float
    ttft_limit_s: float
    terms: tuple[CandidateTerms, ...]

    @property
    def chosen(self) -> CandidateTerms:
        return self.terms[self.index]

    def header_value(self) -> str:
        c = self.chosen
        return (f"instance={self.instance_id}; model={self.model}; feasible={int(self.feasible)}; "
                f"ttft={c.ttft_s:.4f}; limit={self.ttft_limit_s:.4f}; acc={c.accuracy:.4f}; cost={c.cost:.6g}; "
                f"lambda={self.lam:g}; utility={c.utility:.6g}; candidates={len(self.terms)}")

    def as_dict(self) -> dict:
        return {"instance": self.instance_id, "model": self.model, "feasible": self.feasible,
                "utility": self.utility, "lambda": self.lam, "ttft_limit_s": self.ttft_limit_s,
                "candidates": [t.as_dict() for t in self.terms]}


def _check_limit(limit: Any) -> None:
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"ttft_limit must be a positive finite number of seconds, got {limit!r}")


def _check_candidate(i: int, c: Candidate) -> None:
    if math.isnan(c.ttft_s) or c.ttft_s < 0:
        raise ValueError(f"candidate {i} ({c.instance_id!r}): ttft_s must be >= 0 (inf: cannot serve), got {c.ttft_s!r}")
    if not (0.0 <= c.accuracy <= 1.0):
        raise ValueError(f"candidate {i} ({c.instance_id!r}): accuracy must be in [0, 1], got {c.accuracy!r}")
    if not (math.isfinite(c.cost) and c.cost >= 0.0):
        raise ValueError(f"candidate {i} ({c.instance_id!r}): cost must be a finite number >= 0, got {c.cost!r}")


def choose_instance(candidates: Sequence[Candidate], query: Query, lam: float) -> Choice:
    """argmax over candidates with ttft_s ≤ query.ttft_limit_s of U = accuracy − lam·cost.

    Ties go to the first candidate. When no candidate meets the limit, the one with the smallest
    estimated TTFT is chosen (first on ties) and the Choice says `feasible=False`: the query is
    served as fast as the fleet can, rather than refused. Raises ValueError naming 'lambda' for a
    λ that is negative, NaN or infinite, naming 'ttft_limit' for a limit that is not a positive
    finite number, and NoCapacity for an empty candidate list.
    """
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (math.isfinite(lam) and lam >= 0.0):
        raise ValueError(f"lambda must be a finite number >= 0, got {lam!r}")
    limit = query.ttft_limit_s
    _check_limit(limit)
    if not candidates:
        raise NoCapacity("no candidate instances for the query")
    terms = []
    best, best_u, fastest = -1, -math.inf, 0
    for i, c in enumerate(candidates):
        _check_candidate(i, c)
        u = c.accuracy - lam * c.cost
        ok = c.ttft_s <= limit
        terms.append(CandidateTerms(c.instance_id, c.model, c.ttft_s, c.accuracy, c.cost, u, ok))
        if ok and u > best_u:
            best, best_u = i, u
        if c.ttft_s < candidates[fastest].ttft_s:
            fastest = i
    feasible = best >= 0
    k = best if feasible else fastest
    t = terms[k]
    return Choice(t.instance_id, t.model, k, feasible, t.utility, float(lam), float(limit), tuple(terms))
