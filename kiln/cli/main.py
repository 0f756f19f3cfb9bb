"""The `kiln` command: one entry point, one subcommand per question, one module per subcommand."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from kiln.config import ConfigError

# Each module defines add_parser(subparsers) and run(args, overrides) -> exit code.
COMMANDS = {
    "train": "kiln.cli.train",
    "sample": "kiln.cli.sample",
    "memory": "kiln.cli.memory",
    "plan": "kiln.cli.plan",
    "doctor": "kiln.cli.doctor",
    "checkpoints": "kiln.cli.checkpoints",
    "report": "kiln.cli.report",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Train transformer language models on one GPU or a CPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv=None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    try:
        return importlib.import_module(COMMANDS[args.command]).run(args, extra)
    except (ConfigError, FileExistsError, FileNotFoundError, ValueError) as e:
        if os.environ.get("KILN_DEBUG"):
            raise
        print(f"kiln {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only directory, a full disk, a path that is a file: one line, not a traceback
        if os.environ.get("KILN_DEBUG"):
            raise
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"kiln {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kiln ... | head`: the reader has gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
