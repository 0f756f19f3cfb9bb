"""train.compile=true: the step calls torch.compile's model and trains the same run as eager, same seed.

The GPU suite's throughput and fp8 parts train compiled; this is where the compiled path is checked before a GPU
window depends on it (CPU: inductor's C++ backend, so it needs a C++ compiler, which the test looks for).
"""
import json
import shutil

import pytest
import torch

from kiln.run.lm import train

needs_cxx = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                               reason="torch.compile on CPU needs a C++ compiler (g++, c++ or clang++) on PATH")


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] in ("train", "eval")]


@needs_cxx
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_compiled_run_matches_eager(small_config, tmp_path, device):
    precision = "bf16" if device == "cuda" else "fp32"
    runs = {}
    for compiled in (False, True):
        cfg = small_config(train={"max_steps": 6, "eval_interval": 6, "compile": compiled, "device": device},
                           precision={"mode": precision})
        result = train(cfg, tmp_path / str(compiled))
        assert result.step == 6
        # the step called torch.compile's wrapper of the model (or the model itself, eager)
        assert hasattr(result.state.step_model, "_orig_mod") is compiled
        if compiled:
            assert result.state.step_model._orig_mod is result.state.model
        runs[compiled] = _records(tmp_path / str(compiled))
    eager, compiled = runs[False], runs[True]
    assert [r["kind"] for r in eager] == [r["kind"] for r in compiled] and len(eager) == 7
    # Inductor fuses and reorders float sums, so not bit for bit: fp32 agreed to 1.1e-7 relative on the 2-core Xeon
    # (AVX512); 1e-4 leaves room for other CPUs' vector widths and still fails on any wrong term.
    rtol = 2e-2 if precision == "bf16" else 1e-4
    for e, c in zip(eager, compiled):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in e:
                assert c[key] == pytest.approx(e[key], rel=rtol), (key, e["step"])
    # and it did train: the first loss is the untrained model's, the last one lower
    assert compiled[-2]["loss"] < compiled[0]["loss"]

