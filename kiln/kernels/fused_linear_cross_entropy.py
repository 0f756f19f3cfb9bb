"""Output projection + cross-entropy without the [tokens × vocab] logits: loss(x·Wᵀ + b, target).

Tokens go through in chunks of n rows. Per chunk, during the forward:
    Z  = x_c · Wᵀ + b                      (n, V) in the compute dtype, the only logits that exist
    G  = dloss/dZ                          written over Z by the cross-entropy kernel (softmax - onehot, scaled)
    dx_c = G · W                           (n, C)
    dW  += Gᵀ · x_c,  db += Σ_rows G       accumulated in fp32 across chunks
The backward multiplies the stored dx, dW, db by the incoming scalar. Peak extra memory is one (n, V) chunk
plus the fp32 dW, instead of eager's (N, V) logits, their fp32 copy and their gradient.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton

from kiln.errors import KilnError
from kiln.kernels.cross_entropy import (REDUCTIONS, _cross_entropy_fwd_kernel, cross_entropy_reference,
                                        cross_entropy_rows, valid_count)
from kiln.kernels.utils import autocast_dtype, check_device


def default_chunk(N: int, C: int, V: int) -> int:
    # A chunk of logits about the size of x itself: n·V ≈ N·C. At 32k tokens, C=4096, V=128256 that is 1024
    # rows (256 MB of bf16 logits against eager's 8 GB); never below 64 rows, so the matmuls stay tall.
    return max(64, triton.next_power_of_2(triton.cdiv(N, triton.cdiv(V, C))))


def fused_linear_cross_entropy_forward(x, weight, target, bias, ignore_index, label_smoothing, reduction,
                                       compute_dtype, needs_grad, chunk_size=None, block_v=None):
    """(fp32 loss, dx, dW, db) with the gradients None when not needed; gradients in the inputs' dtypes."""
    check_device(x, weight, target, bias, kernel=_cross_entropy_fwd_kernel)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or target.shape != x.shape[:1]:
        raise KilnError(f"fused_linear_cross_entropy: x (N, C), weight (V, C), target (N,); got "
                        f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}", key="x",
                        value=tuple(x.shape), fix="give x (N, C), weight (V, C) and target (N,)")
    if reduction not in REDUCTIONS:
        raise KilnError(f"fused_linear_cross_entropy: reduction={reduction!r}; use one of {REDUCTIONS}",
                        key="reduction", value=reduction, fix=f"use one of {REDUCTIONS}")
    N, C = x.shape
    V = weight.shape[0]
    dx_needed, dw_needed, db_needed = needs_grad
    chunk = chunk_size or default_chunk(N, C, V)
    target = target.contiguous()
    n_valid = valid_count(target, ignore_index)
    loss = torch.empty(N, dtype=torch.float32, device=x.device)
    w = weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    any_grad = dx_needed or dw_needed or db_needed
    dx = torch.empty_like(x) if dx_needed else None
    dw = torch.zeros(V, C, dtype=torch.float32, device=x.device) if dw_needed else None
    db = torch.zeros(V, dtype=torch.float32, device=x.device) if db_needed else None
    for start in range(0, N, chunk):
        end = min(start + chunk, N)
        xc = x[start:end].to(compute_dtype)
        logits = torch.addmm(b, xc, w.t()) if b is not None else xc @ w.t()  # (n, V)
        cross_entropy_rows(logits, target[start:end], loss[start:end], logits if any_grad else None, n_valid,
                           ignore_index, label_smoothing, reduction == "mean", block_v)
        if dx_needed:
            dx[start:end] = logits @ w  # (n, C)
        if dw_needed:
            if logits.dtype == torch.float32:
                dw.addmm_(logits.t(), xc)
            else:  # the chunk's product in the compute dtype (fp32 accumulation inside the matmul), summed in fp32
                dw += (logits.t() @ xc).float()
        if db_needed:
            db += logits.sum(0, dtype=torch.float32)
    total = loss.sum()
    return (total / n_valid[0] if reduction == "mean" else total), dx, dw, db


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, bias, ignore_index, label_smoothing, reduction, compute_dtype, needs_grad,
                chunk_size, block_v):
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen by the caller
            loss, dx, dw, db = fused_linear_cross_entropy_forward(
                x, weight, target, bias, ignore_index, label_smoothing, reduction, compute_dtype, needs_grad,
                chunk_size, block_v)
        ctx.save_for_backward(dx, dw, db)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        dx, dw, db = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        dx = dx * dloss.to(dx.dtype) if dx is not None else None
        dw = (dw * dloss).to(w_dtype) if dw is not None else None
        db = (db * dloss).to(b_dtype) if db is not None else None
        return dx, dw, None, db, None, None, None, None, None, None, None


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean", *,
                               chunk_size: int | None = None, block_v: int | None = None) -> torch.Tensor:
    """cross_entropy(x·Wᵀ + b, target) in fp32 without materialising the logits of all tokens.

    x (N, C), weight (V, C), target (N,). Under torch.autocast the projection runs in the autocast dtype, as
    F.linear would; otherwise in x's dtype. reduction "mean" divides by the valid targets (0 when none), "sum"
    adds token losses. chunk_size (tokens per chunk) and block_v (vocabulary block) override the defaults.
    """
    compute_dtype = autocast_dtype(x.device) or torch.promote_types(x.dtype, weight.dtype)
    grad = torch.is_grad_enabled()
    needs_grad = (grad and x.requires_grad, grad and weight.requires_grad,
                  grad and bias is not None and bias.requires_grad)
    return FusedLinearCrossEntropyFunction.apply(x, weight, target, bias, ignore_index, label_smoothing, reduction,
                                                 compute_dtype, needs_grad, chunk_size, block_v)


class FusedLinearCrossEntropyLoss(nn.Module):
    """forward(x, weight, target, bias=None); with reduction="sum" a drop-in for kiln's LMLoss."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean"):
        super().__init__()
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction

    def forward(self, x, weight, target, bias=None):
        return fused_linear_cross_entropy(x, weight, target, bias, self.ignore_index, self.label_smoothing,
                                          self.reduction)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, kernel=triton"


def fused_linear_cross_entropy_reference(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                                         reduction="mean"):
    """Plain PyTorch: the full logits, then cross-entropy in fp32 (or fp64 for fp64 inputs)."""
    logits = x @ weight.t() + (bias if bias is not None else 0)
    return cross_entropy_reference(logits, target, ignore_index, label_smoothing, reduction)
