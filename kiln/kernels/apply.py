"""Swap a built model's norms, activations, attention core, RoPE and loss for the Triton kernels.

The model is edited from outside, submodule by submodule; torch and every other library stay untouched. The
swapped modules hold the original Parameter objects, so optimizer state and state_dict keys do not change.
Resolving model.kernels needs no Triton; the kernels are imported only when a swap is actually made.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

import kiln.kernels as ops
from kiln.kernels.utils import interpret_env
from kiln.models.transformer import IGNORE_INDEX, SDPA, LMLoss, RMSNorm, Rotary, SwiGLU

BACKENDS = ("torch", "triton", "auto")


def triton_available() -> bool:
    return ops.HAS_TRITON


# The GPUs the kernels' launch configurations are checked for (compiled for sm_80, sm_89 and sm_90 by
# tests/kernels/test_kernels_gpu_launches.py). Older cards have less shared memory per block than some launches
# need: 16-bit flash attention at head dim 128 takes 128 KiB in its backward, a V100 block gets 96 KiB.
MIN_CAPABILITY = (8, 0)


def _capability_ok(device: torch.device) -> tuple[bool, tuple[int, int] | None]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return True, None  # resolving for a GPU this process does not see (planning, tests): assume a new one
    capability = torch.cuda.get_device_capability(device)
    return capability >= MIN_CAPABILITY, capability


def resolve_kernels(kernels: str, device: torch.device | str) -> str:
    """"torch" or "triton" for model.kernels on `device`; explains the fix when Triton cannot run there."""
    device = torch.device(device)
    if kernels not in BACKENDS:
        raise ValueError(f"model.kernels={kernels!r} is unknown; use one of {BACKENDS}")
    if kernels == "torch":
        return "torch"
    supported, capability = _capability_ok(device)
    if kernels == "auto":
        return "triton" if device.type == "cuda" and supported and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("model.kernels='triton' needs the triton package: pip install 'kiln[triton]' "
                           "(or use model.kernels='auto', which falls back to torch)")
    if not supported:
        raise RuntimeError(f"model.kernels='triton' needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                           f"or newer (Ampere and later GPUs); this GPU is "
                           f"{capability[0]}.{capability[1]}: use model.kernels='torch' or 'auto'")
    if device.type in ("cuda", "meta"):
        return "triton"
    if device.type == "cpu" and interpret_env():
        return "triton"  # Triton's interpreter: numpy on the CPU, for tests (slow)
    raise RuntimeError(f"model.kernels='triton' runs on CUDA; on {device.type} only through Triton's interpreter: "
                       f"set TRITON_INTERPRET=1 in the environment before starting (slow, meant for tests), or "
                       f"use model.kernels='auto' or 'torch'")


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
    LMLoss: lambda m: ops.FusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum"),
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
        raise ValueError(f"kernels='triton' replaces attention with FlashAttention, which has no dropout, but "
                         f"{dropout[0]} has dropout {model.get_submodule(dropout[0]).dropout}; set model.dropout=0 "
                         f"or use kernels='torch'")
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
