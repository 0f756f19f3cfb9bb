"""Losses as (sum, count) pairs, so the trainer can normalise over the whole global batch.

The trainer computes  Σ_i loss(output_i, target_i) / Σ_i loss.count(target_i)  over the micro-batches i of one
step: k micro-batches of any (uneven) split then give exactly the mean over the global batch. `count` reads the
targets only, so it is known before any forward pass.

    loss            output, target                      one unit of count   per-unit loss
    CrossEntropy    logits (..., C), class ids (...)    target != ignore     -log softmax, label smoothing as torch
    MSE             same shape, batch dim first         sample               mean over non-batch dims of (o - t)²
    Huber           same shape, batch dim first         sample               mean over non-batch dims, F.huber_loss
    BCEWithLogits   same shape, batch dim first         sample               mean over non-batch dims, F.bce_with_logits
    NTXent          z_a (N, D), z_b (N, D)              anchor (2N)          SimCLR cross-entropy over 2N-2 negatives

Sums are at least fp32 (half-precision inputs are upcast, fp64 stays fp64); counts are int64 on target's device.
`as_loss` turns a name, a Loss or a plain mean-reducing callable into a Loss.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.models.transformer import IGNORE_INDEX, at_least_fp32
from kiln.util import closest


@runtime_checkable
class Loss(Protocol):
    """A loss the trainer can normalise over the global batch.

    `loss(output, target)` is a 0-d tensor: the SUM of per-sample (or per-token) losses of one micro-batch, in at
    least fp32 (fp64 stays fp64). `loss.count(target)` is a 0-d int64 tensor on target's device: how many
    samples/tokens that sum covers. Mean over a global batch = Σ sums / Σ counts.
    """

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def count(self, target: torch.Tensor) -> torch.Tensor: ...


def _count(n: int, target: torch.Tensor) -> torch.Tensor:
    # a fill kernel on the device, not torch.tensor(n): no host-to-device copy in the step
    return torch.full((), n, dtype=torch.int64, device=target.device)


def _per_sample_sum(name: str, elementwise: Callable, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Σ over samples of the per-sample mean over non-batch dims of elementwise(output, target)."""
    if output.shape != target.shape or output.ndim == 0:
        what = "differ" if output.shape != target.shape else "have no batch dimension"
        raise KilnError(f"{name}: output {tuple(output.shape)} and target {tuple(target.shape)} {what}; outputs and "
                        "targets must have the same shape, with the batch dimension first",
                        key="output", value=tuple(output.shape),
                        fix="outputs and targets must have the same shape, with the batch dimension first")
    per_element = elementwise(at_least_fp32(output), at_least_fp32(target))
    # flatten(1) rather than reshape(N, -1): the latter fails on an empty micro-batch
    per_element = per_element.flatten(1) if per_element.ndim > 1 else per_element[:, None]
    return per_element.mean(1).sum()


class CrossEntropy:
    """Cross-entropy over class ids, class dimension LAST: logits (..., C), target (...) of int ids.

    All leading dimensions are flattened, so (N, C) classification and (B, T, C) language-model logits both work.
    (This is not torch's (N, C, d1, ...) convention: move the class dim last first.) Targets equal to
    ignore_index are skipped and not counted. Label smoothing is torch's: (1-ε)·nll + ε·mean_c(-log p_c).
    """

    def __init__(self, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX):
        if not 0.0 <= label_smoothing <= 1.0:
            raise KilnError(f"CrossEntropy: label_smoothing must be in [0, 1], got {label_smoothing}",
                            key="label_smoothing", value=label_smoothing, fix="must be in [0, 1]")
        self.label_smoothing, self.ignore_index = label_smoothing, ignore_index

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if output.ndim == 0 or output.shape[:-1] != target.shape:
            raise KilnError(f"CrossEntropy: output {tuple(output.shape)} and target {tuple(target.shape)} do not "
                            "match; logits are (..., C) with the class dimension last and target (...) class ids",
                            key="output", value=tuple(output.shape),
                            fix="logits are (..., C) with the class dimension last and target (...) class ids")
        logits = at_least_fp32(output).reshape(-1, output.shape[-1])  # (N, C)
        return F.cross_entropy(logits, target.reshape(-1), ignore_index=self.ignore_index,
                               label_smoothing=self.label_smoothing, reduction="sum")

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != self.ignore_index).sum()

    def __repr__(self):
        return f"CrossEntropy(label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index})"


class MSE:
    """Squared error, mean over each sample's non-batch dims, summed over samples; count = samples.

    With equal-size samples the global mean equals F.mse_loss(reduction="mean") over the whole batch.
    """

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _per_sample_sum("MSE", lambda o, t: (o - t) ** 2, output, target)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return _count(target.shape[0], target)

    def __repr__(self):
        return "MSE()"


