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

import contextlib
import math
import os
import random
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn as nn

from kiln.errors import KilnError
from kiln.interop.base import check_base
from kiln.parallel import World
from kiln.train.checkpoint import global_tokens_seen, refuse_per_expert, rng_state, saved_world, set_rng_state
from kiln.train.optim import AdaptiveClip, OptimConfig, build_optimizer, optimizer_groups
from kiln.train.pipeline import ModelPlan, prepare_model
from kiln.train.precision import LossScaler, MasterWeights, Precision, PrecisionConfig, store_frozen


@contextlib.contextmanager
def determinism(on: bool):
    """train.deterministic: torch's deterministic algorithms (an op without one raises, naming itself), cuBLAS's
    fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts: set before the first CUDA matmul) and the
    math attention backend on CUDA (the fused ones' backward accumulates in a varying order). Everything is put
    back on exit. The data order is the seed's in any case."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cudnn.benchmark)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cuda.enable_flash_sdp(before[1])
        torch.backends.cuda.enable_mem_efficient_sdp(before[2])
        torch.backends.cudnn.benchmark = before[3]


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
    tokens_seen: int = 0  # tokens (language models) or samples seen, by every data-parallel copy together
    best_val: float = math.inf
    evals_since_best: int = 0
    numerics: object | None = None  # the numerics monitor, attached by the Trainer; its state is saved too
    world: World = field(default_factory=World)  # this process's place in data parallelism (a world of one)
    adaptive_clip: AdaptiveClip | None = None  # optim.clip_mode=adaptive: the norm history the threshold comes from
    resumed_world: dict | None = None  # the world ({"size", "dp"}) that wrote the checkpoint this state resumed
    # The frozen base a checkpoint refers to instead of holding it (a LoRA run on model.init=hf:DIR: the path and
    # its files' xxh3, kiln.interop.base): the model's state then holds only the trainable weights, the adapters.
    base: dict | None = None

    def model_state_dict(self) -> dict:
        """The model's weights a checkpoint holds: all of them, or with a `base` only the trainable ones."""
        weights = self.model.state_dict()
        if self.base is None:
            return weights
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {name: t for name, t in weights.items() if name in trainable}

    def state_dict(self) -> dict:
        """Everything, in one process's hands (a world of one, and the in-memory rollback snapshot)."""
        return {"model": self.model_state_dict(), "optimizer": self.optimizer.state_dict(), "rng": rng_state()} \
            | self.shared_state_dict()

    def load_state_dict(self, state: dict) -> None:
        refuse_per_expert("the checkpoint", state["model"])
        try:
            if self.base is None:
                self.model.load_state_dict(state["model"])
            else:  # the frozen weights are the base's, loaded when the model was built
                missing = set(self.model_state_dict()) - set(state["model"])
                if missing:
                    raise RuntimeError(f"Missing key(s):\n{sorted(missing)[0]}")
                unexpected = self.model.load_state_dict(state["model"], strict=False).unexpected_keys
                if unexpected:
                    raise RuntimeError(f"Unexpected key(s):\n{unexpected[0]}")
        except RuntimeError as e:  # torch lists every key; the first one says enough
            detail = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
            raise KilnError(f"the checkpoint holds a model of another shape than this config builds ({detail[:160]}"
                            f"); resume with the run's own model settings (drop the model.* overrides) or start "
                            f"a new run directory",
                            key="model",
                            fix="resume with the run's own model settings (drop the model.* overrides) or start "
                                "a new run directory") from None
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_shared_state_dict(state)
        set_rng_state(state["rng"])

    def shared_state_dict(self) -> dict:
        """What is the same on every rank: all but the model, the optimizer and the RNG streams."""
        state = {
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,  # global (kiln.train.checkpoint.global_tokens_seen)
            "world": {"size": self.world.size, "dp": self.world.dp_size},
            "best_val": self.best_val,
            "evals_since_best": self.evals_since_best,
        }
        if self.loader is not None:
            state["data"] = self.loader.state_dict()
        if self.masters is not None:
            state["masters"] = self.masters.state_dict()
        if self.numerics is not None:
            state["numerics"] = self.numerics.state_dict()
        if self.adaptive_clip is not None:
            state["adaptive_clip"] = self.adaptive_clip.state_dict()
        if self.base is not None:
            state["base"] = self.base
        return state

    def load_shared_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state["scaler"])
        if self.masters is not None:
            self.masters.load_state_dict(state["masters"])
        self.step, self.tokens_seen, self.resumed_world = state["step"], global_tokens_seen(state), saved_world(state)
        self.best_val, self.evals_since_best = state["best_val"], state["evals_since_best"]
        if self.loader is not None:
            self.loader.load_state_dict(state["data"])
        if self.numerics is not None and "numerics" in state:
            self.numerics.load_state_dict(state["numerics"])
        if self.adaptive_clip is not None and "adaptive_clip" in state:  # else its history starts here
            self.adaptive_clip.load_state_dict(state["adaptive_clip"])

    def check_base(self, saved: dict, where) -> None:
        """Refuse, in one line, a checkpoint whose base (a LoRA run's model.init) differs from the one this run
        loaded: another directory's files, or the same directory's changed on disk."""
        if saved.get("base") is not None:
            check_base(saved["base"], str(where), self.base or {"init": "", "files": {}})

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in dict.fromkeys(self.model.parameters()))


