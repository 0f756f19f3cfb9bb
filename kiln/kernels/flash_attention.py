"""Attention softmax(q·kᵀ·s)·v without the (T × T) score matrix, s = 1/√D; causal or not; grouped-query heads.

Forward, per block of query rows, streaming over key blocks with an online softmax (running max m, running
denominator l, rescaled accumulator); saves O and the row logsumexp L = m + log l (fp32, B·H·T values).

Backward, recomputing P = exp(q·kᵀ·s - L) block by block from the saved L:
    Δ  = rowsum(O ∘ dO)                      preprocessing kernel, fp32
    dV = Pᵀ · dO
    dP = dO · Vᵀ,  dS = P ∘ (dP - Δ)
    dQ = s · dS · K,  dK = s · dSᵀ · Q
dK, dV: one program per (key block, key/value head) loops over the query heads that share it (GQA) and over
query blocks, so they are summed in registers with no atomics. dQ: one program per query block loops over key
blocks. Both are deterministic.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import triton
import triton.language as tl

from kiln.errors import KilnError
from kiln.kernels.utils import autocast_dtype, check_device, dot_precision, gpu_tiles

LOG2E = 1.4426950408889634  # exp(x) = exp2(x · log2 e): exp2 is the native instruction


@triton.jit
def _flash_attention_fwd_kernel(Q, K, V, O, LSE, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                                stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot, H, GROUP, T, D,
                                qk_scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    kv = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ptr = Q + b.to(tl.int64) * stride_qb + h * stride_qh
    k_ptr = K + b.to(tl.int64) * stride_kb + kv * stride_kh
    v_ptr = V + b.to(tl.int64) * stride_vb + kv * stride_vh
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :], mask=(offs_m < T)[:, None] & d_ok[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)  # keys past the block's last query are all masked
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols < T)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + cols[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        keep = (cols < T)[None, :]
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= cols[None, :])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is visible to every row
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + cols[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    o_ptr = O + b.to(tl.int64) * stride_ob + h * stride_oh
    tl.store(o_ptr + offs_m[:, None] * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=(offs_m < T)[:, None] & d_ok[None, :])
    # Natural-log logsumexp of the scaled scores: m and the scores are in log2 units.
    tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, (m_i + tl.log2(l_i)) / 1.4426950408889634, mask=offs_m < T)


@triton.jit
def _flash_attention_bwd_preprocess_kernel(O, DO, Delta, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh,
                                           stride_dot, H, T, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < T)[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * T + offs_m, tl.sum(o * do, axis=1), mask=offs_m < T)


@triton.jit
def _flash_attention_bwd_dkdv_kernel(Q, K, V, DO, LSE, Delta, DK, DV, stride_qb, stride_qh, stride_qt, stride_kb,
                                     stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_dob, stride_doh,
                                     stride_dot, H, KV_HEADS, GROUP, T, D, sm_scale, qk_scale,
                                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                     BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_n, pid_bkv = tl.program_id(0), tl.program_id(1)
    b, kv = pid_bkv // KV_HEADS, pid_bkv % KV_HEADS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_mask = (offs_n < T)[:, None] & d_ok[None, :]
    k = tl.load(K + b.to(tl.int64) * stride_kb + kv * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + kv * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # query blocks before this key block see none of its keys
    for g in range(0, GROUP):
        h = kv * GROUP + g
        q_ptr = Q + b.to(tl.int64) * stride_qb + h * stride_qh
        do_ptr = DO + b.to(tl.int64) * stride_dob + h * stride_doh
        row_ptr = (b * H + h).to(tl.int64) * T
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < T
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_ptr + offs_m[:, None] * stride_dot + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + row_ptr + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(Delta + row_ptr + offs_m, mask=m_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
            keep = m_ok[:, None] & (offs_n < T)[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.exp2(tl.where(keep, s - lse[:, None] * 1.4426950408889634, float("-inf")))
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
    out = b.to(tl.int64) * KV_HEADS * T * D + kv * T * D + offs_n[:, None] * D + offs_d[None, :]  # contiguous
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _flash_attention_bwd_dq_kernel(Q, K, V, DO, LSE, Delta, DQ, stride_qb, stride_qh, stride_qt, stride_kb,
                                   stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_dob, stride_doh,
                                   stride_dot, H, GROUP, T, D, sm_scale, qk_scale, CAUSAL: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                   DOT_PRECISION: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    kv = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok, m_ok = offs_d < D, offs_m < T
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=q_mask, other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * T + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + pid_bh.to(tl.int64) * T + offs_m, mask=m_ok, other=0.0)
    k_ptr = K + b.to(tl.int64) * stride_kb + kv * stride_kh
    v_ptr = V + b.to(tl.int64) * stride_vb + kv * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n < T)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        keep = m_ok[:, None] & (offs_n < T)[None, :]
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        p = tl.exp2(tl.where(keep, s - lse[:, None] * 1.4426950408889634, float("-inf")))
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    tl.store(DQ + pid_bh.to(tl.int64) * T * D + offs_m[:, None] * D + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _blocks(q: torch.Tensor):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages)."""
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    if gpu_tiles(q.device):
        if q.element_size() * block_d <= 256:
            # 16-bit inputs up to D=128, fp32 up to D=64: 64x64 tiles, 4 warps (8 at D=128, where a tile row
            # holds twice the values): a common starting point, not tuned here.
            return 64, 64, block_d, 8 if block_d >= 128 else 4, 2
        # Wider rows (fp32 at D=128): 32x32 tiles. At 64x64 the fp32 backward needs up to 192.5 KiB of shared
        # memory, more than a block gets on an A100 (163 KiB) or an L4 (99 KiB); 32x32 needs at most 96.2 KiB
        # (checked against both limits by tests/kernels/test_kernels_gpu_launches.py).
        return 32, 32, block_d, 4, 2
    return 16, 16, block_d, 1, 1  # tl.dot's smallest tile; the interpreter's cost is per program and per op


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(*tensors):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _check(q, k, v):
    check_device(q, k, v, kernel=_flash_attention_fwd_kernel)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise KilnError(f"flash_attention: q (B, H, T, D), k and v (B, KV, T, D); got {tuple(q.shape)}, "
                        f"{tuple(k.shape)}, {tuple(v.shape)}", key="q" if q.dim() != 4 else "k",
                        value=tuple(q.shape) if q.dim() != 4 else tuple(k.shape),
                        fix="give q (B, H, T, D) and k, v of one shape (B, KV, T, D)")
    B, H, T, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, D) or H % k.shape[1]:
        raise KilnError(f"flash_attention: k/v {tuple(k.shape)} do not match q {tuple(q.shape)} (same B, T, D; "
                        f"H a multiple of the key/value heads)", key="k", value=tuple(k.shape),
                        fix="same B, T, D; H a multiple of the key/value heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def flash_attention_forward(q, k, v, causal: bool, sm_scale: float):
    """(O (B, H, T, D) in q's dtype, logsumexp (B, H, T) fp32)."""
    _check(q, k, v)
    q, k, v = _unit_last(q, k, v)
    B, H, T, D = q.shape
    o = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    bm, bn, bd, warps, stages = _blocks(q)
    _flash_attention_fwd_kernel[(triton.cdiv(T, bm), B * H)](
        q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o), H, H // k.shape[1], T, D,
        sm_scale * LOG2E, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=warps, num_stages=stages)
    return o, lse


