"""The model pipeline: every transformation of a built model, in one function and one written order.

    fp8 → kernels → recompute → activation offload → loss → pipeline split or parallelize → compile

0. fp8         precision.mode=fp8: the block linears become torchao's Float8Linear (kiln.train.precision).
1. kernels     Triton norms, activations, attention core and RoPE swapped in by exact module type
               (kiln.kernels.apply); the model's loss is left for step 4. On a CPU, fp32 linears and the LM head
               through oneDNN (train.cpu_linear, kiln.perf.cpu_linear).
2. recompute   per-block plan (kiln.memory.recompute): the block's class is swapped, it stays a module.
3. offload     saved activations of the listed blocks to pinned host memory (CUDA only; recomputed blocks keep
               nothing worth moving, so recompute comes first).
4. loss        one choice: "plain" (the model's LMLoss), "fused" (the Triton fused linear cross-entropy) or
               "chunked" (kiln.memory.chunked_loss); kiln.config refuses a fused and a chunked loss together.
5. parallelize tensor parallel first (kiln's plan for its Transformer, or the user's own: ModelPlan.tensor_plan),
               then DDP wraps, FSDP2 shards (kiln.parallel.parallelize): after 1-4, so every transformed block is
               what fully_shard sees; a no-op in a world of one.
   pipeline    parallel.pp > 1 (plan.layout): tensor parallel first when parallel.tp > 1, then the blocks split
               into stages run by torch's pipeline schedules (kiln.parallel.pipeline.PipelineModel), each stage
               wrapped in DDP over the data-parallel ranks;
               the model and the step model are then that one object.
6. compile     torch.compile of the finished model (the step calls the compiled one; hooks stay on the eager one).

Levers 2-4 need kiln's transformer (a `blocks` list, an `LMLoss`); asked of another model they are an error that
says so. Kernels on a model of the user's swap whatever modules of the table it holds.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from kiln.errors import KilnError
from kiln.parallel import ParallelConfig, World, fsdp_options, parallelize
from kiln.parallel.layout import ParallelPlan
from kiln.parallel.pipeline import PipelineModel
from kiln.memory.chunked_loss import ChunkedLMLoss
from kiln.memory.offload import apply_offload
from kiln.memory.recompute import apply_recompute
from kiln.models.transformer import IGNORE_INDEX, LMLoss
from kiln.perf.cpu_linear import swap_linears
from kiln.train.precision import convert_fp8

LOSSES = ("plain", "fused", "chunked")


@dataclass(frozen=True)
class ModelPlan:
    """What the pipeline does to a model; built from the config by the caller (kiln.run), or by hand."""

    kernels: str = "torch"  # "torch" | "triton" (resolved: kiln.perf.hardware.resolve_kernels)
    cpu_linear: bool = False  # fp32 linears through oneDNN (resolved: kiln.perf.cpu_linear.decide_cpu_linear)
    fp8: bool = False  # precision.mode=fp8: torchao's float8 linears in the blocks
    recompute: tuple[str, ...] = ()  # one policy per block (kiln.memory.recompute); () = none
    offload: frozenset[int] = frozenset()  # blocks whose saved activations go to the host (CUDA)
    loss: str = "plain"  # plain | fused | chunked
    loss_chunk: int = 0  # chunked: tokens per chunk
    compile: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the `parallel` section
    layout: ParallelPlan | None = None  # the run's layout when the model is split (parallel.pp > 1)
    tensor_plan: Callable | None = None  # fn(model, tp_mesh): the user's own tensor-parallel plan (kiln.fit)

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"model loss {self.loss!r} is unknown; use one of {LOSSES}")
        if self.loss == "chunked" and self.loss_chunk < 1:
            raise ValueError("the chunked loss needs a chunk size ≥ 1 (memory.chunked_loss)")
        if self.loss == "fused" and self.kernels != "triton":
            raise ValueError("the fused loss is a Triton kernel: it needs kernels='triton'")


@dataclass
class PreparedModel:
    model: nn.Module  # the eager model, transformed in place: hooks, state_dict and the optimizer use it
    step_model: nn.Module  # what the step calls: the compiled model, or the same one
    applied: dict = field(default_factory=dict)  # what was done, for the console and tests


def _needs_blocks(model: nn.Module, lever: str) -> None:
    if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        raise KilnError(f"{lever} works on transformer blocks (a `blocks` ModuleList, as kiln's Transformer has); "
                        f"{type(model).__name__} has none. Turn it off for this model",
                        key=lever, value=type(model).__name__, fix="Turn it off for this model")


def prepare_model(model: nn.Module, plan: ModelPlan, device: torch.device | None = None, world: World | None = None,
                  param_dtype: torch.dtype | None = None) -> PreparedModel:
    """Apply `plan` to `model` in the pipeline's order; returns the eager and the step model.

    param_dtype: FSDP2's compute dtype for parameters (bf16 autocast runs), None to keep theirs."""
    applied = {}
    if plan.fp8:
        applied["fp8"] = convert_fp8(model)
    if plan.kernels == "triton":
        from kiln.kernels.apply import apply_kernels  # lazy: triton is imported only by runs that use the kernels

        applied["kernels"] = apply_kernels(model, "triton", device, skip=(LMLoss,))
    if plan.cpu_linear:
        applied["cpu_linear"] = swap_linears(model)
    if any(p != "none" for p in plan.recompute):
        _needs_blocks(model, "memory.recompute")
        apply_recompute(model, plan.recompute)
        applied["recompute"] = plan.recompute
    if plan.offload:
        _needs_blocks(model, "memory.offload_blocks")
        if device is not None and torch.device(device).type == "cuda":
            apply_offload(model, plan.offload)
            applied["offload"] = sorted(plan.offload)
    if plan.loss != "plain":
        if not isinstance(getattr(model, "loss", None), LMLoss):
            raise KilnError(f"the {plan.loss} loss replaces kiln's LM head + cross-entropy (an LMLoss at "
                            f"model.loss); {type(model).__name__} has none",
                            key="memory.chunked_loss", value=type(model).__name__,
                            fix=f"{type(model).__name__} has none")
        if model.loss.softcap:
            raise KilnError(f"the {plan.loss} loss has no logit soft-cap: model.logit_softcap={model.loss.softcap:g} "
                            f"needs the plain loss (drop --memory.chunked_loss / the fused loss)",
                            key="model.logit_softcap", value=model.loss.softcap,
                            fix="needs the plain loss (drop --memory.chunked_loss / the fused loss)")
        if plan.loss == "chunked":
            model.loss = ChunkedLMLoss(plan.loss_chunk)
        else:
            from kiln.kernels import FusedLinearCrossEntropyLoss  # lazy: triton, as above

            # Like LMLoss, the SUM over valid targets: the step divides by the global batch's valid count.
            model.loss = FusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
        applied["loss"] = plan.loss
    if plan.layout is not None and plan.layout.pp > 1:
        if plan.compile:
            raise KilnError("train.compile with parallel.pp is not built (the stages would compile one by one): "
                            "set --train.compile=false",
                            key="train.compile", value=True, fix="set --train.compile=false")
        data = plan.layout.dp_strategy
        fsdp = fsdp_options(plan.parallel, param_dtype, replicated=not data.shards_parameters) if data.reduces else None
        pipe = PipelineModel(model, plan.layout, world.rank, torch.device(device), world.mesh, fsdp)
        applied["pipeline"] = f"{plan.layout.pp_schedule}: stages {pipe.stage_ids} of {plan.layout.pp} ranks"
        return PreparedModel(pipe, pipe, applied)
    step_model = model
    if world is not None and world.sharded:
        step_model = parallelize(model, plan.parallel, world, torch.device(device), param_dtype, plan.tensor_plan)
        applied["parallel"] = f"{plan.parallel.strategy} × {world.size}"
    if plan.compile:
        step_model = torch.compile(step_model)
    if plan.compile:
        applied["compile"] = True
    return PreparedModel(model, step_model, applied)
