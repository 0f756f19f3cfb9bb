"""`kiln train [CONFIG.toml] [--section.key=value ...] [--run-dir DIR] [--resume RUN_DIR | --auto-resume]`."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from kiln.cli.common import add_config_arguments, config_from
from kiln.config import ConfigError, describe, load_config
from kiln.parallel.watchdog import CollectiveError
from kiln.numerics.outcome import NONFINITE_EXIT
from kiln.run.lm import train
from kiln.run.oom import OOM_EXIT, OutOfMemory
from kiln.train.checkpoint import CheckpointConfig, Checkpointer


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
    p.add_argument("--auto-resume", action="store_true",
                   help="continue the run in --run-dir from its latest verified checkpoint when it has one, else "
                        "start it: one command line for every (re)start, e.g. under torchrun --max-restarts")
    p.add_argument("--force", action="store_true", help="train even when the predicted peak exceeds the free RAM "
                                                        "(CPU)")


def run(args, overrides) -> int:
    if args.auto_resume:
        if args.resume:
            raise ConfigError("--auto-resume decides by itself whether to resume; drop --resume RUN_DIR and give "
                              "--run-dir RUN_DIR")
        if not args.run_dir:
            raise ConfigError("--auto-resume needs --run-dir DIR: the directory every restart continues")
        if Checkpointer(CheckpointConfig(), Path(args.run_dir), warn=lambda msg: None).latest() is not None:
            args.resume, args.run_dir, args.config = args.run_dir, None, None  # the run's own config.toml
    if args.resume:
        if args.config:
            raise ConfigError("--resume reads the run's own config.toml; pass overrides, not a CONFIG file")
        if args.run_dir and Path(args.run_dir) != Path(args.resume):
            raise ConfigError("--resume RUN_DIR continues in RUN_DIR itself; drop --run-dir")
        run_dir = Path(args.resume)
        if not (run_dir / "config.toml").exists():
            raise ConfigError(f"{run_dir} has no config.toml; is it a kiln run directory?")
        args.config = _run_config(run_dir)
        cfg = config_from(args, overrides)
        _same_model(load_config(args.config).model, cfg.model)
    else:
        cfg = config_from(args, overrides)
        run_dir = Path(args.run_dir or f"runs/{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"run directory: {run_dir}")
    try:
        result = train(cfg, run_dir, resume=bool(args.resume), force=args.force)
    except OutOfMemory:  # the report is printed
        return OOM_EXIT
    except CollectiveError as e:  # a rank died or hung: every rank says so, and exits for torchrun to restart
        print(f"kiln train: error: {e}", file=sys.stderr, flush=True)
        return 1
    if result.signal is None and result.failure:
        print(f"kiln train: error: {result.failure}", file=sys.stderr)
        return NONFINITE_EXIT
    return 128 + result.signal if result.signal is not None else 0  # 143 SIGTERM, 130 SIGINT, 138 SIGUSR1


def _same_model(saved, asked) -> None:
    """A checkpoint loads only into the shape it was saved from: say so before building anything."""
    changed = [f"--model.{f.name}={getattr(asked, f.name)} (the run has {getattr(saved, f.name)})"
               for f in dataclasses.fields(saved) if getattr(saved, f.name) != getattr(asked, f.name)]
    if changed:
        raise ConfigError(f"--resume keeps the run's model, but {', '.join(changed)}; drop the model overrides, or "
                          f"train the new shape in a new --run-dir")


def _run_config(run_dir: Path) -> Path:
    """The run's config.toml; when it is damaged, the copy in its latest verified checkpoint (said in one line)."""
    path = run_dir / "config.toml"
    try:
        load_config(path)
        return path
    except ConfigError as e:
        latest = Checkpointer(CheckpointConfig(), run_dir, warn=lambda msg: None).latest()
        if latest is None or not (latest / "config.toml").is_file():
            raise
        print(f"kiln train: {e}; resuming with the copy in {latest.name}/config.toml", file=sys.stderr)
        return latest / "config.toml"
