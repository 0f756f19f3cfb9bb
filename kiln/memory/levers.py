"""The `memory` config section, the config sections the estimator reads, and the estimator's Job.

    MemoryConfig                          recompute, offload, chunked loss keys
    JobSections.of(cfg)                   the sections a Job is built from (model, data, train, precision, memory,
                                          optim, parallel, lora): the one place a Config becomes them; no function
                                          of kiln.memory takes the whole Config (tests/test_memory_sections.py)
    job_of(sections, model, precision, target)
                                          the one builder of the estimator's Job
    job_for(sections, device)             ... for a Device (kiln.memory.devices)
    runtime_job(sections, model, mode, torch_device)
                                          ... for the torch device this process trains on: its recompute plan is
                                          what kiln's model pipeline (kiln.train.pipeline) applies
    for_rank(job, plan, stage)            one rank of a ParallelPlan (tensor, pipeline, context, data parallel)
    rank_jobs(sections, device, ranks)    the plan of `ranks` processes checked as training checks it, and the
                                          Job of every pipeline stage (the planner's too)
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from kiln.errors import KilnError
from kiln.memory.adapters import Adapters
from kiln.memory.estimate import Job, Target, data_parallel, parse_bytes
from kiln.memory.offload import parse_blocks
from kiln.memory.recompute import POLICIES, plan_for
from kiln.models.config import ModelConfig
from kiln.models.registry import family
from kiln.parallel.config import ParallelConfig
from kiln.parallel.layout import ParallelPlan
from kiln.perf.hardware import auto_mode, fp8_refusal
from kiln.precision import PRECISIONS, is_auto
from kiln.util import closest


@dataclass
class MemoryConfig:
    """The `memory` section."""

    recompute: str = "none"  # activation recomputation: none | full | every_k | selective | budget
    recompute_every: int = 2  # every_k: blocks per checkpointed segment (one checkpoint per k blocks)
    recompute_budget: str = ""  # budget: bytes saved activations may take, e.g. 6GiB (least recompute FLOPs)
    offload_blocks: str = "none"  # blocks whose saved activations go to pinned host memory: none | all | 0-5 | 0,2,4
    chunked_loss: int = 0  # tokens per chunk of LM head + cross-entropy (0: off); never makes [tokens x vocab] fp32

    def validate(self):
        if self.recompute not in POLICIES:
            hint = closest(self.recompute, POLICIES)
            raise KilnError(f"memory.recompute={self.recompute!r} is unknown" + (f"; did you mean {hint!r}?" if hint
                                                                                  else "") + f" Use one of {POLICIES}",
                            key="memory.recompute", value=self.recompute, fix=f"Use one of {POLICIES}")
        if self.recompute_every < 1:
            raise KilnError(f"memory.recompute_every must be ≥ 1, got {self.recompute_every}",
                            key="memory.recompute_every", value=self.recompute_every, fix="give a whole number ≥ 1")
        if self.recompute == "budget" and not self.recompute_budget:
            raise KilnError("memory.recompute='budget' needs memory.recompute_budget, e.g. "
                            "--memory.recompute_budget=6GiB",
                            key="memory.recompute_budget", value=self.recompute_budget,
                            fix="e.g. --memory.recompute_budget=6GiB")
        if self.recompute_budget:
            parse_bytes(self.recompute_budget, "memory.recompute_budget")
        if self.chunked_loss < 0:
            raise KilnError(f"memory.chunked_loss must be ≥ 0 (0 = off), got {self.chunked_loss}",
                            key="memory.chunked_loss", value=self.chunked_loss,
                            fix="give a number of chunks ≥ 1, or 0 for off")
        parse_blocks(self.offload_blocks, None)  # the spelling; kiln.config checks the indices


@dataclass(frozen=True)
class JobSections:
    """The config sections the estimator and the planner read, and nothing else of the Config (torchtitan's
    components each take their own slice of the config): the model and data sections (the shape, data.seq_len and
    the tokenizer's vocabulary), train (the batch), precision (the mode), memory (the levers), optim (the optimizer
    and its offload), parallel (the strategy and degrees, which ParallelPlan.build checks) and lora.

    `JobSections.of(cfg)` is the one place a Config becomes them. A planner's Choice returns new ones
    (planner.Choice.on), whose `levers()` are the sections it set, as the run builder records them."""

    model: ModelConfig  # as given: resolved_model() fills in the preset and the vocabulary
    data: object  # kiln.data.DataConfig: seq_len, tokenizer, vocab_size
    train: object  # kiln.train.loop.TrainConfig (a layer above kiln.memory): micro_batch_size, grad_accum_steps
    precision: object  # kiln.train.precision.PrecisionConfig: mode (auto: precision_for picks it per device)
    memory: MemoryConfig
    optim: object  # kiln.train.optim.OptimConfig: name, momentum, offload
    parallel: ParallelConfig
    lora: object = None  # kiln.models.lora.LoraConfig; None or rank 0: a full fine-tune

    @classmethod
    def of(cls, cfg) -> "JobSections":
        """A Config's sections that the estimator reads (the one function of kiln.memory given a whole Config)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def seq_len(self) -> int:
        return self.data.seq_len

    def resolved_model(self) -> ModelConfig:
        return resolved_model(self.model, self.data)

    def levers(self) -> dict:
        """The sections a planner's Choice sets, by name ({"precision": ..., "train": ...}): what the run builder
        records (kiln.run.builder.RunRecord) and dataclasses.replace(cfg, **levers) applies to a Config."""
        return {name: getattr(self, name) for name in LEVER_SECTIONS}


