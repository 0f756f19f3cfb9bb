"""Flash attention against an fp64 reference with the full score matrix: O, dQ, dK, dV, and the saved logsumexp."""
import pytest
import torch
import torch.nn.functional as F

from kiln.kernels import FlashAttention, flash_attention
from kiln.kernels.flash_attention import flash_attention_forward, flash_attention_reference
from kiln.models.transformer import SDPA
from tests.kernels.conftest import DEVICE, assert_close, compare_with_reference


# (B, H, KV, T, D): T not a multiple of the 16-row tiles; D=24 is not a power of two; KV < H is grouped-query.
CASES = [(2, 2, 2, 17, 16), (1, 4, 2, 37, 32), (2, 3, 1, 20, 24)]


@pytest.mark.parametrize("B,H,KV,T,D", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_matches_reference(B, H, KV, T, D, causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, KV, T, D), torch.randn(B, KV, T, D)
    n = compare_with_reference(lambda q, k, v: flash_attention(q, k, v, causal),
                               lambda q, k, v: flash_attention_reference(q, k, v, causal), [q, k, v],
                               what=f"flash {(B, H, KV, T, D)} causal={causal}")
    assert n == 3


def test_flash_attention_on_transposed_views():
    # As in the model: q, k, v are (B, T, H, D) slices of one qkv tensor seen as (B, H, T, D).
    torch.manual_seed(1)
    B, T, H, D = 2, 19, 2, 16
    qkv = torch.randn(B, T, 3 * H * D)

    def split(qkv):
        q, k, v = qkv.split(H * D, dim=-1)
        return [t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v)]

    compare_with_reference(lambda t: flash_attention(*split(t)), lambda t: flash_attention_reference(*split(t)),
                           [qkv], what="flash on views")


def test_explicit_scale():
    torch.manual_seed(5)
    compare_with_reference(lambda q, k, v: flash_attention(q, k, v, causal=False, scale=0.3),
                           lambda q, k, v: flash_attention_reference(q, k, v, causal=False, scale=0.3),
                           [torch.randn(1, 2, 18, 16) for _ in range(3)], what="flash scale=0.3")


def test_saved_logsumexp():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 21, 16, device=DEVICE) for _ in range(3))
    _, lse = flash_attention_forward(q, k, v, causal=True, sm_scale=0.25)
    s = (q.double() @ k.double().transpose(-2, -1)) * 0.25
    s = s.masked_fill(torch.ones(21, 21, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    assert lse.dtype == torch.float32
    assert_close(lse.cpu(), torch.logsumexp(s, -1).cpu())


def test_reference_matches_sdpa():
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 17, 16, dtype=torch.float64), *torch.randn(2, 2, 2, 17, 16, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(flash_attention_reference(q, k, v, causal=True), expected, atol=1e-12, rtol=0)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3)
    assert_close(flash_attention_reference(q, k, v, causal=False, scale=0.3), expected, atol=1e-12, rtol=0)


def test_module_matches_sdpa_module_and_refuses_dropout():
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 2, 17, 16, device=DEVICE), *torch.randn(2, 1, 1, 17, 16, device=DEVICE)
    assert_close(FlashAttention()(q, k, v).cpu(), SDPA()(q, k, v).cpu())
    with_dropout = FlashAttention(dropout=0.1)
    with pytest.raises(ValueError, match="dropout"):
        with_dropout(q, k, v)
    with_dropout.eval()  # no dropout at evaluation: runs
    assert_close(with_dropout(q, k, v).cpu(), SDPA(0.1).eval()(q, k, v).cpu())
