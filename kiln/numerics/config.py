"""The `numerics` section: non-finite tracing, loss-spike detection and recovery, fp16 telemetry."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError

SPIKE_POLICIES = ("off", "warn", "skip", "rollback", "stop")


@dataclass
class NumericsConfig:
    trace: bool = True  # replay a step whose loss or gradient went NaN/Inf with hooks; write nonfinite_report.json
    spike_policy: str = "warn"  # off | warn | skip (withhold the update) | rollback (restore last good state) | stop
    spike_threshold: float = 6.0  # robust z-score (loss - recent median) / (1.4826·MAD of step changes/√2) above which a step is a spike
    spike_grad_norm_threshold: float = 12.0  # the same for log(grad norm), which is heavier-tailed (0: not judged)
    spike_window: int = 100  # steps of loss and grad-norm history whose step-to-step changes give the noise (MAD)
    spike_min_history: int = 20  # accepted steps needed before any step is judged a spike
    spike_rel_floor: float = 0.01  # noise floor as a fraction of the level: a flat history does not flag its noise
    snapshot_interval: int = 50  # rollback from memory: steps between in-memory snapshots of a verified state
    rollback_from: str = "memory"  # memory (snapshot on the training device) | disk (the latest checkpoint)
    rollback_lr_factor: float = 1.0  # lr multiplier for rollback_lr_steps steps after a rollback (1.0: unchanged)
    rollback_lr_steps: int = 0  # steps that run at rollback_lr_factor after each rollback
    max_rollbacks: int = 5  # stop after this many rollbacks: a spike that keeps coming back is not one bad batch
    max_nonfinite_steps: int = 100  # stop after this many non-finite steps in a row (0: never)
    fp16_telemetry_interval: int = 100  # fp16: steps between per-tensor gradient underflow/overflow measurements
    fp16_advice_backoffs: int = 5  # fp16: loss-scale back-offs within 100 steps that count as a collapsing scale

    def validate(self):
        if self.spike_policy not in SPIKE_POLICIES:
            raise KilnError(f"numerics.spike_policy={self.spike_policy!r} is unknown; use one of {SPIKE_POLICIES}",
                            key="numerics.spike_policy", value=self.spike_policy, fix=f"use one of {SPIKE_POLICIES}")
        if self.rollback_from not in ("memory", "disk"):
            raise KilnError(f"numerics.rollback_from={self.rollback_from!r}; use 'memory' or 'disk'",
                            key="numerics.rollback_from", value=self.rollback_from, fix="use 'memory' or 'disk'")
        if self.spike_threshold <= 0 or self.spike_grad_norm_threshold < 0 or self.spike_rel_floor < 0:
            raise KilnError("numerics.spike_threshold must be > 0, numerics.spike_grad_norm_threshold and "
                            "numerics.spike_rel_floor ≥ 0",
                            key="numerics.spike_threshold")
        if self.spike_window < 3 or not 1 <= self.spike_min_history <= self.spike_window:
            raise KilnError(f"numerics: need numerics.spike_window ≥ 3 and 1 ≤ numerics.spike_min_history ≤ spike_window, got "
                            f"{self.spike_window} and {self.spike_min_history}",
                            key="numerics.spike_window", value=self.spike_window)
        if not 0 < self.rollback_lr_factor <= 1:
            raise KilnError(f"numerics.rollback_lr_factor must be in (0, 1], got {self.rollback_lr_factor}",
                            key="numerics.rollback_lr_factor", value=self.rollback_lr_factor,
                            fix="give a factor in (0, 1]")
        for key in ("snapshot_interval", "max_rollbacks", "fp16_advice_backoffs"):
            if getattr(self, key) < 1:
                raise KilnError(f"numerics.{key} must be ≥ 1, got {getattr(self, key)}",
                                key=f"numerics.{key}", value=getattr(self, key), fix="give a whole number ≥ 1")
        for key in ("rollback_lr_steps", "max_nonfinite_steps", "fp16_telemetry_interval"):
            if getattr(self, key) < 0:
                raise KilnError(f"numerics.{key} must be ≥ 0, got {getattr(self, key)}",
                                key=f"numerics.{key}", value=getattr(self, key),
                                fix="give a whole number ≥ 0 (0 = off)")

    @property
    def withholds_spikes(self) -> bool:
        """Whether a spiking update is kept off the weights (decided on the device, folded into found_inf)."""
        return self.spike_policy in ("skip", "rollback", "stop")