LEVER_SECTIONS = ("precision", "train", "memory", "optim", "parallel")


def resolved_model(model: ModelConfig, data) -> ModelConfig:
    """The model section resolved, with the tokenizer's vocabulary (the data section's) when model.vocab_size is 0."""
    model = model.resolve()
    if model.vocab_size == 0:
        model.vocab_size = 256 if data.tokenizer == "bytes" else data.vocab_size
    return model


def precision_for(mode: str, device) -> str:
    """Concrete precision of `mode` on a Device from kiln.memory.devices; auto by the rule `kiln train` uses
    (kiln.perf.hardware.auto_mode), from the device's capability or its measured matmul rates."""
    if is_auto(mode):
        return auto_mode(device.kind, device.capability, device.peak_flops)[0]
    if mode in PRECISIONS and PRECISIONS[mode].fp8 and not device.supports(mode):
        raise KilnError(fp8_refusal(device.kind, device.capability, device.name), key="precision.mode", value=mode)
    if not device.supports(mode):
        raise KilnError(f"precision.mode={mode!r} does not run on {device.name}; its table has "
                        f"{', '.join(device.peak_flops)} (use one of those, or auto)",
                        key="precision.mode", value=mode, fix="use one of those, or auto")
    return mode


def job_of(sections: JobSections, model: ModelConfig, precision: str, target: Target,
           recompute_plan: tuple[str, ...] | None = None, world: int = 1) -> Job:
    """The one builder of the estimator's Job: a resolved model section, a concrete precision and a Target, and
    the sections the step's bytes depend on (train: the batch; memory: recompute, offload, chunked loss; optim:
    the optimizer and its offload; parallel: the strategy; lora: the adapters on a frozen base, None or rank 0 for
    a full fine-tune). The recompute plan is the memory section's (solved for `budget`) unless given. world: ranks
    of parallel.strategy sharing the state (the breakdown is one rank's)."""
    train, memory, optim, parallel = sections.train, sections.memory, sections.optim, sections.parallel
    job = Job(model=model, micro_batch=train.micro_batch_size, seq_len=sections.seq_len,
              grad_accum=train.grad_accum_steps, precision=precision, target=target,
              offload=parse_blocks(memory.offload_blocks, model.n_layer), chunked_loss=memory.chunked_loss,
              optimizer=optim.name, sgd_momentum=optim.momentum, optimizer_offload=optim.offload,
              muon_ns_steps=optim.muon_ns_steps,
              plan=data_parallel(parallel.strategy, world), reshard_after_forward=parallel.reshard_after_forward,
              lora=Adapters.of(model, sections.lora))
    if recompute_plan is None:
        recompute_plan = plan_for(memory.recompute, memory.recompute_every, memory.recompute_budget, job)
    return replace(job, recompute=tuple(recompute_plan))


