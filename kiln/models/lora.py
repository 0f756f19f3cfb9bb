"""LoRA adapters (the `[lora]` section): low-rank updates W + (alpha/rank)·B·A on a frozen base, PEFT's conventions.

Built out by the finetune issue (#38); this module owns LoraConfig so every part of kiln reads one definition.
"""
from __future__ import annotations

from dataclasses import dataclass

LORA_TARGETS = ("attn", "mlp", "all")


@dataclass
class LoraConfig:
    """The `lora` section: low-rank adapters on a frozen base (rank 0: off, a full fine-tune or pretraining)."""

    rank: int = 0  # adapter rank r; 0 = off. Each targeted linear W gets W + (alpha/r)·B·A, A (r, in), B (out, r) = 0 at start
    alpha: float = 16.0  # the scale numerator: updates are multiplied by alpha/rank, as PEFT does
    dropout: float = 0.0  # dropout on the adapter's input (PEFT's lora_dropout)
    targets: str = "all"  # attn | mlp | all (every linear of the blocks except an MoE router) | a comma list of the family's linear names (Family.linears), e.g. attn.qkv,mlp.fc; for kiln.fit, nn.Linear names matched by suffix
    init: str = ""  # "" = fresh adapters (A kaiming-uniform, B = 0) | peft:DIR: start from an existing PEFT adapter
