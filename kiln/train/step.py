"""One optimizer step over a global batch, and evaluation: the arithmetic every training run shares.

    accumulate_gradients(model, batches, objective, precision, scaler)  forward + backward of each micro-batch
    train_step(...)          accumulate, unscale, clip, withhold a non-finite update, step: no host sync
    evaluate(model, batches, objective, precision)   mean loss per token/sample over some batches
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.data.batches import to_device
from kiln.numerics.spikes import StepGuard
from kiln.train.masked import optimizer_step
from kiln.train.optim import clip_gradients
from kiln.train.precision import LossScaler, MasterWeights, Precision


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the global batch's tokens or samples (device scalar, fp64)
    grad_norm: torch.Tensor  # global gradient norm before clipping
    skipped: torch.Tensor  # 1.0 when the update was not applied (inf/NaN gradient, withheld spike)
    count: torch.Tensor  # tokens or samples the loss is normalised by


def micro_batch_losses(model, batches, objective, precision: Precision):
    """Yield each micro-batch's loss as the step normalises it: its SUM divided by the count of the whole global
    batch (valid tokens, or samples), so k micro-batches give the gradient of one batch k× larger even when they
    differ in size. The training step and the NaN trace's replay both take their losses from here."""
    count = sum(objective.count(b) for b in batches).clamp(min=1)
    for batch in batches:
        with precision.autocast():
            yield objective(model, batch) / count, count


def accumulate_gradients(model, batches, objective, precision: Precision, scaler: LossScaler):
    """Forward and backward over every micro-batch; returns (mean loss, count) as device tensors."""
    total_loss, count = None, None
    for loss, count in micro_batch_losses(model, batches, objective, precision):
        scaler.scale_loss(loss).backward()
        total_loss = loss.detach().double() if total_loss is None else total_loss + loss.detach()
    return total_loss, count


def train_step(model, batches, objective, optimizer, precision: Precision, scaler: LossScaler, optim_cfg,
               masters: MasterWeights | None = None, guard: StepGuard | None = None) -> StepResult:
    """One optimizer step over a global batch of micro-batches; no host-device sync with any kiln optimizer."""
    total_loss, count = accumulate_gradients(model, batches, objective, precision, scaler)
    if masters is not None:
        masters.grads_to_masters()
    params = masters.masters if masters is not None else [p for p in model.parameters() if p.requires_grad]
    if guard is not None:
        guard.inspect_scaled_grads(params)  # fp16 underflow/overflow per tensor, every fp16_telemetry_interval
    found_inf = scaler.unscale_(params)  # unscale before clipping: the threshold is in true-gradient units
    grad_norm = clip_gradients(params, optim_cfg)
    # A non-finite gradient is never applied, whatever the precision.
    nonfinite = torch.maximum(found_inf, (~torch.isfinite(grad_norm)).float())
    skipped = nonfinite
    if guard is not None:  # records the step on the device; withholds a spike (spike_policy skip|rollback|stop)
        skipped = guard.check(total_loss, grad_norm, nonfinite, scaler.scale)
    optimizer_step(optimizer, skipped)  # applied or withheld on the device: no host sync on any kiln optimizer
    scaler.update(nonfinite)  # only an overflow backs the loss scale off, not a withheld spike
    if masters is not None:
        masters.masters_to_model()
    # Every trainable parameter's gradient is cleared here: plain optimizers hold the model's parameters,
    # MasterWeights already moved them to the masters, and the host optimizer clears the device copies.
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total_loss, grad_norm, skipped, count)


@torch.no_grad()
def evaluate(model, batches, objective, precision: Precision, device) -> float:
    """Mean loss per token (or sample) over `batches`, in eval mode; one host sync at the end."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.int64)
    for batch in batches:
        batch = to_device(batch, device)
        with precision.autocast():
            total += objective(model, batch).double()
        count += objective.count(batch)
    model.train(was_training)
    return (total / count.clamp(min=1)).item()

