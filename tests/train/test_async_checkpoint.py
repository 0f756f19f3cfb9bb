"""checkpoint.async_save: training goes on while a checkpoint is written; a kill during the write leaves the
previous checkpoint as `latest`; what is written equals the synchronous save of the same step."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from kiln.run.lm import train
from kiln.train.checkpoint import CheckpointConfig, Checkpointer, Staging, verify

ROOT = Path(__file__).resolve().parents[2]


def test_a_kill_while_an_async_save_is_written_leaves_the_previous_checkpoint(corpus_file, kiln_cache, tmp_path):
    """The step-6 save's state.pt takes 60 s to write (a slow disk): steps 7 and 8 train meanwhile, then the
    process is SIGKILLed; step 3 stays `latest` and verifies, step 6 never appears."""
    run = tmp_path / "run"
    args = ["--model.preset=tiny", "--model.n_layer=2", "--model.n_head=2", "--model.d_model=64",
            "--model.max_seq_len=64", f"--data.source={corpus_file}", "--data.seq_len=32", "--data.prefetch=0",
            "--train.micro_batch_size=4", "--train.max_steps=12", "--train.device=cpu", "--precision.mode=fp32",
            "--log.interval=1", "--log.tensorboard=false", "--log.progress=lines", "--train.sample_tokens=0",
            "--schedule.warmup_steps=2", "--checkpoint.interval=3", "--checkpoint.async_save=true",
            f"--run-dir={run}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", KILN_TEST_SLOW_SAVE="6@60")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "parallel" / "elastic_entry.py"), "train", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, steps = time.time() + 120, []
    try:
        while time.time() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file():
                lines = (run / "metrics.jsonl").read_text().splitlines()
                steps = [r["step"] for r in map(json.loads, lines[:-1] if lines else []) if r["kind"] == "train"]
            if steps and max(steps) >= 8:
                break
            time.sleep(0.05)
        in_flight = list((run / "checkpoints").glob(".tmp-step_000006-*"))
        latest_then = (run / "checkpoints" / "latest").read_text().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        output = proc.communicate()[0]
    assert max(steps) >= 8, output[-3000:]  # training went on past step 6 while its checkpoint was written
    assert in_flight and latest_then == "step_000003"
    assert not (run / "checkpoints" / "step_000006").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    verify(run / "checkpoints" / "step_000003")
    assert Checkpointer(CheckpointConfig(), run).load()["step"] == 3


def test_async_checkpoints_equal_synchronous_ones(small_config, tmp_path):
    """The state is copied before training changes it: weights and optimizer moments of the async checkpoint at
    step 3 (written while steps 4-6 train) equal those of the synchronous save."""
    runs = {}
    for async_save in (False, True):
        cfg = small_config(checkpoint={"interval": 3, "async_save": async_save}, train={"max_steps": 6})
        runs[async_save] = tmp_path / f"async_{async_save}"
        train(cfg, runs[async_save])
    for step in ("step_000003", "step_000006"):
        sync, done = (runs[a] / "checkpoints" / step for a in (False, True))
        verify(done)
        a, b = load_file(str(sync / "model.safetensors")), load_file(str(done / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        sa, sb = (torch.load(d / "state.pt", weights_only=True)["optimizer"]["state"] for d in (sync, done))
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in ("exp_avg", "exp_avg_sq"))


def test_staging_copies_into_the_last_saves_buffers():
    """The async save's host copy: equal to the state when taken, untouched by training afterwards, one buffer
    per storage (the model's weights in the state and for safetensors, tied weights), and the next save copies
    into the same buffers (no new allocation, whose page faults made every async save pay again)."""
    w, m = torch.randn(4, 3), torch.randn(5)
    weights = {"w": w, "head": w}  # tied
    state = {"model": {"w": w.detach()}, "optimizer": {"m": m}, "step": 3, "history": [w[1:]]}
    staging = Staging()
    first, first_weights = staging.copy((state, weights))
    assert torch.equal(first["model"]["w"], w) and torch.equal(first["optimizer"]["m"], m) and first["step"] == 3
    assert first_weights["w"] is first_weights["head"] is first["model"]["w"]
    assert torch.equal(first["history"][0], w[1:])
    assert first["model"]["w"].data_ptr() != w.data_ptr()
    before = w.clone()
    w.add_(1.0)  # training goes on
    assert torch.equal(first_weights["w"], before)
    second, second_weights = staging.copy((state, weights))
    assert torch.equal(second_weights["w"], w) and torch.equal(second["optimizer"]["m"], m)
    assert second_weights["w"].data_ptr() == first_weights["w"].data_ptr()
    assert second["optimizer"]["m"].data_ptr() == first["optimizer"]["m"].data_ptr()
    assert staging.copy({"m": m.clone()})["m"].data_ptr() != first["optimizer"]["m"].data_ptr()  # another tensor
