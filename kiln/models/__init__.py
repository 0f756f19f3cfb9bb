"""Models: a decoder-only transformer in four families (gpt2, llama, qwen3, qwen3_moe), each described once in
kiln/models/<family>.py and listed in kiln.models.registry; the presets of all of them."""
import torch

from kiln.models.config import ModelConfig, param_count
from kiln.models.family import Family
from kiln.models.moe import moe_metrics
from kiln.models.registry import ARCHS, FAMILIES, PRESETS, family
from kiln.models.transformer import IGNORE_INDEX, Transformer


def build_model(cfg: ModelConfig, device="cpu") -> Transformer:
    """Build on `device`; pass device="meta" to inspect a large model without allocating it.

    How the model is run (kernels, recompute, compile) is not the model's business: kiln.train.pipeline.
    """
    cfg = cfg.resolve()
    with torch.device(device):
        return Transformer(cfg)


__all__ = ["ARCHS", "FAMILIES", "PRESETS", "Family", "ModelConfig", "Transformer", "IGNORE_INDEX", "build_model",
           "family", "moe_metrics", "param_count"]