class Huber:
    """torch's Huber loss (F.huber_loss): quadratic below delta, linear above; per-sample mean, summed."""

    def __init__(self, delta: float = 1.0):
        if delta <= 0:
            raise KilnError(f"Huber: delta must be > 0, got {delta}",
                            key="delta", value=delta, fix="must be > 0")
        self.delta = delta

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _per_sample_sum("Huber", lambda o, t: F.huber_loss(o, t, reduction="none", delta=self.delta),
                               output, target)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return _count(target.shape[0], target)

    def __repr__(self):
        return f"Huber(delta={self.delta})"


class BCEWithLogits:
    """Binary cross-entropy on logits (F.binary_cross_entropy_with_logits); per-sample mean, summed.

    pos_weight broadcasts against the output as in torch (usually one weight per class, last dim).
    """

    def __init__(self, pos_weight: torch.Tensor | None = None):
        self.pos_weight = pos_weight

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        def bce(o, t):
            pw = None if self.pos_weight is None else torch.as_tensor(self.pos_weight).to(o)
            return F.binary_cross_entropy_with_logits(o, t, pos_weight=pw, reduction="none")
        return _per_sample_sum("BCEWithLogits", bce, output, target)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return _count(target.shape[0], target)

    def __repr__(self):
        pw = None if self.pos_weight is None else torch.as_tensor(self.pos_weight).tolist()
        return f"BCEWithLogits(pos_weight={pw})"


class NTXent:
    """SimCLR's normalized-temperature cross-entropy: output = z_a (N, D), target = z_b (N, D), row i a positive pair.

    Rows are normalised to unit length; each of the 2N embeddings is an anchor whose logits are its cosine
    similarities / temperature to the other 2N-1 (self excluded): one positive (its other view), 2N-2 negatives.
    The sum covers the 2N anchors and count = 2N. Negatives come from the same micro-batch only, so gradient
    accumulation over micro-batches is NOT equivalent to one larger batch (each anchor sees fewer negatives);
    the trainer's normalisation is still a mean per anchor.
    """

    def __init__(self, temperature: float = 0.5):
        if temperature <= 0:
            raise KilnError(f"NTXent: temperature must be > 0, got {temperature}",
                            key="temperature", value=temperature, fix="must be > 0")
        self.temperature = temperature

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if output.shape != target.shape or output.ndim != 2:
            raise KilnError(f"NTXent: output {tuple(output.shape)} and target {tuple(target.shape)} must both be "
                            "(N, D): embeddings of two views, row i of each a positive pair",
                            key="output", value=tuple(output.shape), fix="must both be (N, D)")
        n = output.shape[0]
        z = F.normalize(torch.cat([at_least_fp32(output), at_least_fp32(target)]), dim=1)  # (2N, D)
        sim = (z @ z.T) / self.temperature  # (2N, 2N)
        sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=sim.device), float("-inf"))
        positive = torch.arange(2 * n, device=sim.device).roll(n)  # anchor i ↔ i ± N
        return F.cross_entropy(sim, positive, reduction="sum")

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return _count(2 * target.shape[0], target)

    def __repr__(self):
        return f"NTXent(temperature={self.temperature})"


class _FromMean:
    """A mean-over-samples callable as a Loss: sum = fn(output, target) · N, count = N."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.fn = fn

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return at_least_fp32(self.fn(output, target)) * target.shape[0]

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return _count(target.shape[0], target)

    def __repr__(self):
        return f"from_callable({getattr(self.fn, '__qualname__', self.fn)!r})"


def from_callable(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Loss:
    """Wrap fn(output, target) -> 0-d mean loss as a Loss with sum = fn · N, count = N (N = target.shape[0]).

    Assumes fn averages over the first dimension, as torch's reduction="mean" losses do; an element-wise mean
    over equal-size samples is the same thing.
    """
    return _FromMean(fn)


LOSSES: dict[str, Callable[[], Loss]] = {
    "cross_entropy": CrossEntropy, "mse": MSE, "huber": Huber, "bce": BCEWithLogits, "ntxent": NTXent,
}


def as_loss(loss: str | Loss | Callable) -> Loss:
    """A Loss from a name in LOSSES (default settings), a Loss (returned as it is) or a mean-reducing callable."""
    if isinstance(loss, str):
        if loss not in LOSSES:
            near = closest(loss, LOSSES)
            hint = f"; did you mean {near!r}?" if near else ""
            raise KilnError(f"unknown loss {loss!r}: use one of {sorted(LOSSES)}{hint}",
                            key="loss", value=loss, fix=f"use one of {sorted(LOSSES)}")
        return LOSSES[loss]()
    if isinstance(loss, Loss) and callable(loss.count):
        return loss
    if callable(loss):
        return from_callable(loss)
    raise TypeError(f"cannot make a loss from {type(loss).__name__}: pass a name in {sorted(LOSSES)}, an object "
                    "with __call__(output, target) and count(target), or a callable returning a mean loss")
