"""The iron law of training time: time = FLOPs / (devices × peak FLOP/s × utilisation), and what follows from it.

    e = training_estimate(model_cfg, seq_len, tokens, gpus, peak, mfu, ...)   FLOPs, time, GPU-hours, energy, cost
    implied_mfu(flops, gpu_hours, peak)                                      the MFU a reported run implies

FLOPs are the model's (kiln.perf.flops: 6 per parameter that takes part in a matmul per token, plus attention
over the full T×T square), so the utilisation is MFU; recomputation's extra FLOPs are reported beside them (HFU)
but do not change the time, which MFU already holds.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.models import ModelConfig
from kiln.perf.flops import flops_per_token, recompute_flops_per_token

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal training uses ~20 tokens per parameter


def parse_count(text: str, key: str = "") -> float:
    """'2e12', '2T', '300B', '1.5M', '2_000' -> a number of tokens (or anything counted); `key` names the flag
    it came from in an error."""
    units = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    t = str(text).strip().replace("_", "").replace(",", "")
    unit = t[-1:].upper() if t[-1:].isalpha() else ""
    name = f"{key}={text!r}" if key else repr(text)
    try:
        value = float(t[: len(t) - len(unit)] if unit else t) * units[unit]
    except (ValueError, KeyError):
        raise KilnError(f"cannot read {name} as a count; write it like 2e12, 2T, 300B or 1.5M", key=key or None,
                        value=text, fix="write it like 2e12, 2T, 300B or 1.5M") from None
    if not value > 0 or value != value or value == float("inf"):
        raise KilnError(f"{name} must be a positive, finite count", key=key or None, value=text,
                        fix="give a count > 0, e.g. 300B")
    return value


@dataclass
class Estimate:
    params: int  # the model's parameters
    tokens: float
    flops: float  # model FLOPs of the whole run
    hardware_flops: float  # with what recomputation runs again
    gpus: int
    peak: float  # FLOP/s per device in the run's precision
    mfu: float
    seconds: float
    gpu_hours: float
    energy_kwh: float | None  # device power × GPU-hours × PUE; None when the power is unknown
    cost: float | None  # GPU-hours × price; None without a price

    def to_json(self) -> dict:
        return dict(self.__dict__)


def training_estimate(model: ModelConfig, params: int, seq_len: int, tokens: float, gpus: int, peak: float,
                      mfu: float, power_w: float | None = None, pue: float = 1.0, price: float | None = None,
                      recompute: tuple[str, ...] = ()) -> Estimate:
    """The run's FLOPs, wall time, GPU-hours, energy and cost on `gpus` devices of `peak` FLOP/s at `mfu`."""
    if gpus < 1:
        raise KilnError(f"--gpus must be ≥ 1, got {gpus}", key="--gpus", value=gpus, fix="give --gpus ≥ 1")
    if not 0 < mfu <= 1:
        raise KilnError(f"MFU must be in (0, 1], got {mfu}: a share of the peak, e.g. 0.4", key="--mfu", value=mfu,
                        fix="give a share of the peak, e.g. --mfu=0.4")
    if pue < 1:
        raise KilnError(f"PUE is at least 1 (all power reaching the devices), got {pue}", key="--pue", value=pue,
                        fix="give --pue ≥ 1, e.g. 1.2")
    flops = flops_per_token(model, seq_len) * tokens
    hardware = flops + recompute_flops_per_token(model, seq_len, recompute) * tokens
    seconds = flops / (gpus * peak * mfu)
    gpu_hours = gpus * seconds / 3600
    energy = power_w * gpu_hours * pue / 1000 if power_w else None
    return Estimate(params=params, tokens=tokens, flops=flops, hardware_flops=hardware, gpus=gpus, peak=peak,
                    mfu=mfu, seconds=seconds, gpu_hours=gpu_hours, energy_kwh=energy,
                    cost=gpu_hours * price if price is not None else None)


def implied_mfu(flops: float, gpu_hours: float, peak: float) -> float:
    """The MFU a run that reports `gpu_hours` for `flops` model FLOPs ran at, on devices of `peak` FLOP/s."""
    return flops / (gpu_hours * 3600 * peak)


def duration(seconds: float) -> str:
    """3h 05m, 12.4 days, 41 s."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.1f} days"
