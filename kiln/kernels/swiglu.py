"""SwiGLU activation: y = silu(gate) · up, silu(g) = g · σ(g).

Backward, recomputing s = σ(gate) from the saved inputs instead of storing silu(gate):
    d_up   = dy · g · s
    d_gate = dy · up · s · (1 + g · (1 - s))
gate and up may be strided views (the two halves of one fc output): rows are read through their row stride,
nothing is copied.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl

from kiln.errors import KilnError
from kiln.kernels.utils import as_rows, check_device, elementwise_tile


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(G, U, DY, DG, DU, stride_g, stride_u, stride_dy, stride_dg, stride_du, M, N,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    du = dy * g * s
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(DG + rows[:, None] * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + rows[:, None] * stride_du + cols[None, :], du.to(DU.dtype.element_ty), mask=mask)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_device(gate, up, kernel=_swiglu_fwd_kernel)
    if gate.shape != up.shape:
        raise KilnError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape", key="up",
                        value=tuple(up.shape), fix="give gate and up of one shape")
    g2, u2 = as_rows(gate), as_rows(up)
    M, N = g2.shape
    y = torch.empty((M, N), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    block_m, block_n, warps = elementwise_tile(N, gate.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _swiglu_fwd_kernel[grid](g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), M, N, BLOCK_M=block_m,
                             BLOCK_N=block_n, num_warps=warps)
    return y.view(gate.shape)


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(d_gate, d_up) in the dtypes of gate and up."""
    g2, u2, dy2 = as_rows(gate), as_rows(up), as_rows(dy)
    M, N = g2.shape
    dg = torch.empty((M, N), dtype=gate.dtype, device=gate.device)
    du = torch.empty((M, N), dtype=up.dtype, device=up.device)
    block_m, block_n, warps = elementwise_tile(N, gate.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _swiglu_bwd_kernel[grid](g2, u2, dy2, dg, du, g2.stride(0), u2.stride(0), dy2.stride(0), dg.stride(0),
                             du.stride(0), M, N, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return dg.view(gate.shape), du.view(up.shape)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)  # the inputs only: the backward recomputes σ(gate)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dy, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, computed in fp32, output in the inputs' dtype."""
    return SwiGLUFunction.apply(gate, up)


class SwiGLU(nn.Module):
    """Drop-in for kiln.models.transformer.SwiGLU: forward(gate, up)."""

    def forward(self, gate, up):
        return swiglu(gate, up)

    def extra_repr(self) -> str:
        return "kernel=triton"


def swiglu_reference(gate, up):
    """Plain PyTorch, in fp32 (or fp64 for fp64 inputs), output in the inputs' dtype."""
    dtype = torch.promote_types(gate.dtype, up.dtype)
    g = gate.to(torch.promote_types(dtype, torch.float32))
    return (g * torch.sigmoid(g) * up.to(g.dtype)).to(dtype)
