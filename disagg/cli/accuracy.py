"""`disagg accuracy train|synth`: the accuracy estimator of latency-aware routing."""

from __future__ import annotations

import argparse
import math

from disagg.user_input import UsageError


def cmd_accuracy_train(args) -> int:
    """Train an AccuracyTable from an evaluations CSV; every row is checked before anything is written."""
    from disagg.core.utility import AccuracyTable, EvaluationError, read_evaluations

    if not (args.shrinkage >= 0 and math.isfinite(args.shrinkage)):
        raise UsageError(f"--shrinkage must be a finite number >= 0, got {args.shrinkage!r}")
    if not (0.0 <= args.default_prior <= 1.0):
        raise UsageError(f"--default-prior must be in [0, 1], got {args.default_prior!r}")
    try:
        rows = read_evaluations(args.evaluations)
        if not rows:
            raise UsageError(f"{args.evaluations}: no evaluation rows (only a header)")
        table = AccuracyTable(shrinkage=args.shrinkage, default_prior=args.default_prior).train(rows)
    except EvaluationError as e:
        raise UsageError(str(e)) from None
    table.save(args.out)
    per_model = ", ".join(f"{m}: {table.count(m)} rows, mean {table.model_mean(m):.3f}" for m in table.models)
    print(f"wrote {args.out} ({len(rows)} evaluations; {per_model})")
    return 0


def cmd_accuracy_synth(args) -> int:
    from disagg.sim.synthetic_accuracy import synthetic_evaluations, write_evaluations

    if args.rows_per_model < 1:
        raise UsageError(f"--rows-per-model must be >= 1, got {args.rows_per_model}")
    rows = synthetic_evaluations(args.rows_per_model, args.seed)
    write_evaluations(args.out, rows)
    print(f"wrote {args.out} ({len(rows)} SYNTHETIC evaluations, seed {args.seed})")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`accuracy` and its subcommands."""
    acc = sub.add_parser("accuracy", help="the accuracy estimator of latency-aware routing: train it, or make "
                                          "synthetic evaluations")
    accs = acc.add_subparsers(dest="accuracy_command", required=True)
    at = accs.add_parser("train", help="train an accuracy table from an evaluations CSV (prompt_tokens,model,score)")
    at.add_argument("--evaluations", required=True, help="CSV with a header holding prompt_tokens, model, score")
    at.add_argument("--out", required=True, help="accuracy-table JSON to write (atomically; nothing on bad input)")
    at.add_argument("--shrinkage", type=float, default=8.0, help="rows of weight the model mean has in each bucket")
    at.add_argument("--default-prior", type=float, default=0.5, help="accuracy of a model with no rows")
    at.set_defaults(func=cmd_accuracy_train)
    asy = accs.add_parser("synth", help="write SYNTHETIC evaluations (small vs large model; see "
                                        "disagg/sim/synthetic_accuracy.py)")
    asy.add_argument("--out", required=True)
    asy.add_argument("--rows-per-model", type=int, default=1000)
    asy.add_argument("--seed", type=int, default=0)
    asy.set_defaults(func=cmd_accuracy_synth)
