"""Numeric precision: the `precision` section, autocast, dynamic loss scaling, fp32 master weights.

Which precision a device runs fast (precision.mode=auto) is hardware knowledge: kiln.perf.hardware.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kiln.errors import KilnError
from kiln.precision import MODES, mode as mode_row  # noqa: F401  (MODES: precision.mode's values, re-exported)


@dataclass
class PrecisionConfig:
    mode: str = "auto"  # auto (bf16 where measured faster, else fp32) | fp32 | tf32 | bf16 | fp16 | bf16-master | fp8 (CUDA ≥ 8.9, torchao) | fp64 (reference runs)
    init_scale: float = 65536.0  # fp16: initial loss scale
    growth_factor: float = 2.0  # fp16: scale multiplier after growth_interval clean steps
    backoff_factor: float = 0.5  # fp16: scale multiplier on an inf/NaN gradient (the step is skipped)
    growth_interval: int = 2000  # fp16: clean steps between scale increases
    decided_by: str = ""  # written by kiln train: what chose mode (auto's measurement, the planner, the config); a resume keeps mode

    def validate(self):
        if self.mode not in MODES:
            raise KilnError(f"precision.mode={self.mode!r} is unknown; use one of {MODES}",
                            key="precision.mode", value=self.mode, fix=f"use one of {MODES}")
        if self.init_scale <= 0 or self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise KilnError("precision.init_scale > 0, precision.growth_factor > 1 and 0 < precision.backoff_factor < 1 "
                            "are required",
                            key="precision.init_scale")
        if self.growth_interval < 1:
            raise KilnError(f"precision.growth_interval must be ≥ 1, got {self.growth_interval}",
                            key="precision.growth_interval", value=self.growth_interval,
                            fix="give a number of steps ≥ 1")


class Precision:
    """Autocast dtype, parameter dtype and whether loss scaling is on, for one concrete mode."""

    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device
        self.row = row = mode_row(mode)  # kiln.precision: what the mode computes in, keeps and scales
        self.autocast_dtype = row.autocast
        self.param_dtype = row.param_dtype
        self.loss_scaling = row.loss_scaling
        if row.tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


@torch.no_grad()
def store_frozen(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Every floating-point parameter that takes no gradient (a LoRA base) stored in `dtype` (the mode's
    Mode.frozen: bf16 under bf16 autocast, so its matmuls read it without an autocast copy); returns how many
    elements changed dtype. The Parameter objects stay (tied weights stay tied)."""
    changed = 0
    for p in dict.fromkeys(model.parameters()):
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            changed += p.numel()
    return changed


def fp8_linear(module: torch.nn.Module, fqn: str) -> bool:
    """The linears fp8 converts: those of the transformer blocks whose both dimensions are multiples of 16 (what
    fp8 matmuls need). kiln's LM head is a parameter of the loss, not an nn.Linear: it stays bf16, as is usual."""
    return (isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_fp8(model: torch.nn.Module) -> list[str]:
    """Swap the eligible linears for torchao's Float8Linear (dynamic tensorwise scaling); returns their names."""
    try:
        from torchao.float8 import convert_to_float8_training  # lazy: torchao only for precision.mode=fp8
    except ImportError:
        raise KilnError("precision.mode=fp8 trains through torchao's float8 linears; install it "
                        "(pip install torchao) or use precision.mode=bf16",
                        key="precision.mode", value="fp8",
                        fix="install it (pip install torchao) or use precision.mode=bf16") from None
    names = [name for name, m in model.named_modules() if fp8_linear(m, name)]
    if not names:
        raise KilnError("precision.mode=fp8 found no linear whose dimensions are multiples of 16; use bf16",
                        key="precision.mode", value="fp8", fix="use bf16")
    convert_to_float8_training(model, module_filter_fn=fp8_linear)
    return names


class LossScaler:
    """Dynamic loss scaling for fp16, with its state on the device so no step needs a host sync.

    On an inf/NaN gradient: the step is skipped and the scale multiplied by backoff_factor.
    After growth_interval clean steps in a row: the scale is multiplied by growth_factor.
    """

    def __init__(self, cfg: PrecisionConfig, device: torch.device, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        self.scale = torch.full((), cfg.init_scale if enabled else 1.0, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, params) -> torch.Tensor:
        """Divide gradients by the scale in place; returns found_inf (1.0 when any gradient is inf/NaN)."""
        grads = [p.grad for p in params if p.grad is not None]
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        if self.enabled:
            inv_scale = self.scale.double().reciprocal().float()
            for dtype_grads in _by_dtype(grads):
                torch._amp_foreach_non_finite_check_and_unscale_(dtype_grads, found_inf, inv_scale)
        return found_inf

    def update(self, found_inf: torch.Tensor) -> None:
        if self.enabled:
            torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, self.cfg.growth_factor,
                                     self.cfg.backoff_factor, self.cfg.growth_interval)

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.scale.copy_(state["scale"])
        self.growth_tracker.copy_(state["growth_tracker"])


def _by_dtype(tensors):
    groups: dict[torch.dtype, list] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups.values()


class MasterWeights:
    """fp32 master copies of bf16 parameters: the optimizer updates the masters, the model sees bf16 copies.

    Without them, updates smaller than bf16's 2^-8 relative spacing round away (lr·update ≪ |w|). A frozen
    parameter (a LoRA base) is never updated: it has none (4 B per parameter saved).
    """

    def __init__(self, model: torch.nn.Module):
        self.pairs = []
        for p in dict.fromkeys(model.parameters()):  # tied weights once
            if not p.requires_grad:
                continue
            master = torch.nn.Parameter(p.detach().float().clone())
            self.pairs.append((p, master))
        self.by_model_param = {id(p): m for p, m in self.pairs}

    def groups(self, model_groups: list[dict]) -> list[dict]:
        """Parameter groups over the masters, mirroring the model's groups."""
        return [{**g, "params": [self.by_model_param[id(p)] for p in g["params"]]} for g in model_groups]

    @property
    def masters(self):
        return [m for _, m in self.pairs]

    def grads_to_masters(self) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)

    def state_dict(self) -> dict:
        return {"masters": [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for m, saved in zip(self.masters, state["masters"]):
            m.copy_(saved)
        self.masters_to_model()
