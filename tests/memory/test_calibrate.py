"""The planner's time constants measured on the device: fitted to real steps, kept per device, used by plans."""
import json
from dataclasses import replace

import pytest

from kiln.cli.main import main
from kiln.config import load_config
from kiln.memory import calibrate
from kiln.memory.devices import get_device
from kiln.memory.levers import JobSections, job_for
from kiln.memory.planner import fit_time_model, step_time, time_constants

SHAPES = [["--model.preset=tiny", "--model.n_layer=2", "--model.d_model=256", "--model.n_head=4",
           "--model.max_seq_len=128", "--data.seq_len=128", f"--train.micro_batch_size={m}"] for m in (1, 8)]


def test_the_fit_recovers_the_constants_that_made_the_times():
    """Step times made by step_time with known constants: the least-squares fit gives those constants back.

    The device's peak and bandwidth are fixed here, not the host's measured ones: the fit is first order in the
    matmul efficiency and the roofline's max(compute, memory) bends it where an op changes sides between e = 1 and
    0.5. On the 2-core Intel Xeon with AMX under load (2026-11-27) the measured rates (fp32 88 GFLOP/s, 5.8 GB/s,
    remeasured each session) fitted 0.64 or 1.0 for 0.55."""
    device = replace(get_device("cpu"), time_model=None, peak_flops={"fp32": 200e9, "bf16": 400e9, "fp16": 200e9},
                     bandwidth=20e9)
    truth = {"matmul_efficiency": 0.55, "bandwidth_efficiency": 0.8, "op_overhead_s": 7e-6, "measured": "test"}
    made = replace(device, time_model=truth)
    jobs = [job_for(JobSections.of(load_config(None, shape)), device) for shape in SHAPES]
    fitted = fit_time_model(device, [(j, step_time(j, made)["total"]) for j in jobs], 0.8)
    assert fitted["matmul_efficiency"] == pytest.approx(0.55, rel=0.02)
    assert fitted["op_overhead_s"] == pytest.approx(7e-6, rel=0.02)


def test_a_calibration_is_kept_per_device_and_used_by_plans(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    cpu = get_device("cpu")
    assert calibrate.load(replace(cpu, time_model=None)).time_model is None
    assert main(["plan", "--memory=2GiB", "--calibrate", "--top=1"]) == 0
    out = capsys.readouterr().out
    path = calibrate.cache_path(cpu)
    model = json.loads(path.read_text())
    assert path.is_relative_to(tmp_path) and 0 < model["matmul_efficiency"] <= 1 and model["op_overhead_s"] > 0
    assert f"calibrated cpu: matmuls reach {model['matmul_efficiency']:.0%} of the peak" in out
    loaded = calibrate.load(replace(cpu, time_model=None))
    me, _, op, source = time_constants(loaded)
    assert (me, op) == (model["matmul_efficiency"], model["op_overhead_s"]) and source.startswith("calibrated")
    path.write_text("{broken")
    assert calibrate.load(replace(cpu, time_model=None)).time_model is None  # the defaults until recalibrated
