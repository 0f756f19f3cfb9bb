"""benchmarks/gpu_suite.py --dry-run: every part runs its real code path on CPU at toy sizes and writes its JSON.

The GPU run gets one ~25 min window on a fresh machine; a part that crashes there costs the window, so the dry run
is what catches it here. Numbers are checked for being measured (finite, positive, errors derived from the
predicted and measured values in the same file), not for their size.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-results")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def load(out: Path, part: str) -> dict:
    data = json.loads((out / f"{part}.json").read_text())
    assert (out / f"{part}.md").read_text().startswith(f"# {part}")
    assert data["part"] == part and data["dry_run"] is True and "error" not in data
    assert set(data["env"]) >= {"gpu", "driver", "cuda", "torch", "triton", "date"}
    return data


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_summary_all_done(results):
    summary = json.loads((results / "summary.json").read_text())
    assert summary["parts"] == {p: "done" for p in ("tests", "throughput", "memory", "kernels")}


def test_tests_part_reads_junit(results):
    data = load(results, "tests")
    assert data["returncode"] == 0 and not data["timed_out"]
    # tests/memory/test_levers.py -m gpu: its CUDA test is collected and skipped on CPU.
    assert data["tests"] >= 1 and data["skipped"] == data["tests"] and data["failed"] == 0 and data["failures"] == []
    assert (results / data["junit"]).exists()


def test_throughput_part_measures_both_loops(results):
    data = load(results, "throughput")
    loops = data["loops"]
    for name in ("plain", "kiln"):
        assert finite_positive(loops[name]["tokens_per_s"]) and finite_positive(loops[name]["mfu"])
        assert loops[name]["mfu"] < 1  # against the measured matmul rate; ≥ 1 means a wrong FLOP count or timer
    assert finite_positive(data["ratio_kiln_over_plain"])
    ratio = loops["kiln"]["tokens_per_s"] / loops["plain"]["tokens_per_s"]
    assert data["ratio_kiln_over_plain"] == pytest.approx(ratio)
    assert finite_positive(data["matmul"]["flops_per_s"]) and finite_positive(data["flops_per_token"])
    assert data["data"]
    variants = data["variants"]
    assert variants["kiln triton kernels"] == {"skipped": "Triton kernels need CUDA"}
    measured = {k: v for k, v in variants.items() if "triton" not in k}
    assert len(measured) == 3
    for name, v in measured.items():
        assert "error" not in v, (name, v)
        assert finite_positive(v["tokens_per_s"]), (name, v)
    assert max(v["batch"] for v in measured.values()) == 2 * loops["kiln"]["batch"]


def test_memory_part_compares_estimate_with_measurement(results):
    data = load(results, "memory")
    points = data["points"]
    assert [(p["precision"], p["recompute"]) for p in points] == [("fp32", "none"), ("fp32", "full")]
    for p in points:
        assert finite_positive(p["predicted_bytes"]) and finite_positive(p["measured_bytes"])
        assert p["rel_error"] == pytest.approx((p["predicted_bytes"] - p["measured_bytes"]) / p["measured_bytes"])
    # Full recompute keeps fewer activations: a measurement that ignores the lever would not see that.
    assert points[1]["measured_bytes"] < points[0]["measured_bytes"]
    assert data["max_abs_rel_error"] == pytest.approx(max(abs(p["rel_error"]) for p in points))


def test_memory_part_numbers_match_an_independent_measurement(results):
    # The same toy point measured here: the suite must report what measure_step and the estimator give, not a
    # number made up from the other one.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from gpu_suite import TOY

    from kiln.config import load_config
    from kiln.memory.devices import local_device
    from kiln.memory.estimate import estimate, peak_allocated
    from kiln.memory.levers import job_for
    from kiln.memory.measure import measure_step

    point = load(results, "memory")["points"][0]
    cfg = load_config(None, [f"--model.n_layer={TOY['n_layer']}", f"--model.n_head={TOY['n_head']}",
                             f"--model.d_model={TOY['d_model']}", f"--data.seq_len={TOY['seq_len']}",
                             f"--train.micro_batch_size={TOY['batch']}", "--train.device=cpu",
                             "--precision.mode=fp32", "--memory.recompute=none"])
    cpu = torch.device("cpu")
    assert point["predicted_bytes"] == peak_allocated(estimate(job_for(cfg, local_device(cpu))))
    # CPU peaks are live-tensor byte counts (kiln/memory/measure.py), deterministic for a fixed seed and shape.
    assert point["measured_bytes"] == measure_step(cfg, cpu, steps=3).step_peaks[-1]


def test_kernels_part_captures_output(results):
    data = load(results, "kernels")
    # Without CUDA benchmarks/kernels.py exits 1 with its own message; the suite records it rather than failing.
    assert data["returncode"] == 1 and not data["timed_out"]
    assert "needs a CUDA GPU" in data["output"]


def test_gpu_configs_resolve_to_the_shapes_they_name():
    # The GPU paths cannot run here; their configs can. The throughput part must build GPT-2 124M (biases, seq 1024,
    # as the plain model has), at any batch, and every memory grid point must load.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from gpu_suite import GPT2, GRID_MODELS, kiln_overrides

    from kiln.config import load_config

    for batch in (GPT2["batch"], 2 * GPT2["batch"]):
        cfg = load_config(None, kiln_overrides(dict(GPT2, batch=batch), 50257, torch.device("cuda"), []))
        model = cfg.model.resolve()
        assert (model.n_layer, model.n_head, model.d_model, model.vocab_size) == (12, 12, 768, 50257)
        assert model.bias and model.max_seq_len >= cfg.data.seq_len == 1024
        assert cfg.train.micro_batch_size == batch and cfg.train.device == "cuda"
    for name, args in GRID_MODELS.items():
        for precision in ("fp32", "bf16", "bf16-master"):
            for recompute in ("none", "full", "selective"):
                load_config(None, args + ["--data.tokenizer=bpe", "--data.vocab_size=50257", "--train.device=cuda",
                                          f"--precision.mode={precision}", f"--memory.recompute={recompute}"])
