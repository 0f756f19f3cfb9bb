"""kiln's language-model job, built from a Config: what `kiln train`, `kiln doctor`, `kiln memory --measure`,
`kiln plan --verify` and the benchmarks build. The model is kiln's Transformer; the model pipeline
(kiln.train.pipeline) applies its levers (model_plan).

    lm = build_lm(cfg, run_dir)         kiln.run.builder's steps with LMParts: data, the model, the TrainState
    result = train(cfg, run_dir)        build, (resume,) run the Trainer, sample; returns a TrainResult
"""
from __future__ import annotations

import itertools
import os
import signal
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from rich.console import Console

from kiln.config import Config, checked
from kiln.data import PreparedData, TokenLoader, prepare_data, val_batches
from kiln.data.batches import to_device
from kiln.data.documents import document_separator
from kiln.errors import KilnError
from kiln.evaluate import Prepared, score_task, training_tasks
from kiln.parallel import ParallelPlan, launched_by_torchrun
from kiln.parallel.elastic import batch_after_resharding, restart_record
from kiln.interop.base import base_reference
from kiln.parallel.context import check_context_parallel
from kiln.interop.hf import read_hf
from kiln.memory.devices import get_device, local_device
from kiln.memory.estimate import fmt_bytes, parse_bytes
from kiln.memory.levers import JobSections, runtime_job
from kiln.memory.planner import PlanConfig, search
from kiln.models import ModelConfig, Transformer, build_model
from kiln.models.generate import Sampling
from kiln.models.lora import apply_lora
from kiln.models.registry import family
from kiln.numerics.faults import DelayedLoader
from kiln.perf import flops_per_token
from kiln.perf.flops import recompute_flops_per_token
from kiln.perf.peak import linear_shapes, model_peak_flops
from kiln.perf.hardware import resolve_kernels
from kiln.precision import mode
from kiln.run.adapters import load_peft_adapters, merged_weights
from kiln.run.builder import (RunRecord, build_run, pick_device, recorded_compile, recorded_cpu_linear,
                              recorded_precision, trainer_sections)
from kiln.run.device_levers import device_levers, refuse_before_data
from kiln.run.generate import complete
from kiln.run.start import start_lines
from kiln.run.oom import OomContext, OutOfMemory, oom_report, ram_check
from kiln.train.checkpoint import Checkpointer, RunLock, full_weights
from kiln.train.loop import TrainResult, Trainer
from kiln.train.objective import LanguageModeling
from kiln.train.optim import scaled_lr
from kiln.train.pipeline import ModelPlan
from kiln.train.precision import Precision
from kiln.train.state import TrainState, determinism
from kiln.train.step import evaluate
from kiln.train.target import eval_batch_count, eval_micro_batch, regroup


def resolve_model(cfg: Config, vocab: int) -> ModelConfig:
    """The model section with the preset filled in and the tokenizer's vocabulary when model.vocab_size is 0."""
    model_cfg = cfg.model.resolve()
    if model_cfg.vocab_size == 0:
        model_cfg.vocab_size = vocab
    elif model_cfg.vocab_size < vocab:
        raise KilnError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {vocab}; "
                        f"set --model.vocab_size={vocab} or 0 (take the tokenizer's)",
                        key="model.vocab_size", value=model_cfg.vocab_size, fix=f"set --model.vocab_size={vocab} or 0")
    return model_cfg


def model_plan(cfg: Config, model_cfg: ModelConfig, precision: str, device: torch.device,
               layout: ParallelPlan | None = None) -> ModelPlan:
    """The model pipeline's plan from the train and memory sections (kiln.config checked they agree); layout: the
    run's ParallelPlan when the model is split."""
    kernels = resolve_kernels(cfg.train.kernels, device)
    if kernels == "triton" and (model_cfg.dropout > 0 or cfg.data.masks_documents):
        kernels = "torch"  # train.kernels=auto with dropout or a document mask: FlashAttention has neither (explicit
        # triton is refused)
    job = runtime_job(JobSections.of(cfg), model_cfg, precision, device)
    # tp > 1: kiln.parallel.tensor puts its vocabulary-parallel loss in the plain LMLoss's place
    fused = kernels == "triton" and cfg.parallel.tp == 1
    loss = "chunked" if cfg.memory.chunked_loss else ("fused" if fused else "plain")
    return ModelPlan(kernels=kernels, cpu_linear=cfg.train.cpu_linear == "onednn", fp8=mode(precision).fp8,
                     recompute=job.recompute, offload=job.offload, loss=loss, loss_chunk=cfg.memory.chunked_loss,
                     compile=cfg.train.compile, parallel=cfg.parallel, layout=layout)


