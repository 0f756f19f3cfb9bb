"""Fault injection for tests and demos: planted NaN/Inf, a loss-spike batch, and setups broken on purpose.

Faults are hooks on the built model and a transform of the batches; nothing in the model or the train step
knows about them. Steps are 1-based, as in metrics.jsonl.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from kiln.errors import KilnError
from kiln.models import IGNORE_INDEX
from kiln.util import closest

_SPEC = re.compile(r"(\w[\w.]*)@(\d+)(?:-(\d+))?")  # module names as named_modules gives them: "2" in an nn.Sequential


@dataclass
class FaultsConfig:
    nan_forward: str = ""  # MODULE@STEP or MODULE@FIRST-LAST: a NaN in that module's forward output (blocks.2.mlp@20)
    inf_backward: str = ""  # MODULE@STEP or MODULE@FIRST-LAST: an Inf in the gradient that module passes back
    spike: int = 0  # STEP: the first time that step runs, its batch gets scrambled targets: a real loss spike (0: off)
    unshifted_labels: bool = False  # targets equal the inputs, not the next tokens (doctor check 4 fails)
    frozen_module: str = ""  # MODULE: its output is detached, so its parameters get no gradient (doctor check 3)
    skip_zero_grad: bool = False  # gradients stay in .grad between steps, as if zero_grad were forgotten (check 7)
    oom: int = 0  # STEP: the model's forward raises torch.OutOfMemoryError in that step (the OOM report; 0: off)
    data_delay_ms: float = 0.0  # every batch waits this long before the loader hands it over: a slow data source
    slow_forward_ms: float = 0.0  # the model's every forward takes this much longer (a sleep after it): a slow device
    rank: int = -1  # data parallelism: plant nan_forward / inf_backward / slow_forward_ms on this rank only (-1: every)

    def validate(self):
        for key in ("nan_forward", "inf_backward"):
            if getattr(self, key):
                parse_spec(getattr(self, key), f"faults.{key}")
        for key in ("spike", "oom"):
            if getattr(self, key) < 0:
                raise KilnError(f"faults.{key} must be a step ≥ 1 (0: off), got {getattr(self, key)}",
                                key=f"faults.{key}", value=getattr(self, key), fix="give a step ≥ 1, or 0 for off")
        for key in ("data_delay_ms", "slow_forward_ms"):
            if getattr(self, key) < 0:
                raise KilnError(f"faults.{key} must be ≥ 0 (0: off), got {getattr(self, key)}",
                                key=f"faults.{key}", value=getattr(self, key), fix="give a value ≥ 0, or 0 for off")

    @property
    def any(self) -> bool:
        return bool(self.nan_forward or self.inf_backward or self.spike or self.unshifted_labels
                    or self.frozen_module or self.skip_zero_grad or self.oom or self.slow_forward_ms)


def parse_spec(spec: str, key: str = "fault") -> tuple[str, int, int]:
    """'blocks.2.mlp@20' -> ('blocks.2.mlp', 20, 20); 'blocks.2.mlp@5-9' -> ('blocks.2.mlp', 5, 9)."""
    m = _SPEC.fullmatch(spec.strip())
    if not m:
        raise KilnError(f"{key}={spec!r}; write MODULE@STEP or MODULE@FIRST-LAST, e.g. blocks.2.mlp@20", key=key,
                        value=spec, fix="write MODULE@STEP or MODULE@FIRST-LAST, e.g. blocks.2.mlp@20")
    first = int(m.group(2))
    last = int(m.group(3) or first)
    if first < 1 or last < first:
        raise KilnError(f"{key}={spec!r}: steps are 1-based and FIRST ≤ LAST", key=key, value=spec,
                        fix="steps are 1-based and FIRST ≤ LAST")
    return m.group(1), first, last


def _module(model: nn.Module, name: str, key: str) -> nn.Module:
    modules = dict(model.named_modules())
    if name not in modules:
        hint = closest(name, [n for n in modules if n])
        raise KilnError(f"{key}: the model has no module {name!r}" + (f"; did you mean {hint!r}?" if hint else ""),
                        key=key, value=name, fix=f"did you mean {hint!r}?" if hint else "name a module of the model")
    return modules[name]


def _poison(t: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of t with its first element replaced by value (NaN or Inf): one bad number is enough."""
    mask = torch.zeros_like(t, dtype=torch.bool)
    mask.view(-1)[0] = True
    return t.masked_fill(mask, value)


class DelayedLoader:
    """faults.data_delay_ms: a loader whose every batch arrives `delay_ms` late (a slow disk, a remote source)."""

    def __init__(self, loader, delay_ms: float):
        self.loader, self.delay = loader, delay_ms / 1000

    def next(self):
        time.sleep(self.delay)
        return self.loader.next()

    def __getattr__(self, name):  # batches_served, skip, state_dict, close: the loader's own
        return getattr(self.loader, name)


