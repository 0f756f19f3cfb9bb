"""LayerNorm and RMSNorm kernels against fp64 references: outputs, dx, dw, db."""
import pytest
import torch
import torch.nn.functional as F

from kiln.kernels import LayerNorm, RMSNorm, layer_norm, rms_norm
from kiln.kernels.layer_norm import layer_norm_forward, layer_norm_reference
from kiln.kernels.rms_norm import rms_norm_reference
from kiln.models.transformer import RMSNorm as TorchRMSNorm
from tests.kernels.conftest import DEVICE, assert_close, compare_with_reference, leaf

# Odd sizes: 45 and 100 are not powers of two (masked tails); 51 and 7 rows are not multiples of the row tile.
SHAPES = [(3, 17, 45), (7, 100), (2, 3, 257)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_reference(shape, bias):
    torch.manual_seed(0)
    N = shape[-1]
    x = torch.randn(shape) * 2 + 0.5  # a non-zero mean: the mean term of dx matters
    inputs = [x, torch.randn(N)] + ([torch.randn(N)] if bias else [])
    n = compare_with_reference(lambda x, w, b=None: layer_norm(x, w, b, eps=1e-5),
                               lambda x, w, b=None: layer_norm_reference(x, w, b, eps=1e-5), inputs,
                               what=f"layer_norm{shape}")
    assert n == len(inputs)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape):
    torch.manual_seed(1)
    inputs = [torch.randn(shape) * 2 + 0.5, torch.randn(shape[-1])]
    n = compare_with_reference(lambda x, w: rms_norm(x, w, eps=1e-6), lambda x, w: rms_norm_reference(x, w, 1e-6),
                               inputs, what=f"rms_norm{shape}")
    assert n == 2


def test_references_match_torch():
    torch.manual_seed(2)
    x = torch.randn(5, 45, dtype=torch.float64)
    w, b = torch.randn(2, 45, dtype=torch.float64)
    assert_close(layer_norm_reference(x, w, b, 1e-5), F.layer_norm(x, (45,), w, b, 1e-5), atol=1e-12, rtol=0)
    assert_close(rms_norm_reference(x, w, 1e-6), F.rms_norm(x, (45,), w, 1e-6), atol=1e-12, rtol=0)


def test_layer_norm_saves_fp32_statistics():
    x = torch.randn(6, 45, device=DEVICE)
    _, mean, rstd = layer_norm_forward(x, torch.ones(45, device=DEVICE), None, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32
    assert_close(mean.cpu(), x.double().mean(-1).cpu())
    assert_close(rstd.cpu(), torch.rsqrt(x.double().var(-1, unbiased=False) + 1e-5).cpu())


def test_strided_input():
    # A (T, B, C) -> (B, T, C) transpose: rows that are not contiguous in memory.
    torch.manual_seed(3)
    x = torch.randn(17, 3, 45).transpose(0, 1)
    compare_with_reference(lambda x, w: rms_norm(x.transpose(0, 1).transpose(0, 1), w),
                           lambda x, w: rms_norm_reference(x, w), [x, torch.randn(45)], what="strided rms_norm")


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_weight_gradient_is_deterministic(norm):
    torch.manual_seed(4)
    x, w, dy = leaf(torch.randn(203, 45)), leaf(torch.randn(45)), torch.randn(203, 45, device=DEVICE)
    grads = []
    for _ in range(2):
        w.grad = None
        y = layer_norm(x, w, None) if norm == "layer" else rms_norm(x, w)
        y.backward(dy)
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_modules_share_parameters_and_state_dict_keys():
    ln = torch.nn.LayerNorm(45, eps=1e-5, bias=True).to(DEVICE)
    swapped = LayerNorm.from_torch(ln)
    assert swapped.weight is ln.weight and swapped.bias is ln.bias
    assert list(swapped.state_dict()) == list(ln.state_dict()) == ["weight", "bias"]
    no_bias = LayerNorm.from_torch(torch.nn.LayerNorm(45, bias=False))
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]
    rms = TorchRMSNorm(45, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        rms.weight.normal_()
    swapped_rms = RMSNorm.from_torch(rms)
    assert swapped_rms.weight is rms.weight and swapped_rms.eps == 1e-6
    x = torch.randn(4, 45, device=DEVICE)
    assert_close(swapped(x), ln(x))
    assert_close(swapped_rms(x), rms(x))
