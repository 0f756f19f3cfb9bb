"""Linear layer y = x·Wᵀ + b with W stored (out, in) as in torch, x flattened to (M, in).

Backward, three products of one tiled kernel with fp32 accumulation, transposes by strides (no copies):
    dX = dY · W            (M, out) · (out, in)
    dW = dYᵀ · X           (out, M) · (M, in), the reduction over tokens inside one program
    db = Σ_rows dY         row sums of dYᵀ, taken by the dW programs of the first column of tiles
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import triton
import triton.language as tl

from kiln.kernels.utils import autocast_dtype, check_device, dot_precision, gpu_tiles


@triton.jit
def _matmul_kernel(A, B, C, Bias, RowSum, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                   stride_cn, HAS_BIAS: tl.constexpr, ROW_SUM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """C = A·B (+ bias along N), fp32 accumulation; with ROW_SUM also Σ_k A[m, k] into RowSum (fp32)."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row-tiles share each column of B while it is in L2.
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % group_size
    pid_n = (pid % (GROUP_M * grid_n)) // group_size
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(A + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(offs_m < M)[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(B + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(k < K)[:, None] & (offs_n < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if ROW_SUM:
            row_sum += tl.sum(a.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    if ROW_SUM:
        if pid_n == 0:
            tl.store(RowSum + offs_m, row_sum, mask=offs_m < M)


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
           row_sum: bool = False):
    """a (M, K) · b (K, N) (+ bias) in out_dtype; with row_sum also Σ_k a in fp32. Any strides."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    sums = torch.empty(M, dtype=torch.float32, device=a.device) if row_sum else c
    if gpu_tiles(a.device):
        # 128x128x32 tiles, 8 warps, 3 stages for 16-bit inputs: a common starting point for tensor-core
        # matmuls, not tuned for kiln; fp32 inputs take 64x64 tiles (twice the bytes per element in shared memory).
        wide = a.element_size() <= 2
        bm, bn, bk, warps, stages = (128, 128, 32, 8, 3) if wide else (64, 64, 32, 4, 3)
    else:
        bm, bn, bk, warps, stages = 16, 16, 16, 1, 1  # tl.dot's smallest tile; the interpreter is slow anyway
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _matmul_kernel[grid](a, b, c, bias if bias is not None else c, sums, M, N, K, a.stride(0), a.stride(1),
                         b.stride(0), b.stride(1), c.stride(0), c.stride(1), HAS_BIAS=bias is not None,
                         ROW_SUM=row_sum, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                         DOT_PRECISION=dot_precision(a.dtype), num_warps=warps, num_stages=stages)
    return (c, sums) if row_sum else c


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    check_device(x, weight, bias, kernel=_matmul_kernel)
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"linear: x, weight and bias must share a dtype (or run under autocast), got {x.dtype}, "
                        f"{weight.dtype}, {bias.dtype if bias is not None else None}")
    x2 = x.reshape(-1, x.shape[-1])
    y = matmul(x2, weight.t(), x.dtype, bias)  # (M, in) · (in, out)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, bool, bool]):
    """(dx, dW, db) for the inputs that need them (None otherwise), in the inputs' dtypes."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dx = dw = db = None
    if needs[0]:
        dx = matmul(dy2, weight, x.dtype).view(x.shape)  # (M, out) · (out, in)
    if needs[1] or needs[2]:
        dw, db = matmul(dy2.t(), x2, weight.dtype, row_sum=True)  # (out, M) · (M, in), Σ_M dY alongside
        db = db.to(weight.dtype) if needs[2] else None
        dw = dw if needs[1] else None
    return dx, dw, db


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        return linear_backward(dy, x, weight, needs)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·Wᵀ + b as torch.nn.functional.linear; under torch.autocast the inputs are cast as F.linear's would be."""
    dtype = autocast_dtype(x.device)
    if dtype is not None:
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return LinearFunction.apply(x, weight, bias)


class Linear(nn.Module):
    """Drop-in for nn.Linear(in_features, out_features, bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)
        # nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)) for both.
        bound = 1 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def linear_reference(x, weight, bias=None):
    """Plain PyTorch matmul in the inputs' dtype."""
    y = x @ weight.t()
    return y + bias if bias is not None else y
