"""RoPE kernel against an fp64 reference (and kiln's Rotary), forward and the -θ backward."""
import pytest
import torch

from kiln.kernels import RoPE, rope
from kiln.kernels.rope import rope_reference
from kiln.models.transformer import Rotary, rope_cache
from tests.kernels.conftest import DEVICE, assert_close, compare_with_reference


@pytest.mark.parametrize("B,H,T,D", [(2, 3, 17, 24), (1, 2, 40, 32), (3, 1, 5, 2)])
def test_rope_matches_reference(B, H, T, D):
    torch.manual_seed(0)
    cos, sin = rope_cache(D, T, 10000.0)
    n = compare_with_reference(lambda x: rope(x, cos.to(DEVICE), sin.to(DEVICE)),
                               lambda x: rope_reference(x, cos.double(), sin.double()), [torch.randn(B, H, T, D)],
                               what=f"rope {(B, H, T, D)}")
    assert n == 1


def test_rope_on_transposed_view():
    # As in the model: q is (B, T, H, D) memory seen as (B, H, T, D).
    torch.manual_seed(1)
    cos, sin = rope_cache(24, 17, 10000.0)
    compare_with_reference(lambda x: rope(x.transpose(1, 2), cos.to(DEVICE), sin.to(DEVICE)),
                           lambda x: rope_reference(x.transpose(1, 2), cos.double(), sin.double()),
                           [torch.randn(2, 17, 3, 24)], what="rope transposed")


def test_rope_module_matches_rotary_and_preserves_norm():
    torch.manual_seed(2)
    cos, sin = rope_cache(32, 40, 10000.0)
    x = torch.randn(2, 4, 40, 32, dtype=torch.float64)
    assert_close(rope_reference(x, cos, sin), Rotary()(x, cos.double(), sin.double()), atol=1e-12, rtol=0)
    y = RoPE()(x.float().to(DEVICE), cos.to(DEVICE), sin.to(DEVICE))
    # A rotation: every (x1_i, x2_i) pair keeps its length.
    x1, x2 = x.chunk(2, -1)
    y1, y2 = y.double().cpu().chunk(2, -1)
    assert_close(y1**2 + y2**2, x1**2 + x2**2)


def test_rope_rejects_wrong_cache_shape():
    cos, sin = rope_cache(24, 16, 10000.0)
    with pytest.raises(ValueError, match="cos and sin"):
        rope(torch.randn(1, 1, 17, 24, device=DEVICE), cos.to(DEVICE), sin.to(DEVICE))
