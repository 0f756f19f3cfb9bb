"""Checkpoints: written atomically, the last K kept, a `latest` pointer, weights exportable as safetensors.

Layout of a run directory:
    config.toml                      the resolved config
    checkpoints/step_000400/         state.pt (everything needed to resume), config.toml, model.safetensors
    checkpoints/latest               text file naming the newest complete checkpoint directory

Under data parallelism (kiln.dist) a checkpoint is written by every rank into one temporary directory and
renamed by rank 0 once all are done:
    sharded/                         torch.distributed.checkpoint: model and optimizer, each rank its shards
    optimizer.pt                     parallel.strategy=zero1: the optimizer state consolidated on rank 0
    state.pt                         step, tokens, data position, loss scaler, numerics (rank 0)
    rank_00001.pt                    each rank's RNG streams
    model.safetensors, config.toml   the consolidated weights and the config (rank 0)
DCP reshards on load, so a run resumes on another world size or strategy (fsdp × 2 -> ddp × 1 and back).
"""
from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)


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

    def save_sharded(self, step: int, state, config_toml: str) -> Path:
        """Every rank calls this with the same step: a TrainState under data parallelism (kiln.dist)."""
        world = state.world
        final = self.dir / f"step_{step:06d}"
        tmp = self.dir / f".tmp-{final.name}"
        if world.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        world.barrier()
        model_sd, optim_sd = _sharded_state_dicts(state)
        dcp.save({"model": model_sd} | ({"optimizer": optim_sd} if optim_sd is not None else {}),
                 checkpoint_id=tmp / "sharded")
        if optim_sd is None:  # ZeroRedundancyOptimizer: consolidated on rank 0
            state.optimizer.consolidate_state_dict(to=0)
            if world.main:
                torch.save(state.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"rng": rng_state()}, tmp / f"rank_{world.rank:05d}.pt")
        full = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if world.main:
            torch.save(state.shared_state_dict(), tmp / "state.pt")
            (tmp / "config.toml").write_text(config_toml)
            if self.cfg.safetensors:
                export_tensors(full, tmp / "model.safetensors")
        world.barrier()
        if world.main:
            self._publish(tmp, final)
        world.barrier()
        return final

    def load_sharded(self, state) -> Path:
        """Resume a TrainState under data parallelism from the latest checkpoint, whatever world wrote it."""
        path = self.latest()
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {self.dir}: nothing to resume (train first, or check the path)")
        if not (path / "sharded").is_dir():
            raise ValueError(f"{path} was written by one process without parallel.strategy; resume it the same way "
                             f"(kiln train --resume without torchrun), or start the parallel run from step 0")
        zero1 = (path / "optimizer.pt").exists()
        if zero1 != (state.world.strategy == "zero1"):
            raise ValueError(f"{path} holds {'ZeRO-1' if zero1 else 'per-parameter'} optimizer state; resume it "
                             f"with --parallel.strategy={'zero1' if zero1 else 'ddp or fsdp'}")
        model_sd, optim_sd = _sharded_state_dicts(state)
        target = {"model": model_sd} | ({"optimizer": optim_sd} if optim_sd is not None else {})
        dcp.load(target, checkpoint_id=path / "sharded")
        set_model_state_dict(state.model, target["model"])
        if optim_sd is not None:
            set_optimizer_state_dict(state.model, state.optimizer, target["optimizer"])
        else:
            state.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=state.device,
                                                       weights_only=False))
        state.load_shared_state_dict(torch.load(path / "state.pt", map_location=state.device, weights_only=True))
        mine = path / f"rank_{state.world.rank:05d}.pt"
        if mine.exists():  # a rank the writing world did not have keeps the RNG streams it was seeded with
            set_rng_state(torch.load(mine, weights_only=True)["rng"])
        return path

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = self.dir / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, self.dir / "latest")
        self._prune()

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


def _sharded_state_dicts(state):
    """(model, optimizer) state dicts keyed by parameter names, DTensor shards under FSDP2; the optimizer's is None
    for ZeroRedundancyOptimizer, which DCP cannot shard (it is consolidated instead)."""
    if type(state.optimizer).__name__ == "ZeroRedundancyOptimizer":
        return get_model_state_dict(state.model), None
    return get_state_dict(state.model, state.optimizer)


def export_safetensors(model: torch.nn.Module, path: Path) -> None:
    export_tensors(model.state_dict(), path)


def export_tensors(state_dict: dict, path: Path) -> None:
    from safetensors.torch import save_file  # lazy: only checkpoints with checkpoint.safetensors import it

    # Tied weights are one storage; safetensors refuses shared tensors, so each is written once.
    tensors, seen = {}, set()
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(path))
