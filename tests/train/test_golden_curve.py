"""A stored loss curve: the first 30 steps of two small fixed runs in float64 on CPU, kept under tests/.

torchtitan keeps such curves so that a restructuring of the loop can be shown to change nothing. The runs cover
what a refactor is most likely to disturb: accumulation over micro-batches, warm-up + cosine, clipping, weight
decay, dropout's RNG stream (gpt2 run), RoPE and grouped-query attention (llama run).

Tolerance: in float64 a step's arithmetic differs between machines only in summation order (BLAS kernels for
AVX2 vs AVX-512, thread counts): ~1e-16 relative per operation. Measured 2026-11-23 on a 2-core AVX-512 Xeon:
run to run the curves are bit-identical; capped to AVX2 (ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
ONEDNN_MAX_CPU_ISA=AVX2) they differ by at most 3.7e-16 relative, on one thread by 2.5e-16. 1e-9 leaves six
orders of magnitude for other BLAS builds and is still far below a behavioural change: a clipping threshold 10%
off moves the curve by more than that (the last test).

Regenerate (only for an intended change of behaviour, said so in the commit): KILN_WRITE_GOLDEN=1 pytest this file.
"""
import json
import os
from pathlib import Path

import pytest

from kiln.config import make_config
from kiln.data import DataConfig
from kiln.models import ModelConfig
from kiln.run.lm import train

GOLDEN = Path(__file__).parent / "golden"
RTOL = 1e-9
STEPS = 30

# The two runs. Everything not named takes kiln's defaults, so a changed default shows up here too.
RUNS = {
    "gpt2": dict(model=dict(preset="tiny", n_layer=2, n_head=2, d_model=32, max_seq_len=32, dropout=0.1),
                 train=dict(grad_accum_steps=2, micro_batch_size=3),
                 optim=dict(lr=3e-3, grad_clip=0.5, weight_decay=0.1)),
    "llama": dict(model=dict(preset="llama-125m", n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64,
                             max_seq_len=32, vocab_size=256),
                  train=dict(grad_accum_steps=3, micro_batch_size=2),
                  optim=dict(lr=3e-3, grad_clip=1.0)),
}


def corpus_text() -> str:
    """~40 KB of deterministic text from a linear congruential generator: the same bytes on every machine."""
    words = ("def", "return", "self", "value", "index", "for", "in", "range", "if", "else", "while", "print",
             "import", "class", "list", "dict", "none", "true", "false", "+", "-", "=", "(", ")", ":", "\n")
    state, out = 12345, []
    for _ in range(8000):
        state = (1103515245 * state + 12345) % 2**31
        out.append(words[(state >> 16) % len(words)])
    return " ".join(out)


def golden_config(name: str, tmp_path: Path):
    source = tmp_path / "golden.txt"
    source.write_text(corpus_text())
    spec = RUNS[name]
    cfg = make_config(model=ModelConfig(**spec["model"]),
                      data=DataConfig(source=str(source), seq_len=16, cache_dir=str(tmp_path / "cache")))
    cfg.train.max_steps, cfg.train.device, cfg.train.sample_tokens, cfg.train.eval_batches = STEPS, "cpu", 0, 2
    cfg.precision.mode = "fp64"
    cfg.schedule.warmup_steps, cfg.schedule.total_steps = 5, STEPS
    cfg.log.interval, cfg.log.tensorboard, cfg.log.progress = 1, False, "off"
    for section in ("train", "optim"):
        for key, value in spec[section].items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def curve(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r.get("kind", "train") == "train" and "loss" in r]
    return {"loss": [r["loss"] for r in train_records], "grad_norm": [r["grad_norm"] for r in train_records],
            "lr": [r["lr"] for r in train_records]}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_loss_curve_matches_the_stored_one(name, tmp_path):
    train(golden_config(name, tmp_path), tmp_path / "run")
    got = curve(tmp_path / "run")
    path = GOLDEN / f"{name}.json"
    if os.environ.get("KILN_WRITE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    assert len(got["loss"]) == STEPS
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == pytest.approx(want[key], rel=RTOL, abs=0), key


def test_the_tolerance_would_catch_a_change(tmp_path):
    """The stored curve is not so loose that a small change of behaviour slips through."""
    cfg = golden_config("gpt2", tmp_path)
    cfg.optim.grad_clip = 0.45  # a 10% different clipping threshold
    train(cfg, tmp_path / "run")
    got, want = curve(tmp_path / "run"), json.loads((GOLDEN / "gpt2.json").read_text())
    assert got["loss"] != pytest.approx(want["loss"], rel=RTOL, abs=0)
