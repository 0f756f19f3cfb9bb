"""The precision modes (`precision.mode`), one row each: what a mode computes in, what its weights, gradients and
masters are, whether it scales the loss, which peak FLOPs it counts against. Everything that depends on the mode
asks its row (the runtime's Precision, the estimator's bytes, the peaks, the planner) instead of comparing names,
as the data-parallel strategies do (kiln.parallel.strategy).

    mode("bf16").autocast            torch.bfloat16 (None: no autocast)
    mode("bf16-master").masters      True: fp32 masters beside bf16 weights
    MODES                            every value precision.mode takes: AUTO and the concrete modes

Pure data beside torch's dtypes: imports nothing from kiln, so every layer reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AUTO = "auto"  # not a mode: kiln.perf.hardware picks a concrete one for the device (bf16 where measured faster)


@dataclass(frozen=True)
class Mode:
    name: str
    param_dtype: torch.dtype = torch.float32  # the model's parameters
    autocast: torch.dtype | None = None  # torch.autocast's dtype; None: no autocast
    loss_scaling: bool = False  # dynamic loss scaling (fp16's narrow exponent)
    masters: bool = False  # fp32 master weights beside half-precision parameters (kiln's MasterWeights)
    tf32: bool = False  # CUDA matmuls and convolutions in TF32 (allow_tf32); CUDA only
    fp8: bool = False  # the block linears run torchao's float8 matmuls (CUDA capability ≥ 8.9)
    fsdp_gather: torch.dtype | None = None  # under FSDP2: its MixedPrecisionPolicy gathers parameters in this dtype
    #                                         (bf16 only: fp16 and fp8 gather fp32 shards as they are)
    frozen_dtype: torch.dtype | None = None  # parameters that take no gradient (a LoRA base) are stored in this
    #                                           dtype; None: param_dtype. bf16 modes: 2 B each, no autocast copy
    peak: str = "fp32"  # the datasheet peak a device's FLOPs are counted against (fp8: bf16's, as torchao reports)
    half: str = ""  # the half-precision dtype its matmuls run in ("bf16", "fp16"); "" for full precision
    matmul: torch.dtype = torch.float32  # the elements its matmuls multiply (kiln plan --calibrate times them)
    cpu_matmul: torch.dtype | None = torch.float32  # dtype of its matmuls on a CPU; None: it does not run on one
    # bytes per element, for the estimator (kiln.memory.estimate.Numerics)
    param_bytes: int = 4
    grad_bytes: int = 4
    master_bytes: int = 0
    residual_bytes: int = 4  # the residual stream between blocks
    compute_bytes: int = 4  # matmul outputs and what attention and the MLP make of them

    @property
    def frozen(self) -> torch.dtype:
        """The dtype a frozen parameter is stored in."""
        return self.frozen_dtype or self.param_dtype

    @property
    def frozen_bytes(self) -> int:
        """Bytes per frozen parameter (the estimator's LoRA base)."""
        return self.frozen.itemsize

    @property
    def plain_fp32(self) -> bool:
        """fp32 parameters and products, no autocast, no TF32: what oneDNN's fp32 linears can replace."""
        return self.param_dtype == torch.float32 and self.autocast is None and not self.tf32


MODE_LIST = (
    Mode("fp32"),
    Mode("tf32", tf32=True, peak="tf32", cpu_matmul=None),
    Mode("bf16", autocast=torch.bfloat16, fsdp_gather=torch.bfloat16, frozen_dtype=torch.bfloat16, peak="bf16",
         half="bf16", matmul=torch.bfloat16, cpu_matmul=torch.bfloat16, compute_bytes=2),
    Mode("fp16", autocast=torch.float16, loss_scaling=True, peak="fp16", half="fp16", matmul=torch.float16,
         cpu_matmul=torch.float16, compute_bytes=2),
    Mode("bf16-master", param_dtype=torch.bfloat16, masters=True, peak="bf16", half="bf16",
         matmul=torch.bfloat16, cpu_matmul=torch.bfloat16, param_bytes=2, grad_bytes=2, master_bytes=4, residual_bytes=2, compute_bytes=2),
    # torchao's float8 linears; everything else runs as under bf16 autocast
    Mode("fp8", autocast=torch.bfloat16, fp8=True, frozen_dtype=torch.bfloat16, peak="bf16", half="bf16",
         matmul=torch.bfloat16, cpu_matmul=None, compute_bytes=2),
    Mode("fp64", param_dtype=torch.float64, peak="fp64", matmul=torch.float64, cpu_matmul=torch.float64, param_bytes=8, grad_bytes=8,
         residual_bytes=8, compute_bytes=8),  # reference runs: everything in float64
)
PRECISIONS: dict[str, Mode] = {m.name: m for m in MODE_LIST}
MODES = (AUTO, *PRECISIONS)


def mode(name: str) -> Mode:
    """The row of a concrete mode; AUTO or an unknown name is an error naming the known ones."""
    if name not in PRECISIONS:
        raise ValueError(f"precision.mode={name!r} is not a concrete mode; use one of {', '.join(PRECISIONS)}"
                         + (" (auto is resolved for a device first: kiln.perf.hardware.resolve_mode)"
                            if name == AUTO else ""))
    return PRECISIONS[name]


def is_auto(name: str) -> bool:
    return name == AUTO
