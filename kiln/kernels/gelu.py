"""GELU, tanh approximation: y = x/2 · (1 + tanh(u)), u = √(2/π) · (x + 0.044715 x³).

Since (1 + tanh(u))/2 = σ(2u), the kernels compute y = x · s with s = σ(2u); the backward recomputes s from the
saved input instead of storing it:
    dy/dx = s + x · s · (1 - s) · 2√(2/π) · (1 + 3 · 0.044715 x²)
The σ form avoids the cancellation in 1 - tanh² (and 1 - s is computed without subtraction, see _sigmoid_pair).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl

from kiln.kernels.utils import as_rows, check_device, elementwise_tile

SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715


@triton.jit
def _sigmoid_pair(z):
    # σ(z) and 1 - σ(z) = e·σ(z) with e = exp(-z), both to full relative precision: 1 - σ(z) computed by
    # subtraction is 0 in fp32 from z ≈ 17, which cost 1.9e-6 of dy/dx at x = 5. -z is capped at 80
    # (exp(80) = 5.5e34 < fp32 max), where σ is 1.8e-35: exp never overflows.
    e = tl.exp(tl.minimum(-z, 80.0))
    s = 1.0 / (1.0 + e)
    return s, e * s


@triton.jit
def _gelu_fwd_kernel(X, Y, stride_x, stride_y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, _ = _sigmoid_pair(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (x * s).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(X, DY, DX, stride_x, stride_dy, stride_dx, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, one_minus_s = _sigmoid_pair(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
    grad = s + x * s * one_minus_s * 2.0 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], (dy * grad).to(DX.dtype.element_ty), mask=mask)


def gelu_forward(x: torch.Tensor) -> torch.Tensor:
    check_device(x, kernel=_gelu_fwd_kernel)
    x2 = as_rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m, block_n, warps = elementwise_tile(N, x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gelu_fwd_kernel[grid](x2, y, x2.stride(0), y.stride(0), M, N, BLOCK_M=block_m, BLOCK_N=block_n,
                           num_warps=warps)
    return y.view(x.shape)


def gelu_backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x2, dy2 = as_rows(x), as_rows(dy)
    M, N = x2.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m, block_n, warps = elementwise_tile(N, x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gelu_bwd_kernel[grid](x2, dy2, dx, x2.stride(0), dy2.stride(0), dx.stride(0), M, N, BLOCK_M=block_m,
                           BLOCK_N=block_n, num_warps=warps)
    return dx.view(x.shape)


class GELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)  # the input only: the backward recomputes tanh
        return gelu_forward(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return gelu_backward(dy, x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (torch's approximate="tanh"), computed in fp32, output in x's dtype."""
    return GELUFunction.apply(x)


class GELU(nn.Module):
    """Drop-in for nn.GELU(approximate="tanh")."""

    def forward(self, x):
        return gelu(x)

    def extra_repr(self) -> str:
        return "approximate='tanh', kernel=triton"


def gelu_reference(x):
    """Plain PyTorch, in fp32 (or fp64 for fp64 inputs), output in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (0.5 * xf * (1.0 + torch.tanh(SQRT_2_OVER_PI * (xf + GELU_CUBIC * xf.pow(3))))).to(x.dtype)
