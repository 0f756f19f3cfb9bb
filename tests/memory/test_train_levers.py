"""The levers through `kiln train`: they train, and a resumed run is bit-identical to a straight one."""
import json

import pytest
import torch

from kiln.memory.chunked_loss import ChunkedLMLoss
from kiln.memory.recompute import Recomputed
from kiln.run.lm import train


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.parametrize("sections", [
    dict(optim={"name": "adamw8bit"}, memory={"recompute": "selective", "chunked_loss": 48}),
    dict(optim={"offload": "host"}, precision={"mode": "bf16-master"}, memory={"recompute": "every_k"}),
], ids=["adamw8bit+selective+chunked", "host-offload+bf16-master+every_k"])
def test_resume_with_levers_is_bit_identical(small_config, tmp_path, sections):
    n = 3
    sections = {**sections, "train": {"max_steps": 2 * n}, "schedule": {"total_steps": 2 * n},
                "model": {"dropout": 0.1}}
    straight = train(small_config(**sections), tmp_path / "straight")
    first = small_config(**sections)
    first.train.max_steps = n
    train(first, tmp_path / "resumed")
    resumed = train(small_config(**sections), tmp_path / "resumed", resume=True)
    a, b = straight.state.model.state_dict(), resumed.state.model.state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "resumed")
    run = straight.state
    assert all(isinstance(b, Recomputed) for b in run.model.blocks)  # every block runs under a checkpoint
    assert run.applied["recompute"][0] == ("selective" if sections["memory"]["recompute"] == "selective" else "full")
    if "chunked_loss" in sections["memory"]:
        assert isinstance(run.model.loss, ChunkedLMLoss)
    assert set(run.model.state_dict()) == set(resumed.state.model.state_dict())
