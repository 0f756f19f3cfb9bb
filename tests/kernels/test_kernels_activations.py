"""GELU (tanh) and SwiGLU kernels against fp64 references."""
import pytest
import torch
import torch.nn.functional as F

from kiln.kernels import gelu, swiglu
from kiln.kernels.gelu import gelu_reference
from kiln.kernels.swiglu import swiglu_reference
from tests.kernels.conftest import assert_close, compare_with_reference


@pytest.mark.parametrize("shape", [(3, 17, 45), (5, 257), (4100,)])
def test_gelu_matches_reference(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3  # reaches both tails, where tanh saturates
    compare_with_reference(gelu, gelu_reference, [x], what=f"gelu{shape}")


def test_gelu_tails_and_zero():
    x = torch.tensor([-30.0, -12.0, -5.0, -1e-4, 0.0, 1e-4, 5.0, 12.0, 30.0])
    compare_with_reference(gelu, gelu_reference, [x], upstream=torch.linspace(0.5, 1.5, 9, dtype=torch.float64),
                           what="gelu tails")


@pytest.mark.parametrize("shape", [(3, 17, 45), (2, 5, 100)])
def test_swiglu_on_chunked_views(shape):
    # As in the model: gate and up are the two halves of one fc output, non-contiguous views.
    torch.manual_seed(1)
    h = torch.randn(*shape[:-1], 2 * shape[-1]) * 2
    n = compare_with_reference(lambda h: swiglu(*h.chunk(2, dim=-1)), lambda h: swiglu_reference(*h.chunk(2, dim=-1)),
                               [h], what=f"swiglu{shape}")
    assert n == 1


def test_swiglu_separate_inputs():
    torch.manual_seed(2)
    compare_with_reference(swiglu, swiglu_reference, [torch.randn(7, 45) * 3, torch.randn(7, 45)],
                           what="swiglu separate")


def test_references_match_torch():
    x = torch.randn(200, dtype=torch.float64) * 3
    assert_close(gelu_reference(x), F.gelu(x, approximate="tanh"), atol=1e-12, rtol=0)
    g, u = torch.randn(2, 200, dtype=torch.float64)
    assert_close(swiglu_reference(g, u), F.silu(g) * u, atol=1e-12, rtol=0)