def plan_memory(sections: JobSections, plan_cfg: PlanConfig, device: torch.device, log=print) -> dict:
    """`--plan.memory`: the sections the planner's best choice sets ({"train": ..., "memory": ...}), for the caller
    to apply through the config's own checks."""
    target = get_device(plan_cfg.device) if plan_cfg.device else local_device(device)
    plan = search(sections, target, parse_bytes(plan_cfg.memory, "plan.memory"), plan_cfg.global_batch_tokens)
    if plan.best is None:
        raise KilnError(plan.shortfall(),
                        key="plan.memory", value=plan_cfg.memory,
                        fix="raise plan.memory, or leave it empty and choose the levers yourself")
    best = plan.best
    log(f"plan: {best.choice.describe()} | predicted peak {fmt_bytes(best.total_bytes)} of "
        f"{fmt_bytes(plan.memory)} on {target.name}, {best.step_s:.3g} s/step ({plan.considered} configurations "
        f"considered, {len(plan.candidates)} fit)")
    return best.choice.on(sections).levers()


@dataclass
class LMRun:
    cfg: Config  # resolved: model shape and vocabulary filled in, the plan applied
    state: TrainState
    data: PreparedData | None  # None when built to measure (random tokens)
    tasks: list[Prepared] = field(default_factory=list)  # train.eval_tasks, tokenized once
    record: RunRecord | None = None  # the builder's record of the run: what config.toml saves

    @property
    def model_cfg(self) -> ModelConfig:
        return self.cfg.model

    def evaluate(self, model) -> float | dict[str, float]:
        """The validation loss; for a [[data.mix]], {"val_loss": mix-weighted mean, "val_loss/<name>": each}; with
        train.eval_tasks also task_<name>_acc, _acc_norm, _acc_stderr (multiple choice) or _bpb (text:)."""
        if self.data.sources:
            losses = {f"val_loss/{name}": self._evaluate_on(model, part.val) for name, _, part in self.data.sources}
            weights = {f"val_loss/{name}": w for name, w, _ in self.data.sources}
            mean = sum(weights[k] * v for k, v in losses.items()) / sum(weights.values())
            loss = {**losses, "val_loss": mean}
        else:
            loss = self._evaluate_on(model, self.data.val)
        if not self.tasks:
            return loss
        return {**(loss if isinstance(loss, dict) else {"val_loss": loss}), **self._task_scores(model)}

    def _task_scores(self, model) -> dict[str, float]:
        """Every train.eval_tasks task scored as `kiln eval` scores it, its items split over the data-parallel
        copies and the log-likelihoods summed (every rank gets the same scores)."""
        c, state, world = self.cfg, self.state, self.state.world
        scores = {}
        for prepared in self.tasks:
            result = score_task(model, prepared, vocab=c.model.vocab_size, max_length=c.model.max_seq_len,
                                batch_size=c.train.micro_batch_size, device=state.device,
                                autocast=state.precision.autocast, world=world if world.size > 1 else None)
            scores.update({f"task_{result.name}_{k}": v for k, v in result.scalars.items()})
        return scores

    def _evaluate_on(self, model, tokens) -> float:
        c, world = self.cfg, self.state.world
        batches = val_batches(tokens, c.train.micro_batch_size, c.data.seq_len,
                              eval_batch_count(c.train, len(tokens), c.data.seq_len),  # 0: every window
                              separator=document_separator(c.data, self.data.tokenizer))
        mine = itertools.islice(batches, world.dp_rank, None, world.dp_size)  # each copy its share; totals summed
        size = eval_micro_batch(c.train, c.data.seq_len, c.model.padded_vocab, self.state.device.type,
                                world.plan.pp > 1)
        if size != c.train.micro_batch_size:  # the same windows in larger forwards (kiln.train.target)
            mine = regroup(mine, size)
        return evaluate(model, (to_device(b, self.state.device) for b in mine), self.state.objective,
                        self.state.precision, self.state.device, world if world.size > 1 else None)

    def sample(self, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 50,
               seed: int = 0) -> str | None:
        """Text from the trained model on rank 0 (None on the others), generated with the KV cache (kiln.run.generate)
        from a plain copy of the model: the trained one may carry recompute, offload, Triton kernels or fp8 linears,
        which the cached forward does not go through (the copy costs one more set of weights). When no rank holds
        the whole model (FSDP, TP, PP), every rank calls this: the weights are gathered to rank 0, which samples
        alone."""
        world = self.state.world
        weights = full_weights(self.state) if world.splits_weights else self.state.model.state_dict()
        weights = merged_weights(self.cfg.model, self.cfg.lora, weights) if self.cfg.lora.on else weights
        if not world.main:
            return None
        model = build_model(self.cfg.model, self.state.device)
        model.load_state_dict(weights)
        model.to(self.state.precision.param_dtype)
        return generate_text(model, self.data.tokenizer, prompt, max_new_tokens, temperature, top_k, seed,
                             self.state.device, self.state.precision)

    def final_sample(self, result: TrainResult) -> str | None:
        """The text `kiln train` prints after a run (train.sample_tokens), on rank 0; every rank calls this. None
        when off, after a failure (NaN weights cannot be sampled), or on token-id data (no text to prompt with)."""
        tc, world = self.cfg.train, self.state.world
        if not tc.sample_tokens or result.failure is not None or self.data.tokenizer.kind == "ids":
            return None
        if not (world.main or world.splits_weights):  # the weights are whole on rank 0: it samples alone
            return None
        return self.sample(tc.sample_prompt, tc.sample_tokens)

    def peak_lr(self) -> tuple[float, str | None]:
        """optim.lr, scaled to this run's global batch under optim.lr_scaling (and the line that says so)."""
        c = self.cfg
        tokens = c.train.micro_batch_size * c.train.grad_accum_steps * c.data.seq_len * self.state.world.dp_size
        return scaled_lr(c.optim, tokens)

    def trainer(self, run_dir: Path, console: Console | None = None, callbacks=()) -> Trainer:
        c, state = self.cfg, self.state
        model_flops = flops_per_token(c.model, c.data.seq_len)
        recomputed = recompute_flops_per_token(c.model, c.data.seq_len, self.state.applied.get("recompute", ()))
        return Trainer(state, run_dir, console, **trainer_sections(c), record=self.record or RunRecord(c),
                       evaluate=self.evaluate if self.data is not None else None, flops_per_unit=model_flops,
                       hardware_flops_per_unit=model_flops + recomputed,
                       peak_flops=model_peak_flops(state.device, state.precision.mode, c.model,
                                                   c.train.micro_batch_size * c.data.seq_len,
                                                   onednn=c.train.cpu_linear == "onednn"),
                       peak_lr=self.peak_lr()[0], callbacks=callbacks,
                       vocab_size=self.data.tokenizer.vocab_size if self.data is not None else None)


