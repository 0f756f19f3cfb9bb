"""Sampling from a trained run directory."""
from __future__ import annotations

from pathlib import Path

import torch

from kiln.config import load_config
from kiln.data import load_tokenizer
from kiln.models import build_model
from kiln.train.checkpoint import CheckpointConfig, Checkpointer
from kiln.run.lm import generate_text, pick_device


def load_model(run_dir: Path, device: str = "auto"):
    """The latest checkpoint's model (eval mode) and the run's tokenizer."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").exists():
        raise FileNotFoundError(f"{run_dir} has no config.toml; pass a run directory written by `kiln train`")
    cfg = load_config(run_dir / "config.toml")
    dev = pick_device(device)
    weights = Checkpointer(CheckpointConfig(), run_dir).load_weights(map_location=dev)  # first: "has no checkpoint"
    model = build_model(cfg.model, dev)
    model.load_state_dict(weights)
    model.to(torch.float32).eval()
    return model, load_tokenizer(run_dir), dev


def sample_from_run(run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
                    seed: int = 0, device: str = "auto") -> str:
    model, tokenizer, dev = load_model(run_dir, device)
    return generate_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k or None, seed, dev)
