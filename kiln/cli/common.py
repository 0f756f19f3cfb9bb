"""What every config-taking subcommand shares: CONFIG.toml plus --section.key=value overrides."""
from __future__ import annotations

import argparse

from kiln.config import Config, ConfigError, load_config


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML config file ([section] tables; see `kiln train --help`)")


def config_from(args, overrides: list[str]) -> Config:
    bad = [o for o in overrides if not o.startswith("--") or "=" not in o or "." not in o.split("=")[0]]
    if bad:
        raise ConfigError(f"unrecognized arguments: {' '.join(bad)} (overrides are written --section.key=value)")
    return load_config(args.config, overrides)
