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

Under torchrun, `parallel.strategy=ddp|zero1|fsdp` trains copies of the model on shares of each batch. Tensor
parallelism (`parallel.tp=T`) of a model of your own takes your plan, `tensor_parallel=fn`: kiln builds the run's
DeviceMesh (dims pp, dp, tp) and calls fn(model, tp_mesh), which splits the model with torch's parallelize_module
(ColwiseParallel, RowwiseParallel, ...) on that 1-D tp mesh; kiln then replicates whatever the plan left whole and
applies the rest over the dp dim (FSDP2 or DDP, compile), as torchtitan's parallelize functions do
(kiln.parallel.user_plan). fn is required for T > 1 (kiln's own Transformer has a plan of its own) and refused for
T = 1, so a plan is never silently not applied: pass tensor_parallel=fn only where parallel.tp > 1.
"""
from __future__ import annotations

import itertools
import math
import os
import time
import warnings
from collections.abc import Iterator, Sized
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
from rich.console import Console

from kiln.config import Config, apply_overrides, load_config, parse_override
from kiln.data.batches import BatchLoader, eval_batches, is_dataset, to_device
from kiln.errors import KilnError
from kiln.parallel import ParallelPlan, launched_by_torchrun
from kiln.memory.offload import parse_blocks
from kiln.memory.estimate import recompute_plan
from kiln.models.lora import apply_lora, lora_line
from kiln.models.transformer import Transformer
from kiln.perf import device_peak_flops
from kiln.perf.compile import compile_setting
from kiln.perf.hardware import precision_notice, resolve_kernels, resolve_mode
from kiln.run.fit_checks import (FitInputError, FitWarning, check_data, check_first_loss, first_batch, given_keys,
                                 ignored_keys, recorded, schedule_change)
from kiln.run.builder import build_run, recorded_cpu_linear
from kiln.run.device_levers import device_levers
from kiln.run.predict import check_metrics, evaluate_metrics, remember
from kiln.train.callbacks import Callbacks
from kiln.train.checkpoint import Checkpointer, RunLock
from kiln.train.loop import TrainResult
from kiln.train.losses import NTXent
from kiln.train.objective import Contrastive, Supervised
from kiln.train.optim import scaled_lr
from kiln.train.pipeline import ModelPlan
from kiln.train.state import determinism
from kiln.train.step import evaluate
from kiln.util import format_count

# Defaults for a model of your own where the config does not set them (kiln's are tuned for its language models:
# lr 2e-3, weight decay 0.1, 50 warm-up steps): torch.optim.AdamW's lr and weight decay, and a warm-up of 5% of
# the run (50 steps when the run's length is not known in advance).
FIT_DEFAULTS = {"optim.lr": 1e-3, "optim.weight_decay": 0.01}
WARMUP_SHARE = 0.05


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


def _check_layout(cfg: Config, model: nn.Module, tensor_parallel) -> None:
    """The `parallel` section against fit()'s model and tensor_parallel= (module docstring); one-line errors."""
    par = cfg.parallel
    if par.pp > 1:
        raise KilnError(f"parallel.pp={par.pp}: fit() does not split a model of your own into pipeline stages; set "
                        f"parallel.pp=1 (parallel.tp with tensor_parallel=, or parallel.strategy=fsdp, split it)",
                        key="parallel.pp", value=par.pp, fix="set parallel.pp=1")
    if tensor_parallel is None:
        if par.tp > 1 and not isinstance(model, Transformer):
            raise FitInputError("tensor_parallel", f"parallel.tp={par.tp} splits a model by a tensor-parallel plan, "
                                                   f"and kiln has none for {type(model).__name__}: pass "
                                                   f"tensor_parallel=fn(model, tp_mesh) applying yours "
                                                   f"(parallelize_module), or use parallel.tp=1")
        return
    if not callable(tensor_parallel):
        raise FitInputError("tensor_parallel", f"tensor_parallel={tensor_parallel!r} is not callable; pass a "
                                               f"function fn(model, tp_mesh) that applies parallelize_module")
    if par.tp == 1:
        raise FitInputError("tensor_parallel", "tensor_parallel= splits the model over parallel.tp ranks, and "
                                               "parallel.tp=1: set parallel.tp (and launch a multiple of it with "
                                               "torchrun), or drop tensor_parallel=")
    if par.sequence_parallel:
        raise FitInputError("tensor_parallel", "parallel.sequence_parallel is kiln's plan for its Transformer; with "
                                               "tensor_parallel= your plan decides (SequenceParallel styles): set "
                                               "parallel.sequence_parallel=false")


def _plan(cfg: Config, model: nn.Module, precision: str, device: torch.device, tensor_plan=None) -> ModelPlan:
    mem = cfg.memory
    recompute = ()
    if mem.recompute != "none":
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise KilnError(f"memory.recompute works on transformer blocks (a `blocks` ModuleList); "
                            f"{type(model).__name__} has none: set memory.recompute=none",
                            key="memory.recompute", value=mem.recompute, fix="set memory.recompute=none")
        if mem.recompute == "budget":
            raise KilnError("memory.recompute=budget needs kiln's transformer (the estimator knows its tensors); "
                            "use full, every_k or selective",
                            key="memory.recompute", value="budget", fix="use full, every_k or selective")
        recompute = recompute_plan(mem.recompute, len(blocks), mem.recompute_every)
    blocks = getattr(model, "blocks", None)
    if mem.offload_blocks not in ("", "none") and not isinstance(blocks, nn.ModuleList):
        raise KilnError(f"memory.offload_blocks works on transformer blocks (a `blocks` ModuleList); "
                        f"{type(model).__name__} has none: set memory.offload_blocks=none",
                        key="memory.offload_blocks", value=mem.offload_blocks, fix="set memory.offload_blocks=none")
    offload = parse_blocks(mem.offload_blocks, len(blocks) if blocks is not None else 0)
    if cfg.plan.memory:
        raise KilnError("plan.memory searches the levers of kiln's transformer with its memory estimator; fit() "
                        "trains your model as configured: set plan.memory='' and choose the levers yourself",
                        key="plan.memory", value=cfg.plan.memory,
                        fix="set plan.memory='' and choose the levers yourself")
    if mem.chunked_loss:
        raise KilnError("memory.chunked_loss replaces kiln's LM head + cross-entropy; a model of your own computes "
                        "its loss through `loss=`: set memory.chunked_loss=0",
                        key="memory.chunked_loss", value=mem.chunked_loss, fix="set memory.chunked_loss=0")
    return ModelPlan(kernels=resolve_kernels(cfg.train.kernels, device), cpu_linear=cfg.train.cpu_linear == "onednn",
                     recompute=recompute, offload=offload, compile=compile_setting(cfg.train.compile) == "true",
                     parallel=cfg.parallel, tensor_plan=tensor_plan)


def _epoch_batches(data, batch_size: int) -> int | None:
    """Micro-batches in one pass over `data`; None when it has no length (or is a one-shot iterator)."""
    if is_dataset(data):
        return math.ceil(len(data) / batch_size)
    if isinstance(data, Iterator) or not isinstance(data, Sized):
        return None
    return len(data)


def _run_length(cfg: Config, data, epochs: int | None, given: set[str], copies: int):
    """(cfg with train.max_steps from `epochs`, a line saying so); data with a length and no max_steps or
    time_budget set trains one epoch (not the language model's time budget). copies: the data-parallel copies."""
    tc = cfg.train
    per_epoch = _epoch_batches(data, tc.micro_batch_size)
    implied = epochs is None
    if implied:
        if tc.max_steps or "train.time_budget" in given or per_epoch is None:
            return cfg, None
        epochs = 1
    elif per_epoch is None:
        raise FitInputError("epochs", f"epochs={epochs} needs training data with a length (a Dataset, a list, a "
                                      f"DataLoader); {type(data).__name__} has none: set train.max_steps instead")
    per_step = tc.grad_accum_steps * copies
    steps = math.ceil(epochs * per_epoch / per_step)
    note = (f"{epochs} epoch{'s' if epochs > 1 else ''}{' (data with a length, no train.max_steps)' if implied else ''}"
            f": {steps:,} steps of {per_step} micro-batch{'es' if per_step > 1 else ''}, {per_epoch:,} "
            f"micro-batches of ≤ {tc.micro_batch_size} per epoch")
    if (epochs * per_epoch) % per_step:
        note += f" (the last step takes {steps * per_step - epochs * per_epoch} from the next epoch)"
    return replace(cfg, train=replace(tc, max_steps=steps)), note


def _set(cfg: Config, key: str, value) -> Config:
    section, _, name = key.partition(".")
    return replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})


