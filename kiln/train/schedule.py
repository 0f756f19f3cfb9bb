"""Learning-rate schedules as pure functions of the step: resume restores them from the step alone."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.errors import KilnError

SCHEDULES = ("constant", "cosine", "linear", "step", "onecycle", "wsd")


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # after warmup: constant | cosine | linear | step | onecycle | wsd (warmup-stable-decay)
    warmup_steps: int = 50  # linear warmup from 0 to the peak lr (onecycle: from peak/div_factor)
    min_lr_ratio: float = 0.1  # floor of cosine/linear/wsd decay, as a fraction of the peak lr
    decay_fraction: float = 0.2  # wsd: share of the run spent in the final linear decay
    step_size: int = 1000  # step decay: multiply by gamma every step_size steps after warmup
    gamma: float = 0.1  # step decay factor
    div_factor: float = 25.0  # onecycle: start at peak/div_factor
    total_steps: int = 0  # horizon of the decay (0: train.max_steps); set it to stop early on a longer schedule

    def validate(self):
        if self.name not in SCHEDULES:
            raise KilnError(f"schedule.name={self.name!r} is unknown; use one of {SCHEDULES}",
                            key="schedule.name", value=self.name, fix=f"use one of {SCHEDULES}")
        if self.warmup_steps < 0:
            raise KilnError(f"schedule.warmup_steps must be ≥ 0, got {self.warmup_steps}",
                            key="schedule.warmup_steps", value=self.warmup_steps, fix="give a number of steps ≥ 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise KilnError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
                            key="schedule.min_lr_ratio", value=self.min_lr_ratio, fix="give a ratio in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise KilnError(f"schedule.decay_fraction must be in (0, 1], got {self.decay_fraction}",
                            key="schedule.decay_fraction", value=self.decay_fraction, fix="give a fraction in (0, 1]")
        if self.total_steps < 0:
            raise KilnError(f"schedule.total_steps must be ≥ 0, got {self.total_steps}",
                            key="schedule.total_steps", value=self.total_steps,
                            fix="give a number of steps ≥ 0 (0 = train.max_steps)")
        if self.step_size < 1 or self.gamma <= 0 or self.div_factor < 1:
            raise KilnError("schedule.step_size ≥ 1, schedule.gamma > 0 and schedule.div_factor ≥ 1 are required",
                            key="schedule.step_size")


def lr_factor(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based) of a run of `total_steps`."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        start = 1.0 / cfg.div_factor if cfg.name == "onecycle" else 0.0
        return start + (1.0 - start) * (step + 1) / warmup
    floor = cfg.min_lr_ratio
    progress = (step - warmup) / max(1, total_steps - warmup)  # 0 -> 1 over the post-warmup steps
    progress = min(progress, 1.0)
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.name == "linear":
        return 1.0 - (1 - floor) * progress
    if cfg.name == "step":
        return cfg.gamma ** ((step - warmup) // cfg.step_size)
    if cfg.name == "onecycle":
        final = 1.0 / (cfg.div_factor * 1e4)  # PyTorch OneCycleLR's default final_div_factor
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: hold the peak, then decay linearly to the floor over the last decay_fraction of the run.
    decay_start = total_steps - round(cfg.decay_fraction * total_steps)
    if step < max(decay_start, warmup):
        return 1.0
    span = max(1, total_steps - max(decay_start, warmup))
    return 1.0 - (1 - floor) * min(1.0, (step - max(decay_start, warmup) + 1) / span)