def build_state(model: nn.Module, objective, loader, *, device: torch.device, precision: str,
                precision_cfg: PrecisionConfig, optim: OptimConfig, plan: ModelPlan = ModelPlan(),
                world: World | None = None) -> TrainState:
    """The one builder: model to the device and dtype, the model pipeline, master weights, optimizer, scaler.

    `precision` is a concrete mode (kiln.perf.hardware.resolve_mode); the model is expected freshly built (or
    loaded) in fp32 on any device, with the same seed on every rank (DDP checks; FSDP2 shards what it is given).
    """
    world = world or World()
    mode = Precision(precision, device)
    model = model.to(device=device, dtype=mode.param_dtype)
    store_frozen(model, mode.row.frozen)  # a frozen base (LoRA): bf16 under bf16 autocast, no gradient, no state
    fsdp_dtype = mode.row.fsdp_gather if world.dp_strategy.shards_parameters else None
    prepared = prepare_model(model, plan, device, world, fsdp_dtype)
    groups = optimizer_groups(prepared.model, optim)
    # With optim.offload the host optimizer keeps the fp32 masters itself.
    masters = MasterWeights(prepared.model) if mode.row.masters and optim.offload == "none" else None
    groups = masters.groups(groups) if masters else groups
    if world.dp_strategy.zero_optimizer:
        # Each rank keeps the optimizer state of its shard of the parameters and broadcasts its updated shard.
        # kiln's masked foreach optimizers take the skip flag through ZeroRedundancyOptimizer.step(skipped=...).
        from torch.distributed.optim import ZeroRedundancyOptimizer  # lazy: torch.distributed.optim, zero1 only

        inner = replace(optim, implementation="foreach")
        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=_ZeroInner(inner),
                                            weight_decay=groups[0]["weight_decay"])
        for group in groups[1:]:
            optimizer.add_param_group(group)
        optimizer.takes_skipped = True  # kiln.train.masked.optimizer_step: step(skipped=) reaches the inner one
    else:
        optimizer = build_optimizer(groups, optim)
    scaler = LossScaler(precision_cfg, device, enabled=mode.loss_scaling)
    adaptive = AdaptiveClip(optim.clip_percentile, optim.clip_history, device) if optim.clip_mode == "adaptive" \
        else None
    return TrainState(prepared.model, prepared.step_model, objective, optimizer, scaler, masters, mode, device,
                      loader, prepared.applied, world=world, adaptive_clip=adaptive)


class _ZeroInner:
    """ZeroRedundancyOptimizer's optimizer_class: builds kiln's optimizer over the rank's shard of the groups."""

    def __init__(self, cfg: OptimConfig):
        self.cfg = cfg

    def __call__(self, params, **defaults):
        groups = params if params and isinstance(params[0], dict) else [{"params": params, **defaults}]
        return build_optimizer(groups, self.cfg)