def flash_attention_backward(do, q, k, v, o, lse, causal: bool, sm_scale: float):
    """(dq, dk, dv) in the inputs' dtypes; dk, dv have the key/value heads of k and v."""
    do, q, k, v = _unit_last(do, q, k, v)
    B, H, T, D = q.shape
    KV = k.shape[1]
    bm, bn, bd, warps, stages = _blocks(q)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    _flash_attention_bwd_preprocess_kernel[(triton.cdiv(T, bm), B * H)](
        o, do, delta, *_strides(o), *_strides(do), H, T, D, BLOCK_M=bm, BLOCK_D=bd, num_warps=warps)
    dq = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, KV, T, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, KV, T, D), dtype=v.dtype, device=q.device)
    common = dict(CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, DOT_PRECISION=dot_precision(q.dtype),
                  num_warps=warps, num_stages=stages)
    _flash_attention_bwd_dkdv_kernel[(triton.cdiv(T, bn), B * KV)](
        q, k, v, do, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v), *_strides(do), H, KV, H // KV,
        T, D, sm_scale, sm_scale * LOG2E, **common)
    _flash_attention_bwd_dq_kernel[(triton.cdiv(T, bm), B * H)](
        q, k, v, do, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(do), H, H // KV, T, D,
        sm_scale, sm_scale * LOG2E, **common)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        o, lse = flash_attention_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v for q (B, H, T, D) and k, v (B, KV, T, D), H a multiple of KV (grouped-query).

    scale defaults to 1/√D. Under torch.autocast the inputs are cast to the autocast dtype, as SDPA's would be.
    """
    dtype = autocast_dtype(q.device)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return FlashAttentionFunction.apply(q, k, v, causal, sm_scale)


class FlashAttention(nn.Module):
    """Drop-in for kiln.models.transformer.SDPA: causal forward(q, k, v), grouped-query when k has fewer heads."""

    def __init__(self, dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.dropout, self.causal = dropout, causal

    def forward(self, q, k, v):
        if self.training and self.dropout > 0:
            raise KilnError(f"kiln.kernels.FlashAttention has no attention dropout (model.dropout={self.dropout}); "
                            f"train with model.dropout=0 or model.kernels='torch'", key="model.dropout",
                            value=self.dropout, fix="train with model.dropout=0 or model.kernels='torch'")
        return flash_attention(q, k, v, self.causal)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, kernel=triton"


def flash_attention_reference(q, k, v, causal: bool = True, scale: float | None = None):
    """Plain PyTorch with the full (T × T) scores, in fp32 (or fp64 for fp64 inputs), output in q's dtype."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    qf = q.to(dtype)
    kf = k.to(dtype).repeat_interleave(group, dim=1)
    vf = v.to(dtype).repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vf).to(q.dtype)
