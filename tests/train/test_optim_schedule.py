import math

import pytest
import torch

from kiln.models import build_model
from kiln.train.optim import OptimConfig, build_optimizer, param_groups
from kiln.train.schedule import ScheduleConfig, lr_factor
from tests.conftest import small_model


def test_param_groups_decay_only_matmul_weights():
    model = build_model(small_model(vocab_size=64, bias=True, tie_embeddings=False))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "blocks.0.attn.qkv.weight" in decayed and "blocks.1.mlp.proj.weight" in decayed
    assert "head.weight" in decayed  # untied output head is a matmul weight
    assert {"embed.weight", "pos_embed.weight", "norm.weight", "norm.bias", "blocks.0.attn.qkv.bias",
            "blocks.0.norm1.weight"} <= kept
    assert decayed.isdisjoint(kept)
    assert len(decayed) + len(kept) == len(list(model.parameters()))


def test_tied_embedding_is_not_decayed_and_counted_once():
    model = build_model(small_model(vocab_size=64))
    groups = param_groups(model, 0.1)
    all_params = [p for g in groups for p in g["params"]]
    assert len(all_params) == len({id(p) for p in all_params})
    assert any(p is model.embed.weight for p in groups[1]["params"])


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_optimizers_build_and_step(name):
    model = build_model(small_model(vocab_size=64))
    opt = build_optimizer(model, OptimConfig(name=name))
    x = torch.randint(0, 64, (2, 8))
    model(x, x).backward()
    before = model.blocks[0].mlp.fc.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.blocks[0].mlp.fc.weight)
    if name != "sgd":
        assert opt.defaults["betas"] == (0.9, 0.95)


def _lr(name, step, total=100, **kw):
    return lr_factor(ScheduleConfig(name=name, **({"warmup_steps": 10} | kw)), step, total)


def test_warmup_is_linear_and_reaches_peak():
    assert _lr("cosine", 0) == pytest.approx(0.1)
    assert _lr("cosine", 4) == pytest.approx(0.5)
    assert _lr("cosine", 9) == pytest.approx(1.0)


def test_cosine_key_points():
    assert _lr("cosine", 10) == pytest.approx(1.0)
    assert _lr("cosine", 55) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: mean of peak and floor
    assert _lr("cosine", 100) == pytest.approx(0.1)
    assert _lr("cosine", 500) == pytest.approx(0.1)  # past the horizon: stays at the floor


def test_linear_constant_step_key_points():
    assert _lr("linear", 55) == pytest.approx(1 - 0.9 * 0.5)
    assert _lr("linear", 100) == pytest.approx(0.1)
    assert _lr("constant", 99) == 1.0
    assert _lr("step", 10, step_size=30) == 1.0
    assert _lr("step", 40, step_size=30) == pytest.approx(0.1)
    assert _lr("step", 70, step_size=30) == pytest.approx(0.01)


def test_wsd_holds_then_decays():
    assert _lr("wsd", 50) == 1.0
    assert _lr("wsd", 79) == 1.0  # decay_fraction 0.2 of 100 steps: decay starts at step 80
    assert _lr("wsd", 89) == pytest.approx(1 - 0.9 * 0.5)
    assert _lr("wsd", 99) == pytest.approx(0.1)


def test_onecycle_starts_low_peaks_and_anneals():
    assert _lr("onecycle", 0, warmup_steps=10) == pytest.approx(1 / 25 + (1 - 1 / 25) * 0.1)
    assert _lr("onecycle", 9) == pytest.approx(1.0)
    assert _lr("onecycle", 100) < 1e-4
    assert math.isclose(_lr("onecycle", 55), 0.5, rel_tol=1e-3)


@pytest.mark.parametrize("rule, factor", [("linear", 2.0), ("sqrt", 2.0 ** 0.5)])
def test_lr_scaling_scales_the_peak_lr_with_the_global_batch(small_config, tmp_path, capsys, rule, factor):
    """A batch twice the reference: linear doubles the peak lr (Goyal et al. 2017), sqrt multiplies it by √2; every
    logged lr is the unscaled run's times the factor, and the start says how it was reached."""
    import json

    from kiln.run.lm import train

    tokens = 4 * 32  # micro_batch_size × seq_len of small_config, one micro-batch per step
    lrs = {}
    for name, optim in (("plain", {}), (rule, {"lr_scaling": rule, "reference_batch_tokens": tokens // 2})):
        train(small_config(train={"max_steps": 4}, optim=optim), tmp_path / name)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        lrs[name] = [r["lr"] for r in map(json.loads, lines) if r["kind"] == "train"]
    assert lrs[rule] == pytest.approx([lr * factor for lr in lrs["plain"]], rel=1e-12)
    assert f"{rule} rule for the global batch of 128 (optim.reference_batch_tokens=64)" in capsys.readouterr().out


def test_lr_scaling_needs_its_reference():
    with pytest.raises(ValueError, match="reference_batch_tokens"):
        OptimConfig(lr_scaling="linear").validate()
    with pytest.raises(ValueError, match="lr_scaling"):
        OptimConfig(lr_scaling="cubic", reference_batch_tokens=8).validate()
