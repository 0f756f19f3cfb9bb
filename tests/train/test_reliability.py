"""Runs survive signals, corrupt or missing checkpoints, failed writes, a second process and a crash's leftovers."""
import errno
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
import xxhash
from rich.console import Console

from kiln.memory import devices
from kiln.run import oom
from kiln.run.lm import train
from kiln.train import checkpoint as ckpt
from kiln.train.checkpoint import MANIFEST, Checkpointer, CheckpointWriteError, RunLock

ROOT = Path(__file__).resolve().parents[2]


def _train_losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), "a step logged twice"
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _run_cli(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "kiln", "train", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _cli_args(corpus_file, run_dir, steps):
    return ["--model.preset=tiny", "--model.n_layer=2", "--model.n_head=2", "--model.d_model=64",
            "--model.max_seq_len=64", f"--data.source={corpus_file}", "--data.seq_len=32",
            "--train.micro_batch_size=4", f"--train.max_steps={steps}", "--train.device=cpu",
            "--precision.mode=fp32", "--log.interval=1", "--log.tensorboard=false", "--log.progress=lines",
            "--train.sample_tokens=0", "--schedule.warmup_steps=2", "--schedule.total_steps=60",
            f"--run-dir={run_dir}"]


class Background:
    """A `kiln train` started now and awaited later: a reference run trains on the other core while the test drives
    its own run (each has one thread)."""

    def __init__(self, args: list[str], run_dir: Path):
        self.run_dir, self.proc, self.losses = run_dir, _run_cli(args), None

    def train_losses(self) -> dict[int, float]:
        if self.losses is None:
            out, _ = self.proc.communicate(timeout=180)
            assert self.proc.returncode == 0, out
            self.losses = _train_losses(self.run_dir)
        return self.losses

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture(scope="module")
def straight_60(corpus_file, kiln_cache, tmp_path_factory):
    """The uninterrupted 60-step run every signal test must end on, trained once."""
    run = tmp_path_factory.mktemp("straight") / "run"
    straight = Background(_cli_args(corpus_file, run, 60), run)
    yield straight
    straight.stop()


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 138)])
def test_a_signal_ends_the_run_with_a_checkpoint_and_resume_continues_the_curve(corpus_file, kiln_cache, tmp_path,
                                                                                  straight_60, sig, status):
    run = tmp_path / "run"
    proc = _run_cli(_cli_args(corpus_file, run, 60))
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until a few steps are logged, then signal mid-run
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == status, out
    assert f"stopped by {sig.name} at step" in out and "Traceback" not in out
    stopped = int(out.split("at step ")[1].split(":")[0])
    assert (run / "checkpoints" / f"step_{stopped:06d}" / MANIFEST).is_file()
    assert stopped < 60

    resumed = _run_cli(["--resume", str(run), "--train.max_steps=60"])
    out, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, out
    assert _train_losses(run) == straight_60.train_losses()


@pytest.fixture
def three_checkpoints(small_config, tmp_path):
    run = tmp_path / "run"
    train(small_config(train={"max_steps": 6}, checkpoint={"interval": 2}), run)
    return run


def _damage(path: Path, how: str):
    state = path / "state.pt"
    if how == "truncated":
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif how == "flipped":
        data = bytearray(state.read_bytes())
        for i in range(1000, 1100):
            data[i] ^= 0xFF
        state.write_bytes(bytes(data))
    elif how == "empty":
        state.write_bytes(b"")
    elif how == "deleted":
        shutil.rmtree(path)
    elif how == "safetensors and state.pt":  # the weights file damaged, and state.pt too: nothing to write it from
        (path / "model.safetensors").write_bytes(b"garbage")
        _damage(path, "flipped")


