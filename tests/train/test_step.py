"""The train step: accumulation normalization, loss scaling, skipping non-finite updates, master weights."""
import pytest
import torch

from kiln.models import IGNORE_INDEX, build_model
from kiln.train.optim import OptimConfig, build_optimizer, param_groups
from kiln.train.precision import LossScaler, MasterWeights, Precision, PrecisionConfig
from kiln.train.objective import LanguageModeling
from kiln.train.step import accumulate_gradients, train_step
from tests.conftest import small_model

CPU = torch.device("cpu")


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_equals_one_big_batch_with_uneven_valid_tokens():
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=50, dropout=0.0)).double()
    x = torch.randint(0, 50, (6, 16))
    y = torch.randint(0, 50, (6, 16))
    # Micro-batches hold very different numbers of valid targets: 2, 16+16, 9+16, 16.
    y[0, 2:] = IGNORE_INDEX
    y[3, :7] = IGNORE_INDEX
    precision, scaler = Precision("fp32", CPU), LossScaler(PrecisionConfig(), CPU, enabled=False)

    loss_big, n_big = accumulate_gradients(model, [(x, y)], LanguageModeling(), precision, scaler)
    big = _grads(model)
    model.zero_grad(set_to_none=True)
    micro = [(x[0:1], y[0:1]), (x[1:3], y[1:3]), (x[3:5], y[3:5]), (x[5:6], y[5:6])]
    loss_acc, n_acc = accumulate_gradients(model, micro, LanguageModeling(), precision, scaler)
    acc = _grads(model)

    assert n_big.item() == n_acc.item() == 2 + 16 + 16 + 9 + 16 + 16
    assert abs(loss_big.item() - loss_acc.item()) < 1e-12
    assert big.keys() == acc.keys()
    for name in big:
        assert (big[name] - acc[name]).abs().max().item() < 1e-10, name
    # The naive mean of per-micro-batch means differs: the test above can fail.
    naive = sum(model(xm, ym) for xm, ym in micro) / len(micro)
    assert abs(naive.item() - loss_big.item()) > 1e-3


def _fp16_setup(growth_interval=3, init_scale=1024.0):
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=64))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    cfg = PrecisionConfig(mode="fp16", init_scale=init_scale, growth_interval=growth_interval)
    scaler = LossScaler(cfg, CPU, enabled=True)
    x = torch.randint(0, 64, (2, 16))
    return model, optimizer, Precision("fp16", CPU), scaler, [(x, torch.roll(x, -1, 1))]


def test_fp16_inf_gradient_skips_step_and_halves_scale():
    model, optimizer, precision, scaler, batch = _fp16_setup()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle = model.blocks[1].mlp.fc.weight.register_hook(lambda g: g * float("inf"))
    result = train_step(model, batch, LanguageModeling(), optimizer, precision, scaler, OptimConfig())
    handle.remove()
    assert result.skipped.item() == 1.0
    assert scaler.scale.item() == 512.0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    # Adam's step counter did not advance either: the next clean step is its first.
    assert all(s["step"].item() == 0 for s in optimizer.state.values())

    result = train_step(model, batch, LanguageModeling(), optimizer, precision, scaler, OptimConfig())
    assert result.skipped.item() == 0.0
    assert not torch.equal(model.blocks[1].mlp.fc.weight, before["blocks.1.mlp.fc.weight"])


def test_fp16_scale_grows_after_clean_steps():
    model, optimizer, precision, scaler, batch = _fp16_setup(growth_interval=3)
    scales = []
    for _ in range(7):
        train_step(model, batch, LanguageModeling(), optimizer, precision, scaler, OptimConfig())
        scales.append(scaler.scale.item())
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0]


def test_nonfinite_gradient_is_never_applied_in_fp32():
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=64))
    for impl in ("fused", "foreach"):  # torch's fused kernel skips via found_inf; kiln's foreach masks the update
        optimizer = build_optimizer(model, OptimConfig(implementation=impl))
        scaler = LossScaler(PrecisionConfig(), CPU, enabled=False)
        before = [p.detach().clone() for p in model.parameters()]
        handle = model.norm.weight.register_hook(lambda g: g * float("nan"))
        x = torch.randint(0, 64, (2, 16))
        result = train_step(model, [(x, x)], LanguageModeling(), optimizer, Precision("fp32", CPU), scaler, OptimConfig())
        handle.remove()
        assert result.skipped.item() == 1.0
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clipping_logs_preclip_norm_and_clips():
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=64)).double()
    x = torch.randint(0, 64, (2, 16))
    precision, scaler = Precision("fp32", CPU), LossScaler(PrecisionConfig(), CPU, enabled=False)
    accumulate_gradients(model, [(x, x)], LanguageModeling(), precision, scaler)
    expected = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item()
    model.zero_grad()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, grad_clip=1e-3, name="sgd", momentum=0.0,
                                                   weight_decay=0.0, implementation="foreach"))
    before = [p.detach().clone() for p in model.parameters()]
    result = train_step(model, [(x, x)], LanguageModeling(), optimizer, precision, scaler, OptimConfig(grad_clip=1e-3))
    assert result.grad_norm.item() == pytest.approx(expected, rel=1e-5)
    # Plain SGD moved the parameters by lr × clipped gradient, whose global norm is the threshold.
    moved = torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(before, model.parameters()))).item()
    assert moved == pytest.approx(1e-3 * 1e-3, rel=1e-6)