def build_lm(cfg: Config, run_dir: Path | None = None, log=print, device: torch.device | None = None,
             with_data: bool = True) -> LMRun:
    """Data (tokenized once, cached), the resolved config, the model through the pipeline, the TrainState: the run
    builder's steps (kiln.run.builder) with kiln train's parts.

    with_data=False builds without data (vocabulary from the config, 256 for bytes): for measuring memory on
    random tokens.
    """
    for note in device_levers(cfg, device or pick_device(cfg.train.device)):  # refused before the data
        log(note)
    refuse_before_data(cfg)
    parts = LMParts(Path(run_dir) if run_dir is not None else None, with_data, log)
    run = build_run(cfg, parts, device, log)
    run.state.base = parts.base
    return LMRun(run.cfg, run.state, parts.data, parts.tasks, run.record)


@dataclass
class LMParts:
    """What `kiln train` hands the run builder: its data from the `data` section, kiln's Transformer (or a Hugging
    Face checkpoint's weights in it), the language-modelling objective. Each step returns what it decided."""

    run_dir: Path | None
    with_data: bool
    log: object
    objective: LanguageModeling = field(default_factory=LanguageModeling)
    data: PreparedData | None = None
    initial: dict | None = None  # model.init: the checkpoint's weights
    base: dict | None = None  # a LoRA run's model.init: its path and digest, what its checkpoints refer to
    tasks: list[Prepared] = field(default_factory=list)

    def inputs(self, cfg: Config, world, device, log) -> dict:
        """The data (rank 0 tokenizes or finds the cache and saves the tokenizer; the others wait, then read) and
        the model's shape: a preset, or a Hugging Face checkpoint's; the tokenizer's vocabulary."""
        model, data_cfg = cfg.model, cfg.data
        if model.init:  # a Hugging Face checkpoint: its shape, its weights and (unless told) its tokenizer
            directory = Path(model.init.removeprefix("hf:"))
            shape, self.initial = read_hf(directory, model)  # the user's training fields; recipe parts checked
            self.base = base_reference(model.init) if cfg.lora.on else None  # LoRA checkpoints refer to it
            model = replace(shape, init=model.init)
            if data_cfg.tokenizer == "bytes" and (directory / "tokenizer.json").is_file():
                data_cfg = replace(data_cfg, tokenizer=model.init)
        if self.with_data:  # data.cache_per_node: each node's local rank 0 prepares its own disk's cache too
            first = world.main or (data_cfg.cache_per_node and world.local_rank == 0)
            if first:
                self.data = prepare_data(data_cfg, self.run_dir if world.main else None,
                                         log=log if world.main else lambda msg: None)
            world.barrier()
            if not first:
                self.data = prepare_data(data_cfg, None, log=lambda msg: None)
        vocab = self.data.tokenizer.vocab_size if self.data is not None else (
            256 if data_cfg.tokenizer == "bytes" else data_cfg.vocab_size)
        return {"data": data_cfg, "model": resolve_model(replace(cfg, model=model), vocab)}

    def precision(self, cfg: Config, device, log) -> tuple[dict, str]:
        """--plan.memory's choice of precision, batch split and levers, then the concrete mode and why."""
        planned = checked(replace(cfg, **plan_memory(JobSections.of(cfg), cfg.plan, device, log))) \
            if cfg.plan.memory else cfg
        decided = {f.name: getattr(planned, f.name) for f in fields(Config)
                   if getattr(planned, f.name) != getattr(cfg, f.name)}
        decided["precision"] = recorded_precision(planned.precision, cfg.precision.mode, device)
        return decided, decided["precision"].mode

    def layout(self, cfg: Config, world_size: int) -> ParallelPlan:
        """The layout checked against the model: heads, widths and layers the split divides."""
        tc = cfg.train
        check_context_parallel(cfg.parallel, cfg.data.seq_len, moe=cfg.model.n_experts > 0)  # a checkpoint's shape
        return ParallelPlan.build(cfg.parallel, world_size, cfg.model, family(cfg.model.arch),
                                  tc.micro_batch_size * tc.grad_accum_steps, tc.grad_accum_steps)

    def decisions(self, cfg: Config, device, world, precision: str) -> dict:
        train = recorded_compile(cfg, device)
        rows = train.micro_batch_size * cfg.data.seq_len
        return {"train": recorded_cpu_linear(train, device, precision, linear_shapes(cfg.model, rows), world)}

    def model(self, cfg: Config, device) -> Transformer:
        model = build_model(cfg.model, "cpu" if device.type == "meta" else device)
        if self.initial is not None:
            missing, unexpected = model.load_state_dict(self.initial, strict=False)
            if unexpected or any(not k.startswith("rope_") for k in missing):
                raise KilnError(f"{cfg.model.init}: the checkpoint does not fill kiln's model (missing "
                                f"{missing[:3]}, unexpected {unexpected[:3]})",
                                key="model.init", value=cfg.model.init)
        apply_lora(model, cfg.lora, cfg.model)  # lora.rank > 0: adapters on the family's linears, the rest frozen
        load_peft_adapters(model, cfg.model, cfg.lora)  # lora.init=peft:DIR: the adapters start as DIR's
        return model

    def loader(self, cfg: Config, world, device):
        """The train split's loader (None without data), and train.eval_tasks read before the first step."""
        data, loader = self.data, None
        if data is None:
            return None
        separator = document_separator(cfg.data, data.tokenizer)
        loader = TokenLoader(data.train, cfg.train.micro_batch_size, cfg.data.seq_len, cfg.data.seed, device,
                             cfg.data.prefetch, rank=world.dp_rank, world=world.dp_size,
                             what=f"data.source={cfg.data.source!r}, train split", separator=separator)
        if separator is not None and world.main:
            self.log(f"data.document_mask: documents end at id {separator}; attention and positions restart after "
                     f"it, and its target is not counted")
        if cfg.faults.data_delay_ms:
            loader = DelayedLoader(loader, cfg.faults.data_delay_ms)
        if len(data.val) < cfg.data.seq_len + 1:  # found now, not at the first evaluation
            raise KilnError(f"data.source={cfg.data.source!r}: the validation split holds {len(data.val)} tokens, "
                            f"fewer than one sequence of data.seq_len + 1 = {cfg.data.seq_len + 1}; raise "
                            f"data.val_fraction, lower data.seq_len, or use more text",
                            key="data.val_fraction", value=cfg.data.val_fraction,
                            fix="raise data.val_fraction, lower data.seq_len, or use more text")
        self.tasks = [] if data is None else training_tasks(
            cfg.train, data.tokenizer, cfg.model.max_seq_len, world.plan, self.log if world.main else lambda msg: None)
        return loader

    def levers(self, cfg: Config, model, precision: str, device, plan: ParallelPlan) -> ModelPlan:
        return model_plan(cfg, cfg.model, precision, device, plan if plan.pp > 1 else None)  # pp: stages