def _fit_defaults(cfg: Config, given: set[str], recorded_toml: str | None):
    """(cfg with fit()'s defaults for the keys the caller did not set, a line naming them); a resumed run keeps
    the values its checkpoint recorded."""
    defaults = dict(FIT_DEFAULTS)
    if cfg.train.max_steps:  # a time-budgeted run keeps kiln's warm-up: its first steps are timed inside it
        defaults["schedule.warmup_steps"] = round(WARMUP_SHARE * cfg.train.max_steps)
    used = {}
    for key, value in defaults.items():
        if key in given:
            continue
        old = recorded(recorded_toml, key) if recorded_toml is not None else None
        used[key] = old if old is not None else value
        cfg = _set(cfg, key, used[key])
    if not used:
        return cfg, None
    where = "the resumed run's" if recorded_toml is not None else "defaults for a model of your own"
    shown = ", ".join(f"{k}={v:g}" for k, v in used.items())
    return cfg, f"{where}: {shown} (set them in config= to choose)"


def fit(model: nn.Module, train_data, *, loss="cross_entropy", config=None, eval_data=None,
        epochs: int | None = None, callbacks=(), metrics: dict | None = None,
        run_dir: str | Path | None = None, resume: bool = False, console: Console | None = None,
        flops_per_sample: float | None = None, tensor_parallel=None) -> TrainResult:
    """Train `model` on `train_data`; returns a TrainResult (step, val_loss, val_metrics, stop_reason, checkpoint,
    state). epochs: passes over train_data (default: one, for data with a length and no train.max_steps);
    callbacks: objects with on_step_end / on_eval / on_checkpoint (kiln.train.callbacks); metrics: {name:
    fn(outputs, targets) -> float or (sum, count)} over the whole eval_data, logged as val_<name>;
    tensor_parallel: fn(model, tp_mesh) applying your parallelize_module plan, for parallel.tp > 1 under torchrun
    (module docstring)."""
    cfg = fit_config(config)
    given = given_keys(config)
    ignored = ignored_keys(given)
    if ignored:
        warnings.warn(FitWarning(f"fit() ignores {', '.join(ignored)}: these keys set up kiln's own language model, "
                                 f"its data and its sample text (fit() evaluates all of eval_data); drop them"),
                      stacklevel=2)
    if epochs is not None and "train.time_budget" in given:
        warnings.warn(FitWarning(f"epochs={epochs} sets the run's length: train.time_budget is not used; drop it "
                                 f"(train.max_time still ends a run by the clock)"), stacklevel=2)
    objective = objective_for(loss)
    metrics = check_metrics(metrics, objective)
    if metrics and eval_data is None:
        raise FitInputError("metrics", f"metrics={{{', '.join(map(repr, metrics))}: ...}} are computed on "
                                       f"eval_data, and none was given; pass eval_data=...")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise FitInputError("epochs", f"epochs={epochs!r}; give a whole number ≥ 1 of passes over train_data")
    if epochs is not None and cfg.train.max_steps:
        raise FitInputError("epochs", f"epochs={epochs} and train.max_steps={cfg.train.max_steps} both set the "
                                      f"run's length; pass one of them")
    _check_layout(cfg, model, tensor_parallel)
    run_dir = Path(run_dir or f"runs/{type(model).__name__.lower()}-{time.strftime('%Y%m%d-%H%M%S')}")
    latest = Checkpointer(cfg.checkpoint, run_dir).latest()
    if not resume and latest is not None:
        raise FileExistsError(f"{run_dir} already holds a run with checkpoints; pass resume=True to continue it, "
                              f"or choose another run_dir")
    recorded_toml = (latest / "config.toml").read_text() if resume and latest is not None \
        and (latest / "config.toml").is_file() else None
    con = console or Console(soft_wrap=True)
    parts = FitParts(model, train_data, objective, _Extras(epochs, given, Callbacks(callbacks), metrics, recorded_toml,
                                                           tensor_parallel, eval_data))
    main = not launched_by_torchrun() or int(os.environ["RANK"]) == 0
    with RunLock(run_dir, enabled=main), determinism(cfg.train.deterministic):
        run = build_run(cfg, parts, log=con.print)
        try:
            return _fit(run, parts, eval_data, run_dir, resume, con if run.world.main else Console(quiet=True),
                        flops_per_sample)
        finally:
            run.world.close()


