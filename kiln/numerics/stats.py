"""JSON-ready statistics of a tensor, finite part and non-finite count kept apart.

A DTensor (FSDP2's shards, tensor parallelism) is judged by this rank's part of it, without a collective: the
numerics trace runs these on every op, and ranks that found different things must not wait on each other.
"""
from __future__ import annotations

import math

import torch

from kiln.util import is_dtensor


@torch.no_grad()
def tensor_stats(t: torch.Tensor) -> dict:
    """shape, dtype, min / max / absmax over the finite elements, and how many elements are NaN or ±Inf (a
    DTensor: its global shape, this rank's elements)."""
    out = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    t = local(t)
    if not (t.is_floating_point() or t.is_complex()):
        if t.numel():
            out |= {"min": t.min().item(), "max": t.max().item()}
        return out
    f = t.detach().float()
    finite = torch.isfinite(f)
    n_nan, n_inf = int(torch.isnan(f).sum()), int(torch.isinf(f).sum())
    values = f[finite]
    out |= {"nonfinite": n_nan + n_inf, "nan": n_nan, "inf": n_inf, "numel": f.numel()}
    if values.numel():
        out |= {"min": values.min().item(), "max": values.max().item(), "absmax": values.abs().max().item()}
    else:
        out |= {"min": None, "max": None, "absmax": None}
    return out


def is_finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(local(t)).all())


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def json_safe(value):
    """NaN/Inf floats as strings ("nan", "inf"), recursively: strict JSON readers reject the bare tokens."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
