"""Kernel tests: on CUDA when there is a GPU, else on CPU through Triton's interpreter.

Triton 3.9 chooses interpreter or compiler when a @triton.jit decorator runs, i.e. when a kiln.kernels op module
is imported, and reads TRITON_INTERPRET at that moment. pytest imports this file before the test modules of this
folder, so setting the variable here, at import, is early enough. Only Triton reads it, and no other test folder
imports Triton, so leaving it set for the rest of the session changes nothing there.
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kiln.kernels.utils import interpret_env  # noqa: E402  (imports no Triton)
from kiln.models.transformer import IGNORE_INDEX  # noqa: E402

INTERPRET = interpret_env()
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

_compiled = [f"{name}.{attr}" for name, module in list(sys.modules.items()) if name.startswith("kiln.kernels.")
             for attr, value in vars(module).items() if type(value).__name__ == "JITFunction"]
if INTERPRET and _compiled:
    raise RuntimeError(f"{_compiled[:3]}... were defined for a GPU: kiln.kernels op modules were imported before "
                       f"tests/kernels/conftest.py set TRITON_INTERPRET=1; run the kernel tests in a fresh process")

# Tolerances of fp32 kernels against fp64 references, per kind of op (max over elements of |a-b| ≤ atol + rtol·|b|).
# Measured worst cases on these shapes: 1e-6 (elementwise, norms' dx), 3e-6 (sums over 51 rows, 45-long dots).
# fp32 has 6e-8 relative spacing: these allow ~100 ulps of rounding over sums of up to a few hundred terms and
# still fail on any wrong term (the smallest gradient term here is above 1e-3).
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def assert_close(actual, expected, what="", atol=FP32_TOL["atol"], rtol=FP32_TOL["rtol"]):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    finite, within = bool(torch.isfinite(a).all()), bool((err <= bound).all())
    assert finite, f"{what}: non-finite values"
    assert within, f"{what}: max |diff| {err.max().item():.3e} (bound atol={atol}, rtol={rtol})"


def leaf(t: torch.Tensor, dtype=None, device=DEVICE) -> torch.Tensor:
    return t.detach().to(device=device, dtype=dtype or t.dtype).requires_grad_(t.is_floating_point())


def compare_with_reference(kernel_fn, reference_fn, inputs, upstream=None, tol=None, what=""):
    """Run kernel_fn on fp32 copies of `inputs` (on DEVICE) and reference_fn on fp64 CPU copies; compare the
    outputs and the gradient of every floating input for an upstream gradient that is not 1.

    Integer inputs are passed unchanged; upstream defaults to a random tensor (or 0.37 for scalar outputs).
    """
    tol = tol or FP32_TOL
    ours = [leaf(t, torch.float32) if t.is_floating_point() else t.to(DEVICE) for t in inputs]
    ref = [leaf(t, torch.float64, "cpu") if t.is_floating_point() else t.cpu() for t in inputs]
    out = kernel_fn(*ours)
    expected = reference_fn(*ref)
    if upstream is None:
        upstream = torch.full((), 0.37, dtype=torch.float64) if expected.dim() == 0 else \
            torch.randn(expected.shape, dtype=torch.float64)
    assert out.dtype == torch.float32, f"{what}: output dtype {out.dtype}"
    assert_close(out.cpu(), expected, f"{what} output", **tol)
    out.backward(upstream.to(DEVICE, out.dtype))
    expected.backward(upstream)
    checked = 0
    for i, (o, r) in enumerate(zip(ours, ref)):
        if r.is_floating_point():
            assert o.grad is not None, f"{what}: no gradient for input {i}"
            assert_close(o.grad.cpu(), r.grad, f"{what} grad of input {i}", **tol)
            checked += 1
    return checked


def randn(*shape, scale=1.0, device=DEVICE):
    return torch.randn(*shape, device=device) * scale


def targets(n, vocab, device=DEVICE):
    """Class ids for n rows, every 7th one ignored."""
    t = torch.randint(0, vocab, (n,), device=device)
    t[::7] = IGNORE_INDEX
    return t


def _outputs_and_grads(fn, inputs, upstream):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(upstream.to(out.dtype))
    return [out.float()] + [t.grad.float() for t in leaves if t.is_floating_point()]


def assert_within_twice_torch_error(name, kernel_fn, torch_fn, inputs, dtype):
    """The low-precision criterion: for the output and every gradient, max|kernel - ref| ≤ 2·max|torch - ref| +
    atol, where ref is torch_fn on the same low-precision inputs upcast to fp32 and atol = eps(dtype)·max|ref|."""
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    ref_inputs = [t.float() if t.is_floating_point() else t for t in inputs]
    expected = torch_fn(*ref_inputs)
    device = expected.device
    upstream = torch.randn(expected.shape, device=device) if expected.dim() else torch.tensor(0.37, device=device)
    ref = _outputs_and_grads(torch_fn, ref_inputs, upstream)
    ours = _outputs_and_grads(kernel_fn, inputs, upstream)
    low = _outputs_and_grads(torch_fn, inputs, upstream)
    assert len(ours) == len(ref) > 1
    for i, (k, t, r) in enumerate(zip(ours, low, ref)):
        atol = torch.finfo(dtype).eps * r.abs().max().item()
        err_k, err_t = (k - r).abs().max().item(), (t - r).abs().max().item()
        assert err_k <= 2 * err_t + atol, f"{name} tensor {i}: kernel err {err_k:.3e} vs torch {err_t:.3e}"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16/fp16 kernels)")