class FaultInjector:
    """Arms the configured faults on a built (uncompiled) model; `begin_step` tells it which step runs next."""

    def __init__(self, cfg: FaultsConfig, model: nn.Module, vocab_size: int | None, rank: int = 0):
        """vocab_size: the data's token ids (kiln's language-model batches); None for other models, which then
        take the module faults only. rank: this process's, for faults.rank."""
        if vocab_size is None and (cfg.spike or cfg.unshifted_labels):
            raise KilnError("faults.spike and faults.unshifted_labels rewrite language-model targets (token ids); "
                            "this model trains on other data: use the module faults (nan_forward, inf_backward, "
                            "frozen_module, skip_zero_grad)",
                            key="faults.spike" if cfg.spike else "faults.unshifted_labels",
                            fix="use the module faults (nan_forward, inf_backward, frozen_module, skip_zero_grad)")
        self.cfg, self.model, self.vocab_size = cfg, model, vocab_size
        self.step = 0
        self.spiked = False  # the spike batch is served once: a rollback that replays step `spike` gets clean data
        self._handles = []
        self._leftover: dict[nn.Parameter, torch.Tensor] = {}
        here = cfg.rank < 0 or cfg.rank == rank
        if cfg.nan_forward and here:
            name, first, last = parse_spec(cfg.nan_forward, "faults.nan_forward")
            self._handles.append(_module(model, name, "faults.nan_forward").register_forward_hook(
                self._nan_output(first, last)))
        if cfg.slow_forward_ms and here:  # a straggler: this rank's compute is slower than the others'
            self._handles.append(model.register_forward_hook(self._slow_forward))
        if cfg.oom and here:
            self._handles.append(model.register_forward_pre_hook(self._out_of_memory))
        if cfg.inf_backward and here:
            name, first, last = parse_spec(cfg.inf_backward, "faults.inf_backward")
            module = _module(model, name, "faults.inf_backward")
            if isinstance(module, nn.Embedding):
                raise KilnError(f"faults.inf_backward={cfg.inf_backward!r}: {name} takes token ids, which have no "
                                f"gradient; pick a module with a floating-point input such as blocks.1.attn",
                                key="faults.inf_backward", value=cfg.inf_backward,
                                fix="pick a module with a floating-point input such as blocks.1.attn")
            self._handles.append(module.register_full_backward_hook(self._inf_grad_input(first, last)))
        if cfg.frozen_module:
            module = _module(model, cfg.frozen_module, "faults.frozen_module")
            self._handles.append(module.register_forward_hook(lambda m, args, out: out.detach()))
        if cfg.skip_zero_grad:
            for p in model.parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._keep_grad))

    def _nan_output(self, first: int, last: int):
        def hook(module, args, output):
            if first <= self.step <= last:
                if not isinstance(output, torch.Tensor):
                    raise TypeError(f"faults.nan_forward: {type(module).__name__} returns {type(output).__name__}, "
                                    f"not a tensor; pick another module")
                return _poison(output, float("nan"))
        return hook

    def _inf_grad_input(self, first: int, last: int):
        def hook(module, grad_input, grad_output):
            if first <= self.step <= last:
                return tuple(None if g is None else _poison(g, float("inf")) for g in grad_input)
        return hook

    def _slow_forward(self, module, args, output) -> None:
        if torch.is_grad_enabled():  # training forwards only: evaluation is not what a straggler slows
            time.sleep(self.cfg.slow_forward_ms / 1000)

    def _keep_grad(self, p: torch.Tensor) -> None:
        self._leftover[p] = p.grad

    def _out_of_memory(self, module, args):
        if self.step == self.cfg.oom:
            raise torch.OutOfMemoryError(f"planted by faults.oom={self.cfg.oom}: the allocator could not find memory "
                                         f"for the forward")

    def begin_step(self, step: int) -> None:
        """Arm the step-keyed faults for `step`; with skip_zero_grad, put last step's gradients back."""
        self.step = step
        for p, grad in self._leftover.items():
            p.grad = grad
        self._leftover = {}

    def transform(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
        """The batches of the current step, with the data faults applied."""
        if self.cfg.unshifted_labels:
            batches = [(x, x.clone(), *doc) for x, _, *doc in batches]
        if self.cfg.spike and self.step == self.cfg.spike and not self.spiked:
            self.spiked = True
            # Targets remapped by a fixed affine map of the ids: mostly tokens the model finds unlikely.
            batches = [(x, torch.where(y == IGNORE_INDEX, y, (y * 7 + 13) % self.vocab_size), *doc)
                       for x, y, *doc in batches]
        return batches

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._leftover = {}
