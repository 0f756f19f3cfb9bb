"""Models: a decoder-only transformer (GPT-2 and Llama flavours) and its presets."""
import torch

from kiln.models.config import PRESETS, ModelConfig, param_count
from kiln.models.transformer import IGNORE_INDEX, Transformer


def build_model(cfg: ModelConfig, device="cpu") -> Transformer:
    """Build on `device`; pass device="meta" to inspect a large model without allocating it.

    How the model is run (kernels, recompute, compile) is not the model's business: kiln.train.pipeline.
    """
    cfg = cfg.resolve()
    with torch.device(device):
        return Transformer(cfg)


__all__ = ["PRESETS", "ModelConfig", "Transformer", "IGNORE_INDEX", "build_model", "param_count"]