def train(cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
          force: bool = False, callbacks=()) -> TrainResult:
    """Train (or resume) a language-model run; returns the result with the final validation loss and a sample.

    On a CPU the predicted peak is checked against the free RAM first (force: warn instead of refusing). A step
    that runs out of memory raises OutOfMemory after printing its report. callbacks: kiln.train.callbacks."""
    run_dir = Path(run_dir)
    if not resume and Checkpointer(cfg.checkpoint, run_dir).latest() is not None:
        raise FileExistsError(f"{run_dir} already holds a run with checkpoints; pass --resume {run_dir} to continue "
                              f"it, or choose another --run-dir")
    con = console or Console(soft_wrap=True)
    main = not launched_by_torchrun() or int(os.environ["RANK"]) == 0
    if not main:
        con = Console(quiet=True)  # rank 0 speaks for the run
    ram_check(cfg, pick_device(cfg.train.device), force, log=lambda msg: con.print(msg, highlight=False))
    with RunLock(run_dir, enabled=main), determinism(cfg.train.deterministic):
        lm = build_lm(cfg, run_dir, log=lambda msg: con.print(msg, highlight=False))
        try:
            return _train(lm, cfg, run_dir, resume, con, callbacks)
        finally:
            lm.state.world.close()


def _train(lm: LMRun, cfg: Config, run_dir: Path, resume: bool, con: Console, callbacks=()) -> TrainResult:
    trainer = lm.trainer(run_dir, con, callbacks)
    if resume:
        path = trainer.resume()
        con.print(f"resumed from {path} at step {lm.state.step}", highlight=False)
        resharded = batch_after_resharding(lm.state.resumed_world["dp"], lm.state.world.dp_size, lm.cfg.train)
        if resharded:
            con.print(resharded, highlight=False)
    # torchrun restarted this group (--auto-resume)
    restart = restart_record(run_dir, lm.state.step, lm.state.world, lm.state.resumed_world)
    if restart is not None:
        trainer.events.append(restart)
        trainer.resumed_at = lm.state.step  # the failed attempt's records past it move aside (trained again)
        con.print(f"restart {restart['restarts']}: continuing at step {restart['step']}, {restart['steps_lost']} "
                  f"step(s) of the failed attempt trained again", highlight=False)
    for line in start_lines(lm, cfg, resume):
        con.print(line, highlight=False)
    c, state = lm.cfg, lm.state
    try:
        result = trainer.run()
    except torch.OutOfMemoryError as e:
        report = oom_report(OomContext(c, state.device, state.step + 1, trainer.checkpointer.latest()), e, run_dir)
        for line in report:
            con.print(line, highlight=False, markup=False)
        raise OutOfMemory(report) from None
    lm.cfg = result.cfg = trainer.record.cfg  # the run as recorded: a time-budgeted run has its max_steps now
    if result.signal is not None:
        con.print(stop_line(result, run_dir), highlight=False)
        return result
    shown_val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a (stopped before an evaluation)"
    con.print(f"done at step {result.step} ({result.stop_reason}): val_loss {shown_val} | unigram baseline "
              f"{lm.data.unigram_loss:.4f} | checkpoint {result.checkpoint}", highlight=False)
    result.unigram_loss = lm.data.unigram_loss
    result.sample = lm.final_sample(result)
    if result.sample is not None:
        con.rule("sample")
        con.print(result.sample, markup=False, highlight=False)
        con.rule()
    return result


def stop_line(result: TrainResult, run_dir: Path) -> str:
    name = signal.Signals(result.signal).name
    return (f"stopped by {name} at step {result.step}: checkpoint {result.checkpoint}; resume with `kiln train "
            f"--resume {run_dir}` (exit status {128 + result.signal})")


def generate_text(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int, device, precision: Precision | None = None) -> str:
    """prompt + the model's continuation of it (KV cache; stops at the end-of-text id). An empty prompt starts a
    document: the end-of-text id (0 for a tokenizer without one)."""
    ids = tokenizer.encode(prompt) or [max(tokenizer.eot_id, 0)]
    done = complete(model, tokenizer, [ids], max_new_tokens, Sampling(temperature, top_k or 0), seed=seed,
                    stop_ids=(tokenizer.eot_id,), autocast=precision.autocast if precision is not None else None)
    return prompt + done.texts[0]