@pytest.mark.parametrize("how", ["truncated", "flipped", "empty", "deleted", "safetensors and state.pt"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_good_one(three_checkpoints, how):
    ckpts = three_checkpoints / "checkpoints"
    _damage(ckpts / "step_000006", how)
    said = []
    checkpointer = Checkpointer(ckpt.CheckpointConfig(), three_checkpoints, warn=said.append)
    state = checkpointer.load()
    assert state["step"] == 4 and checkpointer.loaded.name == "step_000004"
    assert len(said) == 1 and ("step_000006" in said[0])


def _flip_or_cut(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flipped":
        middle = len(data) // 2  # inside a tensor's bytes: the header still parses
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:])
    else:
        path.write_bytes(data[: len(data) // 2])


def test_a_damaged_weights_file_is_written_again_from_a_state_that_verifies(small_config, tmp_path):
    """model.safetensors flipped or truncated beside an intact state.pt: the resume takes that checkpoint (not the
    one before), writes the file again byte for byte, reseals the manifest, says so in one line, and trains on
    exactly as from the intact checkpoint."""
    base = tmp_path / "base"
    cfg = dict(checkpoint={"interval": 2}, schedule={"total_steps": 6})
    train(small_config(train={"max_steps": 4}, **cfg), base)
    weights = base / "checkpoints" / "step_000004" / "model.safetensors"
    original = weights.read_bytes()
    losses, said = {}, {}
    for how in ("intact", "flipped", "truncated"):
        run = tmp_path / how
        shutil.copytree(base, run)
        if how != "intact":
            _flip_or_cut(run / "checkpoints" / "step_000004" / "model.safetensors", how)
        out = io.StringIO()
        result = train(small_config(train={"max_steps": 6}, **cfg), run, resume=True,
                       console=Console(file=out, width=400, soft_wrap=True))
        losses[how] = _train_losses(run)
        said[how] = [line for line in out.getvalue().splitlines() if "checkpoint:" in line]
        assert (run / "checkpoints" / "step_000004" / "model.safetensors").read_bytes() == original
        ckpt.verify(run / "checkpoints" / "step_000004")
        assert result.step == 6
    assert losses["flipped"] == losses["truncated"] == losses["intact"]
    assert sorted(losses["intact"]) == list(range(1, 7))
    fix = "step_000004/state.pt verifies and holds the weights: rewrote model.safetensors from it and resealed the " \
          "manifest"
    damaged = "checkpoint: step_000004/model.safetensors"
    assert said == {"intact": [],
                    "flipped": [f"{damaged} does not match its checksum (corrupted); {fix}"],
                    "truncated": [f"{damaged} has {len(original) // 2} bytes, the manifest {len(original)} "
                                  f"(truncated?); {fix}"]}


def test_a_garbage_latest_pointer_and_a_named_bad_checkpoint(three_checkpoints):
    ckpts = three_checkpoints / "checkpoints"
    (ckpts / "latest").write_text("../../etc\n")
    said = []
    assert Checkpointer(ckpt.CheckpointConfig(), three_checkpoints, warn=said.append).load()["step"] == 6
    assert "holds '../../etc', which is not a step" in said[0]
    _damage(ckpts / "step_000004", "flipped")
    with pytest.raises(ckpt.CheckpointCorrupt, match="step_000004/state.pt does not match its checksum"):
        Checkpointer(ckpt.CheckpointConfig(), three_checkpoints).load(path=ckpts / "step_000004")


def test_resume_after_a_crash_logs_each_step_once(small_config, tmp_path):
    """A crash after step 6 was logged but before its checkpoint: resume re-runs 5-6 and the metrics say so once."""
    cfg = dict(train={"max_steps": 6}, checkpoint={"interval": 4}, schedule={"total_steps": 6})
    train(small_config(**cfg), tmp_path / "run")
    import shutil

    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000006")  # the crash
    train(small_config(**cfg), tmp_path / "run", resume=True)
    train(small_config(**cfg), tmp_path / "straight")
    assert _train_losses(tmp_path / "run") == _train_losses(tmp_path / "straight")
    stale = [json.loads(line) for line in (tmp_path / "run" / "metrics.stale-1.jsonl").read_text().splitlines()]
    assert {r["step"] for r in stale} == {5, 6}


def test_a_failed_write_names_the_disk_and_keeps_earlier_checkpoints(three_checkpoints, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    checkpointer = Checkpointer(ckpt.CheckpointConfig(), three_checkpoints)
    size = sum(f.stat().st_size for f in (three_checkpoints / "checkpoints" / "step_000006").rglob("*") if f.is_file())
    with pytest.raises(CheckpointWriteError, match=f"No space left on device.*one checkpoint of this run takes "
                                                   f"{size:,} bytes; earlier checkpoints are intact"):
        checkpointer.save(8, {"step": 8}, "")
    ckpts = three_checkpoints / "checkpoints"
    assert not list(ckpts.glob(".tmp-*"))
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000004", "step_000006"]
    for p in ckpts.glob("step_*"):
        ckpt.verify(p)


def test_leftovers_of_an_interrupted_save_are_cleaned_or_restored(three_checkpoints):
    ckpts = three_checkpoints / "checkpoints"
    (ckpts / ".tmp-step_000008-999").mkdir()
    os.replace(ckpts / "step_000006", ckpts / ".old-step_000006-999")  # a re-save killed after moving it aside
    said = []
    done = Checkpointer(ckpt.CheckpointConfig(), three_checkpoints, warn=said.append).clean_leftovers()
    assert done == [".old-step_000006-999 restored as step_000006", ".tmp-step_000008-999"]
    assert (ckpts / "step_000006" / "state.pt").exists() and not list(ckpts.glob(".tmp-*"))
    assert "removed 2 leftover" in said[0]


def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path):
    with RunLock(tmp_path / "run"):
        started = time.time()
        with pytest.raises(FileExistsError, match=f"in use by process {os.getpid()}"):
            with RunLock(tmp_path / "run"):
                pass
        assert time.time() - started < 5
    with RunLock(tmp_path / "run"):  # released: the next run gets it
        pass


def test_an_os_error_at_the_cli_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run([sys.executable, "-m", "kiln", "train", f"--run-dir={blocker}/run", "--train.max_steps=1"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_kiln_checkpoints_lists_and_marks_the_corrupt_one(three_checkpoints, capsys):
    from kiln.cli.main import main

    _damage(three_checkpoints / "checkpoints" / "step_000006", "truncated")
    _flip_or_cut(three_checkpoints / "checkpoints" / "step_000004" / "model.safetensors", "flipped")
    assert main(["checkpoints", str(three_checkpoints)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step_000006") and "CORRUPT" in out[0] and "(latest)" in out[0]
    assert out[1].startswith("step_000004") and out[1].endswith(
        "ok: step_000004/model.safetensors does not match its checksum (corrupted), written again from state.pt when "
        "it is loaded")
    assert out[-1] == "resume takes: step_000004"


def test_max_time_ends_the_run_with_a_checkpoint(small_config, tmp_path):
    result = train(small_config(train={"max_steps": 10_000, "max_time": "1s"}), tmp_path / "run")
    assert result.stop_reason.startswith("max_time") and 0 < result.step < 10_000
    assert (result.checkpoint / MANIFEST).is_file()


def test_a_wall_clock_interval_saves_between_step_intervals(small_config, tmp_path):
    train(small_config(train={"max_steps": 6}, checkpoint={"every_minutes": 1e-6, "keep_last": 10}), tmp_path / "run")
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == [f"step_{i:06d}" for i in range(1, 7)]  # every step, since the interval is ~0


def test_on_error_warn_trains_on_when_a_save_fails(small_config, tmp_path, monkeypatch):
    real_save = ckpt.torch.save

    def fails_at_step_2(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", fails_at_step_2)
    cfg = small_config(train={"max_steps": 4}, checkpoint={"interval": 2, "on_error": "warn"})
    result = train(cfg, tmp_path / "run")
    assert result.step == 4 and result.checkpoint.name == "step_000004"
    with pytest.raises(CheckpointWriteError):
        train(small_config(train={"max_steps": 4}, checkpoint={"interval": 2}), tmp_path / "stop")


def _prepare(source: str, cache: str) -> int:
    from kiln.data import DataConfig, prepare_data

    return len(prepare_data(DataConfig(source=source, cache_dir=cache, seq_len=32), None, log=lambda m: None).train)


def test_two_cold_runs_racing_on_one_token_cache_both_get_a_valid_one(corpus_file, tmp_path):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        sizes = pool.starmap(_prepare, [(str(corpus_file), str(tmp_path / "cache"))] * 2)
    assert sizes[0] == sizes[1] > 0
    # one cache directory, no scratch left behind; beside it the flock file that made the second prepare wait
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(entries) == 2 and entries[1] == entries[0] + ".lock" and (tmp_path / "cache" / entries[0]).is_dir()
    assert _prepare(str(corpus_file), str(tmp_path / "cache")) == sizes[0]  # and it reads back


def test_kill_9_at_random_moments_never_leaves_an_unloadable_run(corpus_file, kiln_cache, tmp_path):
    """A run saving every step is SIGKILLed at a random moment, 50 times over (about 30 s on a 2-core
    CPU; KILN_KILL9_TRIALS sets another count): what it leaves always loads, at most one interval of steps is
    lost each time, and a resume of the last one trains on to the straight run's curve."""
    rng = random.Random(0)
    trials = int(os.environ.get("KILN_KILL9_TRIALS", "50"))
    steps = max(60, 2 * trials)
    args = _cli_args(corpus_file, tmp_path / "run", steps) + ["--checkpoint.interval=1", "--checkpoint.keep_last=2"]
    with Background(_cli_args(corpus_file, tmp_path / "straight", steps), tmp_path / "straight") as straight:
        for trial in range(trials):
            proc = _run_cli(args if trial == 0 else ["--resume", str(tmp_path / "run"), f"--train.max_steps={steps}"])
            deadline = time.time() + 120  # a first start on a loaded machine, the reference run beside it
            while time.time() < deadline and not (tmp_path / "run" / "checkpoints" / "latest").exists():
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.6))  # somewhere in a step or a save
            proc.kill()
            proc.wait()
            said = []
            state = Checkpointer(ckpt.CheckpointConfig(), tmp_path / "run", warn=said.append).load()
            logged = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                      if line.endswith("}")]
            assert state["step"] >= max(logged) - 1, (trial, state["step"], max(logged), said)
        finished = _run_cli(["--resume", str(tmp_path / "run"), f"--train.max_steps={steps}"])
        out, _ = finished.communicate(timeout=120)
        assert finished.returncode == 0, out
        assert _train_losses(tmp_path / "run") == straight.train_losses()
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_an_out_of_memory_step_prints_the_report_and_exits_3(corpus_file, kiln_cache, tmp_path):
    """faults.oom plants torch.OutOfMemoryError in step 4's forward: the run ends with the estimator's breakdown,
    the measured peak, the device's size, the planner's advice and the checkpoint to resume from, exit status 3."""
    run = tmp_path / "run"
    proc = _run_cli([*_cli_args(corpus_file, run, 10), "--faults.oom=4", "--checkpoint.interval=2"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    assert "Traceback" not in out
    report = out[out.index("out of memory in step 4"):]
    for part in ("planted by faults.oom=4", "predicted peak", "parameters", "measured peak so far", "the device holds",
                 "kiln plan:", "step_000002", "exit status 3"):
        assert part in report, part
    assert _train_losses(run).keys() == {1, 2, 3}  # nothing of the failed step was logged


def test_the_ram_check_refuses_before_any_data_is_prepared_and_force_warns(small_config, tmp_path, monkeypatch):
    cfg = small_config(train={"max_steps": 2})
    need = oom.predicted_peak(cfg, torch.device("cpu"))
    monkeypatch.setattr(oom, "available_memory", lambda: need // 2)
    cfg.data.cache_dir = str(tmp_path / "never-made")
    with pytest.raises(ValueError, match=r"predicts a peak of .* --force"):
        train(cfg, tmp_path / "refused")
    assert not (tmp_path / "never-made").exists() and not (tmp_path / "refused").exists()
    console = Console(record=True, width=200)
    result = train(cfg, tmp_path / "forced", console=console, force=True)
    assert result.step == 2 and "training anyway (--force)" in console.export_text()
    monkeypatch.setattr(oom, "available_memory", devices.available_memory)
    assert need < devices.available_memory()  # the real check passes this small job


def test_manifests_of_either_checksum_catch_one_flipped_byte(three_checkpoints):
    """Manifests hold xxh3 checksums; those written with CRC-32 (before xxh3) still verify. Either catches a single
    flipped byte, and both checksums agree with independent implementations (zlib, xxhash over read bytes)."""
    path = three_checkpoints / "checkpoints" / "step_000006"
    manifest = json.loads((path / MANIFEST).read_text())
    data = (path / "state.pt").read_bytes()
    assert manifest["state.pt"]["xxh3"] == xxhash.xxh3_64(data).hexdigest()
    ckpt.verify(path)
    old = {name: {"bytes": e["bytes"], "crc32": f"{zlib.crc32((path / name).read_bytes()):08x}"}
           for name, e in manifest.items()}
    (path / MANIFEST).write_text(json.dumps(old))
    ckpt.verify(path)
    for entries in (old, manifest):
        (path / MANIFEST).write_text(json.dumps(entries))
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        (path / "state.pt").write_bytes(bytes(flipped))
        with pytest.raises(ckpt.CheckpointCorrupt, match="does not match its checksum"):
            ckpt.verify(path)
        (path / "state.pt").write_bytes(data)
