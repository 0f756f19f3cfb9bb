"""Helpers every package may use; imports nothing from kiln."""
from __future__ import annotations

import difflib
import sys


def closest(name: str, choices) -> str | None:
    """The valid name nearest to a misspelt one (None when nothing is close)."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.4)
    return match[0] if match else None




def format_count(n: int) -> str:
    """A count for people: 850, 5.0k, 1.2M, 3.4B (never '5e-06M')."""
    if abs(n) < 1000:
        return str(n)
    text = str(n)
    for scale, suffix in ((1e3, "k"), (1e6, "M"), (1e9, "B"), (1e12, "T")):
        value = n / scale
        text = (f"{value:.1f}" if abs(value) < 99.95 else f"{value:.0f}") + suffix
        if abs(float(text[:-1])) < 1000:
            break
    return text


def is_dtensor(x) -> bool:
    """isinstance(x, torch.distributed.tensor.DTensor) without importing it: nothing is a DTensor until that module
    is loaded (by FSDP2 or tensor parallelism), and importing it costs 1.3 s of start-up that plain runs never use."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)
