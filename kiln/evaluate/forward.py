"""The scoring's forward on every layout: each row's summed log-likelihood of its scored tokens, computed through the
forward the validation pass runs (kiln.train.step.evaluate) with a scoring head in the loss's place.

    with scoring_head(model, vocab, softcap) as head:   ScoringHead where the model's loss module was
        sums = row_loglikelihoods(model, head, ids, targets, autocast, world)   (B,) float64

The validation pass calls model(x, y, reduction="sum") (a pipeline: its evaluate_batch, the schedule's
forward-only path), and the model hands the final hidden states, the head weight and the targets to its loss
module. Under tensor parallelism that loss is VocabParallelLoss on the vocabulary-sharded head, under context
parallelism the model sees only this rank's positions of x and y, under pipeline parallelism the last stage alone
applies the loss. Scoring needs each token's log-probability instead of the batch's summed loss, so for the length
of the scoring the loss module is swapped for a ScoringHead (the seam ModelPlan's plain/fused/chunked losses and
tensor parallelism's VocabParallelLoss already use); every other part of the forward is the validation pass's own.

The head takes the rows of the valid targets only (a continuation's few tokens, not the row's T logits of V
columns each), takes the softmax over the first `vocab` columns (kiln pads the vocabulary to a multiple of 64; the
model lm-evaluation-harness scores, exported, has no padding rows) and records each token's log-probability. Each
row's sum is then complete on this rank (one process, dp copies, tp ranks: the same on each), or it is this cp
rank's share of the row's positions, or it exists on the last pipeline stage only (zeros elsewhere):
loglikelihoods sums over cp and pp after its rows are scored.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.models.parts import IGNORE_INDEX, at_least_fp32, soft_cap
from kiln.parallel.pipeline import PipelineModel
from kiln.util import is_dtensor


def width_multiple(plan) -> int:
    """What a scoring batch's width must divide by on a layout (a ParallelPlan; None: one process): 2·cp under
    context parallelism (each cp rank holds 2 equal chunks of every row), tp under sequence parallelism (each tp
    rank its share of the positions between the TP regions)."""
    if plan is None:
        return 1
    return math.lcm(2 * plan.cp if plan.cp > 1 else 1, plan.tp if plan.sequence_parallel else 1)


class ScoringHead(nn.Module):
    """LMLoss's contract (h (N, C), the head weight (V, C), targets (N,) -> the summed loss over valid targets), for
    scoring: returns -Σ log p(target) with the softmax over the first `vocab` columns, and appends each token's
    log p (0 at an ignored target; float64) to `taken`."""

    def __init__(self, vocab: int, softcap: float = 0.0):
        super().__init__()
        self.vocab, self.softcap = vocab, softcap
        self.taken: list[torch.Tensor] = []

    def forward(self, h, weight, targets):
        valid = targets != IGNORE_INDEX
        h, picked = h[valid], targets[valid]  # (n, C), (n,): the scored tokens only
        if is_dtensor(weight):  # tensor parallel: this rank's rows of the padded vocabulary
            from kiln.parallel.tensor import vocab_parallel_log_likelihood  # lazy: DTensor's imports, tp > 1 only

            logp = vocab_parallel_log_likelihood(h, weight, picked, self.vocab)
        else:
            logits = soft_cap(at_least_fp32(F.linear(h, weight[:self.vocab])), self.softcap)  # (n, vocab)
            logp = F.log_softmax(logits, dim=-1).gather(1, picked[:, None])[:, 0]
        out = torch.zeros(targets.shape, dtype=torch.float64, device=targets.device)
        out[valid] = logp.double()
        self.taken.append(out)
        return -out.sum()


def _loss_holder(model: nn.Module) -> nn.Module | None:
    """The module whose `loss` the forward calls: kiln's Transformer (maybe inside DDP), or a pipeline's last
    stage; None on a pipeline rank without the last stage."""
    if isinstance(model, PipelineModel):
        return model if model.has_last else None
    inner = getattr(model, "module", model)  # DDP
    if not isinstance(getattr(inner, "loss", None), nn.Module):
        raise TypeError(f"task scoring runs kiln's Transformer's forward with a scoring head in its loss's place; "
                        f"{type(inner).__name__} has no loss module")
    return inner


@contextlib.contextmanager
def scoring_head(model: nn.Module, vocab: int, softcap: float = 0.0):
    """A ScoringHead in the place of `model`'s loss module while the block runs (the loss put back after)."""
    holder, head = _loss_holder(model), ScoringHead(vocab, softcap)
    if holder is None:
        yield head
        return
    loss = holder.loss
    holder.loss = head
    try:
        yield head
    finally:
        holder.loss = loss


def row_loglikelihoods(model: nn.Module, head: ScoringHead, ids: torch.Tensor, targets: torch.Tensor, autocast=None,
                       cp: int = 1) -> torch.Tensor:
    """(B,) float64: each row's Σ log p(targets) over its valid targets, through the validation pass's forward.
    This rank's share under context parallelism (cp ranks), zeros on a pipeline rank without the last stage."""
    autocast = autocast or contextlib.nullcontext
    head.taken.clear()
    if isinstance(model, PipelineModel):  # the schedule's forward-only path; the last stage's loss per micro-batch
        model.evaluate_batch(ids, targets, autocast)
        if not model.has_last:
            return torch.zeros(ids.shape[0], dtype=torch.float64, device=ids.device)
    else:
        with autocast():
            model(ids, targets, reduction="sum")
    B, T = ids.shape
    taken = torch.cat(head.taken)  # the micro-batches in order; this rank's T/cp positions of each row under cp
    return taken[-B * (T // cp):].view(B, T // cp).sum(1)
