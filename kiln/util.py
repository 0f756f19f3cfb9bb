"""Helpers every package may use; imports nothing from kiln."""
from __future__ import annotations

import difflib


def closest(name: str, choices) -> str | None:
    """The valid name nearest to a misspelt one (None when nothing is close)."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.4)
    return match[0] if match else None
