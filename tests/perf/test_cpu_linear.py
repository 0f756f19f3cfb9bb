import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.models import build_model
from kiln.perf import cpu_linear
from kiln.perf.cpu_linear import OneDnnLinear, decide_cpu_linear, linear, onednn_available, swap_linears
from kiln.perf.measured import lookup
from kiln.run.lm import train
from tests.conftest import small_model

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_backward_match_float64(bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 24, generator=gen).transpose(0, 1)  # (40, 3, 24), not contiguous
    w = torch.randn(56, 24, generator=gen)
    b = torch.randn(56, generator=gen) if bias else None
    dy = torch.randn(40, 3, 56, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    y = linear(*leaves)
    y.backward(dy)
    ref = [t.double().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    y_ref = F.linear(*ref)
    y_ref.backward(dy.double())
    assert y.dtype == torch.float32 and y.shape == (40, 3, 56)
    assert _rel(y, y_ref) < 1e-6
    for leaf, r in zip(leaves, ref):
        assert _rel(leaf.grad, r.grad) < 1e-6


@needs_onednn
@needs_onednn
def test_no_rows_trains_as_torchs():
    """An MoE expert that no token chose gets (0, C) inputs: forward and backward give torch's empty output and
    zero weight gradient (oneDNN's backward refused the zero-sized product)."""
    w = torch.randn(8, 4, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    x = torch.randn(0, 4, requires_grad=True)
    y = linear(x, w, b)
    assert y.shape == (0, 8)
    (y.sum() + (w * 0).sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
    assert x.grad.shape == (0, 4)


def test_other_dtypes_and_autocast_take_torchs_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear.OneDnnLinearFunction, "apply", lambda *a: calls.append(a) or F.linear(*a))
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    linear(x.bfloat16(), w.bfloat16())
    linear(x.double(), w.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, w)
    assert y.dtype == torch.bfloat16 and not calls
    linear(x, w)
    assert len(calls) == 1


@needs_onednn
def test_swapped_model_trains_as_torchs(tmp_path):
    """kiln's transformer with its linears and LM head swapped: the same loss and gradients as the original."""
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=256).resolve(), "cpu")
    twin = copy.deepcopy(model)
    names = swap_linears(twin)
    assert "loss" in names and "blocks.0.attn.qkv" in names
    assert isinstance(twin.blocks[0].mlp.fc, OneDnnLinear)
    assert twin.state_dict().keys() == model.state_dict().keys()
    idx = torch.randint(0, 256, (4, 32))
    losses = []
    for m in (model, twin):
        loss = m(idx, idx.roll(-1, 1))
        loss.backward()
        losses.append(loss)
    assert abs(losses[0].item() - losses[1].item()) < 1e-6 * abs(losses[0].item())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name


def test_decide_explicit_and_blocked():
    cpu = torch.device("cpu")
    assert decide_cpu_linear("torch", cpu, "fp32", [(64, 32, 32)], compiled=False) == (False, "train.cpu_linear=torch")
    on, why = decide_cpu_linear("auto", cpu, "bf16", [(64, 32, 32)], compiled=False)
    assert not on and why.startswith("auto: torch, precision.mode=bf16")
    on, why = decide_cpu_linear("auto", cpu, "fp32", [(64, 32, 32)], compiled=True)
    assert not on and "train.compile" in why
    with pytest.raises(ValueError, match="train.cpu_linear=onednn .* precision.mode=bf16 .* use --train.cpu_linear"):
        decide_cpu_linear("onednn", cpu, "bf16", [(64, 32, 32)], compiled=False)
    with pytest.raises(ValueError, match="train.cpu_linear='fast'"):
        decide_cpu_linear("fast", cpu, "fp32", [], compiled=False)


@needs_onednn
def test_auto_measures_once_and_follows_the_measurement(monkeypatch):
    shapes = [(96, 48, 40), (96, 48, 120), (96, 120, 48)]
    on, why = decide_cpu_linear("auto", torch.device("cpu"), "fp32", shapes, compiled=False)
    stored = lookup("cpu_linear", "fp32 linear fwd+bwd 96x48x120")  # the largest product, timed both ways
    assert stored is not None and stored["torch_s"] > 0 and stored["onednn_s"] > 0
    assert on == (stored["torch_s"] / stored["onednn_s"] >= cpu_linear.GAIN)
    assert f"{stored['torch_s'] / stored['onednn_s']:.2f}x" in why and "(96×48)·(48×120)" in why
    monkeypatch.setattr(cpu_linear, "_measure", lambda *a: pytest.fail("measured twice"))
    assert decide_cpu_linear("auto", torch.device("cpu"), "fp32", shapes, compiled=False)[0] == on


@needs_onednn
def test_training_with_onednn_follows_torchs_curve_and_resumes_exactly(small_config, tmp_path):
    def run(choice, steps, run_dir, resume=False):
        cfg = small_config(train={"cpu_linear": choice, "max_steps": steps}, checkpoint={"interval": 3})
        return train(cfg, run_dir, resume=resume)

    torch_run, onednn_run = run("torch", 6, tmp_path / "torch"), run("onednn", 6, tmp_path / "onednn")
    assert torch_run.cfg.train.cpu_linear_decided_by == "train.cpu_linear=torch"
    assert onednn_run.cfg.train.cpu_linear == "onednn"
    assert onednn_run.val_loss == pytest.approx(torch_run.val_loss, rel=1e-4)
    assert "blocks.0.mlp.fc" in onednn_run.state.applied["cpu_linear"] and "cpu_linear" not in torch_run.state.applied
    # a resume from step 3 runs the recorded products and lands on the same weights
    half = tmp_path / "half"
    run("onednn", 3, half)
    assert 'cpu_linear = "onednn"' in (half / "config.toml").read_text()
    resumed = run("onednn", 6, half, resume=True)
    assert resumed.val_loss == onednn_run.val_loss
