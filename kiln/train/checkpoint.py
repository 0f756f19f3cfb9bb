"""Checkpoints: written atomically, the last K kept, a `latest` pointer, weights exportable as safetensors.

Layout of a run directory:
    config.toml                      the resolved config
    checkpoints/step_000400/         state.pt (everything needed to resume), config.toml, model.safetensors
    checkpoints/latest               text file naming the newest complete checkpoint directory
"""
from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0: only at the end of training)
    keep_last: int = 3  # number of checkpoints kept on disk (oldest deleted first)
    safetensors: bool = True  # also export the weights as model.safetensors in each checkpoint

    def validate(self):
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval must be ≥ 0, got {self.interval}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be ≥ 1 (otherwise nothing could resume), got {self.keep_last}")


def rng_state() -> dict:
    """Every RNG stream training draws from: python, numpy, torch CPU and CUDA."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path):
        self.cfg = cfg
        self.dir = Path(run_dir) / "checkpoints"

    def save(self, step: int, state: dict, config_toml: str, model: torch.nn.Module | None = None) -> Path:
        """Write to a temporary directory, then rename: a crash never leaves a half-written checkpoint."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step_{step:06d}"
        tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(state, tmp / "state.pt")
        (tmp / "config.toml").write_text(config_toml)
        if self.cfg.safetensors and model is not None:
            export_safetensors(model, tmp / "model.safetensors")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = self.dir / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, self.dir / "latest")
        self._prune()
        return final

    def _prune(self) -> None:
        done = sorted(p for p in self.dir.glob("step_*") if p.is_dir())
        for old in done[: -self.cfg.keep_last]:
            shutil.rmtree(old)

    def latest(self) -> Path | None:
        pointer = self.dir / "latest"
        if not pointer.exists():
            return None
        path = self.dir / pointer.read_text().strip()
        if not (path / "state.pt").exists():
            raise FileNotFoundError(f"{pointer} names {path.name}, which has no state.pt; the checkpoint is incomplete")
        return path

    def load(self, map_location="cpu") -> dict:
        path = self.latest()
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {self.dir}: nothing to resume (train first, or check the path)")
        return torch.load(path / "state.pt", map_location=map_location, weights_only=True)


def export_safetensors(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    # Tied weights are one storage; safetensors refuses shared tensors, so each is written once.
    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(path))
