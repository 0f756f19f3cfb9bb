"""LayerNorm over the last dimension: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps).

Backward, per row with x̂ = (x - mean) * rstd and g = dy * w:
    dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))
    dw = Σ_rows dy * x̂,  db = Σ_rows dy
dw and db are summed per program over a slice of rows into fp32 partials, then the partials are summed in a
second pass: the same inputs give the same bits (no atomics).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl

from kiln.errors import KilnError
from kiln.kernels.utils import as_rows, check_device, partial_programs, row_tile


@triton.jit
def _layer_norm_fwd_kernel(X, Y, W, B, Mean, Rstd, stride_x, stride_y, M, N, eps,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows*stride passes 2^31
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd[:, None] * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_bwd_kernel(X, W, Mean, Rstd, DY, DX, DW_partial, DB_partial, stride_x, stride_dy, stride_dx,
                           M, N, rows_per_program, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w
        c_xhat = tl.sum(g * xhat, axis=1) / N
        c_mean = tl.sum(g, axis=1) / N
        dx = (g - xhat * c_xhat[:, None] - c_mean[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    tl.store(DW_partial + pid * N + cols, dw, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_partial + pid * N + cols, db, mask=col_ok)


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """y in x's dtype, and mean and rstd per row in fp32 for the backward."""
    check_device(x, weight, bias, kernel=_layer_norm_fwd_kernel)
    x2 = as_rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    block_m, block_n, warps = row_tile(N, x.device)
    _layer_norm_fwd_kernel[(triton.cdiv(M, block_m),)](
        x2, y, weight, bias if bias is not None else weight, mean, rstd, x2.stride(0), y.stride(0), M, N, eps,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return y.view(x.shape), mean, rstd


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                        rstd: torch.Tensor, has_bias: bool):
    """(dx, dw, db); db is None without a bias. dw and db come back in the weight's dtype."""
    x2, dy2 = as_rows(x), as_rows(dy)
    M, N = x2.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m, block_n, warps = row_tile(N, x.device)
    rows_per_program = block_m * triton.cdiv(M, block_m * partial_programs(M, x.device))
    programs = triton.cdiv(M, rows_per_program)
    dw_partial = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    db_partial = torch.empty((programs, N), dtype=torch.float32, device=x.device) if has_bias else dw_partial
    _layer_norm_bwd_kernel[(programs,)](
        x2, weight, mean, rstd, dy2, dx, dw_partial, db_partial, x2.stride(0), dy2.stride(0), dx.stride(0), M, N,
        rows_per_program, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    # Second pass: the partials summed in a fixed order, so dw/db are bitwise reproducible.
    dw = dw_partial.sum(0).to(weight.dtype)
    db = db_partial.sum(0).to(weight.dtype) if has_bias else None
    return dx.view(x.shape), dw, db


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd, ctx.has_bias)
        return dx, dw, db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension, statistics in fp32, output in x's dtype."""
    return LayerNormFunction.apply(x, weight, bias, eps)


class LayerNorm(nn.Module):
    """Drop-in for nn.LayerNorm(dim, eps, bias=...) over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.normalized_shape, self.eps = (dim,), eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_parameter("bias", nn.Parameter(torch.zeros(dim)) if bias else None)

    @classmethod
    def from_torch(cls, module: nn.LayerNorm) -> "LayerNorm":
        """A kernel LayerNorm holding `module`'s own Parameter objects (optimizer and state_dict keys unchanged)."""
        if len(module.normalized_shape) != 1 or module.weight is None:
            raise KilnError("kiln.kernels.LayerNorm replaces LayerNorms over one dimension with a weight",
                            key="module", value=tuple(module.normalized_shape),
                            fix="keep this LayerNorm on kernels='torch'")
        with torch.device("meta"):
            new = cls(module.normalized_shape[0], module.eps, bias=False)
        new.weight, new.bias = module.weight, module.bias
        return new

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, bias={self.bias is not None}, kernel=triton"


def layer_norm_reference(x, weight, bias=None, eps: float = 1e-5):
    """Plain PyTorch, statistics in fp32 (or fp64 for fp64 inputs), output in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)
