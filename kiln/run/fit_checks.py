"""fit()'s checks before the first step: the data, the first batch and the first loss, the config keys it ignores,
and a resume that changes the schedule. A mistake gets one line naming what was given, what is expected and the
fix, instead of a message from deep inside PyTorch ("grad can be implicitly created only for scalar outputs",
`KeyError: 1`, a collate TypeError).

    check_data(data, name, batch_size)          -> a first batch to try (None for a one-shot iterator)
    check_first_loss(state, batch, name, called)  one forward and loss on it (class ids against the model's
                                                outputs too); the run's RNG streams and buffers are restored after, so
                                                the run is the same with or without the check
    first_batch(data, name, batch_size)         what check_data's batch is called in a message: train_data[0:8], or
                                                train_data's first batch
    ignored_keys(given), given_keys(config)     config keys fit() does not use, warned about once
    schedule_change(cfg, old_toml, step, lr)    the warning when a resume changes a schedule's length
"""
from __future__ import annotations

import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import default_collate

from kiln.config import Config
from kiln.data.batches import is_dataset, map_tensors, to_device
from kiln.errors import KilnError
from kiln.train.checkpoint import rng_state, set_rng_state
from kiln.train.losses import CrossEntropy, _FromMean
from kiln.train.objective import Contrastive, Supervised
from kiln.train.schedule import lr_factor

# fit() trains the model it is given on the data it is given: these keys configure kiln's own model and data.
IGNORED_SECTIONS = ("model", "data")
IGNORED_KEYS = ("train.sample_tokens", "train.sample_prompt", "train.eval_batches", "train.eval_tasks",
                "train.eval_task_limit", "train.eval_micro_batch_size")
OBJECTIVES_DOC = "docs/library.md, 'Objectives'"


class FitInputError(KilnError):
    """fit()'s input is unusable: `argument` names which one (train_data, eval_data, loss, epochs, ...)."""

    def __init__(self, argument: str, message: str, *, fix: str | None = None):
        super().__init__(message, key=argument, fix=fix)
        self.argument = argument


class FitWarning(UserWarning):
    """fit() goes on, but not as the caller may think: an ignored key, a schedule that changes on resume."""


def _describe(x) -> str:
    """A value's structure in a few characters: Tensor(8, 6), (Tensor(6), str), dict(x, y)."""
    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)}" if x.ndim != 1 else f"Tensor({x.shape[0]})"
    if isinstance(x, np.ndarray):
        return f"ndarray{x.shape}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_describe(v) for v in x[:4]) + (", ..." if len(x) > 4 else "")
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    if isinstance(x, dict):
        return "dict(" + ", ".join(map(str, x)) + ")"
    return type(x).__name__


def _bad_leaf(x, allowed: tuple):
    """The first value in a nested item/batch that is not of an allowed type, or None."""
    if isinstance(x, (tuple, list)):
        return next((b for b in map(lambda v: _bad_leaf(v, allowed), x) if b is not None), None)
    if isinstance(x, dict):
        return next((b for b in map(lambda v: _bad_leaf(v, allowed), x.values()) if b is not None), None)
    if isinstance(x, allowed) and not isinstance(x, (str, bytes)):
        return None
    return x


ITEM_TYPES = (torch.Tensor, np.ndarray, np.generic, int, float, bool)


