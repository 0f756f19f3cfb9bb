"""train.deterministic: torch's deterministic algorithms for the run (and only the run), two runs bit for bit."""
import json

import pytest
import torch

from kiln.run.lm import train
from kiln.train.state import determinism


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if r["kind"] == "train"]


def test_the_switch_is_on_inside_the_run_and_put_back_after():
    assert not torch.are_deterministic_algorithms_enabled()
    with determinism(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cuda.flash_sdp_enabled()
    with determinism(False):
        assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_two_deterministic_runs_are_bit_identical(small_config, tmp_path, device):
    precision = "bf16" if device == "cuda" else "fp32"
    runs = []
    for name in ("a", "b"):
        cfg = small_config(train={"max_steps": 6, "deterministic": True, "device": device},
                           precision={"mode": precision})
        train(cfg, tmp_path / name)
        runs.append(_losses(tmp_path / name))
    assert runs[0] == runs[1] and len(runs[0]) == 6
    assert not torch.are_deterministic_algorithms_enabled()  # the process is as it was
