"""The one error type a user's bad input raises, and the one place it turns into a line.

Deep code raises a KilnError (or a subclass: ConfigError, FitInputError, SourceError, ...) that carries what was
wrong as data: `key` (the config key, flag, argument or path at fault), `value` (what was given) and `fix` (what to
do instead). It subclasses ValueError, so a caller's `except ValueError` keeps catching it. The entry points format
it once: the `kiln` command prints `kiln CMD: error: <message>` on stderr and exits 2 (kiln.cli.main), `kiln.fit`
raises it with the traceback cut at the call (`at_boundary`); `--traceback` or KILN_TRACEBACK=1 shows the whole
traceback instead. Internal invariants are not KilnErrors: they stay asserts and RuntimeErrors, with a traceback.
Imports nothing from kiln, so every package may raise it.
"""
from __future__ import annotations

import functools
import os

# KILN_DEBUG is the older name of KILN_TRACEBACK; both are honoured.
TRACEBACK_ENV = ("KILN_TRACEBACK", "KILN_DEBUG")
UNSET = object()  # `value` was not given (None is a value a user can give)


class KilnError(ValueError):
    """A user's input cannot be used. str() is the whole one-line message; `fix`, when given and not already part
    of the message, is appended after '; '."""

    def __init__(self, message: str, *, key: str | None = None, value=UNSET, fix: str | None = None):
        self.message = message
        self.key = key
        self.value = None if value is UNSET else value
        self.has_value = value is not UNSET
        self.fix = fix
        super().__init__(message if not fix or fix in message else f"{message}; {fix}")

    def fields(self) -> dict:
        """key, value and fix as keywords, to raise the same error as another KilnError type."""
        return {"key": self.key, "fix": self.fix, **({"value": self.value} if self.has_value else {})}


def traceback_wanted() -> bool:
    """Whether the user asked for tracebacks instead of one-line errors (KILN_TRACEBACK=1, or KILN_DEBUG=1)."""
    return any(os.environ.get(name, "") not in ("", "0") for name in TRACEBACK_ENV)


def one_line(e: BaseException) -> str:
    """An error's message on one line (a message holding newlines keeps its words)."""
    return " ".join(str(e).split("\n"))


def at_boundary(fn):
    """A library entry point (kiln.fit): a KilnError raised anywhere below reaches the caller with its traceback
    cut at this call, so what they see is their own line and the message; KILN_TRACEBACK=1 keeps the whole one."""

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KilnError as e:
            if traceback_wanted():
                raise
            raise e.with_traceback(None) from None

    return entry
