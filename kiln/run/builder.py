"""One run builder: the ordered steps that assemble every training run, whatever the model. `kiln train` (a
language model, kiln.run.lm) and `kiln.fit` (a model of the user's, kiln.run.fit) differ in the parts they hand
it, not in a copy of the sequence (torchtitan's Trainer.__init__, Lightning's Trainer.fit).

    run = build_run(cfg, parts, device, log)     steps 1-9 below; run.record.cfg is the run's config as recorded
    trainer = run.trainer(run_dir, console, ...)  step 10: the loop, given its sections and the record

    1. world      init_world(cfg.parallel): the process group (launch refusals before any data is read)
    2. batch      train.grad_accum_steps for the data-parallel copies (train.global_batch_size)
    3. inputs     parts.inputs: the data and the model's shape (kiln train: tokenizer, vocabulary, HF init)
    4. seed       train.seed on every rank: the same initial weights
    5. precision  parts.precision: the concrete mode (kiln train records it and why; --plan.memory's choice first)
    6. layout     the run's ParallelPlan, built once with the model (parts.layout) and laid over the world
    7. decisions  parts.decisions: train.compile, train.cpu_linear, and why; train.cpu_allocator (glibc tuned here)
    8. model      parts.model, its data loader (parts.loader) and memory levers (parts.levers: a ModelPlan)
    9. state      build_state: the model pipeline, the optimizer, the TrainState
   10. loop       Trainer (kiln.train.loop); the caller resumes (trainer.resume) and runs it

No part receives the whole Config to change it, and none mutates it: every step returns what it decided
({"section.key": value} or {"section": a new section}) and the builder records it in a RunRecord, whose Config
is what config.toml and every checkpoint save (a resume, or `--train.max_steps=N`, repeats the run). The loop
receives its own sections (trainer_sections) and hands a budgeted run's train.max_steps to record.decide.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from rich.console import Console

from kiln.config import Config, to_toml
from kiln.errors import KilnError
from kiln.parallel import World, device_for, init_world
from kiln.parallel.layout import ParallelPlan
from kiln.perf.allocator import decide_allocator, tune
from kiln.perf.compile import compile_key, compile_setting, decide_compile
from kiln.perf.cpu_linear import decide_cpu_linear
from kiln.perf.hardware import decide_mode
from kiln.train.loop import Trainer
from kiln.train.state import TrainState, build_state, seed_everything

TRAINER_SECTIONS = ("train", "schedule", "optim", "log", "checkpoint", "numerics", "faults", "parallel")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError("train.device asks for CUDA but torch sees no GPU; use --train.device=cpu",
                        key="train.device", value=name, fix="use --train.device=cpu")
    return device


class RunRecord:
    """The run's Config as it is recorded: the Config given, with every decision a step returned. The caller's
    Config is never changed (dataclasses.replace makes each new one)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def decide(self, key: str, value) -> None:
        """Record one decision: "section.key" and its value, or "section" and a whole new section."""
        section, _, name = key.partition(".")
        new = replace(getattr(self.cfg, section), **{name: value}) if name else value
        self.cfg = replace(self.cfg, **{section: new})

    def record(self, decided: dict | None) -> None:
        for key, value in (decided or {}).items():
            self.decide(key, value)

    def toml(self) -> str:
        """The text of the run's config.toml (and of every checkpoint's)."""
        return to_toml(self.cfg)


def trainer_sections(cfg: Config) -> dict:
    """The config sections the loop reads (kiln.train.loop.Trainer's keyword arguments)."""
    return {name: getattr(cfg, name) for name in TRAINER_SECTIONS}


@dataclass
class Run:
    record: RunRecord
    world: World
    state: TrainState
    parts: object

    @property
    def cfg(self) -> Config:
        return self.record.cfg

    def trainer(self, run_dir, console: Console | None = None, **kw) -> Trainer:
        """Step 10: the loop over the state, given its sections and the record (kw: evaluate, peak_lr, FLOPs...)."""
        return Trainer(self.state, run_dir, console, **trainer_sections(self.cfg), record=self.record, **kw)


def build_run(cfg: Config, parts, device: torch.device | None = None, log=print) -> Run:
    """Steps 1-9 (module docstring). On a failure the world is closed before the error goes up."""
    device = device or pick_device(cfg.train.device)
    world = init_world(cfg.parallel, device.type)  # 1
    try:
        return _build(RunRecord(cfg), parts, device_for(world, device), world, log)
    except BaseException:
        world.close()
        raise


