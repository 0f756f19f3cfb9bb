"""TrainState: exactly what a checkpoint holds, built in one place.

    state = build_state(model, objective, loader, device=..., precision=..., optim=..., plan=...)
    state.state_dict() / state.load_state_dict(d)     model, optimizer, loss scaler, master weights, data
                                                        position, step, tokens (or samples) seen, evaluation
                                                        bookkeeping, every RNG stream, the numerics monitor's state

`kiln train`, `fit()` for a user's model, `kiln memory --measure`, `kiln plan --verify`, `kiln doctor` and the
benchmarks all build their state here (through kiln.run for a Config). The schedule has no state of its own: its
position is `step` (and the run's length, saved in its config).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from kiln.train.checkpoint import rng_state, set_rng_state
from kiln.train.optim import OptimConfig, build_optimizer, param_groups
from kiln.train.pipeline import ModelPlan, prepare_model
from kiln.train.precision import LossScaler, MasterWeights, Precision, PrecisionConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainState:
    model: nn.Module  # eager, after the model pipeline: hooks, state_dict and the optimizer use it
    step_model: nn.Module  # what the step calls (compiled, or the same module)
    objective: object  # kiln.train.objective: loss and normalisation of a micro-batch
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    masters: MasterWeights | None
    precision: Precision
    device: torch.device
    loader: object | None  # batches: next(), batches_served, skip(n), state_dict(), close(); None to measure only
    applied: dict = field(default_factory=dict)  # what the model pipeline did
    step: int = 0
    tokens_seen: int = 0  # tokens (language models) or samples seen
    best_val: float = math.inf
    evals_since_best: int = 0
    numerics: object | None = None  # the numerics monitor, attached by the Trainer; its state is saved too

    def state_dict(self) -> dict:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "best_val": self.best_val,
            "evals_since_best": self.evals_since_best,
            "rng": rng_state(),
        }
        if self.loader is not None:
            state["data"] = self.loader.state_dict()
        if self.masters is not None:
            state["masters"] = self.masters.state_dict()
        if self.numerics is not None:
            state["numerics"] = self.numerics.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self.masters is not None:
            self.masters.load_state_dict(state["masters"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.best_val, self.evals_since_best = state["best_val"], state["evals_since_best"]
        if self.loader is not None:
            self.loader.load_state_dict(state["data"])
        if self.numerics is not None and "numerics" in state:
            self.numerics.load_state_dict(state["numerics"])
        set_rng_state(state["rng"])

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in dict.fromkeys(self.model.parameters()))


def build_state(model: nn.Module, objective, loader, *, device: torch.device, precision: str,
                precision_cfg: PrecisionConfig, optim: OptimConfig, plan: ModelPlan = ModelPlan()) -> TrainState:
    """The one builder: model to the device and dtype, the model pipeline, master weights, optimizer, scaler.

    `precision` is a concrete mode (kiln.perf.hardware.resolve_mode); the model is expected freshly built (or
    loaded) in fp32 on any device.
    """
    mode = Precision(precision, device)
    model = model.to(device=device, dtype=mode.param_dtype)
    prepared = prepare_model(model, plan, device)
    groups = param_groups(prepared.model, optim.weight_decay)
    # With optim.offload the host optimizer keeps the fp32 masters itself.
    masters = MasterWeights(prepared.model) if mode.mode == "bf16-master" and optim.offload == "none" else None
    optimizer = build_optimizer(masters.groups(groups) if masters else groups, optim)
    scaler = LossScaler(precision_cfg, device, enabled=mode.loss_scaling)
    return TrainState(prepared.model, prepared.step_model, objective, optimizer, scaler, masters, mode, device,
                      loader, prepared.applied)
