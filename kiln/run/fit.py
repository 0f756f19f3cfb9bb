"""kiln as a library: train your own nn.Module with kiln's loop.

    from kiln import fit
    result = fit(model, train_data, loss="mse", config={"train.max_steps": 500, "optim.lr": 1e-3},
                 eval_data=val_data, run_dir="runs/mlp")

Everything `kiln train` does comes along: accumulation normalised per sample (per token for language models),
clipping, every precision mode, warm-up + cosine/WSD schedules, checkpoints and bit-identical resume
(`resume=True`), metrics.jsonl, TensorBoard, the numerics guard (NaN traced to the first module of your model,
spikes skipped or rolled back). It is the same Trainer over the same TrainState, built by the same builder.

`train_data`: a torch Dataset (kiln shuffles it, seeded, and cuts batches of train.micro_batch_size) or any
re-iterable of ready batches (a DataLoader, a list). A batch is (inputs, targets) for a supervised loss, or
(view_a, view_b) for "ntxent". `loss`: a name ("cross_entropy", "mse", "huber", "bce", "ntxent"), a
kiln.train.losses loss, any callable f(output, target) returning a mean over the batch, or an objective
(kiln.train.objective: something with unit, count(batch) and __call__(model, batch)).
`config`: a kiln Config, a dict {"section.key": value}, a list of "--section.key=value" strings, or a TOML path;
the model and data sections do not apply. The memory levers need a transformer's blocks and say so otherwise.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
from rich.console import Console

from kiln.config import Config, apply_overrides, load_config, parse_override, to_toml
from kiln.data.batches import BatchLoader, eval_batches, to_device
from kiln.dist import device_for, init_world
from kiln.memory.offload import parse_blocks
from kiln.memory.estimate import recompute_plan
from kiln.perf import device_peak_flops
from kiln.perf.hardware import precision_notice, resolve_kernels, resolve_mode
from kiln.run.lm import pick_device
from kiln.train.checkpoint import Checkpointer, RunLock
from kiln.train.loop import TrainResult, Trainer, accumulation_for
from kiln.train.losses import NTXent
from kiln.train.objective import Contrastive, Supervised
from kiln.train.optim import scaled_lr
from kiln.train.pipeline import ModelPlan
from kiln.train.state import build_state, determinism, seed_everything
from kiln.train.step import evaluate


def fit_config(config=None) -> Config:
    """A Config from what fit() accepts: None, a Config, {"section.key": value}, ["--section.key=value"], a path."""
    if config is None:
        return load_config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return apply_overrides(load_config(), config)
    if isinstance(config, (list, tuple)):
        return apply_overrides(load_config(), {f"{s}.{k}": v for s, k, v in map(parse_override, config)})
    if isinstance(config, (str, Path)):
        return load_config(config)
    raise TypeError(f"config must be a kiln Config, a dict of 'section.key' values, a list of '--section.key=value' "
                    f"strings or a TOML path; got {type(config).__name__}")


def objective_for(loss):
    """An objective from fit()'s `loss` argument."""
    if hasattr(loss, "unit") and hasattr(loss, "count"):  # already an objective
        return loss
    if loss == "ntxent" or isinstance(loss, NTXent):
        return Contrastive(loss if isinstance(loss, NTXent) else None)
    return Supervised(loss)


def _plan(cfg: Config, model: nn.Module, precision: str, device: torch.device) -> ModelPlan:
    mem = cfg.memory
    recompute = ()
    if mem.recompute != "none":
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"memory.recompute works on transformer blocks (a `blocks` ModuleList); "
                             f"{type(model).__name__} has none: set memory.recompute=none")
        if mem.recompute == "budget":
            raise ValueError("memory.recompute=budget needs kiln's transformer (the estimator knows its tensors); "
                             "use full, every_k or selective")
        recompute = recompute_plan(mem.recompute, len(blocks), mem.recompute_every)
    blocks = getattr(model, "blocks", None)
    if mem.offload_blocks not in ("", "none") and not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"memory.offload_blocks works on transformer blocks (a `blocks` ModuleList); "
                         f"{type(model).__name__} has none: set memory.offload_blocks=none")
    offload = parse_blocks(mem.offload_blocks, len(blocks) if blocks is not None else 0)
    if cfg.plan.memory:
        raise ValueError("plan.memory searches the levers of kiln's transformer with its memory estimator; fit() "
                         "trains your model as configured: set plan.memory='' and choose the levers yourself")
    if mem.chunked_loss:
        raise ValueError("memory.chunked_loss replaces kiln's LM head + cross-entropy; a model of your own computes "
                         "its loss through `loss=`: set memory.chunked_loss=0")
    return ModelPlan(kernels=resolve_kernels(cfg.train.kernels, device), recompute=recompute, offload=offload,
                     compile=cfg.train.compile, parallel=cfg.parallel)


