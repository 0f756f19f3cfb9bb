"""End to end through the `kiln` command line."""
import json
import subprocess
import sys

from kiln.cli.main import COMMANDS, build_parser, main


def test_command_table_matches_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)


def test_train_then_sample(corpus_file, kiln_cache, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--run-dir", str(run), f"--data.source={corpus_file}", f"--data.cache_dir={kiln_cache}",
                 "--model.n_layer=2", "--model.d_model=64", "--model.n_head=2", "--data.seq_len=32",
                 "--train.max_steps=6", "--train.micro_batch_size=4", "--train.eval_batches=2",
                 "--train.sample_tokens=20", "--train.device=cpu", "--log.interval=2", "--log.progress=lines"])
    out = capsys.readouterr().out
    assert code == 0
    assert "sample" in out and "val_loss" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [2, 4, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tokens_seen", "peak_mem_bytes",
                "mfu"):
        assert key in train_records[-1], key
    assert any("val_loss" in r for r in records)
    assert (run / "config.toml").exists() and (run / "tokenizer.json").exists()
    assert (run / "checkpoints" / "step_000006" / "state.pt").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    code = main(["sample", str(run), "--prompt", "def ", "--max-new-tokens", "15", "--temperature", "0.8",
                 "--top-k", "5", "--device", "cpu"])
    text = capsys.readouterr().out
    assert code == 0 and text.startswith("def ") and len(text.encode()) > 4

    # Resume to 8 steps: continues from 6, appends to the same metrics file.
    code = main(["train", "--resume", str(run), "--train.max_steps=8", "--train.sample_tokens=0"])
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6, 8]


def test_errors_exit_nonzero_with_message(tmp_path, capsys):
    assert main(["train", "--model.presett=tiny"]) == 2
    assert "did you mean model.preset?" in capsys.readouterr().err
    assert main(["sample", str(tmp_path)]) == 2
    assert "no config.toml" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path)]) == 2


def test_train_help_lists_every_section():
    out = subprocess.run([sys.executable, "-m", "kiln.cli.main", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for section in ("[model]", "[data]", "[optim]", "[schedule]", "[train]", "[precision]", "[checkpoint]", "[log]"):
        assert section in out
    assert "--resume" in out and "--run-dir" in out
