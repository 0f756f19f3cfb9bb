import math

import pytest
import torch

from kiln.memory.devices import cpu_device
from kiln.memory.levers import precision_for
from kiln.perf.flops import cpu_peak
from kiln.perf.hardware import BF16_CPU_MIN_SPEEDUP, resolve_mode
from kiln.run.lm import train


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "bf16-master"])
def test_every_precision_mode_trains(small_config, tmp_path, mode):
    cfg = small_config(precision={"mode": mode}, train={"max_steps": 12}, optim={"lr": 3e-3})
    out = train(cfg, tmp_path / mode)
    run = out.state
    assert run.precision.mode == mode
    assert math.isfinite(out.val_loss) and out.val_loss < math.log(256)
    expected = torch.bfloat16 if mode == "bf16-master" else torch.float32
    assert all(p.dtype == expected for p in run.model.parameters())


def test_auto_precision_resolution():
    """On this host: auto is bf16 exactly when bf16 matmuls measured ≥ 1.2x fp32's, for kiln train and the planner
    alike (tests/train/test_precision_portable.py checks the rule on injected rates)."""
    cpu = torch.device("cpu")
    assert resolve_mode("fp32", cpu) == "fp32"
    fp32, bf16 = cpu_peak("fp32"), cpu_peak("bf16")
    assert resolve_mode("auto", cpu) == ("bf16" if bf16 >= BF16_CPU_MIN_SPEEDUP * fp32 else "fp32")
    assert precision_for("auto", cpu_device()) == resolve_mode("auto", cpu)
    with pytest.raises(ValueError, match="tf32.*CUDA"):
        resolve_mode("tf32", cpu)


def test_early_stopping(small_config, tmp_path):
    # lr so small the model cannot improve on validation between evaluations -> stops after `patience` evals.
    cfg = small_config(train={"max_steps": 40, "eval_interval": 2, "early_stop_patience": 2,
                              "early_stop_min_delta": 0.01},
                       optim={"lr": 1e-9}, schedule={"warmup_steps": 0, "name": "constant"})
    out = train(cfg, tmp_path / "run")
    assert out.stop_reason.startswith("early stop")
    assert out.step == 6  # evals at 2 (best), 4 and 6 (no better by 0.01) -> stop