def job_for(sections: JobSections, device, recompute_plan: tuple[str, ...] | None = None, world: int = 1) -> Job:
    """The Job of the sections on a Device (kiln.memory.devices: a table entry, or this machine measured)."""
    return job_of(sections, sections.resolved_model(), precision_for(sections.precision.mode, device),
                  device.target, recompute_plan, world)


def runtime_target(torch_device) -> Target:
    """The estimator's Target for the device this process trains on, without measuring anything."""
    if torch_device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(torch_device)
        return Target("cuda", float(f"{major}.{minor}"))
    return Target(torch_device.type)


def runtime_job(sections: JobSections, model: ModelConfig, precision: str, torch_device) -> Job:
    """The Job of the step this process is about to train: its resolved model section, its concrete precision and
    its device, nothing measured. Its recompute plan is what kiln's model pipeline applies."""
    return job_of(sections, model, precision, runtime_target(torch_device))


def for_rank(job: Job, plan: ParallelPlan, stage: int = 0) -> Job:
    """The Job of pipeline rank `stage` of `plan`, from the Job of the whole model on one rank (job_of): its
    blocks (plan.rank_blocks) become the model, the per-rank batch (micro_batch × grad_accum sequences) is cut into
    the plan's pipeline micro-batches, the model state is shared by plan.dp × plan.cp ranks under plan.strategy
    (context-parallel ranks hold the same weights and reduce their gradients together, as torchtitan's FSDP over
    its dp_shard_cp mesh). With plan.tp > 1 the embedding, head and logits are vocabulary-parallel, as
    kiln.parallel.tensor always splits them."""
    model, T = job.model, job.seq_len
    if T % plan.cp:
        raise KilnError(f"parallel.cp={plan.cp} splits each sequence of data.seq_len={T} tokens: pick a cp that "
                        f"divides it", key="parallel.cp", value=plan.cp, fix="pick a cp that divides it")
    blocks = plan.rank_blocks(model.n_layer, stage) if plan.pp > 1 else list(range(model.n_layer))
    micro, accum = job.micro_batch, job.grad_accum
    if plan.pp > 1:
        m = plan.pp_microbatches or max(plan.pp, accum)
        micro, accum = micro * accum // m, m
    recompute = tuple(job.recompute[i] for i in blocks) if job.recompute else ()
    if recompute and recompute[0] == "seg":  # a full segment cut by the stage boundary starts here
        recompute = ("full",) + recompute[1:]
    return replace(job, model=replace(model, n_layer=len(blocks)), micro_batch=micro, grad_accum=accum,
                   recompute=recompute, offload=frozenset(k for k, i in enumerate(blocks) if i in job.offload),
                   plan=plan, stage=stage)


def rank_jobs(sections: JobSections, device, ranks: int, recompute_plan: tuple[str, ...] | None = None,
              stages=None) -> tuple[ParallelPlan, list[Job]]:
    """`ranks` processes under sections.parallel: the ParallelPlan (checked by ParallelPlan.build, the runtime's
    own check, so the errors are the same) and the Job of every pipeline stage (one without pipeline parallelism),
    or of the `stages` given. The one builder of a rank's Job, for `kiln memory --ranks` and the planner alike."""
    model = sections.resolved_model()
    tc = sections.train
    plan = ParallelPlan.build(sections.parallel, ranks, model, family(model.arch),
                              batch_sequences=tc.micro_batch_size * tc.grad_accum_steps,
                              grad_accum_steps=tc.grad_accum_steps)
    job = job_for(sections, device, recompute_plan, world=plan.dp * plan.cp)
    return plan, [for_rank(job, plan, s) for s in (range(plan.pp) if stages is None else stages(plan))]
