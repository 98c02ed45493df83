"""`disagg check-config` and `disagg tiny-model`: a command group of the `disagg` CLI, registered
through the `disagg.commands` entry point (pyproject.toml), so that `disagg` itself never imports
this package."""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg.user_input import UsageError


def cmd_check_config(args) -> int:
    from serve_app.config import ConfigError, load_serve_config

    try:
        apps = load_serve_config(args.config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for name, cfg in apps:
        pools = " + ".join(f"{pool.num_replicas} {role}" + (f" (TP {pool.tensor_parallel_size})"
                                                             if pool.tensor_parallel_size > 1 else "")
                           for role, pool in cfg.pools().items())
        cm = cfg.router.cost_model
        cm = f"{cm.get('name', '?')} (inline)" if isinstance(cm, dict) else cm
        print(f"{args.config}: application {name!r} ok: {pools} on {cfg.engine.device}, model {cfg.model.source}, "
              f"policy {cfg.router.policy}, cost model {cm}")
    return 0


def cmd_tiny_model(args) -> int:
    from serve_app.tiny_model import build_tiny_model

    print(build_tiny_model(Path(args.dest) if args.dest else None, size=args.size))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`check-config` and `tiny-model`."""
    cc = sub.add_parser("check-config", help="validate a Serve config file of this app (file:line: field errors)")
    cc.add_argument("config")
    cc.set_defaults(func=cmd_check_config)

    tm = sub.add_parser("tiny-model", help="build the offline tiny model (idempotent)")
    tm.add_argument("--dest")
    tm.add_argument("--size", default="tiny", choices=["tiny", "small"])
    tm.set_defaults(func=cmd_tiny_model)
