"""RMSNorm over the last dimension: y = x * rstd * w, rstd = 1 / sqrt(mean(x²) + eps).

Backward, per row with x̂ = x * rstd and g = dy * w:
    dx = rstd * (g - x̂ * mean(g * x̂))
    dw = Σ_rows dy * x̂
dw is summed per program over a slice of rows into fp32 partials, then the partials are summed in a second
pass: the same inputs give the same bits (no atomics).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl

from kiln.kernels.utils import as_rows, check_device, partial_programs, row_tile


@triton.jit
def _rms_norm_fwd_kernel(X, Y, W, Rstd, stride_x, stride_y, M, N, eps,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows*stride passes 2^31
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None] * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(X, W, Rstd, DY, DX, DW_partial, stride_x, stride_dy, stride_dx, M, N, rows_per_program,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w
        c_xhat = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * c_xhat[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_partial + pid * N + cols, dw, mask=col_ok)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """y in x's dtype, and rstd per row in fp32 for the backward."""
    check_device(x, weight, kernel=_rms_norm_fwd_kernel)
    x2 = as_rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    block_m, block_n, warps = row_tile(N, x.device)
    _rms_norm_fwd_kernel[(triton.cdiv(M, block_m),)](x2, y, weight, rstd, x2.stride(0), y.stride(0), M, N, eps,
                                                     BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return y.view(x.shape), rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """(dx, dw); dw comes back in the weight's dtype."""
    x2, dy2 = as_rows(x), as_rows(dy)
    M, N = x2.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m, block_n, warps = row_tile(N, x.device)
    rows_per_program = block_m * triton.cdiv(M, block_m * partial_programs(M, x.device))
    programs = triton.cdiv(M, rows_per_program)
    dw_partial = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](x2, weight, rstd, dy2, dx, dw_partial, x2.stride(0), dy2.stride(0),
                                      dx.stride(0), M, N, rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n,
                                      num_warps=warps)
    # Second pass: the partials summed in a fixed order, so dw is bitwise reproducible.
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension, statistics in fp32, output in x's dtype."""
    return RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """Drop-in for kiln.models.transformer.RMSNorm: `.weight` and `.eps`."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @classmethod
    def from_torch(cls, module: nn.Module) -> "RMSNorm":
        """A kernel RMSNorm holding `module`'s own weight Parameter (optimizer and state_dict keys unchanged)."""
        with torch.device("meta"):
            new = cls(module.weight.shape[0], module.eps)
        new.weight = module.weight
        return new

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, kernel=triton"


def rms_norm_reference(x, weight, eps: float = 1e-6):
    """Plain PyTorch, statistics in fp32 (or fp64 for fp64 inputs), output in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(xf.dtype)).to(x.dtype)
