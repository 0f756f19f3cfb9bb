"""fp16 kernels on any device: on CPU through the interpreter (numpy has float16, though no bfloat16).

The same criterion as the CUDA tests (tests/kernels/conftest.py, assert_within_twice_torch_error) at small odd
shapes: the kernels' fp16 loads, fp32 math, fp16 stores and fp16 tl.dot operands against torch's own fp16 ops.
bf16 needs a GPU (tests/kernels/test_kernels_cuda.py).
"""
import pytest
import torch
import torch.nn.functional as F

import kiln.kernels as ops
from kiln.models.transformer import Rotary, rope_cache
from tests.kernels.conftest import DEVICE, assert_within_twice_torch_error, randn, targets


COS, SIN = rope_cache(32, 17, 10000.0, device=DEVICE)
CASES = {  # name -> (fp32 inputs, kernel, torch)
    "layer_norm": (lambda: [randn(3, 17, 100, scale=2) + 1, randn(100), randn(100)], ops.layer_norm,
                   lambda x, w, b: F.layer_norm(x, (100,), w, b)),
    "rms_norm": (lambda: [randn(3, 17, 100, scale=2), randn(100)], ops.rms_norm,
                 lambda x, w: F.rms_norm(x, (100,), w, 1e-6)),
    "gelu": (lambda: [randn(5, 300, scale=3)], ops.gelu, lambda x: F.gelu(x, approximate="tanh")),
    "swiglu": (lambda: [randn(5, 150, scale=2), randn(5, 150)], ops.swiglu, lambda g, u: F.silu(g) * u),
    "rope": (lambda: [randn(1, 2, 17, 32)], lambda x: ops.rope(x, COS, SIN), lambda x: Rotary()(x, COS, SIN)),
    "linear": (lambda: [randn(3, 17, 45), randn(60, 45, scale=0.1), randn(60)], ops.linear, F.linear),
    "cross_entropy": (lambda: [randn(13, 333, scale=3), targets(13, 333)], ops.cross_entropy, F.cross_entropy),
    "fused_linear_cross_entropy": (lambda: [randn(20, 32), randn(333, 32, scale=0.3), targets(20, 333)],
                                   ops.fused_linear_cross_entropy,
                                   lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t)),
    "flash_attention": (lambda: [randn(1, 4, 40, 32), randn(1, 2, 40, 32), randn(1, 2, 40, 32)],
                        ops.flash_attention,
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
    "flash_attention_d128": (lambda: [randn(1, 2, 70, 128) for _ in range(3)], ops.flash_attention,
                             lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
}


@pytest.mark.parametrize("name", CASES)
def test_fp16_within_twice_torch_error(name):
    torch.manual_seed(0)
    make, kernel_fn, torch_fn = CASES[name]
    assert_within_twice_torch_error(name, kernel_fn, torch_fn, make(), torch.float16)
