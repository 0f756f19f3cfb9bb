"""The parts kiln's model families share: norms, attention, MLPs, RoPE and the loss.

A family (kiln/models/gpt2.py, llama.py, qwen3.py, qwen3_moe.py) builds its block from these. Each is a small
nn.Module so that recompute policies, offload and Triton kernels (kiln.kernels.apply swaps them by type) are
applied to a built model from outside.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.models.config import ModelConfig

IGNORE_INDEX = -100


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or as it is when it is wider already (fp64 reference runs)."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Statistics in fp32 whatever the input dtype: bf16 sums of squares lose 3 digits at d=4096.
        xf = at_least_fp32(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * at_least_fp32(self.weight)).type_as(x)


class SwiGLU(nn.Module):
    """silu(gate) * up."""

    def forward(self, gate, up):
        return F.silu(gate) * up


class Rotary(nn.Module):
    """Rotate-half RoPE: x of shape (B, H, T, D), cos/sin of shape (T, D/2)."""

    def forward(self, x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Window(NamedTuple):
    """What a block's attention is told of the window besides x (its `rope_cache` argument). A plain (cos, sin)
    pair, or None without RoPE, is the window of one document from position 0."""

    cos: torch.Tensor | None  # (T, D/2) from position 0 (sliced to T by the attention), or (B, 1, T, D/2) per row
    sin: torch.Tensor | None
    mask: object = None  # None: plain causal | (B, 1, T, T) bool | a flex BlockMask (kiln.models.documents)


def window(rope_cache) -> Window:
    """The Window of a block's rope_cache argument: None, a (cos, sin) pair (pipeline stages pass one), a Window."""
    if rope_cache is None:
        return Window(None, None)
    return rope_cache if isinstance(rope_cache, Window) else Window(*rope_cache)


