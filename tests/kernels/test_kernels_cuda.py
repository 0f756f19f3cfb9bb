"""bf16 and fp16 kernels on CUDA (skipped without a GPU).

A kernel passes when, for its output and every gradient, |kernel - fp32 ref| ≤ 2·|torch low precision - fp32 ref|
+ atol (maximum over elements), where the fp32 reference runs torch's own ops on the same low-precision inputs
upcast to fp32, and atol is one unit of the low-precision dtype at the reference's largest magnitude
(eps·max|ref|: 2^-7 relative for bf16, 2^-10 for fp16).
"""
import pytest
import torch
import torch.nn.functional as F

import kiln.kernels as ops
from kiln.models import ModelConfig, build_model
from kiln.train.pipeline import ModelPlan, prepare_model
from kiln.models.transformer import Rotary, rope_cache
from tests.kernels.conftest import assert_within_twice_torch_error, randn, requires_cuda, targets

CUDA = torch.device("cuda")


def _rand(*shape, scale=1.0):
    return randn(*shape, scale=scale, device=CUDA)


def _targets(n, vocab):
    return targets(n, vocab, device=CUDA)


def _cases():
    """name -> (make fp32 inputs, kernel fn, torch fn); integer inputs pass through unchanged."""
    def tables():
        return rope_cache(128, 257, 10000.0, device=CUDA)  # cos, sin (257, 64), fp32 as in the model

    return {
        "layer_norm": (lambda: [_rand(4, 257, 4096, scale=2) + 1, _rand(4096), _rand(4096)],
                       lambda x, w, b: ops.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (4096,), w, b)),
        "rms_norm": (lambda: [_rand(3, 17, 1000, scale=2), _rand(1000)],
                     lambda x, w: ops.rms_norm(x, w), lambda x, w: F.rms_norm(x, (1000,), w, 1e-6)),
        "gelu": (lambda: [_rand(8, 257, 3072, scale=3)], ops.gelu, lambda x: F.gelu(x, approximate="tanh")),
        "swiglu": (lambda: [_rand(8, 257, 2 * 2816, scale=2)], lambda h: ops.swiglu(*h.chunk(2, -1)),
                   lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]),
        "rope": (lambda: [_rand(2, 8, 257, 128)], lambda x: ops.rope(x, *tables()),
                 lambda x: Rotary()(x, *tables())),
        "linear": (lambda: [_rand(4, 257, 1000), _rand(3000, 1000, scale=0.03), _rand(3000)],
                   ops.linear, F.linear),
        "cross_entropy": (lambda: [_rand(1000, 32003, scale=3), _targets(1000, 32003)],
                          ops.cross_entropy, lambda x, t: F.cross_entropy(x, t)),
        "fused_linear_cross_entropy": (
            lambda: [_rand(2000, 768), _rand(50257, 768, scale=0.05), _targets(2000, 50257)],
            ops.fused_linear_cross_entropy, lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t)),
        "flash_attention": (lambda: [_rand(2, 8, 1000, 64), _rand(2, 2, 1000, 64), _rand(2, 2, 1000, 64)],
                            ops.flash_attention,
                            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
        "flash_attention_d128": (lambda: [_rand(1, 4, 257, 128) for _ in range(3)], ops.flash_attention,
                                 lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(_cases()))
def test_low_precision_within_twice_torch_error(name, dtype):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    make, kernel_fn, torch_fn = _cases()[name]
    assert_within_twice_torch_error(name, kernel_fn, torch_fn, make(), dtype)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_model_under_bf16_autocast(arch):
    """The trainer's setting: fp32 parameters, forward under autocast; kernels as close to fp32 as torch is."""
    torch.manual_seed(0)
    kw = dict(preset="tiny", n_layer=2, n_head=4, d_model=256, max_seq_len=128, vocab_size=1000)
    if arch == "llama":
        kw |= dict(preset="llama-125m", n_kv_head=2, d_ff=0)
    reference = build_model(ModelConfig(**kw), CUDA)
    model = build_model(ModelConfig(**kw), CUDA)
    prepare_model(model, ModelPlan(kernels="triton", loss="fused"), CUDA)
    assert type(model.loss) is ops.FusedLinearCrossEntropyLoss
    model.load_state_dict(reference.state_dict())
    x = torch.randint(0, 1000, (4, 128), device=CUDA)
    y = torch.roll(x, -1, 1)
    loss32 = reference(x, y).item()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_torch = reference(x, y)
        loss_ours = model(x, y)
    assert loss_ours.dtype == torch.float32
    assert abs(loss_ours.item() - loss32) <= 2 * abs(loss_torch.item() - loss32) + 1e-2
    loss_ours.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