def check_data(data, name: str, batch_size: int):
    """Refuse what kiln cannot batch, with the fix; return a first batch to try the model on (None when drawing
    it would consume a one-shot iterator)."""
    if isinstance(data, (torch.Tensor, np.ndarray)):
        shape = tuple(data.shape)
        raise FitInputError(name, f"{name} is a bare {type(data).__name__} of shape {shape}; fit() takes a Dataset "
                                  f"of (inputs, targets): pass TensorDataset(inputs, targets) (or a list of ready "
                                  f"(inputs, targets) batches)")
    if is_dataset(data):
        if len(data) == 0:
            raise FitInputError(name, f"{name} is an empty {type(data).__name__}: nothing to train on")
        item = data[0]
        bad = _bad_leaf(item, ITEM_TYPES)
        if bad is not None:
            raise FitInputError(name, f"{name}[0] is {_describe(item)}: kiln batches tensors, numbers and numpy "
                                      f"arrays (in tuples, lists or dicts), not {type(bad).__name__}; turn it into "
                                      f"a tensor in __getitem__ (e.g. a class id, or token ids)")
        n = min(batch_size, len(data))
        try:
            return default_collate([data[i] for i in range(n)])
        except (TypeError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            items = {_describe(data[i]) for i in range(n)}
            raise FitInputError(name, f"{name}[0:{n}] cannot be stacked into a batch ({first[:120]}); items are "
                                      f"{', '.join(sorted(items)[:3])}: every item must have the same structure "
                                      f"and tensor shapes (pad them in __getitem__, or pass ready batches)") from None
    if not isinstance(data, Iterable) or isinstance(data, Iterator):  # (a one-shot iterator would lose a batch)
        return None
    try:
        batch = next(iter(data))
    except StopIteration:
        raise FitInputError(name, f"{name} yields no batches: nothing to train on") from None
    bad = _bad_leaf(batch, (torch.Tensor,))
    if bad is not None:
        raise FitInputError(name, f"{name}'s first batch is {_describe(batch)}: ready batches hold tensors (in "
                                  f"tuples, lists or dicts), not {type(bad).__name__}; convert it with "
                                  f"torch.as_tensor, or pass a Dataset and let kiln batch it")
    return batch


def first_batch(data, name: str, batch_size: int) -> str:
    """check_data's batch as a message names it: the Dataset's first items, or the iterable's first batch."""
    return f"{name}[0:{min(batch_size, len(data))}]" if is_dataset(data) else f"{name}'s first batch"


def _first_dim_shapes(output, target) -> str:
    return f"model output {tuple(output.shape)} and targets {tuple(target.shape)}"


def _check_supervised(model, objective: Supervised, batch, name: str, precision, called: str) -> None:
    inputs, targets = batch
    dtype = next(model.parameters()).dtype
    inputs = map_tensors(inputs, lambda t: t.to(dtype) if t.is_floating_point() else t)  # as Supervised does
    with precision.autocast():
        output = model(inputs)
    loss = objective.loss
    # (B, 1) against (B,) or the reverse: an element-wise loss broadcasts them to (B, B) without a word
    if isinstance(output, torch.Tensor) and isinstance(targets, torch.Tensor) and not isinstance(loss, CrossEntropy) \
            and (output.shape == targets.shape + (1,) or targets.shape == output.shape + (1,)) and output.numel() > 1:
        both = tuple(torch.broadcast_shapes(output.shape, targets.shape))
        fix = (f"return out.squeeze(-1) from forward, or targets {tuple(output.shape)}" if output.ndim > targets.ndim
               else f"targets.squeeze(-1) in the data, or outputs {tuple(targets.shape)}")
        raise FitInputError("loss", f"{_first_dim_shapes(output, targets)} broadcast to {both} in the loss, "
                                    f"comparing every output with every target; make them the same shape (e.g. "
                                    f"{fix})")
    if isinstance(loss, _FromMean):
        value = loss.fn(output, targets)
        if not isinstance(value, torch.Tensor):
            raise FitInputError("loss", f"the loss function returned {type(value).__name__}, not a tensor; return "
                                        f"a 0-d tensor (the batch's mean) so it can be backpropagated")
        if value.numel() != 1:
            raise FitInputError("loss", f"the loss function returned a tensor of shape {tuple(value.shape)} (one "
                                        f"value per sample?) for a batch of {_batch(targets)}; fit() needs the "
                                        f"batch's mean, a scalar: return loss.mean() (or use reduction='mean')")
    elif not isinstance(output, torch.Tensor):
        raise FitInputError("loss", f"model(inputs) returned {_describe(output)}, and loss={loss!r} takes a tensor; "
                                    f"return the tensor from forward, or pass a loss function that takes what it "
                                    f"returns")
    if isinstance(loss, CrossEntropy):
        _check_class_ids(output, targets, loss.ignore_index, name, called)


def _check_class_ids(output, targets, ignore_index: int, name: str, called: str) -> None:
    """Class ids outside the model's outputs, in the first batch: torch's answer would be "IndexError: Target 2 is
    out of bounds" from inside the step (on CUDA, a device-side assert). Checked here, once, so the step itself
    never reads a target on the host."""
    if not isinstance(output, torch.Tensor) or not isinstance(targets, torch.Tensor) or output.ndim == 0 \
            or output.shape[:-1] != targets.shape or targets.is_floating_point():
        return  # CrossEntropy's own shape message, at the step, says what is wrong
    ids = targets[targets != ignore_index]
    if ids.numel() == 0:
        return
    classes, lo, hi = output.shape[-1], int(ids.min()), int(ids.max())
    if lo >= 0 and hi < classes:
        return
    bad = hi if hi >= classes else lo
    raise FitInputError(name, f"{called} holds class id {bad} in its targets, and the model outputs {classes} "
                              f"class score{'s' if classes > 1 else ''} per sample (ids 0 to {classes - 1}); give "
                              f"the model's last layer one output per class, or fix the labels (class ids run from 0 "
                              f"to the number of classes - 1; {ignore_index} marks a target to skip)")


def _batch(t) -> str:
    return f"{t.shape[0]}" if isinstance(t, torch.Tensor) and t.ndim else "?"


def check_first_loss(state, batch, name: str, called: str | None = None) -> None:
    """Try the model and the loss on one batch of `name` (`called` in messages: first_batch) before the first
    step; a mistake becomes one line. The RNG streams, the model's buffers (BatchNorm statistics) and its
    train/eval mode are as before afterwards."""
    called = called or f"{name}'s first batch"
    objective, model = state.objective, state.model
    supervised = isinstance(objective, (Supervised, Contrastive))
    what = "(inputs, targets)" if isinstance(objective, Supervised) else "(view_a, view_b)"
    if supervised and isinstance(batch, dict):
        raise FitInputError(name, f"{name}'s batches are dicts ({', '.join(map(str, batch))}), and loss= takes "
                                  f"{what} pairs; return a tuple from __getitem__, or pass an objective that reads "
                                  f"the dict ({OBJECTIVES_DOC})")
    if supervised and (not isinstance(batch, (tuple, list)) or len(batch) != 2):
        raise FitInputError(name, f"{name}'s batches are {_describe(batch)}, and loss= takes {what} pairs; return "
                                  f"(inputs, targets) from __getitem__ (TensorDataset(x, y) does), or pass an "
                                  f"objective ({OBJECTIVES_DOC})")
    batch = to_device(batch, state.device)
    rng = rng_state()
    buffers = {k: v.clone() for k, v in model.state_dict().items() if k not in dict(model.named_parameters())}
    try:
        with torch.no_grad():
            if isinstance(objective, Supervised):
                _check_supervised(model, objective, batch, name, state.precision, called)
            else:
                try:
                    objective.size(batch)
                    objective.count(batch)
                    with state.precision.autocast():
                        objective(model, batch)
                except (KeyError, IndexError) as e:
                    key = e.args[0] if e.args else None
                    if isinstance(batch, dict) and isinstance(key, int):
                        raise FitInputError(name, f"{type(objective).__name__} indexed {name}'s batch with [{key}], but "
                                                  f"batches are dicts ({', '.join(map(str, batch))}): index them "
                                                  f"by key, batch[{next(iter(batch))!r}] ({OBJECTIVES_DOC})") from None
                    raise
    finally:
        set_rng_state(rng)
        if buffers:
            model.load_state_dict(buffers, strict=False)


def given_keys(config) -> set[str]:
    """The 'section.key's a fit() config sets: the keys of a dict, list or TOML file; of a Config, those that
    differ from kiln's defaults."""
    if config is None:
        return set()
    if isinstance(config, dict):
        return set(config)
    if isinstance(config, (list, tuple)):
        return {text.lstrip("-").split("=", 1)[0] for text in config}
    if isinstance(config, (str, Path)):
        data = tomllib.loads(Path(config).read_text())
        return {f"{s}.{k}" for s, table in data.items() if isinstance(table, dict) for k in table}
    if isinstance(config, Config):
        mine, default = config.to_dict(), Config().to_dict()
        return {f"{s}.{k}" for s in mine for k in mine[s] if mine[s][k] != default[s][k]}
    return set()


def ignored_keys(given: set[str]) -> list[str]:
    return sorted(k for k in given if k.split(".")[0] in IGNORED_SECTIONS or k in IGNORED_KEYS)


def recorded(toml_text: str, key: str):
    """A value of a saved config.toml ('section.key'), or None."""
    section, _, name = key.partition(".")
    try:
        return tomllib.loads(toml_text).get(section, {}).get(name)
    except tomllib.TOMLDecodeError:
        return None


def schedule_change(cfg: Config, old_toml: str, step: int, peak_lr: float) -> str | None:
    """A resume whose schedule length follows train.max_steps, with another max_steps than the run had: the lr
    from here on is not the one the run was on. The message gives both and how to keep the old schedule."""
    sched = cfg.schedule
    old_steps, old_total = recorded(old_toml, "train.max_steps"), recorded(old_toml, "schedule.total_steps")
    new_steps = cfg.train.max_steps
    if sched.name == "constant" or sched.total_steps or old_total or not old_steps or not new_steps \
            or old_steps == new_steps:
        return None
    was, now = (peak_lr * lr_factor(sched, step, h) for h in (old_steps, new_steps))
    return (f"resume at step {step}: train.max_steps {old_steps} → {new_steps} changes the {sched.name} schedule, "
            f"whose length is train.max_steps while schedule.total_steps=0: the lr at step {step} becomes "
            f"{now:.3g} (it was {was:.3g}); to keep the old schedule set schedule.total_steps={old_steps}")
