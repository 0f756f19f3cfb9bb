"""The `kiln` command: one entry point, one subcommand per question, one module per subcommand."""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys

from kiln.cli.finish import exit_process, freeze_loaded
from kiln.errors import KilnError, one_line, traceback_wanted

# Each module defines add_parser(subparsers) and run(args, overrides) -> exit code.
COMMANDS = {
    "train": "kiln.cli.train",
    "sample": "kiln.cli.sample",
    "eval": "kiln.cli.eval",
    "memory": "kiln.cli.memory",
    "plan": "kiln.cli.plan",
    "doctor": "kiln.cli.doctor",
    "checkpoints": "kiln.cli.checkpoints",
    "estimate": "kiln.cli.estimate",
    "profile": "kiln.cli.profile",
    "data": "kiln.cli.data",
    "export": "kiln.cli.export",
    "report": "kiln.cli.report",
}


# `--section.key=value`: taken out of argv before argparse sees it, because argparse reads any argument holding a
# space (`--train.sample_prompt="def f"`, a data path with a space) as a positional, i.e. as CONFIG.
OVERRIDE = re.compile(r"--[A-Za-z_]\w*\.[A-Za-z_]\w*=")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, like every other kiln error (its usage block is one --help away)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kiln", description="Train transformer language models on one GPU or a CPU.")
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, show Python's traceback instead of the one `error:` line (as KILN_TRACEBACK=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # --traceback is kiln's own flag, not a subcommand's: taken out of argv so that it works before or after CMD
    show_traceback = "--traceback" in argv or traceback_wanted()
    argv = [a for a in argv if a != "--traceback"]
    overrides = [a for a in argv if OVERRIDE.match(a)]
    args, extra = build_parser().parse_known_args([a for a in argv if not OVERRIDE.match(a)])
    extra = overrides + extra  # anything argparse did not know is an override or, if not, reported as unrecognized
    try:
        return importlib.import_module(COMMANDS[args.command]).run(args, extra)
    except BrokenPipeError:  # `kiln ... | head`: the reader has gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KilnError, ValueError, OSError) as e:  # KilnError is bad input; a bare ValueError is one not yet typed
        if show_traceback:
            raise
        print(f"kiln {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `kiln` command and `python -m kiln`: the modules loaded so far frozen out of the garbage collector's
    scans, main(), then the process ends without the interpreter's teardown once everything is flushed
    (kiln.cli.finish: ~0.3 s and ~0.4 s of CPU in a training run). main() itself freezes nothing and returns, so
    that tests and other Python code can call it."""
    freeze_loaded()
    try:
        code = main()
    except SystemExit as e:  # argparse's --help and its one-line errors
        if not isinstance(e.code, (int, type(None))):
            raise
        code = e.code or 0
    exit_process(code)


# What to do about the errors the OS reports while kiln reads or writes a path.
ERRNO_FIX = {
    errno.EEXIST: "a file is where kiln needs a directory; move it or choose another path",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another path",
    errno.EISDIR: "a directory is where kiln expects a file; give the file's path",
    errno.EACCES: "no permission; choose a directory you can write, or fix its permissions",
    errno.EPERM: "operation not permitted; choose a directory you can write",
    errno.EROFS: "read-only file system; choose a directory on a writable disk",
    errno.ENOSPC: "the disk is full; free space or choose another disk",
    errno.EDQUOT: "disk quota exceeded; free space or choose another disk",
}


def _one_line(e: Exception) -> str:
    """kiln's own messages as they are; the OS's as its meaning, the path and the fix."""
    if not isinstance(e, OSError) or e.errno is None:
        return one_line(e)
    where = f": {e.filename}" if e.filename else ""
    fix = f" ({ERRNO_FIX[e.errno]})" if e.errno in ERRNO_FIX else ""
    return f"{e.strerror or e}{where}{fix}"

if __name__ == "__main__":
    entry()
