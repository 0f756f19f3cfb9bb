"""The library's entry points as kiln/__init__.py exports them: `fit` at the error boundary.

A KilnError (bad input: a config key, an argument, a file) raised anywhere below reaches the caller with the
traceback cut at their call, its key, value and fix as attributes; KILN_TRACEBACK=1 keeps the whole traceback.
kiln.run.fit.fit itself is unwrapped, for kiln's own callers and tests.
"""
from __future__ import annotations

from kiln.errors import at_boundary
from kiln.run.fit import fit as _fit

fit = at_boundary(_fit)
