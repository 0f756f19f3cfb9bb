"""Sampling from a trained run directory."""
from __future__ import annotations

from pathlib import Path

from kiln.run.lm import generate_text
from kiln.run.source import load_source


def load_model(run_dir: Path, device: str = "auto"):
    """The model (eval mode) and tokenizer of a run's latest checkpoint (or of RUN_DIR/checkpoints/step_N, hf:DIR:
    kiln.run.source), and its device."""
    source = load_source(run_dir, device)
    return source.model, source.tokenizer, source.device


def sample_from_run(run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
                    seed: int = 0, device: str = "auto") -> str:
    model, tokenizer, dev = load_model(run_dir, device)
    return generate_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k or None, seed, dev)
