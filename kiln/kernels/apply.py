"""Swap a built model's norms, activations, attention core, RoPE and loss for the Triton kernels.

The model is edited from outside, submodule by submodule; torch and every other library stay untouched. The
swapped modules hold the original Parameter objects, so optimizer state and state_dict keys do not change.
Whether the kernels run (train.kernels = torch | triton | auto on a device) is kiln.perf.hardware.resolve_kernels,
which needs no Triton.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

import kiln.kernels as ops
from kiln.errors import KilnError
from kiln.perf.hardware import resolve_kernels
from kiln.models.transformer import IGNORE_INDEX, SDPA, LMLoss, RMSNorm, Rotary, SwiGLU

def _gelu(m: nn.GELU) -> nn.Module | None:
    return ops.GELU() if m.approximate == "tanh" else None  # the kernel is the tanh approximation only


# The model's module type -> a kernel module doing the same, or None to leave that one alone. Exact types
# only: a subclass may have changed forward. Entries look the kernels up when called, so this table exists
# (and model.kernels resolves) without Triton.
SWAPS: dict[type, Callable[[nn.Module], nn.Module | None]] = {
    nn.LayerNorm: lambda m: ops.LayerNorm.from_torch(m),
    RMSNorm: lambda m: ops.RMSNorm.from_torch(m),
    nn.GELU: _gelu,
    SwiGLU: lambda m: ops.SwiGLU(),
    Rotary: lambda m: ops.RoPE(),
    SDPA: lambda m: ops.FlashAttention(dropout=m.dropout, causal=True),
    # LMLoss returns the SUM over valid targets: the trainer divides by the global batch's valid count.
    # A soft-capped head (model.logit_softcap) stays: the fused kernel has no cap.
    LMLoss: lambda m: None if m.softcap else ops.FusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX,
                                                                              reduction="sum"),
}


def apply_kernels(model: nn.Module, kernels: str = "triton", device: torch.device | str | None = None,
                  skip: tuple[type, ...] = ()) -> list[str]:
    """Swap `model`'s submodules for kernel modules when `kernels` resolves to "triton"; returns the swapped names.

    device defaults to where the model's parameters are; module types in `skip` are left alone (kiln's model
    pipeline chooses the loss itself). Attention with dropout is refused here, not at the first forward:
    FlashAttention has no dropout.
    """
    if device is None:
        device = next(model.parameters()).device
    if resolve_kernels(kernels, device) == "torch":
        return []
    dropout = [n for n, m in model.named_modules() if type(m) is SDPA and m.dropout > 0]
    if dropout:
        p = model.get_submodule(dropout[0]).dropout
        raise KilnError(f"kernels='triton' replaces attention with FlashAttention, which has no dropout, but "
                        f"{dropout[0]} has dropout {p}; set model.dropout=0 or use kernels='torch'",
                        key="model.dropout", value=p, fix="set model.dropout=0 or use kernels='torch'")
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            make = SWAPS.get(type(child)) if not isinstance(child, skip) else None
            new = make(child) if make is not None else None
            if new is not None:
                new.train(child.training)
                setattr(parent, name, new)
                swapped.append(f"{parent_name}.{name}" if parent_name else name)
    return swapped