def test_bf16_master_weights_keep_small_updates():
    """An update of 1e-4·|w| rounds away in bf16 but accumulates in the fp32 master."""
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=64)).to(torch.bfloat16)
    masters = MasterWeights(model)
    opt_cfg = OptimConfig(name="sgd", lr=1e-5, momentum=0.0, weight_decay=0.0, grad_clip=0.0)
    optimizer = build_optimizer([{"params": masters.masters}], opt_cfg)
    scaler = LossScaler(PrecisionConfig(), CPU, enabled=False)
    start = masters.masters[0].detach().clone()
    x = torch.randint(0, 64, (2, 16))
    for _ in range(3):
        train_step(model, [(x, x)], LanguageModeling(), optimizer, Precision("bf16-master", CPU), scaler, opt_cfg, masters)
    assert masters.masters[0].dtype == torch.float32
    assert not torch.equal(masters.masters[0], start)
    torch.testing.assert_close(model.embed.weight.float(), masters.masters[0].to(torch.bfloat16).float())


def _bits(obj) -> list[torch.Tensor]:
    """Every tensor in a (nested) state, as raw bytes in a fixed order: -0.0 differs from +0.0, NaN equals NaN."""
    if isinstance(obj, torch.Tensor):
        return [obj.detach().reshape(-1).clone().view(torch.uint8)]
    if isinstance(obj, dict):
        return [b for key in sorted(obj, key=str) for b in _bits(obj[key])]
    if isinstance(obj, (list, tuple)):
        return [b for value in obj for b in _bits(value)]
    return []


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads per process spin against other processes and
    these small steps slow down 10x and more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step_rig(name, impl, offload, mode):
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=64)).to(torch.bfloat16 if mode == "bf16-master" else torch.float32)
    cfg = OptimConfig(name=name, implementation=impl, offload=offload, lr=1e-2)
    masters = MasterWeights(model) if mode == "bf16-master" and offload == "none" else None
    groups = param_groups(model, cfg.weight_decay)
    optimizer = build_optimizer(masters.groups(groups) if masters else groups, cfg)
    scaler = LossScaler(PrecisionConfig(), CPU, enabled=False)
    return model, optimizer, masters, scaler, cfg


def _everything(model, optimizer, masters):
    return _bits([dict(model.named_parameters()), optimizer.state_dict(), masters.state_dict() if masters else []])


@pytest.mark.parametrize("mode", ["fp32", "bf16-master"])
@pytest.mark.parametrize("name,impl,offload", [
    ("adamw", "fused", "none"), ("adamw", "foreach", "none"), ("adam", "loop", "none"), ("sgd", "foreach", "none"),
    ("adamw8bit", "auto", "none"), ("adamw", "fused", "host"), ("adamw", "foreach", "host-async"),
    ("adamw8bit", "auto", "host-async"),
])
def test_withheld_train_step_is_exact(name, impl, offload, mode, one_thread):
    """Through train_step: a step with a NaN gradient leaves the model, the masters and the optimizer state bit
    for bit, and the run then matches one that never took it."""
    run = _step_rig(name, impl, offload, mode)
    ref = _step_rig(name, impl, offload, mode)
    precision = Precision(mode, CPU)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = [(x, torch.roll(x, -1, 1))]

    def step(rig):
        model, optimizer, masters, scaler, cfg = rig
        return train_step(model, batch, LanguageModeling(), optimizer, precision, scaler, cfg, masters)

    step(run), step(ref)
    before = _everything(run[0], run[1], run[2])
    _everything(ref[0], ref[1], ref[2])  # state_dict() flushes host-async: both runs alike, so their grads match
    handle = run[0].blocks[0].mlp.fc.weight.register_hook(lambda g: g * float("nan"))
    assert step(run).skipped.item() == 1.0
    handle.remove()
    after = _everything(run[0], run[1], run[2])
    _everything(ref[0], ref[1], ref[2])
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    for _ in range(2):
        assert step(run).skipped.item() == step(ref).skipped.item() == 0.0
    got, want = _everything(run[0], run[1], run[2]), _everything(ref[0], ref[1], ref[2])
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
