"""Garbage in every file kiln reads back: one line naming the file and what to do, or a fallback to the previous
good checkpoint, never a bare `'utf-8' codec can't decode`; a run without a checkpoint says exactly that."""
import json
import shutil

import pytest

from kiln.cli.main import main
from kiln.config import ConfigError, load_config
from kiln.data.tokenizer import load_tokenizer
from kiln.report import write_report
from kiln.run.lm import train
from kiln.train.checkpoint import Checkpointer, CheckpointConfig

GARBAGE = bytes(range(256)) * 4  # every byte value: not UTF-8, not JSON, not TOML


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_file, kiln_cache):
    """A 6-step run with checkpoints at steps 3 and 6."""
    from kiln.config import make_config
    from kiln.data import DataConfig
    from tests.conftest import small_model

    cfg = make_config(model=small_model(), data=DataConfig(source=str(corpus_file), seq_len=32, prefetch=0))
    tc = cfg.train
    tc.max_steps, tc.micro_batch_size, tc.eval_batches, tc.sample_tokens, tc.device = 6, 4, 2, 0, "cpu"
    cfg.precision.mode, cfg.log.interval, cfg.log.tensorboard, cfg.log.progress = "fp32", 1, False, "off"
    cfg.schedule.warmup_steps, cfg.checkpoint.interval = 2, 3
    run = tmp_path_factory.mktemp("trained") / "run"
    train(cfg, run)
    return run


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def one_line_error(text: str) -> str:
    lines = [line for line in text.splitlines() if "error:" in line]
    assert len(lines) == 1, text
    assert "codec can't decode" not in lines[0]
    return lines[0]


def test_a_binary_config_file_is_named(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_bytes(GARBAGE)
    with pytest.raises(ConfigError, match=r"job.toml is not a TOML text file \(byte 128 is not UTF-8"):
        load_config(path)
    code, out = cli(capsys, "train", str(path))
    assert code == 2 and "job.toml is not a TOML text file" in one_line_error(out)


@pytest.mark.parametrize("text, why", [
    (GARBAGE, "holds binary bytes"),
    (b"hello\n", "holds 'hello', which is not a step (it should read like step_000400)"),
    (b"step_000009\n", "names step_000009, which is not in"),
])
def test_a_latest_pointer_that_is_not_a_step_is_said_and_the_newest_good_checkpoint_used(run, text, why, capsys):
    (run / "checkpoints" / "latest").write_bytes(text)
    warnings = []
    checkpointer = Checkpointer(CheckpointConfig(), run, warn=warnings.append)
    assert checkpointer.latest().name == "step_000006"
    assert checkpointer.load()["step"] == 6
    assert len(warnings) == 1 and why in warnings[0] and "using the newest checkpoint that verifies" in warnings[0]
    code, out = cli(capsys, "checkpoints", str(run))
    assert code == 0 and f"note: " in out and why in out and "resume takes: step_000006" in out


def test_a_bare_step_number_in_latest_is_that_step(run):
    (run / "checkpoints" / "latest").write_text("3\n")
    warnings = []
    assert Checkpointer(CheckpointConfig(), run, warn=warnings.append).latest().name == "step_000003"
    assert warnings == []


@pytest.mark.parametrize("content", [GARBAGE, b'["not", "a", "manifest"]', b'{"state.pt": 12}'])
def test_a_damaged_manifest_falls_back_to_the_previous_checkpoint(run, content):
    (run / "checkpoints" / "step_000006" / "manifest.json").write_bytes(content)
    warnings = []
    checkpointer = Checkpointer(CheckpointConfig(), run, warn=warnings.append)
    assert checkpointer.load()["step"] == 3
    assert any("skipping step_000006: step_000006/manifest.json is" in w for w in warnings), warnings


def test_a_damaged_tokenizer_is_named(run, capsys):
    (run / "tokenizer.json").write_bytes(GARBAGE)
    with pytest.raises(ValueError, match=r"tokenizer.json is not valid JSON \(binary bytes, not UTF-8\); delete it"):
        load_tokenizer(run)
    code, out = cli(capsys, "sample", str(run), "--max-new-tokens=2", "--device=cpu")
    assert code == 2 and "tokenizer.json is not valid JSON" in one_line_error(out)


def test_a_damaged_config_and_damaged_metrics_lines_do_not_stop_a_resume(run, capsys, tmp_path):
    """The run's config.toml in binary garbage: the copy in the latest checkpoint is used, said in one line;
    garbage lines in metrics.jsonl move aside with the records of the interrupted attempt."""
    (run / "config.toml").write_bytes(GARBAGE)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(GARBAGE[128:400] + b"\n")
    code, out = cli(capsys, "train", "--resume", str(run), "--train.max_steps=7")
    assert code == 0, out
    assert "is not a TOML text file" in out and "resuming with the copy in step_000006/config.toml" in out
    assert "resumed from" in out and "at step 6" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 8))
    assert "\ufffd" in (run / "metrics.stale-1.jsonl").read_text()  # the damaged line, kept aside
    (run / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes() + GARBAGE[128:160] + b"\n")
    _, report = write_report([run], tmp_path / "r.html")
    assert report.runs[0].unreadable_lines == 1 and len(report.runs[0].train) == 7


@pytest.mark.parametrize("command", [["sample", "--max-new-tokens=2", "--device=cpu"], ["export", "--hf", "OUT"]])
def test_sample_and_export_on_a_run_without_a_checkpoint_say_so(run, command, capsys, tmp_path):
    shutil.rmtree(run / "checkpoints")
    argv = [command[0], str(run), *[str(tmp_path / a) if a == "OUT" else a for a in command[1:]]]
    code, out = cli(capsys, *argv)
    assert code == 2
    assert f"{run} has no checkpoint: the run saved none yet" in one_line_error(out)


def test_report_on_a_run_without_a_checkpoint_says_so(run, capsys, tmp_path):
    code, out = cli(capsys, "report", str(run), "--out", str(tmp_path / "with.html"))
    assert code == 0 and "no checkpoint" not in out
    shutil.rmtree(run / "checkpoints")
    code, out = cli(capsys, "report", str(run), "--out", str(tmp_path / "without.html"))
    assert code == 0 and "run: finished: 6 steps, val_loss" in out
    assert "; no checkpoint (nothing to resume, sample or export)" in out


def test_a_run_whose_checkpoints_are_all_damaged_says_so(run, capsys):
    for step in ("step_000003", "step_000006"):
        (run / "checkpoints" / step / "state.pt").write_bytes(GARBAGE)
    code, out = cli(capsys, "sample", str(run), "--max-new-tokens=2", "--device=cpu")
    assert code == 2 and "has 2 checkpoint(s) and none verifies (`kiln checkpoints" in one_line_error(out)
