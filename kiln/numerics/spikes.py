"""Loss-spike detection on the device: a recent level and the noise of step-to-step changes, no host sync.

Each step, StepGuard.check() judges the loss and the log of the gradient norm against the accepted steps:
    z = (x - level) / max(1.4826·MAD_Δ/√2, floor)    floor: rel_floor·|level| for the loss, rel_floor for log
level: the median of the last LEVEL_STEPS accepted steps; MAD_Δ: the MAD of the changes between consecutive
accepted steps over the last `window` (a falling trend is an offset of the changes, not noise). 1.4826·MAD
estimates the standard deviation of Gaussian noise, but one outlier barely moves it, unlike a mean and
standard deviation. The gradient norm is judged on a log scale because it is heavy-tailed and
multiplicative, and it has its own, higher threshold: on a clean 600-step run (4 layers, width 128, fp32) the
loss z never exceeded 2.6 while single steps at 2-4× the median norm (clipped to 1.0 anyway) reached z 9.6 on
the log scale. A step is a spike when either z exceeds its threshold (upward only: a sudden drop is good news).
Spikes and non-finite steps are not added to the history, so an incident cannot raise the bar for the next.

Everything the host later needs (values, statistics, flags, loss scale) goes into a small device-side ring of
one row per step, read in one transfer at the next sync point.
"""
from __future__ import annotations

import torch

# Columns of a ring row. GN_MED and GN_MAD are the median and MAD of log(grad norm).
LOSS, GRAD_NORM, LOSS_MED, GN_MED, LOSS_MAD, GN_MAD, LOSS_Z, GN_Z, SPIKE, OVERFLOW, SCALE = range(11)
N_COLS = 11
MAD_TO_STD = 1.4826
# The level a step is judged against: the median of the last LEVEL_STEPS accepted steps. Short, so that it follows
# the falling loss of early training (a median over the whole window sat far above it: a 2× jump at step 22-40 of
# the default job reached z 3-4.4 only); long enough that one noisy step does not move it.
LEVEL_STEPS = 10
DIFF_TO_NOISE = 2 ** 0.5  # the difference of two steps' independent noise has √2 times the noise's spread


def level_and_noise(history: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(level, MAD of the step-to-step changes) per row of a (rows, window) ring of accepted values (NaN: none),
    whose oldest column is `pos`.

    The noise is measured on first differences, around their median: a trend (the loss falling fast in the first
    steps) is a constant offset of the differences and does not count as noise, while with the plain MAD around
    the median the whole descent of the window did, and hid real spikes until the history flattened out.
    """
    ordered = torch.roll(history, -pos, dims=1)  # oldest to newest
    level = ordered[:, -LEVEL_STEPS:].nanmedian(dim=1).values
    diffs = ordered[:, 1:] - ordered[:, :-1]  # NaN where either step was not accepted
    centre = diffs.nanmedian(dim=1).values
    return level, (diffs - centre[:, None]).abs().nanmedian(dim=1).values


class StepGuard:
    """Per-step numerics on the device: spike judgement, a withhold decision, a record ring for the host."""

    def __init__(self, window: int, min_history: int, threshold: float, rel_floor: float, withhold: bool,
                 ring_size: int, device: torch.device, detect: bool = True, grad_norm_threshold: float = 12.0):
        self.window, self.min_history, self.rel_floor = window, min_history, rel_floor
        # (loss, log grad norm) thresholds; 0 for the grad norm means it is recorded but never judged
        self.thresholds = torch.tensor([threshold, grad_norm_threshold or float("inf")], device=device)
        self.withhold, self.detect, self.ring_size = withhold, detect, ring_size
        self.history = torch.full((2, window), float("nan"), device=device)  # accepted (loss, log grad norm)
        self.ring = torch.zeros((ring_size, N_COLS), dtype=torch.float64, device=device)
        self._pos = 0  # next history column, host-side: every step writes one (NaN when not accepted)
        self.step = 0  # the step being computed, set by the loop (1-based)
        self.telemetry = None  # fp16 telemetry (kiln.numerics.fp16), when loss scaling is on

    def history_state(self) -> tuple[torch.Tensor, int]:
        return self.history.clone(), self._pos

    def load_history_state(self, state: tuple[torch.Tensor, int] | None) -> None:
        """Restore the history of a snapshot; None forgets it (spikes are judged again after min_history steps)."""
        if state is None:
            self.history.fill_(float("nan"))
            self._pos = 0
        else:
            self.history.copy_(state[0])
            self._pos = state[1]

    def slot(self, step: int) -> int:
        return step % self.ring_size

    def inspect_scaled_grads(self, params) -> None:
        """Called before unscaling: fp16 gradients as they came out of the backward pass."""
        if self.telemetry is not None and self.telemetry.due(self.step):
            self.telemetry.measure(params, self.step)

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, overflow: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
        """Record this step; returns 1.0 when the update must not be applied (non-finite, or a withheld spike)."""
        values = torch.stack([loss.detach().float(), grad_norm.detach().float()])  # (2,): what is recorded
        x = torch.stack([values[0], values[1].clamp(min=1e-30).log()])  # what is judged
        finite = torch.isfinite(values).all()
        if self.detect:
            med, mad = level_and_noise(self.history, self._pos)  # (2,), (2,)
            floor = self.rel_floor * torch.stack([med[0].abs(), torch.ones_like(med[1])])
            spread = torch.maximum(MAD_TO_STD * mad / DIFF_TO_NOISE, floor).clamp(min=1e-12)
            z = (x - med) / spread
            armed = (~self.history[0].isnan()).sum() >= self.min_history
            spike = armed & finite & (z > self.thresholds).any()
            self.history[:, self._pos] = torch.where(finite & ~spike, x, float("nan"))
            self._pos = (self._pos + 1) % self.window
        else:
            med = mad = z = torch.full_like(x, float("nan"))
            spike = torch.zeros((), dtype=torch.bool, device=x.device)
        flags = torch.stack([spike.float(), overflow.float(), scale.float()])
        self.ring[self.slot(self.step)] = torch.cat([values, med, mad, z, flags])
        if self.withhold:
            return torch.maximum(overflow, spike.float())
        return overflow
