"""`kiln estimate`: the iron law's arithmetic, the MFU a reported run implies, and the command's output."""
import json

import pytest

from kiln.cli.main import main
from kiln.models import ModelConfig
from kiln.models.config import param_count
from kiln.perf.estimate import implied_mfu, parse_count, training_estimate
from kiln.perf.flops import flops_per_token

GPT2 = ModelConfig(preset="gpt2-124m", vocab_size=50257).resolve()


@pytest.mark.parametrize("text, value", [("2e12", 2e12), ("2T", 2e12), ("300B", 3e11), ("1.5M", 1.5e6),
                                         ("2_000", 2000), ("7k", 7000)])
def test_counts_read_with_their_units(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["lots", "", "-5B", "nan", "inf", "0", "3X"])
def test_counts_that_are_not_refused(text):
    with pytest.raises(ValueError):
        parse_count(text)


def test_time_gpu_hours_energy_and_cost_follow_the_iron_law():
    tokens, gpus, peak, mfu = 1e10, 8, 989e12, 0.4
    e = training_estimate(GPT2, param_count(GPT2), 1024, tokens, gpus, peak, mfu, power_w=700, pue=1.2, price=2.5)
    flops = flops_per_token(GPT2, 1024) * tokens
    assert e.flops == flops and e.hardware_flops == flops
    assert e.seconds == pytest.approx(flops / (gpus * peak * mfu), rel=1e-12)
    assert e.gpu_hours == pytest.approx(gpus * e.seconds / 3600, rel=1e-12)
    assert e.energy_kwh == pytest.approx(0.7 * e.gpu_hours * 1.2, rel=1e-12)
    assert e.cost == pytest.approx(2.5 * e.gpu_hours, rel=1e-12)
    # the MFU a run reporting these GPU-hours implies is the one it was estimated with
    assert implied_mfu(e.flops, e.gpu_hours, peak) == pytest.approx(mfu, rel=1e-12)
    # recomputation adds executed FLOPs, not time: MFU already pays for it
    full = training_estimate(GPT2, param_count(GPT2), 1024, tokens, gpus, peak, mfu, recompute=("full",) * 12)
    assert full.hardware_flops > full.flops == e.flops and full.seconds == e.seconds


def test_kiln_estimate_prints_formula_assumptions_and_json(capsys):
    args = ["estimate", "--model.preset=gpt2-124m", "--model.vocab_size=50257", "--data.seq_len=1024", "--chinchilla",
            "--device=H100", "--gpus=8", "--price=2.5", "--pue=1.2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for part in ("124.5M parameters", "20 × parameters, Chinchilla", "FLOPs = (6 × matmul parameters",
                 "8 × H100, bf16 peak 989 TFLOP/s each, 700 W", "MFU: 40.0%, assumed", "time = FLOPs / (GPUs × peak",
                 "GPU-hours:", "energy = power × GPU-hours × PUE = 700 W", "cost = GPU-hours × price"):
        assert part in out, part
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    e = training_estimate(GPT2, param_count(GPT2), 1024, 20 * param_count(GPT2), 8, 989e12, 0.4, 700, 1.2, 2.5)
    assert data["tokens"] == 20 * data["params"] and data["gpu_hours"] == pytest.approx(e.gpu_hours, rel=1e-12)
    assert data["cost"] == pytest.approx(e.cost, rel=1e-12) and data["mfu_from"].startswith("assumed")


def test_from_run_takes_the_measured_mfu(small_config, tmp_path, capsys):
    """The median MFU of the run's last half of logged intervals, and the run's own config when none is given."""
    import statistics

    from kiln.run.lm import resolve_model, train

    cfg = small_config(train={"max_steps": 6})
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    mfus = [r["mfu"] for r in records if r["kind"] == "train"]
    capsys.readouterr()
    assert main(["estimate", "--tokens=1B", "--device=H100", f"--from-run={tmp_path / 'run'}", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mfu"] == statistics.median(mfus[len(mfus) // 2:])
    assert "median of the last 3 logged intervals" in data["mfu_from"]
    assert data["params"] == param_count(resolve_model(cfg, 256))  # the 2-layer test model, not the default one
