"""Models: a decoder-only transformer (GPT-2 and Llama flavours) and its presets."""
from kiln.models.config import PRESETS, ModelConfig, param_count
from kiln.models.transformer import IGNORE_INDEX, Transformer


def build_model(cfg: ModelConfig, device="cpu") -> Transformer:
    """Build on `device`; pass device="meta" to inspect a large model without allocating it.

    cfg.kernels "triton" (or "auto" on CUDA with Triton installed) swaps in the Triton kernels after construction.
    """
    cfg = cfg.resolve()
    with torch.device(device):
        model = Transformer(cfg)
    if cfg.kernels != "torch":
        from kiln.kernels.apply import apply_kernels  # Triton is imported only by models that ask for kernels

        apply_kernels(model, cfg.kernels, device)
    return model


import torch  # noqa: E402

__all__ = ["PRESETS", "ModelConfig", "Transformer", "IGNORE_INDEX", "build_model", "param_count"]
