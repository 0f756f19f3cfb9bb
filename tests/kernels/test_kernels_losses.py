"""Cross-entropy and fused linear cross-entropy against fp64 references: loss, dlogits / dx, dW, db."""
import math

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels import cross_entropy, fused_linear_cross_entropy
from kiln.kernels.cross_entropy import cross_entropy_reference
from kiln.kernels.fused_linear_cross_entropy import default_chunk, fused_linear_cross_entropy_reference
from tests.kernels.conftest import DEVICE, assert_close, compare_with_reference, leaf


def _targets(N, V, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = -100  # every fifth ignored: the mean is over the 4/5 that count
    return t


@pytest.mark.parametrize("N,V", [(51, 45), (17, 257)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_matches_reference(N, V, smoothing, reduction):
    torch.manual_seed(0)
    logits, target = torch.randn(N, V) * 3, _targets(N, V, 0)
    # Blocks of 16 and 64: the online softmax crosses several vocabulary blocks (45 -> 3, 257 -> 5).
    compare_with_reference(
        lambda x, t: cross_entropy(x, t, label_smoothing=smoothing, reduction=reduction, block_v=16 if V < 64 else 64),
        lambda x, t: cross_entropy_reference(x, t, label_smoothing=smoothing, reduction=reduction),
        [logits, target], what=f"cross_entropy N={N} V={V} eps={smoothing} {reduction}")


def test_cross_entropy_reference_matches_torch():
    logits, target = torch.randn(51, 45, dtype=torch.float64) * 3, _targets(51, 45, 1)
    for smoothing in (0.0, 0.1):
        expected = F.cross_entropy(logits, target, ignore_index=-100, label_smoothing=smoothing)
        assert_close(cross_entropy_reference(logits, target, label_smoothing=smoothing), expected, atol=1e-12, rtol=0)


def test_cross_entropy_large_logits_are_stable():
    # Logits around 1e4: exp overflows fp32 without the running-max subtraction.
    logits = torch.randn(9, 45) * 5 + 1e4
    target = torch.arange(9)
    compare_with_reference(lambda x, t: cross_entropy(x, t, block_v=16), cross_entropy_reference, [logits, target],
                           tol=dict(atol=1e-5, rtol=1e-6), what="cross_entropy large logits")


def test_cross_entropy_all_ignored_is_zero():
    logits = leaf(torch.randn(6, 45))
    loss = cross_entropy(logits, torch.full((6,), -100, device=DEVICE))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad).item() == 0


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_linear_cross_entropy_matches_reference(bias, smoothing, reduction):
    torch.manual_seed(1)
    N, C, V = 51, 24, 45
    target = _targets(N, V, 2)
    inputs = [torch.randn(N, C), torch.randn(V, C) * 0.3] + ([torch.randn(V)] if bias else [])
    # chunk_size=16: four chunks, the last one short, so dW and db are summed across chunks.
    n = compare_with_reference(
        lambda x, w, b=None: fused_linear_cross_entropy(x, w, target.to(DEVICE), b, label_smoothing=smoothing,
                                                        reduction=reduction, chunk_size=16, block_v=16),
        lambda x, w, b=None: fused_linear_cross_entropy_reference(x, w, target, b, label_smoothing=smoothing,
                                                                  reduction=reduction),
        inputs, what=f"flce bias={bias} eps={smoothing} {reduction}")
    assert n == len(inputs)


def test_fused_linear_cross_entropy_without_grad_matches():
    torch.manual_seed(2)
    x, w, target = leaf(torch.randn(20, 16)), leaf(torch.randn(45, 16)), _targets(20, 45, 3).to(DEVICE)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, w, target, chunk_size=8)
    expected = fused_linear_cross_entropy_reference(x.detach().double().cpu(), w.detach().double().cpu(),
                                                    target.cpu())
    assert not loss.requires_grad
    assert_close(loss.cpu(), expected)


def test_default_chunk_keeps_logits_near_input_size():
    # 32k tokens, hidden 4096, vocabulary 128256: 1024 rows of logits per chunk (1024·128256 ≈ 32768·4096).
    assert default_chunk(32768, 4096, 128256) == 1024
    assert default_chunk(100, 64, 50257) == 64  # never below 64 rows
    n = default_chunk(16384, 768, 50257)
    assert n * 50257 <= 2 * 16384 * 768 and math.log2(n).is_integer()
