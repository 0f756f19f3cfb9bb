"""The decoder-only transformer every family shares: embeddings, the family's blocks, final norm, LM head.

The family's description (kiln.models.registry, one file per family) picks the block, the norm and the
positions (a learned table or RoPE). The model knows nothing of training: recompute, offload, kernels and
sharding are applied to a built model from outside.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.models.cache import KVCache
from kiln.models.config import ModelConfig
from kiln.models.costs import make_norm
from kiln.models.documents import packed
from kiln.models.moe import ExpertLinear, MoE, moe_losses
from kiln.models.parts import (IGNORE_INDEX, SDPA, LMLoss, RMSNorm, Rotary, SwiGLU, at_least_fp32,  # noqa: F401
                               Window, llama3_frequencies, rope_cache, soft_cap)
from kiln.models.registry import family


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        fam = family(cfg.arch)
        V = cfg.padded_vocab
        self.embed = nn.Embedding(V, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if fam.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(fam.block(cfg) for _ in range(cfg.n_layer))
        self.norm = make_norm(fam.norm, cfg.d_model, cfg.norm_eps, bool(cfg.bias) and fam.biases)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, V, bias=False)
        self.loss = LMLoss(cfg.logit_softcap)
        if fam.positions == "rope":
            cos, sin = rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, scaling=tuple(cfg.rope_scaling))
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.moe = [m for m in self.modules() if isinstance(m, MoE)]  # a plain list: not registered twice
        self.moe_aux_loss: torch.Tensor | None = None  # the last training forward's load-balancing loss
        self.documents = packed  # doc, idx -> (positions, mask): a context-parallel shard puts its own here
        self.apply(self._init_weights)

    def init_std(self, module: nn.Module) -> float:
        """The std a matrix of `module` starts with (what kiln doctor checks): GPT-2's N(0, 0.02), residual
        output projections 0.02/sqrt(2·n_layer) so the residual stream's variance stays O(1) with depth; with
        model.zero_init_proj those start at 0 (modded-nanogpt): each block begins as the identity, and its
        input-side weights still get gradients through the residual."""
        if not getattr(module, "residual", False):
            return 0.02
        return 0.0 if self.cfg.zero_init_proj else 0.02 / math.sqrt(2 * self.cfg.n_layer)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, ExpertLinear)):  # ExpertLinear: every expert's weight, stacked
            std = self.init_std(module)
            nn.init.normal_(module.weight, mean=0.0, std=std) if std else nn.init.zeros_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Final normalized hidden states (B, T, C) for token ids (B, T). With a KV cache (generation), idx are the
        next T tokens after the cached ones: their keys and values are added to it (kiln.models.cache). doc (B, T):
        the document of each position within its window (kiln.models.documents): positions restart at each
        document's first token and attention stays inside the document, so each computes what it would alone."""
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise KilnError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}",
                            key="model.max_seq_len", value=T,
                            fix=f"give at most {self.cfg.max_seq_len} tokens per row, or a larger model.max_seq_len")
        if doc is not None and cache is not None:
            raise KilnError("a document mask is for training windows; generation with the KV cache takes none",
                            key="doc", fix="pass doc=None with a cache")
        x = self.embed(idx)  # (B, T, C)
        mask = None
        if doc is not None:
            positions, mask = self.documents(doc, idx)  # (B, T), (B, 1, T, T)
        else:
            positions = torch.arange(T, device=idx.device) if cache is None else cache.positions(T, idx.device)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
            rope = None if mask is None else Window(None, None, mask)
        elif cache is None and doc is None:
            rope = (self.rope_cos, self.rope_sin)  # the blocks take the first T rows
        else:  # each row's own positions (left padding or document starts shift them), (B, 1, T, D/2)
            rope = Window(self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1), mask)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, rope) if cache is None else block(x, rope, cache.layer(i))
        if cache is not None:
            cache.advance(T)
        return self.norm(x)

    def forward(self, idx, targets=None, reduction: str = "mean", cache: KVCache | None = None,
                doc: torch.Tensor | None = None):
        """Logits (B, T, V) without targets; with targets the loss ("mean" over valid targets or "sum").

        A mixture of experts in training adds moe_aux_coef × its load-balancing loss (and moe_z_coef × the
        router z-loss) to the mean, as HF's Qwen3-MoE adds router_aux_loss_coef × aux_loss; with "sum" the same
        term times the valid-target count, so the step's division by the count gives it back. cache: a KVCache
        to read and extend (generation, kiln.models.generate). doc (B, T): documents packed in each window
        (kiln.models.documents); the targets that cross a boundary are IGNORE_INDEX already (the data's work)."""
        h = self.hidden(idx, cache, doc)
        if targets is None:
            return soft_cap(F.linear(h, self.head_weight), self.cfg.logit_softcap)
        total = self.loss(h.flatten(0, 1), self.head_weight, targets.flatten())
        count = (targets != IGNORE_INDEX).sum()
        if self.moe and self.training:
            total = total + self._moe_penalty() * count
        if reduction == "sum":
            return total
        return total / count.clamp(min=1)

    def _moe_penalty(self) -> torch.Tensor:
        count_load(self.moe)
        return moe_penalty(self.cfg, *moe_losses(self.moe), self)


def count_load(layers: list[MoE]) -> None:
    """Adds each block's routed counts of the forward that just ran to its load (what moe_metrics reads)."""
    with torch.no_grad():
        for m in layers:
            m.load = m.routed if m.load is None else m.load + m.routed


def moe_penalty(cfg: ModelConfig, aux: torch.Tensor, z: torch.Tensor | None, holder) -> torch.Tensor:
    """moe_aux_coef × the load-balancing loss (+ moe_z_coef × the z-loss), the loss kept on holder.moe_aux_loss."""
    holder.moe_aux_loss = aux.detach()
    penalty = cfg.moe_aux_coef * aux
    return penalty + cfg.moe_z_coef * z if z is not None else penalty
