"""A model's outputs over data, and validation metrics: the inference side of fit().

    predict(model, data, batch_size=None, device=None)      outputs over `data`, concatenated along dim 0
    evaluate_metrics(model, batches, objective, ..., metrics)   val_loss and val_<name> over a whole eval set

A model trained by fit() in this process is predicted on its run's device, in its run's precision (autocast mode,
weights' dtype) and by default in batches of its train.micro_batch_size; any other module on its parameters'
device, in their dtype, in batches of 32 (Keras's default).
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn

from kiln.data.batches import eval_batches, is_dataset, map_tensors, to_device
from kiln.errors import KilnError
from kiln.train.objective import Contrastive, Supervised
from kiln.train.precision import Precision

DEFAULT_BATCH = 32
# model -> (Precision, device, micro-batch size) of the fit() run that trained it; weak: forgets deleted models
_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MetricError(KilnError):
    """A metric function's argument or return value is unusable; names the metric."""

    def __init__(self, name: str, message: str):
        super().__init__(message, key=name)
        self.metric = name


def remember(model: nn.Module, precision: Precision, device: torch.device, batch_size: int) -> None:
    """fit(): predict() on this model uses the run's precision, device and micro-batch size."""
    _RUNS[model] = (precision, device, batch_size)


def _inputs(batch):
    """The model's input of a batch or item: the first element of a tuple/list (inputs, targets), else the whole."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _cast_like(x, dtype: torch.dtype):
    return map_tensors(x, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _concat(outputs: list):
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([o[k] for o in outputs]) for k in first}
    raise TypeError(f"predict: the model returned {type(first).__name__}; outputs are concatenated when they are "
                    f"tensors, or tuples, lists or dicts of tensors")


def _batches(data, batch_size: int):
    if isinstance(data, torch.Tensor):
        if data.ndim == 0:
            raise KilnError("predict: data is a 0-d tensor; give inputs with the batch dimension first, (N, ...)",
                            key="data", value=tuple(data.shape),
                            fix="give inputs with the batch dimension first, (N, ...)")
        yield from data.split(batch_size)
    elif is_dataset(data):
        for batch in eval_batches(data, batch_size):
            yield _inputs(batch)
    else:
        for batch in data:
            yield _inputs(batch)


@torch.no_grad()
def predict(model: nn.Module, data, batch_size: int | None = None, device=None):
    """The outputs of `model` over `data`, concatenated along the batch dimension, on the CPU.

    `data`: a tensor of inputs (N, ...), a Dataset (items (inputs, targets) or inputs alone), or an iterable of
    batches (a DataLoader, a list); of a tuple/list batch or item the first element is the input. In eval mode
    (restored after), no grad; outputs may be a tensor or tuples, lists, dicts of tensors."""
    run = _RUNS.get(model)
    precision = run[0] if run else None
    param = next(model.parameters(), None)
    device = torch.device(device) if device is not None else run[1] if run else (
        param.device if param is not None else torch.device("cpu"))
    batch_size = batch_size or (run[2] if run else DEFAULT_BATCH)
    if batch_size < 1:
        raise KilnError(f"predict: batch_size must be ≥ 1, got {batch_size}",
                        key="batch_size", value=batch_size, fix="batch_size must be ≥ 1")
    if precision is not None and precision.device.type != device.type:
        precision = Precision(precision.mode, device)  # the run's mode on the device asked for
    dtype = param.dtype if param is not None else torch.float32
    was_training = model.training
    model.eval()
    outputs = []
    try:
        for x in _batches(data, batch_size):
            x = _cast_like(to_device(x, device), dtype)
            if precision is not None:
                with precision.autocast():
                    out = model(x)
            else:
                out = model(x)
            outputs.append(map_tensors(out, lambda t: t.detach().cpu()))
    finally:
        model.train(was_training)
    if not outputs:
        raise KilnError("predict: data holds no batches",
                        key="data", fix="data holds no batches")
    return _concat(outputs)


def _outputs(objective, model, batch):
    """(output, target) as the objective's loss sees them."""
    dtype = next(model.parameters()).dtype
    if isinstance(objective, Supervised):
        inputs, targets = batch
        return model(_cast_like(inputs, dtype)), targets
    a, b = batch
    return model(_cast_like(a, dtype)), model(_cast_like(b, dtype))


