"""Numerics: where a NaN came from, what to do about loss spikes, fp16 telemetry, and `kiln doctor`'s checks.

    config.py    NumericsConfig, the `numerics` section
    faults.py    FaultsConfig (the `faults` section) and the hooks that plant NaN/Inf, spikes, broken setups
    spikes.py    StepGuard: rolling median/MAD spike detection and the skip decision, on the device
    trace.py     replay of a non-finite step with module, gradient and op hooks -> nonfinite_report.json
    fp16.py      loss-scale history, per-tensor underflow/overflow, advice
    monitor.py   Numerics: what the training loop calls each step and at each sync point
    doctor.py    the pre-flight checklist behind `kiln doctor`
"""
from kiln.numerics.config import NumericsConfig
from kiln.numerics.faults import FaultsConfig

__all__ = ["NumericsConfig", "FaultsConfig"]
