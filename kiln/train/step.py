"""One optimizer step over a global batch, and evaluation: the arithmetic every training run shares.

    accumulate_gradients(model, batches, objective, precision, scaler)  forward + backward of each micro-batch
    train_step(...)          accumulate, unscale, clip, withhold a non-finite update, step: no host sync
    evaluate(model, batches, objective, precision)   mean loss per token/sample over some batches
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp

from kiln.data.batches import to_device
from kiln.parallel import World, gradient_sync
from kiln.parallel.pipeline import PipelineModel
from kiln.numerics.spikes import StepGuard
from kiln.train.masked import optimizer_step
from kiln.train.optim import AdaptiveClip, clip_gradients
from kiln.train.precision import LossScaler, MasterWeights, Precision
from kiln.util import is_dtensor


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the global batch's tokens or samples (device scalar, fp64)
    grad_norm: torch.Tensor  # global gradient norm before clipping
    skipped: torch.Tensor  # 1.0 when the update was not applied (inf/NaN gradient, withheld spike)
    count: torch.Tensor  # tokens or samples the loss is normalised by
    clip_threshold: torch.Tensor | None = None  # optim.clip_mode=adaptive: the threshold this step was clipped at


def micro_batch_losses(model, batches, objective, precision: Precision, world: World | None = None):
    """Yield each micro-batch's loss as the step normalises it: its SUM divided by the count of the whole global
    batch (valid tokens, or samples; across all ranks under data parallelism), so k micro-batches on n ranks give
    the gradient of one batch k·n times larger even when they differ in size. The training step and the NaN
    trace's replay both take their losses from here. The consumer runs the backward before drawing the next loss:
    gradients are reduced across ranks on the last micro-batch only."""
    count = sum(objective.count(b) for b in batches)
    if world is not None:  # the global batch's count: every rank divides by the same number (tp ranks share data;
        world.all_reduce(count, dim="dp")  # cp ranks too: each sees the whole batch and sums its 1/cp of the tokens)
    count = count.clamp(min=1)
    for i, batch in enumerate(batches):
        with gradient_sync(model, i == len(batches) - 1):
            with precision.autocast():
                loss = objective(model, batch) / count
            yield loss, count


def accumulate_gradients(model, batches, objective, precision: Precision, scaler: LossScaler,
                         world: World | None = None):
    """Forward and backward over every micro-batch; returns (mean loss over the global batch, count)."""
    if isinstance(model, PipelineModel):
        return _pipeline_gradients(model, batches, objective, precision, scaler, world)
    # DDP and FSDP average gradients over the dp ranks (FSDP over dp × cp under context parallelism); each rank's
    # loss is already a share of the global mean.
    ranks = world.grad_ranks if world is not None and world.dp_strategy.reduces else 1
    total_loss, count = None, None
    for loss, count in micro_batch_losses(model, batches, objective, precision, world):
        scaler.scale_loss(loss * ranks if ranks > 1 else loss).backward()
        total_loss = loss.detach().double() if total_loss is None else total_loss + loss.detach()
    if world is not None:  # every rank logs and judges the same loss: the copies' and each copy's cp shares
        world.all_reduce(total_loss, dim="dp")
        world.all_reduce(total_loss, dim="cp")
    return total_loss, count


def _pipeline_gradients(pipe: PipelineModel, batches, objective, precision: Precision, scaler: LossScaler,
                        world: World | None):
    """Pipeline parallel: the step's micro-batches concatenated into this rank's batch, which the schedule splits
    into plan.pp_microbatches; each loss divided by the valid count over the data-parallel copies (the stages of a
    copy see the same data). The last stage's losses are summed over every rank, so each logs the global mean."""
    count = sum(objective.count(b) for b in batches)
    if pipe.dp > 1:
        torch.distributed.all_reduce(count, group=pipe.dp_group)
    count = count.clamp(min=1)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    total_loss = pipe.train_step(x, y, count, scaler.scale_loss, precision.autocast)
    if world is not None:  # the last stage's share of each copy; tp ranks of a stage hold the same loss
        world.all_reduce(total_loss, dim="pp")
        world.all_reduce(total_loss, dim="dp")
    return total_loss, count