def _batch_size(target) -> int:
    while isinstance(target, (tuple, list)):
        target = target[0]
    if isinstance(target, dict):
        return _batch_size(next(iter(target.values())))
    return target.shape[0]


def _metric_terms(name: str, value, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of one batch from what a metric returned: a float (the batch's mean) or a (sum, count) pair."""
    def scalar(v, what):
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise MetricError(name, f"metrics[{name!r}] returned {what} of shape {tuple(v.shape)}; return one "
                                        f"number (the batch's mean) or a (sum, count) pair, e.g. "
                                        f"((pred == y).sum(), len(y))")
            return v.detach().reshape(()).to(device, torch.float64)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return torch.tensor(float(v), dtype=torch.float64, device=device)
        raise MetricError(name, f"metrics[{name!r}] returned {type(v).__name__} as {what}; return a float (the "
                                f"batch's mean) or a (sum, count) pair of numbers")
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise MetricError(name, f"metrics[{name!r}] returned a {len(value)}-tuple; return a float (the batch's "
                                    f"mean) or a (sum, count) pair")
        return scalar(value[0], "a sum"), scalar(value[1], "a count")
    mean = scalar(value, "a value")
    return mean * n, torch.tensor(float(n), dtype=torch.float64, device=device)


@torch.no_grad()
def evaluate_metrics(model, batches, objective, precision: Precision, device, metrics: dict, world=None) -> dict:
    """{"val_loss": mean loss, "val_<name>": Σ sums / Σ counts of each metric} over `batches` (this rank's share),
    in eval mode, one host sync at the end. The loss is kiln.train.step.evaluate's: the same sums and counts."""
    was_training = model.training
    model.eval()
    zero = torch.zeros((), device=device, dtype=torch.float64)
    total, count = zero.clone(), zero.clone()
    sums = {name: zero.clone() for name in metrics}
    counts = {name: zero.clone() for name in metrics}
    try:
        for batch in batches:
            batch = to_device(batch, device)
            with precision.autocast():
                output, target = _outputs(objective, model, batch)
                total += objective.loss(output, target).double()
            count += objective.loss.count(target)
            for name, fn in metrics.items():
                s, c = _metric_terms(name, fn(output, target), _batch_size(target), device)
                sums[name] += s
                counts[name] += c
    finally:
        model.train(was_training)
    values = torch.stack([total, count, *sums.values(), *counts.values()])
    if world is not None:  # over the copies that evaluated different batches (tp ranks of one copy: the same)
        world.all_reduce(values, dim="dp")
    values = values.tolist()
    k = len(metrics)
    out = {"val_loss": values[0] / max(values[1], 1)}
    for i, name in enumerate(metrics):
        s, c = values[2 + i], values[2 + k + i]
        out[f"val_{name}"] = s / c if c else math.nan
    return out


def check_metrics(metrics, objective) -> dict:
    """fit()'s metrics= argument, checked: {name: fn(outputs, targets)} on a supervised or contrastive loss."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise MetricError("", f"metrics must be a dict {{name: fn(outputs, targets)}}, got {type(metrics).__name__}")
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name.isidentifier() or name == "loss":
            raise MetricError(str(name), f"metrics key {name!r}: use a short identifier other than 'loss' (it is "
                                         f"logged as val_<name>)")
        if not callable(fn):
            raise MetricError(name, f"metrics[{name!r}] is {type(fn).__name__}, not a function; give "
                                    f"fn(outputs, targets) -> float or (sum, count)")
    if metrics and not isinstance(objective, (Supervised, Contrastive)):
        raise MetricError(next(iter(metrics)), f"metrics= see (outputs, targets) of a supervised or contrastive loss; "
                                               f"{objective!r} is an objective of your own: compute the metric in a "
                                               f"callback's on_eval instead")
    return dict(metrics)
