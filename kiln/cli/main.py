"""The `kiln` command: one entry point, one subcommand per question."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kiln.config import ConfigError, describe, load_config

SUBCOMMANDS = ("train", "sample")


def _config_from(args, overrides):
    """CONFIG.toml and --section.key=value overrides, the way every config-taking subcommand reads them."""
    unknown = [o for o in overrides if not o.startswith("--") or "=" not in o or "." not in o.split("=")[0]]
    if unknown:
        raise ConfigError(f"unrecognized arguments: {' '.join(unknown)} (overrides are written --section.key=value)")
    return load_config(args.config, overrides)


def cmd_train(args, overrides) -> int:
    from kiln.train.trainer import train

    if args.resume:
        if args.config:
            raise ConfigError("--resume reads the run's own config.toml; pass overrides, not a CONFIG file")
        run_dir = Path(args.resume)
        saved = run_dir / "config.toml"
        if not saved.exists():
            raise ConfigError(f"{run_dir} has no config.toml; is it a kiln run directory?")
        args.config = saved
        cfg = _config_from(args, overrides)
        # A resumed run keeps its resolved model shape; the preset is not re-applied on top of it.
    else:
        cfg = _config_from(args, overrides)
        run_dir = Path(args.run_dir or f"runs/{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"run directory: {run_dir}")
    train(cfg, run_dir, resume=bool(args.resume))
    return 0


def cmd_sample(args, overrides) -> int:
    from kiln.sample import sample_from_run

    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    text = sample_from_run(Path(args.run_dir), args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                           args.seed, args.device)
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Train transformer language models on one GPU or a CPU.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="train a model (default: the tiny GPT on the Python standard library)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model. Every config key can be set in CONFIG.toml or overridden as --section.key=value.",
        epilog="config keys (default, description):\n" + describe(),
    )
    train.add_argument("config", nargs="?", help="TOML config file ([section] tables of the keys below)")
    train.add_argument("--run-dir", help="where config, metrics, checkpoints go (default runs/PRESET-TIME)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    train.set_defaults(func=cmd_train)

    sample = sub.add_parser("sample", help="generate text from a trained run")
    sample.add_argument("run_dir", help="a run directory written by `kiln train`")
    sample.add_argument("--prompt", default="", help="text to continue")
    sample.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    sample.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0: greedy)")
    sample.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed")
    sample.add_argument("--device", default="auto", help="auto | cpu | cuda")
    sample.set_defaults(func=cmd_sample)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        return args.func(args, extra)
    except (ConfigError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"kiln {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
