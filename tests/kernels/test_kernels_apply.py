"""Swapping a model's modules for the kernels: resolution, the registry, parameters kept, same numbers, same
training curve."""
import pytest
import torch
import torch.nn as nn

import kiln.kernels as ops
from kiln.kernels.apply import SWAPS, apply_kernels
from kiln.perf.hardware import resolve_kernels
from kiln.models import IGNORE_INDEX, ModelConfig, build_model
from kiln.models.transformer import SDPA, LMLoss, RMSNorm, Rotary, SwiGLU, rope_cache
from kiln.train.optim import OptimConfig, build_optimizer
from kiln.train.precision import LossScaler, Precision, PrecisionConfig
from kiln.train.objective import LanguageModeling
from kiln.train.pipeline import ModelPlan, prepare_model
from kiln.train.step import train_step
from tests.kernels.conftest import DEVICE, assert_close


def test_resolution(monkeypatch):
    assert resolve_kernels("torch", "cuda") == "torch"
    assert resolve_kernels("auto", "cpu") == "torch"  # even under the interpreter: it is for tests only
    assert resolve_kernels("auto", "cuda") == "triton"  # Triton is installed with kiln[test]
    assert resolve_kernels("triton", "meta") == "triton"
    with pytest.raises(ValueError, match="unknown"):
        resolve_kernels("cuda", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_kernels("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels("triton", "cpu") == "triton"


def test_gpus_older_than_ampere_keep_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # V100
    assert resolve_kernels("auto", "cuda") == "torch"
    with pytest.raises(ValueError, match="compute capability 8.0 or newer.*this GPU is 7.0"):
        resolve_kernels("triton", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100
    assert resolve_kernels("auto", "cuda") == resolve_kernels("triton", "cuda") == "triton"


def test_public_api_exports():
    for name in ops.__all__:
        assert callable(getattr(ops, name)), name
    functional = ["linear", "layer_norm", "rms_norm", "gelu", "swiglu", "cross_entropy",
                  "fused_linear_cross_entropy", "rope", "flash_attention"]
    assert all(getattr(ops, f).__module__ == f"kiln.kernels.{f}" for f in functional)


def _registry_case(source: type):
    """An instance of each swappable module type, its inputs, and a scalar loss of its output."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    if source is nn.LayerNorm:
        m = nn.LayerNorm(45)
        with torch.no_grad():
            m.weight.normal_(generator=g), m.bias.normal_(generator=g)
        return m, (rnd(3, 17, 45),)
    if source is RMSNorm:
        m = RMSNorm(45)
        with torch.no_grad():
            m.weight.normal_(generator=g)
        return m, (rnd(3, 17, 45),)
    if source is nn.GELU:
        return nn.GELU(approximate="tanh"), (rnd(3, 17, 45) * 3,)
    if source is SwiGLU:
        return SwiGLU(), tuple(rnd(3, 17, 90).chunk(2, -1))
    if source is Rotary:
        cos, sin = rope_cache(24, 17, 10000.0)
        return Rotary(), (rnd(2, 3, 17, 24), cos.to(DEVICE), sin.to(DEVICE))
    if source is SDPA:
        return SDPA(), (rnd(2, 4, 17, 16), rnd(2, 2, 17, 16), rnd(2, 2, 17, 16))
    if source is LMLoss:
        targets = torch.randint(0, 45, (51,), generator=g)
        targets[::4] = IGNORE_INDEX
        return LMLoss(), (rnd(51, 24), rnd(45, 24) * 0.3, targets.to(DEVICE))
    raise AssertionError(f"no test case for registry entry {source.__name__}")


@pytest.mark.parametrize("source", list(SWAPS), ids=lambda t: t.__name__)
def test_every_registry_entry_builds_and_matches(source):
    original, inputs = _registry_case(source)
    original = original.to(DEVICE)
    swapped = SWAPS[source](original)
    assert swapped is not None and type(swapped) is not source
    assert [id(p) for p in swapped.parameters()] == [id(p) for p in original.parameters()]

    def run(module):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point() and t.dim() > 1 and i == 0)
                  for i, t in enumerate(inputs)]
        for p in module.parameters():
            p.grad = None
        out = module(*leaves)
        (out * torch.linspace(0.5, 1.5, out.numel(), device=DEVICE).view_as(out)).sum().backward()
        return [out] + [t.grad for t in leaves if t.grad is not None] + [p.grad for p in module.parameters()]

    expected, got = run(original), run(swapped)
    assert len(got) == len(expected) >= 2  # the output and at least one gradient
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_close(a.cpu(), b.cpu(), f"{source.__name__} tensor {i}", atol=2e-5, rtol=2e-5)


def test_exact_gelu_is_left_alone():
    assert SWAPS[nn.GELU](nn.GELU()) is None
    model = nn.Sequential(nn.LayerNorm(8), nn.GELU())
    assert apply_kernels(model, "triton", DEVICE) == ["0"]
    assert type(model[1]) is nn.GELU


def _config(arch, **kw):
    base = dict(preset="tiny", n_layer=2, n_head=2, d_model=64, max_seq_len=32, vocab_size=64)
    if arch == "llama":
        base |= dict(preset="llama-125m", n_head=4, n_kv_head=2, d_ff=96)  # grouped-query, head_dim 16
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_build_model_swaps_modules_and_keeps_parameters(arch):
    torch.manual_seed(0)
    reference = build_model(_config(arch), DEVICE)
    model = build_model(_config(arch), DEVICE)
    prepare_model(model, ModelPlan(kernels="triton", loss="fused"), DEVICE)
    assert type(model.norm) in (ops.LayerNorm, ops.RMSNorm)
    block = model.blocks[1]
    assert type(block.attn.core) is ops.FlashAttention and type(model.loss) is ops.FusedLinearCrossEntropyLoss
    assert type(block.mlp.act) is (ops.GELU if arch == "gpt2" else ops.SwiGLU)
    assert (block.attn.rope is None) if arch == "gpt2" else (type(block.attn.rope) is ops.RoPE)
    assert list(model.state_dict()) == list(reference.state_dict())
    # Parameters are the same objects before and after a swap: an optimizer built earlier still sees them.
    torch_model = build_model(_config(arch), DEVICE)
    before = [id(p) for p in torch_model.parameters()]
    apply_kernels(torch_model, "triton")
    assert [id(p) for p in torch_model.parameters()] == before


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_model_loss_and_gradients_match_torch(arch):
    torch.manual_seed(0)
    reference = build_model(_config(arch), DEVICE)
    model = build_model(_config(arch), DEVICE)
    prepare_model(model, ModelPlan(kernels="triton", loss="fused"), DEVICE)
    model.load_state_dict(reference.state_dict())
    x = torch.randint(0, 64, (2, 29), device=DEVICE)
    y = torch.randint(0, 64, (2, 29), device=DEVICE)
    y[:, :4] = IGNORE_INDEX
    losses = []
    for m in (reference, model):
        loss = m(x, y, reduction="sum") * 0.01
        loss.backward()
        losses.append(loss)
    assert_close(losses[1].cpu(), losses[0].cpu(), "loss")
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert_close(q.grad.cpu(), p.grad.cpu(), name, atol=2e-5, rtol=1e-4)
    with torch.no_grad():  # logits path (no loss) is untouched by the swap but runs through the kernels
        assert_close(model(x).cpu(), reference(x).cpu(), "logits", atol=2e-5, rtol=1e-4)


def test_dropout_is_refused_when_the_kernels_are_applied():
    model = build_model(_config("gpt2", dropout=0.1), DEVICE)
    with pytest.raises(ValueError, match="model.dropout=0"):
        apply_kernels(model, "triton", DEVICE)
    assert type(model.blocks[0].attn.core) is not ops.FlashAttention  # refused before anything was swapped


def _train(cfg, batch, steps, kernels=False):
    torch.manual_seed(0)
    model = build_model(cfg, DEVICE)
    if kernels:
        prepare_model(model, ModelPlan(kernels="triton", loss="fused"), DEVICE)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    precision, scaler = Precision("fp32", DEVICE), LossScaler(PrecisionConfig(), DEVICE, enabled=False)
    objective = LanguageModeling()
    return [train_step(model, [batch], objective, optimizer, precision, scaler, OptimConfig()).loss.item()
            for _ in range(steps)]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_convergence_matches_torch(arch):
    # The same small model, seed and data trained with kernels=torch and kernels=triton (the interpreter on CPU):
    # fp32 losses per step agree within 1e-4 while the loss itself falls by far more. One batch of 2x16 tokens,
    # repeated, so 6 steps are enough to learn something (the interpreter costs ~0.3 s per step here).
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (2, 17), generator=g).to(DEVICE)
    batch = (data[:, :-1], data[:, 1:])
    steps = 6
    torch_losses = _train(_config(arch), batch, steps)
    triton_losses = _train(_config(arch), batch, steps, kernels=True)
    assert torch_losses[0] - torch_losses[-1] > 0.5, torch_losses  # training moved: the comparison means something
    for step, (a, b) in enumerate(zip(torch_losses, triton_losses)):
        assert abs(a - b) <= 1e-4, f"step {step}: torch {a:.6f} vs triton {b:.6f}"