def fit(model: nn.Module, train_data, *, loss="cross_entropy", config=None, eval_data=None,
        run_dir: str | Path | None = None, resume: bool = False, console: Console | None = None,
        flops_per_sample: float | None = None) -> TrainResult:
    """Train `model` on `train_data`; returns a TrainResult (step, val_loss, stop_reason, checkpoint, state)."""
    cfg = fit_config(config)
    objective = objective_for(loss)
    run_dir = Path(run_dir or f"runs/{type(model).__name__.lower()}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not resume and Checkpointer(cfg.checkpoint, run_dir).latest() is not None:
        raise FileExistsError(f"{run_dir} already holds a run with checkpoints; pass resume=True to continue it, "
                              f"or choose another run_dir")
    world = init_world(cfg.parallel, pick_device(cfg.train.device).type)
    try:
        with RunLock(run_dir, enabled=world.main), determinism(cfg.train.deterministic):
            return _fit(model, train_data, objective, cfg, eval_data, run_dir, resume, console, flops_per_sample,
                        world)
    finally:
        world.close()


def _fit(model, train_data, objective, cfg, eval_data, run_dir, resume, console, flops_per_sample,
         world) -> TrainResult:
    con = console or Console(soft_wrap=True)
    if not world.main:
        con = Console(quiet=True)  # rank 0 speaks for the run
    device = device_for(world, pick_device(cfg.train.device))
    cfg = replace(cfg, train=replace(cfg.train, grad_accum_steps=accumulation_for(cfg.train, world.size)))
    seed_everything(cfg.train.seed)  # dropout and any init the model does lazily draw from here
    precision = resolve_mode(cfg.precision.mode, device)
    loader = BatchLoader(train_data, cfg.train.micro_batch_size, cfg.train.seed, device, world.rank, world.size)
    state = build_state(model, objective, loader, device=device, precision=precision, precision_cfg=cfg.precision,
                        optim=cfg.optim, plan=_plan(cfg, model, precision, device), world=world)
    evaluate_fn = None
    if eval_data is not None:
        def evaluate_fn(m):
            mine = itertools.islice(eval_batches(eval_data, cfg.train.micro_batch_size), world.rank, None, world.size)
            return evaluate(m, (to_device(b, device) for b in mine), objective, state.precision, device,
                            world if world.size > 1 else None)
    # optim.lr_scaling counts the global batch in samples here (the objective's unit)
    peak_lr, scaled = scaled_lr(cfg.optim, cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world.size)
    trainer = Trainer(state, cfg, run_dir, con, evaluate=evaluate_fn, config_toml=to_toml,
                      flops_per_unit=flops_per_sample, peak_flops=device_peak_flops(device, precision),
                      peak_lr=peak_lr)
    if resume:
        path = trainer.resume()
        con.print(f"resumed from {path} at step {state.step}", highlight=False)
    tc = cfg.train
    con.print(f"model: {type(model).__name__} {state.n_params / 1e6:.3g}M parameters | device {device} | precision "
              f"{precision} | {objective!r} | {tc.micro_batch_size}×{tc.grad_accum_steps} per step", highlight=False)
    for line in (scaled, precision_notice(cfg.precision.mode, device)):
        if line:
            con.print(line, highlight=False)
    result = trainer.run()
    if result.signal is not None:
        con.print(f"stopped by signal {result.signal} at step {result.step}: checkpoint {result.checkpoint}; resume "
                  f"with fit(..., resume=True)", highlight=False)
        return result
    shown = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a (no eval_data)"
    con.print(f"done at step {result.step} ({result.stop_reason}): val_loss {shown} | checkpoint {result.checkpoint}",
              highlight=False)
    return result
