"""model.logit_softcap: logits -> cap·tanh(logits / cap) before the loss (kiln.models.parts.LMLoss), stated once
for the estimator (kiln.memory.estimate asks these; it never looks at the cap itself).

    saved(cfg, N)                  what the cap keeps for backward on N tokens: tanh's fp32 output, (N, V)
    transients(cfg, N, fwd, bwd)   the loss' forward and backward temporaries with the cap, from the plain loss'

The chunked and fused losses and the vocabulary-parallel loss have no cap: they refuse a capped model.
"""
from __future__ import annotations

from kiln.models.config import ModelConfig


def saved(cfg: ModelConfig, N: int) -> dict[str, int]:
    if not cfg.logit_softcap:
        return {}
    return {"logits.softcap_tanh": N * cfg.padded_vocab * 4}  # tanh keeps its output for its backward


def transients(cfg: ModelConfig, N: int, fwd: int, bwd: int) -> tuple[int, int]:
    """Forward: the fp32 logits stay alive through the cap (cap() holds them) beside logits / cap, then beside the
    capped product: two (N, V) fp32 at once, beyond what is saved. Backward: each step of the chain (the capped
    logits' gradient, tanh's, the division's) frees the one before it: two (N, V) fp32 at once, as the plain
    loss' backward."""
    if not cfg.logit_softcap:
        return fwd, bwd
    return max(fwd, 2 * N * cfg.padded_vocab * 4), bwd
