"""A run's config records the precision auto resolved to, and what decided it; a resume runs that precision even
where auto would now decide otherwise (simulated: the measured matmul rates are injected)."""
import tomllib

import torch

from kiln.cli.main import main
from kiln.config import load_config, to_toml
from kiln.perf import flops
from kiln.run.lm import train

BF16_FAST = {torch.float32: 100e9, torch.bfloat16: 400e9}  # an AMX-like CPU: auto → bf16
BF16_SLOW = {torch.float32: 100e9, torch.bfloat16: 1e9}  # bf16 emulated: auto → fp32


def _precision(run_dir):
    return tomllib.loads((run_dir / "config.toml").read_text())["precision"]


def test_resume_keeps_the_precision_auto_chose(small_config, tmp_path, monkeypatch, capsys):
    path = tmp_path / "auto.toml"
    path.write_text(to_toml(small_config(precision={"mode": "auto"})))
    run = tmp_path / "run"
    monkeypatch.setattr(flops, "_cpu_peak_cache", dict(BF16_FAST))
    assert main(["train", str(path), "--run-dir", str(run), "--train.max_steps=2", "--schedule.total_steps=4"]) == 0
    recorded = _precision(run)
    assert recorded["mode"] == "bf16"
    assert recorded["decided_by"] == ("precision.mode=auto on cpu: bf16 matmul 400 GFLOP/s vs fp32 100 GFLOP/s on "
                                      "this CPU (auto takes bf16 from 1.2x fp32's rate)")
    capsys.readouterr()

    monkeypatch.setattr(flops, "_cpu_peak_cache", dict(BF16_SLOW))  # the machine now decides fp32
    assert main(["train", "--resume", str(run), "--train.max_steps=4"]) == 0
    out = capsys.readouterr().out
    assert "precision bf16 |" in out and "precision bf16, as recorded when the run started (precision.mode=auto" in out
    assert _precision(run) == recorded

    # Bit for bit what a bf16 run of 4 steps straight gives.
    straight = train(small_config(precision={"mode": "bf16"}, train={"max_steps": 4}, schedule={"total_steps": 4}),
                     tmp_path / "straight")
    resumed = torch.load(run / "checkpoints" / "step_000004" / "state.pt", weights_only=False)["model"]
    assert all(torch.equal(v, resumed[k]) for k, v in straight.state.model.state_dict().items())


def test_a_mode_given_on_the_command_line_replaces_the_recorded_one(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[precision]\nmode = "bf16"\ndecided_by = "precision.mode=auto on cpu: ..."\n')
    cfg = load_config(path, ["--precision.mode=fp32"])
    assert (cfg.precision.mode, cfg.precision.decided_by) == ("fp32", "")
    assert load_config(path).precision.decided_by == "precision.mode=auto on cpu: ..."
