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


def _help(*argv) -> str:
    """What `kiln ARGV --help` prints, from the parser itself (in this process)."""
    parser = build_parser()
    if argv:
        parser = next(a for a in parser._actions if a.dest == "command").choices[argv[0]]
    return " ".join(parser.format_help().split())  # argparse's wrapping undone


def _continuations(cls) -> dict[str, list[str]]:
    """{field: the comment-only lines right below it}, read with Python's own tokenizer (not field_help's regex)."""
    import inspect
    import io
    import textwrap
    import tokenize

    tokens = list(tokenize.generate_tokens(io.StringIO(textwrap.dedent(inspect.getsource(cls))).readline))
    alone = {t.start[0]: t.string.lstrip("#").strip() for t in tokens
             if t.type == tokenize.COMMENT and t.line.strip().startswith("#")}
    fields = {t.start[0]: t.string for t, after in zip(tokens, tokens[1:])
              if t.type == tokenize.NAME and t.start[1] == 4 and after.string == ":"}
    out = {}
    for row, name in fields.items():
        while row + 1 in alone:
            row += 1
            out.setdefault(name, []).append(alone[row])
    return out


def test_help_says_what_the_code_accepts():
    """The families `kiln export` writes, the forms data.source reads and every config key's whole comment, each as
    the code has them: the help is derived from the tables the code dispatches on, so it cannot fall behind."""
    import dataclasses
    from pathlib import Path

    from kiln.config import SECTIONS, describe
    from kiln.data.corpus import EXTENSIONS, FORMAT_NAMES, by_extension, sources
    from kiln.data.prepare import file_kind
    from kiln.interop.hf import hf_config
    from kiln.models.registry import FAMILIES

    exporting = []  # a family exports when its Hugging Face config.json and tensor names can be written
    for name, fam in FAMILIES.items():
        cfg = dataclasses.replace(next(iter(fam.presets.values())), vocab_size=256).resolve()
        try:
            hf_config(cfg, 256), fam.hf_tensors(cfg)
            exporting.append(name)
        except (TypeError, NotImplementedError, ValueError):
            pass
    assert exporting == list(FAMILIES) and len(exporting) == 4  # every family kiln has exports today
    for text in (_help(), _help("export")):
        assert f"({', '.join(exporting)})" in text or f"(model.arch): {', '.join(exporting)}." in text, text
    assert "GPT-2, Llama)" not in _help()

    keys = {}
    for line in describe().splitlines():
        if line.startswith("  --"):
            key, _, text = line.strip().partition("  ")
            keys[key.split("=")[0]] = text
    assert keys["--data.source"] == sources() and f"auto (by extension: {by_extension()})" in keys["--data.format"]
    for ext, fmt in EXTENSIONS.items():  # each extension the help names is read as that format
        assert file_kind(Path(f"corpus{ext}"), "auto")[0] == fmt
        assert ext in sources() and FORMAT_NAMES[fmt] in sources() and f"{ext}" in by_extension()
    assert file_kind(Path("corpus.jsonl.zst"), "auto") == ("jsonl", "zst")
    assert file_kind(Path("notes.md"), "auto")[0] == "text"
    for form in ("'stdlib'", "a text file", "a directory", "`datasets` save_to_disk directory", "data.format=tokens"):
        assert form in sources()

    continued = 0
    for section, cls in SECTIONS.items():
        for name, lines in _continuations(cls).items():
            assert keys[f"--{section}.{name}"].endswith(" ".join(lines)), (section, name)
            continued += 1
    assert continued >= 2  # parallel.strategy and parallel.tp span lines today: the scan found them
    assert keys["--parallel.strategy"].endswith("(FSDP2 fully_shard): the rows of kiln.parallel.strategy.STRATEGIES")