@dataclass
class _Extras:
    epochs: int | None
    given: set
    callbacks: Callbacks
    metrics: dict
    recorded_toml: str | None
    tensor_plan: object = None  # fit()'s tensor_parallel
    eval_data: object = None


@dataclass
class FitParts:
    """What fit() hands the run builder (kiln.run.builder): the user's model, data and objective. Each step returns
    what it decided; the builder records it."""

    model_: nn.Module
    train_data: object
    objective: object
    extras: _Extras
    notes: tuple = ()  # the run length's and the defaults' lines, printed before training
    first: tuple = (None, None)  # the first train_data and eval_data batches, checked

    def inputs(self, cfg: Config, world, device, log) -> dict:
        """The run's length from `epochs` (or one epoch), fit()'s defaults, the first batches checked."""
        x = self.extras
        device_notes = device_levers(cfg, device)  # a lever this device cannot run: refused here, before the data
        cfg, length_note = _run_length(cfg, self.train_data, x.epochs, x.given,
                                        ParallelPlan.data_copies(cfg.parallel, world.size))
        cfg, defaults_note = _fit_defaults(cfg, x.given, x.recorded_toml)
        self.notes = (length_note, defaults_note, *device_notes)
        mb = cfg.train.micro_batch_size
        self.first = (check_data(self.train_data, "train_data", mb),
                      check_data(x.eval_data, "eval_data", mb) if x.eval_data is not None else None)
        return {"train": cfg.train, "optim": cfg.optim, "schedule": cfg.schedule}

    def precision(self, cfg: Config, device, log) -> tuple[dict, str]:
        return {}, resolve_mode(cfg.precision.mode, device)  # recorded as given (auto stays auto)

    def layout(self, cfg: Config, world_size: int) -> ParallelPlan:
        return ParallelPlan.build(cfg.parallel, world_size)  # a model of the user's: no family to check

    def decisions(self, cfg: Config, device, world, precision: str) -> dict:
        linears = [(cfg.train.micro_batch_size, m.in_features, m.out_features) for m in self.model_.modules()
                   if type(m) is nn.Linear]  # (rows: a sample a row, as for an MLP)
        return {"train": recorded_cpu_linear(cfg.train, device, precision, linears, world)}

    def model(self, cfg: Config, device) -> nn.Module:
        # lora.rank > 0: its nn.Linear layers named by lora.targets (suffixes, as PEFT's target_modules; kiln's
        # Transformer: its family's linears) get adapters in place, the rest of the model is frozen
        apply_lora(self.model_, cfg.lora, self.model_.cfg if isinstance(self.model_, Transformer) else None)
        return self.model_

    def loader(self, cfg: Config, world, device) -> BatchLoader:
        return BatchLoader(self.train_data, cfg.train.micro_batch_size, cfg.train.seed, device, world.dp_rank,
                           world.dp_size)

    def levers(self, cfg: Config, model, precision: str, device, plan: ParallelPlan) -> ModelPlan:
        return _plan(cfg, model, precision, device, self.extras.tensor_plan)


