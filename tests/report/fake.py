"""Fabricated run directories: metrics records of every kind, a resolved config, a profile summary."""
from __future__ import annotations

import json
from pathlib import Path

from kiln.config import Config, to_toml

GiB = 1024**3


def train_record(step: int, loss: float, tokens_per_step: int = 2048, **extra) -> dict:
    return {"kind": "train", "step": step, "loss": loss, "lr": 1e-3 * min(step, 20) / 20, "grad_norm": 2.0 / step**0.5,
            "tokens_per_s": 15000.0 + step, "step_time_s": tokens_per_step / (15000.0 + step),
            "tokens_seen": step * tokens_per_step, "peak_mem_bytes": GiB // 2 + step * 1024 * 1024,
            "mfu": 0.5 + step / 1000, "skipped_steps": 0} | extra


def make_run(root: Path, name: str = "run", train=(), eval=(), numerics=(), config: Config | None = None,
             toml: str | None = None, lm: bool = True, profile: dict | None = None, tail: str = "") -> Path:
    """A run directory as kiln writes it; `tail` is appended to metrics.jsonl as is (a half-written line)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "config.toml").write_text(toml if toml is not None else to_toml(config or Config()))
    lines = [json.dumps(r) for r in [*train, *eval, *numerics]]
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines) + tail)
    if lm:
        (path / "tokenizer.json").write_text('{"kind": "bytes"}')
    if profile is not None:
        (path / "profile").mkdir()
        (path / "profile" / "summary.json").write_text(json.dumps(profile))
    return path


def steps_run(root: Path, name: str = "run", steps=range(10, 101, 10), evals=(50, 100), **kw) -> Path:
    """A run logged every 10 steps with validation at `evals`: loss falls as 4/sqrt(step)."""
    train = [train_record(s, 4.0 / s**0.25) for s in steps]
    evals = [{"kind": "eval", "step": s, "val_loss": 3.9 / s**0.25, "val_ppl": 2.0} for s in evals]
    return make_run(root, name, train=train, eval=evals, **kw)
