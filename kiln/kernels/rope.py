"""Rotary position embedding, rotate-half convention: x = [x1, x2] along the head dimension,
    y1 = x1 · cos θ - x2 · sin θ
    y2 = x2 · cos θ + x1 · sin θ
The rotation is orthogonal, so the backward rotates the gradient by -θ (the transpose):
    dx1 = dy1 · cos θ + dy2 · sin θ
    dx2 = dy2 · cos θ - dy1 · sin θ
One kernel does both, with the sign of sin θ as a compile-time flag. cos and sin are constants (no gradient).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl

from kiln.errors import KilnError
from kiln.kernels.utils import check_device, gpu_tiles


@triton.jit
def _rope_kernel(X, Y, Cos, Sin, stride_xb, stride_xh, stride_xt, stride_yb, stride_yh, stride_yt, stride_c,
                 H, T, HALF, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid_bh = tl.program_id(0)
    b, h = pid_bh // H, pid_bh % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_HALF)
    mask = (t < T)[:, None] & (d < HALF)[None, :]
    x_ptr = X + b.to(tl.int64) * stride_xb + h * stride_xh + t[:, None] * stride_xt + d[None, :]
    y_ptr = Y + b.to(tl.int64) * stride_yb + h * stride_yh + t[:, None] * stride_yt + d[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(Cos + t[:, None] * stride_c + d[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + t[:, None] * stride_c + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        sin = -sin
    tl.store(y_ptr, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + HALF, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, H, T, D = x.shape
    y = torch.empty((B, H, T, D), dtype=x.dtype, device=x.device)
    # Whole half-rows per program; 32 positions (16 on the interpreter) per program: 32x64 fp32 halves fit in
    # registers at D=128.
    block_half = triton.next_power_of_2(D // 2)
    block_t = max(1, min(triton.next_power_of_2(T), 32 if gpu_tiles(x.device) else 16))
    grid = (B * H, triton.cdiv(T, block_t))
    _rope_kernel[grid](x, y, cos, sin, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
                       y.stride(2), cos.stride(0), H, T, D // 2, BACKWARD=backward, BLOCK_T=block_t,
                       BLOCK_HALF=block_half, num_warps=4)
    return y


def _check(x, cos, sin):
    check_device(x, cos, sin, kernel=_rope_kernel)
    if x.dim() != 4 or x.shape[-1] % 2:
        raise KilnError(f"rope: x must be (B, H, T, D) with D even, got {tuple(x.shape)}", key="x",
                        value=tuple(x.shape), fix="give x of shape (B, H, T, D) with D even")
    T, half = x.shape[2], x.shape[3] // 2
    if cos.shape != (T, half) or sin.shape != (T, half):
        raise KilnError(f"rope: cos and sin must be (T, D/2) = ({T}, {half}), got {tuple(cos.shape)}, "
                        f"{tuple(sin.shape)}", key="cos" if cos.shape != (T, half) else "sin",
                        value=tuple(cos.shape) if cos.shape != (T, half) else tuple(sin.shape),
                        fix=f"give cos and sin of shape ({T}, {half})")
    if cos.requires_grad or sin.requires_grad:
        raise KilnError("rope: cos and sin are constants here; the kernel computes no gradient for them",
                        key="cos" if cos.requires_grad else "sin", fix="pass cos and sin detached (.detach())")


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _check(x, cos, sin)
    return _rotate(x, cos.contiguous(), sin.contiguous(), backward=False)


def rope_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(dy, cos, sin, backward=True)


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        y = rope_forward(x, cos, sin)
        ctx.save_for_backward(cos, sin)
        return y

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return rope_backward(dy, cos, sin), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (B, H, T, D) by cos, sin (T, D/2); computed in fp32, output in x's dtype."""
    return RoPEFunction.apply(x, cos, sin)


class RoPE(nn.Module):
    """Drop-in for kiln.models.transformer.Rotary: forward(x, cos, sin)."""

    def forward(self, x, cos, sin):
        return rope(x, cos, sin)

    def extra_repr(self) -> str:
        return "kernel=triton"


def rope_reference(x, cos, sin):
    """Plain PyTorch, in fp32 (or fp64 for fp64 inputs), output in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    cos, sin = cos.to(xf.dtype), sin.to(xf.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
