"""Cross-entropy over logits (N, V) with integer targets (N,), ignore_index and label smoothing ε.

Per row, with lse = log Σ_j exp(x_j) found by an online softmax over blocks of the vocabulary:
    loss = lse - (1 - ε) · x_target - ε/V · Σ_j x_j          (ε = 0: lse - x_target)
    dloss/dx_j = softmax_j - ε/V - (1 - ε) · [j = target]
Rows whose target is ignore_index have loss 0 and gradient 0. The gradient is written during the forward (a
second sweep over the row, while it is still in cache), already divided by the number of valid targets for
reduction="mean"; the backward only multiplies it by the incoming scalar. No [N, V] softmax is kept.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl

from kiln.errors import KilnError
from kiln.kernels.utils import check_device, gpu_tiles

REDUCTIONS = ("mean", "sum")


@triton.jit
def _cross_entropy_fwd_kernel(Logits, stride_l, Grad, stride_g, Target, Loss, NValid, V, ignore_index, smoothing,
                              COMPUTE_GRAD: tl.constexpr, MEAN: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31 at 32k tokens x 128k vocabulary
    target = tl.load(Target + row)
    logits = Logits + row * stride_l
    grad = Grad + row * stride_g
    if target == ignore_index:
        tl.store(Loss + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                tl.store(grad + cols, tl.zeros([BLOCK_V], dtype=tl.float32).to(Grad.dtype.element_ty),
                         mask=cols < V)
        return
    # Sweep 1: running max m and running Σ exp(x - m), rescaled whenever the max grows. Every term is a
    # difference of nearby logits: at logits around 1e4, lse - x_target in fp32 would lose up to 5e-4 (half an
    # ulp at 1e4).
    x_target = tl.load(logits + target).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    d = tl.zeros([], dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)  # Σ_j (x_j - x_target), for label smoothing
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(logits + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        total += tl.sum(tl.where(mask, x - x_target, 0.0), axis=0)
    # lse - (1-ε)·x_t - ε·mean(x) = log d + (m - x_t) - ε/V · Σ_j (x_j - x_t)
    tl.store(Loss + row, tl.log(d) + (m - x_target) - smoothing / V * total)
    if COMPUTE_GRAD:
        inv_d = 1.0 / d
        scale = 1.0
        if MEAN:
            scale = 1.0 / tl.load(NValid)
        # Sweep 2: the gradient, written over `Grad` (which may be the logits themselves). softmax as
        # exp(x - m) / d rather than exp(x - lse), for the same reason as above.
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            x = tl.load(logits + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - m) * inv_d - smoothing / V
            g = tl.where(cols == target, g - (1.0 - smoothing), g)
            tl.store(grad + cols, (g * scale).to(Grad.dtype.element_ty), mask=mask)


def vocab_block(V: int, device: torch.device) -> int:
    # CUDA: 4096 per block with 8 warps = 16 fp32 values per thread, 8-32 blocks per row at vocabularies 32k-128k
    # (not tuned). Interpreter: 64, so the odd test vocabularies span several blocks and exercise the online
    # rescaling.
    return min(triton.next_power_of_2(V), 4096 if gpu_tiles(device) else 64)


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor | None,
                       n_valid: torch.Tensor, ignore_index: int, label_smoothing: float, mean: bool,
                       block_v: int | None = None) -> None:
    """Per-row losses into `loss` (fp32, N) and, when `grad` is given, the scaled gradient into it.

    `grad` may be `logits` itself (fused linear cross-entropy overwrites its logits chunk). `n_valid` is a
    one-element fp32 tensor on the device, read by the kernel: no host synchronisation.
    """
    N, V = logits.shape
    if logits.stride(-1) != 1:
        raise KilnError("cross_entropy: logits need a unit stride along the vocabulary", key="logits",
                        value=tuple(logits.stride()), fix="pass logits.contiguous()")
    block = block_v or vocab_block(V, logits.device)
    _cross_entropy_fwd_kernel[(N,)](
        logits, logits.stride(0), grad if grad is not None else logits, grad.stride(0) if grad is not None else 0,
        target, loss, n_valid, V, ignore_index, label_smoothing, COMPUTE_GRAD=grad is not None, MEAN=mean,
        BLOCK_V=block, num_warps=8 if gpu_tiles(logits.device) else 1)


def _check(logits, target, label_smoothing, reduction):
    check_device(logits, target, kernel=_cross_entropy_fwd_kernel)
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise KilnError(f"cross_entropy: logits (N, V) and target (N,), got {tuple(logits.shape)} and "
                        f"{tuple(target.shape)}", key="logits" if logits.dim() != 2 else "target",
                        value=tuple(logits.shape) if logits.dim() != 2 else tuple(target.shape),
                        fix="give logits (N, V) and target (N,)")
    if not 0.0 <= label_smoothing <= 1.0:
        raise KilnError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}",
                        key="label_smoothing", value=label_smoothing, fix="give a value in [0, 1]")
    if reduction not in REDUCTIONS:
        raise KilnError(f"cross_entropy: reduction={reduction!r}; use one of {REDUCTIONS}", key="reduction",
                        value=reduction, fix=f"use one of {REDUCTIONS}")


def valid_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Valid targets as a one-element fp32 device tensor, at least 1 (an all-ignored batch gives loss 0)."""
    return (target != ignore_index).sum().clamp(min=1).to(torch.float32).reshape(1)


def cross_entropy_forward(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                          compute_grad=True, block_v=None):
    """(fp32 loss, gradient of the loss w.r.t. logits in logits' dtype or None)."""
    _check(logits, target, label_smoothing, reduction)
    N = logits.shape[0]
    n_valid = valid_count(target, ignore_index)
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if compute_grad else None
    cross_entropy_rows(logits, target.contiguous(), loss, grad, n_valid, ignore_index, label_smoothing,
                       reduction == "mean", block_v)
    total = loss.sum()
    return (total / n_valid[0] if reduction == "mean" else total), grad


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, compute_grad, block_v):
        loss, grad = cross_entropy_forward(logits, target, ignore_index, label_smoothing, reduction, compute_grad,
                                           block_v)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        (grad,) = ctx.saved_tensors
        # Out of place: calling backward twice (retain_graph=True) must not scale the saved gradient twice.
        return grad * dloss.to(grad.dtype), None, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean", *, block_v: int | None = None):
    """Cross-entropy of logits (N, V) against target (N,), in fp32.

    reduction "mean" divides by the number of targets that are not ignore_index (an all-ignored batch gives 0,
    where torch gives NaN); "sum" adds the token losses. block_v overrides the vocabulary block (tests).
    """
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    return CrossEntropyFunction.apply(logits, target, ignore_index, label_smoothing, reduction, compute_grad,
                                      block_v)


class CrossEntropyLoss(nn.Module):
    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean"):
        super().__init__()
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction

    def forward(self, logits, target):
        return cross_entropy(logits, target, self.ignore_index, self.label_smoothing, self.reduction)


def cross_entropy_reference(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    """Plain PyTorch from the formula above, in fp32 (or fp64 for fp64 logits)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = target != ignore_index
    lse = torch.logsumexp(x, dim=-1)
    x_target = x.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_row = lse - (1.0 - label_smoothing) * x_target - label_smoothing * x.mean(-1)
    total = torch.where(valid, per_row, torch.zeros_like(per_row)).sum()
    return total / valid.sum().clamp(min=1) if reduction == "mean" else total
