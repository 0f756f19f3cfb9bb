"""`kiln train [CONFIG.toml] [--section.key=value ...] [--run-dir DIR] [--resume RUN_DIR]`."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from kiln.cli.common import add_config_arguments, config_from
from kiln.config import ConfigError, describe
from kiln.run.lm import train


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model (default: the nano GPT on the Python standard library, 120 s of steps)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model. Every config key can be set in CONFIG.toml or overridden as --section.key=value.",
        epilog="config keys (default, description):\n" + describe(),
    )
    add_config_arguments(p)
    p.add_argument("--run-dir", help="where config, metrics, checkpoints go (default runs/PRESET-TIME)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")


def run(args, overrides) -> int:
    if args.resume:
        if args.config:
            raise ConfigError("--resume reads the run's own config.toml; pass overrides, not a CONFIG file")
        if args.run_dir and Path(args.run_dir) != Path(args.resume):
            raise ConfigError("--resume RUN_DIR continues in RUN_DIR itself; drop --run-dir")
        run_dir = Path(args.resume)
        if not (run_dir / "config.toml").exists():
            raise ConfigError(f"{run_dir} has no config.toml; is it a kiln run directory?")
        args.config = run_dir / "config.toml"
        cfg = config_from(args, overrides)
    else:
        cfg = config_from(args, overrides)
        run_dir = Path(args.run_dir or f"runs/{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"run directory: {run_dir}")
    result = train(cfg, run_dir, resume=bool(args.resume))
    return 128 + result.signal if result.signal is not None else 0  # 143 SIGTERM, 130 SIGINT, 138 SIGUSR1