def train_step(model, batches, objective, optimizer, precision: Precision, scaler: LossScaler, optim_cfg,
               masters: MasterWeights | None = None, guard: StepGuard | None = None,
               world: World | None = None, adaptive_clip: AdaptiveClip | None = None) -> StepResult:
    """One optimizer step over a global batch of micro-batches; no host-device sync with any kiln optimizer.

    Under data parallelism every decision (the fp16 overflow, a non-finite norm, a spike) is the same on all
    ranks: the loss is all-reduced, the gradients are reduced (DDP) or their norm is global (FSDP), and an
    overflow anywhere is an overflow everywhere."""
    total_loss, count = accumulate_gradients(model, batches, objective, precision, scaler, world)
    if masters is not None:
        masters.grads_to_masters()
    params = masters.masters if masters is not None else [p for p in model.parameters() if p.requires_grad]
    if guard is not None:
        guard.inspect_scaled_grads(params)  # fp16 underflow/overflow per tensor, every fp16_telemetry_interval
    found_inf = scaler.unscale_(params)  # unscale before clipping: the threshold is in true-gradient units
    if world is not None:
        world.all_reduce(found_inf, op=ReduceOp.MAX)
    pipelined = isinstance(model, PipelineModel)  # the norm over every stage's gradients, not this rank's
    norm_of = (lambda ps: model.grad_norm(ps, masters)) if pipelined else None
    grad_norm, threshold = clip_gradients(params, optim_cfg, adaptive_clip, norm_of)
    if is_dtensor(grad_norm):  # FSDP2: the norm over every rank's shards, replicated
        grad_norm = grad_norm.full_tensor()
    # A non-finite gradient is never applied, whatever the precision.
    nonfinite = torch.maximum(found_inf, (~torch.isfinite(grad_norm)).float())
    skipped = nonfinite
    if guard is not None:  # records the step on the device; withholds a spike (spike_policy skip|rollback|stop)
        skipped = guard.check(total_loss, grad_norm, nonfinite, scaler.scale)
        if pipelined and world is not None:  # its inputs are the same on every rank; its decision made so
            skipped = world.all_reduce(skipped.clone(), op=ReduceOp.MAX)
    optimizer_step(optimizer, skipped)  # applied or withheld on the device: no host sync on any kiln optimizer
    scaler.update(nonfinite)  # only an overflow backs the loss scale off, not a withheld spike
    if masters is not None:
        masters.masters_to_model()
    # Every trainable parameter's gradient is cleared here: plain optimizers hold the model's parameters,
    # MasterWeights already moved them to the masters, and the host optimizer clears the device copies.
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total_loss, grad_norm, skipped, count, threshold)


@torch.no_grad()
def evaluate(model, batches, objective, precision: Precision, device, world: World | None = None) -> float:
    """Mean loss per token (or sample) over `batches` (this rank's share of them), in eval mode; one host sync at
    the end, after the totals are summed over ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)  # counts may be integers or (weighted) floats
    pipelined = isinstance(model, PipelineModel)
    with precision.autocast() if whole_weights(model, world) else contextlib.nullcontext():
        for batch in batches:
            batch = to_device(batch, device)
            if pipelined:  # the schedule's forward-only path; zeros off the last stage
                batch_total, batch_count = model.evaluate_batch(*batch, precision.autocast)
                total += batch_total
                count += batch_count
                continue
            with precision.autocast():
                total += objective(model, batch).double()
            count += objective.count(batch)
    model.train(was_training)
    if world is not None:  # over the copies that evaluated different batches (and a pipeline's stages: the last
        for dim in ("pp", "dp"):  # holds them, the others zeros)
            world.all_reduce(total, dim=dim)
            world.all_reduce(count, dim=dim)
        world.all_reduce(total, dim="cp")  # each cp rank summed its 1/cp of the tokens; all counted the batch
    return (total / count.clamp(min=1)).item()


def whole_weights(model, world: World | None) -> bool:
    """Whether evaluate() runs every batch inside one outer autocast region: autocast keeps its cast of each fp32
    weight (a leaf that takes a gradient) until the outermost region ends, so each weight is cast to the compute
    dtype once per evaluation instead of once per batch: the same casts, the same losses, bit for bit. (bf16, tiny
    preset, 2-core AMX Xeon, one thread: 0.95x the CPU time; the training forward holds the same casts, so the peak
    is not raised.) Only where every rank holds whole, plain weights (one process, DDP, ZeRO-1): FSDP's gathered
    weights would stay cached for the whole evaluation, and a pipeline's stages enter autocast themselves."""
    return not isinstance(model, PipelineModel) and (world is None or not world.splits_weights)

