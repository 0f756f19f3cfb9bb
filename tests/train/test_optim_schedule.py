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
