"""MFU never exceeds 100% on a CPU, and every train record says which peak it divided by."""
import json

import pytest
import torch

from kiln.models import PRESETS
from kiln.perf import flops, peak
from kiln.perf.peak import linear_shapes, model_peak_flops, utilisation
from kiln.run.lm import train

CPU = torch.device("cpu")


def test_utilisation_raises_a_peak_the_model_beat():
    assert utilisation(6e6, 8e6, 1000.0, 16e9) == pytest.approx((6e9 / 16e9, 8e9 / 16e9, 16e9))
    mfu, hfu, used = utilisation(6e6, 8e6, 1000.0, 4e9)  # 8 GFLOP/s achieved against a "peak" of 4
    assert (mfu, hfu, used) == pytest.approx((0.75, 1.0, 8e9))
    assert utilisation(6e6, 6e6, 1000.0, None) == (None, None, None)


def test_the_model_shapes_are_its_linears():
    nano = PRESETS["nano"].resolve()
    nano.vocab_size = 256
    assert linear_shapes(nano, 2048) == [(2048, 256, 768), (2048, 256, 256), (2048, 256, 1024), (2048, 1024, 256)]
    llama = PRESETS["llama-125m"].resolve()  # GQA: q + 2 kv heads of 64; SwiGLU's gate and up in one matmul
    assert linear_shapes(llama, 8)[0] == (8, 768, 768 + 2 * 4 * 64) and linear_shapes(llama, 8)[2] == (8, 768, 4096)


def _train_records(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "train"]


@pytest.mark.parametrize("shapes_too", [False, True], ids=["square-peak-low", "every-peak-low"])
def test_fp16_mfu_never_exceeds_one(small_config, tmp_path, monkeypatch, shapes_too):
    """The bug: on an AMD Zen 4 CPU (no AVX512-FP16) fp16's peak came from one square 256³ product, which ran at
    1.3 GFLOP/s while the model's own shapes ran ~10x faster: MFU 205%. Simulated here by a square peak of
    1 MFLOP/s (and, second case, model-shape rates as low): MFU must stay ≤ 1 and say which peak it used."""
    monkeypatch.setattr(flops, "_cpu_peak_cache", {torch.float16: 1e6})
    if shapes_too:
        monkeypatch.setattr(peak, "linear_rate", lambda *args: 1e6)
        monkeypatch.setattr(peak, "refresh_rate", lambda *args: 1e6)
        monkeypatch.setattr(peak, "square_rate", lambda *args: 1e6)
    cfg = small_config(precision={"mode": "fp16"}, train={"max_steps": 4})
    model = train(cfg, tmp_path / "run").cfg.model  # resolved: the byte vocabulary filled in
    records = _train_records(tmp_path / "run")
    assert len(records) == 4
    for r in records:
        assert 0 < r["mfu"] <= r["hfu"] <= 1.0
        assert r["mfu_peak_flops"] >= 1e6
        rate_flops = r["mfu"] * r["mfu_peak_flops"]  # what the model achieved, FLOP/s
        assert rate_flops == pytest.approx(flops.flops_per_token(model, 32) * r["tokens_per_s"],
                                           rel=1e-6)
    if shapes_too:  # nothing measured was near the model's rate: each record's peak is the rate it achieved
        assert all(r["mfu"] == pytest.approx(1.0) for r in records)
    else:  # the model's own shapes were measured, far above the square product
        assert min(r["mfu_peak_flops"] for r in records) > 1e8


def test_the_cpu_peak_includes_the_models_shapes(monkeypatch):
    monkeypatch.setattr(flops, "_cpu_peak_cache", {torch.float32: 1e6})
    monkeypatch.setattr(peak, "_cache", {})
    cfg = PRESETS["nano"].resolve()
    cfg.vocab_size = 256
    measured = model_peak_flops(CPU, "fp32", cfg, 256)
    assert measured == max(peak._cache.values()) > 1e8  # any CPU multiplies these shapes at > 0.1 GFLOP/s
    assert model_peak_flops(CPU, "fp32") == 1e6  # without a model: the square product alone
