"""Triton kernels with hand-written backward passes, one file per op, each with a plain-PyTorch reference.

Functional API (torch-like signatures): linear, layer_norm, rms_norm, gelu, swiglu, cross_entropy,
fused_linear_cross_entropy, rope, flash_attention. Modules: Linear, LayerNorm, RMSNorm, GELU, SwiGLU,
CrossEntropyLoss, FusedLinearCrossEntropyLoss, RoPE, FlashAttention. `kiln.kernels.apply.apply_kernels` swaps
a built model's norms, activations, attention, RoPE and loss for these (model.kernels = "triton" | "auto").

Without Triton installed this package still imports (so model.kernels="auto" can fall back to torch); the
kernels themselves then raise an ImportError naming the fix.
"""
from __future__ import annotations

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None

__all__ = [
    "linear", "layer_norm", "rms_norm", "gelu", "swiglu", "cross_entropy", "fused_linear_cross_entropy", "rope",
    "flash_attention",
    "Linear", "LayerNorm", "RMSNorm", "GELU", "SwiGLU", "CrossEntropyLoss", "FusedLinearCrossEntropyLoss", "RoPE",
    "FlashAttention",
    "LinearFunction", "LayerNormFunction", "RMSNormFunction", "GELUFunction", "SwiGLUFunction",
    "CrossEntropyFunction", "FusedLinearCrossEntropyFunction", "RoPEFunction", "FlashAttentionFunction",
]

if HAS_TRITON:
    from kiln.kernels.cross_entropy import CrossEntropyFunction, CrossEntropyLoss, cross_entropy
    from kiln.kernels.flash_attention import FlashAttention, FlashAttentionFunction, flash_attention
    from kiln.kernels.fused_linear_cross_entropy import (FusedLinearCrossEntropyFunction, FusedLinearCrossEntropyLoss,
                                                         fused_linear_cross_entropy)
    from kiln.kernels.gelu import GELU, GELUFunction, gelu
    from kiln.kernels.layer_norm import LayerNorm, LayerNormFunction, layer_norm
    from kiln.kernels.linear import Linear, LinearFunction, linear
    from kiln.kernels.rms_norm import RMSNorm, RMSNormFunction, rms_norm
    from kiln.kernels.rope import RoPE, RoPEFunction, rope
    from kiln.kernels.swiglu import SwiGLU, SwiGLUFunction, swiglu
else:
    def __getattr__(name: str):
        if name in __all__:
            raise ImportError(f"kiln.kernels.{name} needs the triton package: pip install 'kiln[triton]'")
        raise AttributeError(f"module 'kiln.kernels' has no attribute {name!r}")
