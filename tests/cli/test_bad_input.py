"""Bad input is one clear line: exit status 2, a message naming the key, file or value and the fix, no traceback.

Each case runs the real `kiln` entry point in this process (fast) with stderr captured. A case passes when the
command returns 2, stderr is exactly one line `kiln CMD: error: ...` holding every expected fragment, and no
traceback was printed anywhere. `KILN_DEBUG=1` turns the line back into the traceback (tested once at the end).
"""
from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from kiln.cli.main import main
from kiln.config import SECTIONS, load_config
from kiln.run.lm import train

SMALL = ["--model.preset=tiny", "--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", "--model.max_seq_len=32",
         "--data.seq_len=16", "--train.micro_batch_size=2", "--train.max_steps=1", "--train.device=cpu",
         "--precision.mode=fp32", "--log.tensorboard=false", "--log.progress=off", "--train.sample_tokens=0",
         "--train.eval_batches=1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, corpus_file):
    """Files and directories the cases point at, and one real (tiny) run to resume and sample from."""
    root = tmp_path_factory.mktemp("bad input")  # a space in every path: it must never matter
    files = {
        "toml_syntax": ("[optim\nlr = 1", "text"),
        "toml_type": ("[train]\nmax_steps = \"many\"\n", "text"),
        "toml_top_key": ("lr = 3e-4\n", "text"),
        "toml_unknown": ("[optim]\nlearning_rate = 3e-4\n", "text"),
        "empty.txt": ("", "text"),
        "short.txt": ("abc", "text"),
        "binary.bin": (bytes(range(256)) * 64, "bytes"),
        "a file": ("not a directory", "text"),
        "bad prompts.jsonl": ('{"prompt": "a"}\n{"prompt": "b",\n', "text"),
    }
    for name, (content, kind) in files.items():
        path = root / name
        path.write_bytes(content) if kind == "bytes" else path.write_text(content)
    (root / "empty dir").mkdir()
    (root / "not a run").mkdir()
    (root / "not a run" / "notes.txt").write_text("hello")
    readonly = root / "read-only"
    readonly.mkdir()
    read_only_skip = _make_read_only(readonly)
    run = root / "run ü"
    cfg = load_config(None, [*SMALL, f"--data.source={corpus_file}", "--train.max_steps=2",
                             "--checkpoint.interval=2"])
    train(cfg, run)
    yield {"root": root, "run": run, "corpus": corpus_file, "read_only_skip": read_only_skip}
    if os.geteuid() == 0 and read_only_skip is None:
        subprocess.run(["umount", str(readonly)], check=False)
    readonly.chmod(stat.S_IRWXU)


def _make_read_only(path: Path) -> str | None:
    """A directory nobody can write: permissions for a user; for root, who ignores them, a read-only tmpfs mount.
    Returns why it could not be done (the read-only cases then skip with that reason), or None on success."""
    if os.geteuid() != 0:
        path.chmod(stat.S_IRUSR | stat.S_IXUSR)
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True,
                          text=True)
    return None if done.returncode == 0 else f"running as root, and a read-only tmpfs cannot be mounted here: " \
                                              f"{done.stderr.strip()}"