def _fit(run, parts: FitParts, eval_data, run_dir, resume, con, flops_per_sample) -> TrainResult:
    cfg, state, world, extras, objective = run.cfg, run.state, run.world, parts.extras, parts.objective
    device, precision, model, train_data = state.device, state.precision.mode, parts.model_, parts.train_data
    first, eval_first = parts.first
    if not world.dp_strategy.shards_parameters:  # FSDP2's sharded forward is the step's to run
        for name, data, batch in (("train_data", train_data, first), ("eval_data", eval_data, eval_first)):
            if batch is not None:
                check_first_loss(state, batch, name, first_batch(data, name, cfg.train.micro_batch_size))
    metrics = extras.metrics
    evaluate_fn = None
    if eval_data is not None:
        def evaluate_fn(m):
            mine = itertools.islice(eval_batches(eval_data, cfg.train.micro_batch_size), world.dp_rank, None,
                                    world.dp_size)
            batches = (to_device(b, device) for b in mine)
            reduce = world if world.size > 1 else None
            if metrics:
                return evaluate_metrics(m, batches, objective, state.precision, device, metrics, reduce)
            return evaluate(m, batches, objective, state.precision, device, reduce)
    # optim.lr_scaling counts the global batch in samples here (the objective's unit)
    peak_lr, scaled = scaled_lr(cfg.optim, cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world.dp_size)
    trainer = run.trainer(run_dir, con, evaluate=evaluate_fn, flops_per_unit=flops_per_sample,
                          peak_flops=device_peak_flops(device, precision), peak_lr=peak_lr,
                          callbacks=extras.callbacks.callbacks)
    remember(state.model, state.precision, device, cfg.train.micro_batch_size)  # predict() runs as the run did
    if resume:
        path = trainer.resume()
        con.print(f"resumed from {path} at step {state.step}", highlight=False)
        if extras.recorded_toml is not None:
            change = schedule_change(cfg, extras.recorded_toml, state.step, peak_lr)
            if change:
                warnings.warn(FitWarning(change), stacklevel=3)
    tc = cfg.train
    con.print(f"model: {type(model).__name__} {format_count(state.n_params)} parameters | device {device} | "
              f"precision {precision} | {objective!r} | {tc.micro_batch_size}×{tc.grad_accum_steps} per step",
              highlight=False)
    for line in (lora_line(cfg.lora, state.model), *parts.notes[:2], scaled,
                 precision_notice(cfg.precision.mode, device), *parts.notes[2:]):
        if line:
            con.print(line, highlight=False)
    result = trainer.run()
    result.cfg = run.cfg  # the run as recorded
    if result.signal is not None:
        con.print(f"stopped by signal {result.signal} at step {result.step}: checkpoint {result.checkpoint}; resume "
                  f"with fit(..., resume=True)", highlight=False)
        return result
    shown = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a (no eval_data)"
    shown += "".join(f" | {k} {v:.4f}" for k, v in (result.val_metrics or {}).items())
    con.print(f"done at step {result.step} ({result.stop_reason}): val_loss {shown} | checkpoint {result.checkpoint}",
              highlight=False)
    return result