def _build(record: RunRecord, parts, device: torch.device, world: World, log) -> Run:
    copies = ParallelPlan.data_copies(record.cfg.parallel, world.size)
    record.decide("train.grad_accum_steps", accumulation_for(record.cfg.train, copies))  # 2
    record.record(parts.inputs(record.cfg, world, device, log))  # 3
    seed_everything(record.cfg.train.seed)  # 4
    decided, precision = parts.precision(record.cfg, device, log)  # 5: the concrete mode the run trains in
    record.record(decided)
    world.lay_out(parts.layout(record.cfg, world.size))  # 6
    record.record(parts.decisions(record.cfg, device, world, precision))  # 7
    record.decide("train", recorded_allocator(record.cfg.train, device))
    cfg = record.cfg
    model = parts.model(cfg, device)  # 8
    loader = parts.loader(cfg, world, device)
    levers = parts.levers(cfg, model, precision, device, world.plan)
    state = build_state(model, parts.objective, loader, device=device, precision=precision,  # 9
                        precision_cfg=cfg.precision, optim=cfg.optim, plan=levers, world=world)
    return Run(record, world, state, parts)


def accumulation_for(tc, world_size: int) -> int:
    """grad_accum_steps per rank: from train.global_batch_size when it is set, else as configured."""
    if not tc.global_batch_size:
        return tc.grad_accum_steps
    per_step = tc.micro_batch_size * world_size
    if tc.global_batch_size % per_step:
        raise KilnError(f"train.global_batch_size={tc.global_batch_size} sequences cannot be shared by {world_size} "
                        f"ranks of train.micro_batch_size={tc.micro_batch_size}: it must be a multiple of "
                        f"{per_step}; change the world size, the micro-batch or the global batch",
                        key="train.global_batch_size", value=tc.global_batch_size,
                        fix="change the world size, the micro-batch or the global batch")
    return tc.global_batch_size // per_step


def recorded_precision(pc, asked: str, device: torch.device):
    """The precision section with its concrete mode and what decided it, as the run's config.toml records them:
    a resume (and `--train.max_steps=N` repeats) runs that mode, whatever auto would measure on the machine then.
    A config that already says what decided it (a resumed run's) keeps its words."""
    mode, why = decide_mode(pc.mode, device)
    if pc.mode != asked:
        why = f"plan.memory chose precision.mode={mode} (precision.mode={asked} was given)"
    return replace(pc, mode=mode, decided_by=pc.decided_by if pc.decided_by and pc.mode == asked != "auto" else why)


def recorded_compile(cfg: Config, device: torch.device):
    """The train section with train.compile resolved (auto: from its measured cost and gain, kiln.perf.compile) and
    why, as config.toml records them: a resume, or `--train.max_steps=N`, compiles as the run did. A concrete
    value that already says why (a resumed run's) keeps its words."""
    tc = cfg.train
    setting = compile_setting(tc.compile)
    why = tc.compile_decided_by
    recorded = "true" if why.startswith("auto: on,") else "false" if why.startswith("auto: off,") else ""
    if setting != "auto" and recorded == setting:  # the run's own reason for the value it has (not an override's)
        return replace(tc, compile=setting == "true")
    rows = tc.micro_batch_size * cfg.data.seq_len
    on, why = decide_compile(tc.compile, device, compile_key(cfg.model, cfg.precision.mode, rows), tc.max_steps,
                             tc.time_budget, blocked_by="faults.* hook the eager modules" if cfg.faults.any else
                             "parallel.pp runs torch's pipeline schedules on eager stages" if cfg.parallel.pp > 1
                             else None)
    return replace(tc, compile=on, compile_decided_by=why)


def recorded_allocator(tc, device: torch.device):
    """The train section `tc` with why train.cpu_allocator resolved as it did, glibc's malloc tuned for this process
    where it did (kiln.perf.allocator). Decided again on a resume: the host and its environment may differ."""
    on, why = decide_allocator(tc.cpu_allocator, device)
    if on and not tune():
        why = f"{tc.cpu_allocator}: system, glibc refused mallopt"
    return replace(tc, cpu_allocator_decided_by=why)


def recorded_cpu_linear(tc, device: torch.device, precision: str, shapes: list[tuple[int, int, int]], world):
    """The train section `tc` with train.cpu_linear resolved to onednn or torch (auto: measured once per machine at
    the largest of `shapes`, the model's linears as (rows, in, out); kiln.perf.cpu_linear) and why, as config.toml
    records them: a resume runs the products the run ran."""
    if tc.cpu_linear != "auto" and tc.cpu_linear_decided_by.startswith(f"auto: {tc.cpu_linear},"):
        return tc  # a resumed run's choice, with its reason

    def decide():
        compiled = compile_setting(tc.compile) == "true"
        return decide_cpu_linear(tc.cpu_linear, device, precision, shapes, compiled=compiled)

    if tc.cpu_linear == "auto":  # rank 0 measures and decides (auto never raises): every rank runs its products
        on, why = world.broadcast_object(decide() if world.main else None)
    else:
        on, why = decide()  # an explicit value: the same answer, or the same refusal, on every rank
    return replace(tc, cpu_linear="onednn" if on else "torch", cpu_linear_decided_by=why)
