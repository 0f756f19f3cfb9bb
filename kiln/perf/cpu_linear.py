"""fp32 linears on a CPU through oneDNN where torch's own matmul is the slower of the two (train.cpu_linear).

    cpu_linear_setting(value)                       "auto" | "onednn" | "torch"
    decide_cpu_linear(value, device, precision, shapes, compiled)   (on, why): the resolved choice, one line why
    swap_linears(model)                             the model's nn.Linear layers and LM head through `linear`
    linear(x, weight, bias=None)                    F.linear, through oneDNN for plain fp32 CPU tensors

torch's F.linear in fp32 on an x86 CPU calls MKL's sgemm, which picks its code by CPU vendor: on a 2-core AMD EPYC
(Zen 5, AVX512) F.linear ran the tiny model's linears at 111-113 GFLOP/s a core, the oneDNN library that torch also
ships (its bf16 linears already run there) at 226-248, the backward's products 1.7-2.2× faster too. The same
arithmetic in fp32 (a product of K terms accumulated in fp32; the order differs, so results differ in the last
bits, as between two BLAS libraries). Other CPUs (an Intel one, where MKL takes its AVX512 path) were not measured,
so `auto` decides by measurement: it times both, forward and backward, on the model's largest linear once per
machine (kept in kiln.perf.measured) and takes oneDNN when it is at least GAIN faster.

The products go through `torch.ops.mkldnn._linear_pointwise`, the op inductor's CPU backend emits for a linear,
inside an autograd Function with its own backward (dX = dY·W, dW = dYᵀ·X: the same op with transposed operands;
the op first copies a transposed input, dYᵀ, to contiguous memory: 51 ms of an 859 ms tiny-model step on one
thread). Anything else (bf16 under autocast, which torch already sends to oneDNN; DTensors; a compiled graph; other
dtypes and devices) goes to F.linear, call by call, so a swapped model stays correct everywhere.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.models.parts import LMLoss
from kiln.perf.measured import remembered
from kiln.precision import mode

SETTINGS = ("auto", "onednn", "torch")
GAIN = 1.1  # auto takes oneDNN when torch's forward + backward take at least this many times as long
TRIES = 3
PLAIN = (torch.Tensor, nn.Parameter)


def cpu_linear_setting(value: str) -> str:
    if value not in SETTINGS:
        raise KilnError(f"train.cpu_linear={value!r}; use one of {SETTINGS}", key="train.cpu_linear", value=value,
                        fix=f"use one of {SETTINGS}")
    return value


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) · w (N, K)ᵀ (+ bias) through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


class OneDnnLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = _product(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _product(dy2, weight.t()).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = _product(dy2.t(), x.reshape(-1, x.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def _through_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    # no rows (an MoE expert no token of the micro-batch chose): oneDNN's inner product refuses a zero-sized
    # dimension ("could not create a primitive descriptor", forward and backward); torch's handles it
    return (x.numel() > 0 and all(type(t) in PLAIN and t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; plain fp32 CPU tensors outside autocast go through oneDNN."""
    if _through_onednn(x, weight, bias):
        return OneDnnLinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDnnLinear(nn.Linear):
    """nn.Linear whose product is `linear`: the same parameters, state_dict and hooks (swap_linears changes the
    class of a built layer in place)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def swap_linears(model: nn.Module) -> list[str]:
    """Every exact nn.Linear of `model` becomes a OneDnnLinear in place, and kiln's LM head (the `linear` of an
    LMLoss) `linear`; returns the swapped names."""
    swapped = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
            swapped.append(name)
        elif isinstance(module, LMLoss):
            module.linear = linear
            swapped.append(name)
    return swapped


def _seconds(fn) -> float:
    fn()  # picks the kernel, warms the caches
    best = float("inf")
    for _ in range(TRIES):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure(m: int, k: int, n: int) -> dict:
    """Seconds of one forward + backward of a (m×k)·(n×k)ᵀ linear through F.linear and through oneDNN."""
    gen = torch.Generator().manual_seed(0)  # never the global stream: training RNG stays untouched
    x, w, dy = (torch.randn(*shape, generator=gen) for shape in ((m, k), (n, k), (m, n)))

    def torch_step():
        F.linear(x, w), dy @ w, dy.t() @ x

    def onednn_step():
        _product(x, w), _product(dy, w.t()), _product(dy.t(), x.t())

    return {"torch_s": _seconds(torch_step), "onednn_s": _seconds(onednn_step)}


def timings(m: int, k: int, n: int) -> dict:
    """_measure of this shape, once per machine (kiln.perf.measured)."""
    return remembered("cpu_linear", f"fp32 linear fwd+bwd {m}x{k}x{n}", lambda: _measure(m, k, n))


def _blocked(device: torch.device, precision: str, compiled: bool) -> str | None:
    """Why this run's linears cannot go through oneDNN, or None."""
    if device.type != "cpu":
        return f"the run is on {device.type}"
    if not mode(precision).plain_fp32:
        return f"precision.mode={precision} (its linears are not fp32 products; bf16 ones already run in oneDNN)"
    if compiled:
        return "train.compile is on (inductor chooses the compiled graph's kernels)"
    if not onednn_available():
        return "this torch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)"
    return None


def decide_cpu_linear(value: str, device: torch.device, precision: str, shapes: list[tuple[int, int, int]],
                      compiled: bool) -> tuple[bool, str]:
    """(oneDNN or not, why) for train.cpu_linear=`value`; `shapes` the model's linears as (rows, in, out), the
    largest timed by auto."""
    setting = cpu_linear_setting(value)
    blocked = _blocked(device, precision, compiled)
    if setting == "torch":
        return False, "train.cpu_linear=torch"
    if setting == "onednn":
        if blocked:
            raise KilnError(f"train.cpu_linear=onednn runs fp32 linears on a CPU, but {blocked}: use "
                            f"--train.cpu_linear=auto or torch", key="train.cpu_linear", value="onednn",
                            fix="use --train.cpu_linear=auto or torch")
        return True, "train.cpu_linear=onednn"
    if blocked:
        return False, f"auto: torch, {blocked}"
    if not shapes:
        return False, "auto: torch, the model has no linear layers"
    m, k, n = max(shapes, key=lambda s: s[0] * s[1] * s[2])
    m = min(m, max(64, int(2e9 // (2 * k * n))))  # a product of at most ~2 GFLOP is timed
    times = timings(m, k, n)
    ratio = times["torch_s"] / times["onednn_s"]
    on = ratio >= GAIN
    return on, (f"auto: {'onednn' if on else 'torch'}, oneDNN's fp32 linear forward + backward "
                f"{ratio:.2f}x the speed of torch's F.linear at ({m}×{k})·({k}×{n}) on this CPU (measured once; "
                f"oneDNN from {GAIN}x)")