def _cases():
    """(id, argv template, fragments the one line must hold). {root}, {run}, {corpus} are filled from `world`."""
    t = ["train", *SMALL, "--data.source={corpus}"]
    return [
        # config keys, sections, types, sizes
        ("unknown key", [*t, "--optim.lrr=1e-3"], ["optim.lrr", "did you mean optim.lr"]),
        ("unknown section", [*t, "--optimz.lr=1e-3"], ["optimz", "did you mean 'optim'"]),
        ("not an int", [*t, "--train.max_steps=many"], ["train.max_steps", "'many'", "int"]),
        ("not a bool", [*t, "--log.tensorboard=maybe"], ["log.tensorboard", "'maybe'"]),
        ("negative steps", [*t, "--train.max_steps=-5"], ["train.max_steps", "-5"]),
        ("negative layers", [*t, "--model.n_layer=-1"], ["model.n_layer", "-1"]),
        ("zero micro-batch", [*t, "--train.micro_batch_size=0"], ["train.micro_batch_size"]),
        ("negative eval micro-batch", [*t, "--train.eval_micro_batch_size=-1"], ["train.eval_micro_batch_size", "-1"]),
        ("zero seq_len", [*t, "--data.seq_len=0"], ["data.seq_len"]),
        ("seq_len over the model", [*t, "--data.seq_len=4096"], ["seq_len", "max_seq_len"]),
        ("heads do not divide width", [*t, "--model.n_head=3"], ["n_head", "d_model"]),
        ("negative lr", [*t, "--optim.lr=-1"], ["optim.lr"]),
        ("nan lr", [*t, "--optim.lr=nan"], ["optim.lr", "finite"]),
        ("inf lr", [*t, "--optim.lr=inf"], ["optim.lr", "finite"]),
        ("nan clip", [*t, "--optim.grad_clip=nan"], ["optim.grad_clip", "finite"]),
        ("unknown precision", [*t, "--precision.mode=fp12"], ["precision.mode", "fp12"]),
        ("fp8 on a CPU", [*t, "--precision.mode=fp8"], ["precision.mode='fp8'", "compute capability", "use bf16"]),
        ("unknown optimizer", [*t, "--optim.name=adamz"], ["optim.name", "adamz"]),
        ("unknown preset", [*t, "--model.preset=gpt5"], ["model.preset", "gpt5"]),
        ("unknown device", [*t, "--train.device=tpu"], ["train.device", "tpu"]),
        ("bad duration", [*t, "--train.max_time=soon"], ["train.max_time", "soon"]),
        ("moved key", [*t, "--model.kernels=triton"], ["model.kernels", "train.kernels"]),
        ("override without a value", [*t, "--optim.lr"], ["--optim.lr"]),
        ("stray argument", [*t, "lr=3"], ["lr=3", "--section.key=value"]),
        ("unknown flag", [*t, "--fast"], ["--fast"]),
        # config files
        ("TOML syntax error", ["train", "{root}/toml_syntax"], ["toml_syntax", "not valid TOML"]),
        ("TOML wrong type", ["train", "{root}/toml_type"], ["train.max_steps", "'many'"]),
        ("TOML top-level key", ["train", "{root}/toml_top_key"], ["'lr'", "[section]"]),
        ("TOML unknown key", ["train", "{root}/toml_unknown"], ["optim.learning_rate", "toml_unknown"]),
        ("config is a directory", ["train", "{root}/empty dir"], ["empty dir", "is a directory"]),
        ("config is missing", ["train", "{root}/missing.toml"], ["missing.toml", "does not exist"]),
        # resume
        ("resume a file", ["train", "--resume={root}/a file"], ["a file"]),
        ("resume an empty directory", ["train", "--resume={root}/empty dir"], ["empty dir", "config.toml"]),
        ("resume a directory that is not a run", ["train", "--resume={root}/not a run"], ["not a run", "config.toml"]),
        ("resume a missing directory", ["train", "--resume={root}/nowhere"], ["nowhere"]),
        ("resume another model shape", ["train", "--resume={run}", "--model.n_layer=3"], ["--model.n_layer=3", "(the run has 1)", "new --run-dir"]),
        ("resume with a config file", ["train", "{root}/toml_type", "--resume={run}"], ["--resume", "CONFIG"]),
        # data
        ("data path missing", ["train", *SMALL, "--data.source={root}/nowhere.txt"], ["data.source", "nowhere.txt"]),
        ("data file empty", ["train", *SMALL, "--data.source={root}/empty.txt"], ["data.source", "empty.txt"]),
        ("data file binary", ["train", *SMALL, "--data.source={root}/binary.bin"], ["data.source", "binary.bin"]),
        ("data too short", ["train", *SMALL, "--data.source={root}/short.txt"], ["data.source", "short.txt"]),
        # run and cache directories
        ("run dir is a file", [*t, "--run-dir={root}/a file"], ["a file", "move it or choose another path"]),
        ("run dir read-only", [*t, "--run-dir={root}/read-only/run"], ["read-only", "choose"]),
        ("cache dir is a file", [*t, "--run-dir={root}/r1", "--data.cache_dir={root}/a file"], ["a file", "choose"]),
        ("cache dir read-only", [*t, "--run-dir={root}/r2", "--data.cache_dir={root}/read-only/cache"],
         ["read-only", "choose"]),
        # the other commands
        ("memory: nan", ["memory", "--optim.lr=nan", "--out="], ["optim.lr", "finite"]),
        ("memory: unknown key", ["memory", "--model.layers=3", "--out="], ["model.layers"]),
        ("memory: unknown device", ["memory", "--device=H900", "--out="], ["H900"]),
        ("memory: fp8 on an A100", ["memory", "--device=A100", "--precision.mode=fp8", "--out="],
         ["A100-80GB is 8.0", "use bf16"]),
        ("memory: zero ranks", ["memory", "--ranks=0", "--out="], ["--ranks"]),
        ("memory: ranks not a number", ["memory", "--ranks=two", "--out="], ["--ranks", "'two'"]),
        ("plan: zero GPUs", ["plan", "--gpus=0"], ["--gpus"]),
        ("plan: memory unreadable", ["plan", "--memory=lots"], ["lots"]),
        ("plan: unknown interconnect", ["plan", "--gpus=2", "--interconnect=carrier-pigeon"], ["carrier-pigeon"]),
        ("plan: inf", ["plan", "--optim.weight_decay=inf"], ["optim.weight_decay", "finite"]),
        ("doctor: missing config", ["doctor", "{root}/missing.toml"], ["missing.toml"]),
        ("doctor: unknown key", ["doctor", "--train.max_stepz=3"], ["train.max_stepz"]),
        ("sample: missing run", ["sample", "{root}/nowhere"], ["nowhere"]),
        ("sample: not a run", ["sample", "{root}/not a run"], ["not a run"]),
        ("sample: negative tokens", ["sample", "{run}", "--max-new-tokens=-3"], ["--max-new-tokens"]),
        ("sample: nan temperature", ["sample", "{run}", "--temperature=nan"], ["--temperature"]),
        ("sample: top-p above 1", ["sample", "{run}", "--top-p=1.5"], ["--top-p=1.5", "[0, 1]"]),
        ("sample: prompt file not JSON", ["sample", "{run}", "--prompt-file={root}/bad prompts.jsonl"],
         ["bad prompts.jsonl:2", "not a JSON object"]),
        ("sample: missing prompt file", ["sample", "{run}", "--prompt-file={root}/nowhere.jsonl"], ["nowhere.jsonl"]),
        ("sample: prompt and prompt file", ["sample", "{run}", "--prompt=a", "--prompt-file={root}/bad prompts.jsonl"],
         ["--prompt-file"]),
        ("sample: chat without a template", ["sample", "{run}", "--chat"], ["no chat template", "--chat-template"]),
        ("sample: missing checkpoint", ["sample", "{run}/checkpoints/step_000009"], ["step_000009"]),
        ("checkpoints: missing run", ["checkpoints", "{root}/nowhere"], ["nowhere"]),
        ("estimate: zero GPUs", ["estimate", "--tokens=1B", "--device=H100", "--gpus=0"], ["--gpus"]),
        ("estimate: unknown device", ["estimate", "--tokens=1B", "--device=H1000"], ["H1000", "H100"]),
        ("estimate: tokens not a number", ["estimate", "--tokens=lots", "--device=H100"], ["lots", "2T"]),
        ("estimate: MFU over 1", ["estimate", "--tokens=1B", "--device=H100", "--mfu=1.5"], ["MFU", "1.5"]),
        ("estimate: no token count", ["estimate", "--device=H100"], ["--tokens", "--chinchilla"]),
        ("estimate: a run without MFU", ["estimate", "--tokens=1B", "--device=H100", "--from-run={root}/not a run"],
         ["not a run", "metrics.jsonl"]),
        ("unknown command", ["trian"], ["trian"]),
    ]


