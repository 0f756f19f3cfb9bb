"""Exact resume: 2N steps straight == N steps, resume, N more — bit for bit."""
import json

import pytest
import torch

from kiln.run.lm import train


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}



@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_is_bit_identical(small_config, tmp_path, precision):
    n = 6
    # Dropout exercises the torch RNG stream; accumulation exercises the data position; fp16 the scaler state.
    sections = dict(train={"max_steps": 2 * n, "grad_accum_steps": 2}, model={"dropout": 0.1},
                    schedule={"total_steps": 2 * n}, precision={"mode": precision, "growth_interval": 4,
                                                                  "init_scale": 256.0})
    straight = train(small_config(**sections), tmp_path / "straight")

    first = small_config(**sections)
    first.train.max_steps = n
    train(first, tmp_path / "resumed")
    second = small_config(**sections)  # what `kiln train --resume DIR --train.max_steps=2N` builds
    resumed = train(second, tmp_path / "resumed", resume=True)

    a, b = straight.state.model.state_dict(), resumed.state.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "resumed")
    assert straight.val_loss == resumed.val_loss
    if precision == "fp16":
        assert torch.equal(straight.state.scaler.scale, resumed.state.scaler.scale)


def test_refuses_to_overwrite_a_run(small_config, tmp_path):
    train(small_config(train={"max_steps": 2}), tmp_path / "run")
    with pytest.raises(FileExistsError, match="--resume"):
        train(small_config(train={"max_steps": 2}), tmp_path / "run")


def test_checkpoints_keep_last_and_latest_pointer(small_config, tmp_path):
    cfg = small_config(train={"max_steps": 8}, checkpoint={"interval": 2, "keep_last": 2})
    train(cfg, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000006", "step_000008"]
    assert (ckpt / "latest").read_text().strip() == "step_000008"
    assert not list(ckpt.glob(".tmp-*"))
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "step_000008" / "model.safetensors"))
    assert "embed.weight" in weights and weights["embed.weight"].shape[1] == 64
