"""Linear kernel (tiled matmul, fp32 accumulation) against an fp64 reference: y, dX, dW, db."""
import pytest
import torch

from kiln.kernels import Linear, linear
from kiln.kernels.linear import linear_reference
from tests.kernels.conftest import DEVICE, assert_close, compare_with_reference, leaf


@pytest.mark.parametrize("x_shape,out", [((3, 17, 45), 33), ((7, 100), 19), ((2, 40, 16), 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_reference(x_shape, out, bias):
    torch.manual_seed(0)
    inputs = [torch.randn(x_shape), torch.randn(out, x_shape[-1]) * 0.3] + ([torch.randn(out)] if bias else [])
    n = compare_with_reference(linear, linear_reference, inputs, what=f"linear{x_shape}->{out}")
    assert n == len(inputs)


def test_linear_only_requested_gradients():
    torch.manual_seed(1)
    x = torch.randn(5, 45, device=DEVICE)  # no grad: dX is not computed
    w, b = leaf(torch.randn(33, 45)), leaf(torch.randn(33))
    linear(x, w, b).backward(torch.ones(5, 33, device=DEVICE) * 0.5)
    assert_close(w.grad.cpu(), 0.5 * x.double().sum(0).expand(33, 45).cpu())
    assert_close(b.grad.cpu(), torch.full((33,), 2.5, dtype=torch.float64))


def test_module_like_nn_linear():
    torch.manual_seed(2)
    ref = torch.nn.Linear(45, 33).to(DEVICE)
    mod = Linear(45, 33).to(DEVICE)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(4, 45, device=DEVICE)
    assert_close(mod(x).cpu(), ref(x).cpu())
    assert list(mod.state_dict()) == ["weight", "bias"]
