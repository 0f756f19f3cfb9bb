"""The train record of a log interval: loss, lr, gradient norm, throughput, MFU, memory, utilisation, measured over
the window of steps since the last record.

    metrics = StepMetrics(unit, device, flops_per_unit=..., peak_flops=..., optim=cfg.optim)
    metrics.step_done(units, busy_s, result.skipped)   after every step
    record = metrics.record(result, lr, state)         at a log interval (one host-device transfer); starts a window
    metrics.restart() / metrics.restart_clock()        after a rollback / time that is not training (eval, a save)
"""
from __future__ import annotations

import math
import resource
import time

import torch

from kiln.models import moe_metrics
from kiln.perf.peak import utilisation
from kiln.train.step import StepResult


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class StepMetrics:
    """The logging window (steps, units and busy seconds since the last record) and what a record makes of it."""

    def __init__(self, unit: str, device: torch.device, *, flops_per_unit: float | None, peak_flops: float | None,
                 hardware_flops_per_unit: float | None, optim):
        """unit: "tokens" or "samples"; flops_per_unit and peak_flops give MFU, hardware_flops_per_unit (the same
        plus what recomputation runs again) HFU; optim (cfg.optim) names the clip threshold a record shows."""
        self.unit, self.device = unit, device
        self.flops_per_unit, self.peak = flops_per_unit, peak_flops
        self.hardware_flops_per_unit = hardware_flops_per_unit or flops_per_unit  # + recomputation (HFU)
        self.grad_clip = optim.grad_clip if optim.clip_mode == "norm" else math.nan
        self.skipped_total = torch.zeros((), device=device)
        self.restart()

    def restart(self) -> None:
        """A new window: nothing counted since now."""
        self.window_start, self.window_steps, self.window_units, self.window_busy = time.perf_counter(), 0, 0, 0.0

    def restart_clock(self) -> None:
        """The time until now was not training (evaluation, a save): the window's rate leaves it out."""
        self.window_start = time.perf_counter()

    def step_done(self, units: int, busy: float, skipped: torch.Tensor) -> None:
        """One optimizer step of `units` tokens or samples, `busy` seconds inside train_step."""
        self.window_busy += busy  # CPU: the step's compute, which runs in the call
        self.skipped_total += skipped
        self.window_steps += 1
        self.window_units += units

    def record(self, result: StepResult, lr: float, state) -> dict:
        """The train record of the window that ends at this step (None where a value is not known); the next window
        starts when the record is logged (restart)."""
        # The one host-device transfer per log interval.
        threshold = result.clip_threshold if result.clip_threshold is not None else result.grad_norm.new_tensor(
            self.grad_clip)
        loss, grad_norm, skipped, scale, threshold = torch.stack([
            result.loss.double(), result.grad_norm.double(), self.skipped_total.double(), state.scaler.scale.double(),
            threshold.double()]).tolist()
        elapsed = time.perf_counter() - self.window_start
        rate = self.window_units * state.world.dp_size / elapsed  # global: every data-parallel copy served as many
        # per device: the global rate shared by the ranks; a measured peak the model beat is raised to its rate
        mfu, hfu, peak = utilisation(self.flops_per_unit or 0.0, self.hardware_flops_per_unit or 0.0,
                                     rate / state.world.size, self.peak)
        return {
            "step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            # the global-norm threshold in force (norm: optim.grad_clip; adaptive: this step's percentile)
            "clip_threshold": threshold if math.isfinite(threshold) and threshold > 0 else None,
            f"{self.unit}_per_s": rate, "step_time_s": elapsed / self.window_steps,
            f"{self.unit}_seen": state.tokens_seen,  # global (the state counts every data-parallel copy)
            "peak_mem_bytes": peak_memory_bytes(state.device),
            "mfu": mfu if self.flops_per_unit else None, "hfu": hfu if self.flops_per_unit else None,
            "mfu_peak_flops": peak if self.flops_per_unit else None,  # the peak this record's MFU divides by
            "skipped_steps": int(skipped), "loss_scale": scale if state.scaler.enabled else None,
            # ddp, zero1: seconds per step the gradient all-reduces were in flight (overlapping the backward)
            "comm_s": state.world.comm.take() / self.window_steps if state.world.comm is not None else None,
            "utilisation": self.utilisation(elapsed),
            # a mixture of experts: moe_aux_loss, moe_load_max, moe_load_min (a pipeline's over all its stages)
            **(state.model.moe_metrics() if hasattr(state.model, "moe_metrics") else moe_metrics(state.model)),
        }

    def utilisation(self, elapsed: float) -> float | None:
        """How busy the device was over the log interval: on CUDA NVML's busy share (torch.cuda.utilization,
        when pynvml is installed); on a CPU the share of the interval spent inside the steps (forward, backward,
        optimizer), the rest being data, logging and everything else between them."""
        if self.device.type == "cuda":
            try:
                return torch.cuda.utilization(self.device) / 100
            except Exception:  # no NVML here: better no number than the host's launch time, which is not busy time
                return None
        return min(1.0, self.window_busy / elapsed) if elapsed > 0 else None
