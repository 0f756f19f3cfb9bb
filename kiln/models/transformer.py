"""A decoder-only transformer with two block flavours that share their parts.

GPT-2: LayerNorm, GELU MLP, learned positions, tied embeddings, optional biases.
Llama: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, optional untied head.

The model knows nothing of training. Norms, activations, the attention core, RoPE and the loss are
submodules, so recompute policies, offload and Triton kernels are applied to a built model from outside.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

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


class SDPA(nn.Module):
    """Causal attention core through torch.nn.functional.scaled_dot_product_attention."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):  # q (B, H, T, D); k, v (B, KV, T, D)
        gqa = k.shape[1] != q.shape[1]
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)


class LMLoss(nn.Module):
    """Output head + cross-entropy: returns the SUM of token losses over valid targets, in fp32.

    Summing (not averaging) lets the trainer divide by the valid-token count of the whole global batch.
    """

    def forward(self, h, weight, targets):  # h (N, C), weight (V, C), targets (N,)
        logits = at_least_fp32(F.linear(h, weight))  # (N, V): loss and softmax statistics in fp32
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: bool):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        bias = bool(cfg.bias) and cfg.arch == "gpt2"
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=bias)
        self.rope = Rotary() if rotary else None
        self.core = SDPA(cfg.dropout)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=bias)
        self.proj.residual = True

    def forward(self, x, rope_cache=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            cos, sin = rope_cache
            q, k = self.rope(q, cos[:T], sin[:T]), self.rope(k, cos[:T], sin[:T])
        y = self.core(q, k, v)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, C)
        return self.proj(y)


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=bool(cfg.bias))
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=bool(cfg.bias))
        self.proj.residual = True

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class SwiGLUMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)  # gate and up in one matmul
        self.act = SwiGLU()
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.proj.residual = True

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)  # (B, T, F) each
        return self.proj(self.act(gate, up))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=bool(cfg.bias))
        self.attn = Attention(cfg, rotary=False)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=bool(cfg.bias))
        self.mlp = GeluMLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rope_cache=None):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, rotary=True)
        self.norm2 = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLUMLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rope_cache=None):
        x = x + self.drop(self.attn(self.norm1(x), rope_cache))
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


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        gpt2 = cfg.arch == "gpt2"
        V = cfg.padded_vocab
        self.embed = nn.Embedding(V, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if gpt2 else None
        self.drop = nn.Dropout(cfg.dropout)
        block = GPT2Block if gpt2 else LlamaBlock
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        self.norm = (
            nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=bool(cfg.bias)) if gpt2
            else RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        )
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, V, bias=False)
        self.loss = LMLoss()
        if not gpt2:
            cos, sin = rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, scaling=tuple(cfg.rope_scaling))
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # GPT-2: N(0, 0.02); residual output projections scaled by 1/sqrt(2·n_layer) so the residual
        # stream's variance stays O(1) with depth.
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Final normalized hidden states (B, T, C) for token ids (B, T)."""
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(idx)  # (B, T, C)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(T, device=idx.device))
        else:
            rope = (self.rope_cos, self.rope_sin)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope)
        return self.norm(x)

    def forward(self, idx, targets=None, reduction: str = "mean"):
        """Logits (B, T, V) without targets; with targets the loss ("mean" over valid targets or "sum")."""
        h = self.hidden(idx)
        if targets is None:
            return F.linear(h, self.head_weight)
        total = self.loss(h.flatten(0, 1), self.head_weight, targets.flatten())
        if reduction == "sum":
            return total
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 vocab_limit: int | None = None, generator: torch.Generator | None = None):
        """Sample continuations of idx (B, T). Tokens at or above vocab_limit (vocabulary padding) are never drawn."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.max_seq_len:]
            logits = F.linear(self.hidden(context)[:, -1], self.head_weight).float()  # (B, V)
            if vocab_limit is not None:
                logits[:, vocab_limit:] = -float("inf")
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