class SDPA(nn.Module):
    """Causal attention core through torch.nn.functional.scaled_dot_product_attention; with a mask (documents
    packed in a window, kiln.models.documents) the mask instead: SDPA's attn_mask for a boolean one,
    flex_attention for a BlockMask."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, mask=None):  # q (B, H, T, D); k, v (B, KV, T, D)
        gqa = k.shape[1] != q.shape[1]
        p = self.dropout if self.training else 0.0
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)
        if isinstance(mask, torch.Tensor):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa)
        if p:
            raise KilnError("flex_attention has no dropout: set model.dropout=0 to attend with a block mask",
                            key="model.dropout", value=p, fix="set model.dropout=0 to attend with a block mask")
        from torch.nn.attention.flex_attention import flex_attention  # lazy: only a BlockMask (GPU, context parallel)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """model.logit_softcap: cap·tanh(logits / cap), which keeps every logit inside (-cap, cap); cap 0: as they are."""
    return logits if not cap else cap * torch.tanh(logits / cap)


class LMLoss(nn.Module):
    """Output head + cross-entropy: returns the SUM of token losses over valid targets, in fp32.

    Summing (not averaging) lets the trainer divide by the valid-token count of the whole global batch.
    """

    linear = staticmethod(F.linear)  # the head's product (kiln.perf.cpu_linear sets oneDNN's on a CPU)

    def __init__(self, softcap: float = 0.0):
        super().__init__()
        self.softcap = softcap  # model.logit_softcap (0 = off)

    def forward(self, h, weight, targets):  # h (N, C), weight (V, C), targets (N,)
        logits = soft_cap(at_least_fp32(self.linear(h, weight)), self.softcap)  # (N, V): loss and softmax statistics in fp32
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


class Attention(nn.Module):
    """Causal self-attention: fused q/k/v projection, optional per-head RMSNorm of q and k (Qwen3's QK-norm),
    optional RoPE, grouped-query heads (n_kv_head ≤ n_head), output projection."""

    def __init__(self, cfg: ModelConfig, rotary: bool, bias: bool = False, qk_norm: bool = False):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if qk_norm else None
        self.rope = Rotary() if rotary else None
        self.core = SDPA(cfg.dropout)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=bias)
        self.proj.residual = True

    def forward(self, x, rope_cache=None, cache=None):
        """rope_cache: RoPE's (cos, sin) tables from position 0, or a Window: those of each row's positions
        (B, 1, T, D/2) and the document mask of packed documents; with a KV cache (kiln.models.cache, generation),
        `cache` is this block's LayerCache."""
        B, T, _ = x.shape
        win = window(rope_cache)
        qkv = self.qkv(x)  # (B, T, (H + 2·KV)·D)
        # The heads this module computes, read off the output width: all of them, or a tensor-parallel rank's share
        # (kiln.parallel.tensor gives each rank its rows of q, k and v).
        D = self.head_dim
        KV = qkv.shape[-1] // D * self.n_kv_head // (self.n_head + 2 * self.n_kv_head)
        H = KV * self.n_head // self.n_kv_head
        q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
        q = q.view(B, T, H, D)  # (B, T, H, D)
        k = k.view(B, T, KV, D)  # (B, T, KV, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, KV, T, D)
        v = v.view(B, T, KV, D).transpose(1, 2)
        if self.rope is not None:
            cos, sin = (win.cos[:T], win.sin[:T]) if win.cos.dim() == 2 else (win.cos, win.sin)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if cache is None:
            # (B, H, T, D); a core without a mask argument (the Triton FlashAttention) is never given one
            y = self.core(q, k, v) if win.mask is None else self.core(q, k, v, win.mask)
        else:
            k, v = cache.update(k, v)  # (B, KV, S, D): the cached positions and these T
            # The cache's mask, not is_causal: the T queries are the last T of S keys (is_causal aligns them with
            # the first T), and left padding is masked out.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask, enable_gqa=k.shape[1] != H)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H·D)
        return self.proj(y)


class GeluMLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(d_ff, d_model, bias=bias)
        self.proj.residual = True

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Relu2MLP(GeluMLP):
    """fc, relu(x)², proj: modded-nanogpt's MLP (its GPT-2 speedrun's), GELU's matmuls."""

    def __init__(self, d_model: int, d_ff: int, bias: bool):
        super().__init__(d_model, d_ff, bias)
        self.act = ReLUSquared()


class GeluExactMLP(GeluMLP):
    """fc, the exact (erf) GELU, proj: nanoGPT's MLP (nn.GELU()), GPT-2's matmuls. On a CPU in bf16 torch's erf GELU
    runs ~3x faster than its tanh form (2.3 vs 7.6 ms on (8, 256, 1536), one thread, AMX Xeon; docs/benchmarks.md)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool):
        super().__init__(d_model, d_ff, bias)
        self.act = nn.GELU()


class ReLUSquared(nn.Module):
    def forward(self, x):
        return F.relu(x).square()


class SwiGLUMLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 2 * d_ff, bias=False)  # gate and up in one matmul
        self.act = SwiGLU()
        self.proj = nn.Linear(d_ff, d_model, bias=False)
        self.proj.residual = True

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)  # (..., F) each
        return self.proj(self.act(gate, up))


class PreNormBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)): the block every family here shares; a family picks the parts."""

    def __init__(self, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, mlp: nn.Module, dropout: float):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp
        self.drop = nn.Dropout(dropout)

    def forward(self, x, rope_cache=None, cache=None):
        x = x + self.drop(self.attn(self.norm1(x), rope_cache, cache))
        return x + self.drop(self.mlp(self.norm2(x)))


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: float):
    """Llama 3's RoPE scaling: long wavelengths slowed by `factor`, short ones kept, those between blended."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(between, blended, scaled)


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None,
               scaling: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim/2), in fp32; `scaling`: Llama 3's (factor, low_freq_factor,
    high_freq_factor, original_max_len), or () for none."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling:
        inv_freq = llama3_frequencies(inv_freq, *scaling)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


