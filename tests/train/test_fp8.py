"""precision.mode=fp8: torchao's float8 linears in the blocks, refused where there are no fp8 tensor cores, in the
estimator and the planner. The conversion is checked on CPU (a module swap); training in fp8 needs CUDA ≥ 8.9."""
import importlib.util

import pytest
import torch
import torch.nn as nn

from kiln.config import load_config
from kiln.memory.devices import get_device
from kiln.memory.estimate import estimate
from kiln.memory.levers import JobSections, job_for, precision_for
from kiln.memory.planner import _precisions
from kiln.models import build_model
from kiln.models.transformer import LMLoss
from kiln.perf.hardware import fp8_refusal, resolve_mode
from kiln.train.pipeline import ModelPlan, prepare_model
from kiln.train.precision import fp8_linear
from tests.conftest import small_model

TORCHAO = importlib.util.find_spec("torchao") is not None


def test_fp8_is_refused_without_fp8_tensor_cores():
    with pytest.raises(ValueError, match=r"compute capability ≥ 8.9.*this run is on cpu: use bf16"):
        resolve_mode("fp8", torch.device("cpu"))
    assert "A100-80GB is 8.0" in fp8_refusal("cuda", 8.0, "A100-80GB")
    assert fp8_refusal("cuda", 8.9) is None and fp8_refusal("cuda", 9.0) is None  # Ada, Hopper
    with pytest.raises(ValueError, match="A100-80GB is 8.0"):
        precision_for("fp8", get_device("A100"))
    assert precision_for("fp8", get_device("H100")) == "fp8"


def test_fp8_is_in_the_estimator_and_the_planner():
    """Modelled as bf16 autocast (torchao saves the bf16 inputs for backward) and ranked at bf16's rate until the
    GPU suite measures its speed-up: the planner offers it where the device has fp8 tensor cores, and only there."""
    cfg = load_config(None, ["--model.preset=gpt2-124m", "--train.micro_batch_size=8"])
    h100 = get_device("H100")
    fp8 = estimate(job_for(JobSections.of(load_config(None, ["--model.preset=gpt2-124m", "--train.micro_batch_size=8",
                                              "--precision.mode=fp8"])), h100))
    bf16 = estimate(job_for(JobSections.of(load_config(None, ["--model.preset=gpt2-124m", "--train.micro_batch_size=8",
                                               "--precision.mode=bf16"])), h100))
    assert fp8.total_bytes == bf16.total_bytes and fp8.job.precision == "fp8"
    assert "fp8" in _precisions(h100) and "fp8" in _precisions(get_device("L4"))
    assert "fp8" not in _precisions(get_device("A100")) and cfg.precision.mode == "auto"


def test_the_linears_fp8_can_take():
    assert fp8_linear(nn.Linear(64, 192), "blocks.0.attn.qkv")
    assert not fp8_linear(nn.Linear(24, 64), "x") and not fp8_linear(nn.Linear(64, 40), "x")
    assert not fp8_linear(nn.LayerNorm(64), "x")


@pytest.mark.skipif(not TORCHAO, reason="torchao is not installed (pip install torchao, or the test extra)")
def test_the_pipeline_swaps_every_block_linear_for_float8_and_leaves_the_head():
    from torchao.float8.float8_linear import Float8Linear

    model = build_model(small_model(n_layer=3, vocab_size=256).resolve(), "cpu")
    prepared = prepare_model(model, ModelPlan(fp8=True))
    names = prepared.applied["fp8"]
    assert len(names) == 3 * 4  # qkv, proj, fc and the MLP's proj of each block
    modules = dict(model.named_modules())
    assert all(isinstance(modules[n], Float8Linear) for n in names)
    assert not any(isinstance(m, nn.Linear) and not isinstance(m, Float8Linear) for m in model.blocks.modules())
    assert type(model.loss) is LMLoss  # the head (a parameter of the loss) stays high precision


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9) or not TORCHAO,
                    reason="needs CUDA with compute capability ≥ 8.9 and torchao")
def test_fp8_trains_like_bf16_on_a_gpu(small_config, tmp_path):
    from kiln.run.lm import train

    final = {}
    for mode in ("bf16", "fp8"):
        cfg = small_config(train={"max_steps": 40, "device": "cuda"}, precision={"mode": mode})
        cfg.model.d_model, cfg.model.n_head = 128, 4
        final[mode] = train(cfg, tmp_path / mode).val_loss
    assert abs(final["fp8"] - final["bf16"]) < 0.05 * final["bf16"], final