CASES = _cases()


@pytest.mark.parametrize("argv, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(world, argv, fragments, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    if "{root}/read-only" in " ".join(argv) and world["read_only_skip"]:
        pytest.skip(world["read_only_skip"])
    argv = [a.format(**world) for a in argv]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own errors
        status = e.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2, f"exit status {status}\nstdout: {out}\nstderr: {err}"
    assert len(lines) == 1 and lines[0].startswith(f"kiln {argv[0] if argv[0] != 'trian' else ''}".rstrip()), err
    assert "Traceback" not in out + err
    for fragment in fragments:
        assert fragment.format(**world) in lines[0], f"{fragment!r} not in: {lines[0]}"


def _float_keys():
    return [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
            if float in typing.get_args(typing.get_type_hints(cls)[f.name]) or typing.get_type_hints(cls)[f.name] is float]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_refuses_non_finite_values(value, capsys):
    keys = _float_keys()
    assert len(keys) >= 20, keys  # the sections do hold this many float keys: the scan works
    for key in keys:
        assert main(["memory", f"--{key}={value}", "--out="]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and key in err[0] and "finite" in err[0], (key, err)


def test_spaces_and_unicode_in_override_values_are_values_not_a_config_path(world, tmp_path, monkeypatch):
    """`--train.sample_prompt="def f"` is one shell word with a space: it must reach the config, not argparse's
    positional CONFIG; a data path with spaces and non-ASCII letters trains."""
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "dätä with spaces.txt"
    corpus.write_text(world["corpus"].read_text())
    run = tmp_path / "rün dir"
    status = main(["train", *SMALL, f"--data.source={corpus}", "--train.sample_prompt=def f(x):",
                   "--train.sample_tokens=4", f"--run-dir={run}"])
    assert status == 0
    assert 'sample_prompt = "def f(x):"' in (run / "config.toml").read_text()


def test_kiln_debug_shows_the_traceback(tmp_path):
    env = dict(os.environ, KILN_DEBUG="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-m", "kiln", "memory", "--optim.lr=nan", "--out="], capture_output=True,
                          text=True, env=env, cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "optim.lr" in proc.stderr


# Word for word: the edges of issue 36, each once the one line a user reads.
EXACT = [
    ("negative width", [*SMALL, "--model.d_model=-64"],
     "kiln train: error: model.d_model must be ≥ 1 (0: the preset's), got -64"),
    ("triton on a CPU", [*SMALL, "--model.dropout=0", "--train.kernels=triton"],
     "kiln train: error: train.kernels='triton' runs on CUDA; on cpu only through Triton's interpreter: set "
     "TRITON_INTERPRET=1 in the environment before starting (slow, meant for tests), or use train.kernels='auto' or "
     "'torch'"),
    ("FSDP2's CPU offload on a CPU", [*SMALL, "--parallel.strategy=fsdp", "--parallel.cpu_offload=true"],
     "kiln train: error: parallel.cpu_offload keeps FSDP2's parameters, gradients and optimizer state in host memory, "
     "and train.device is the CPU, whose memory that is: nothing would move; drop --parallel.cpu_offload "
     "(parallel.strategy=fsdp still shards them over the ranks)"),
]


@pytest.mark.parametrize("argv, line", [c[1:] for c in EXACT], ids=[c[0] for c in EXACT])
def test_the_refusals_word_for_word(world, argv, line, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # tests/kernels sets it for the interpreter
    status = main(["train", *argv, f"--data.source={world['corpus']}", f"--run-dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert (status, err.splitlines()) == (2, [line]), out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused at start


def test_sample_on_a_run_without_a_checkpoint_says_it_has_none(world, capsys, tmp_path):
    """A config.toml and nothing else (its model.vocab_size 0: the tokenizer's, which only a trained run knows)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text((world["run"] / "config.toml").read_text().replace("vocab_size = 256",
                                                                                       "vocab_size = 0"))
    assert main(["sample", str(run), "--device=cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kiln sample: error: {run} has no checkpoint: the run saved none yet (it saves every checkpoint.interval "
        f"steps and at its end); train it first"]


def test_levers_that_do_nothing_on_a_cpu_say_so_at_start(world, capsys, tmp_path):
    status = main(["train", *SMALL, f"--data.source={world['corpus']}", f"--run-dir={tmp_path / 'run'}",
                   "--memory.offload_blocks=all", "--optim.offload=host"])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[1:3] == [  # after "run directory: ...", before the data
        "memory.offload_blocks=all does nothing on a CPU: it copies a GPU's saved activations to host memory, where a "
        "CPU run keeps them already (drop it to train the same without this line)",
        "optim.offload=host saves no memory on a CPU: the optimizer state it moves to the host is in host memory "
        "already, and it keeps fp32 copies of the parameters and gradients beside them (8 bytes a parameter more when "
        "the parameters are fp32); --optim.offload=none uses less memory"]
