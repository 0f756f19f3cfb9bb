"""The peak FLOP/s that MFU divides by, and MFU that can never exceed 100%.

    model_peak_flops(device, precision, cfg, rows)   CUDA: the datasheet; CPU: measured at the model's shapes
    utilisation(model_flops, hardware_flops, rate, peak)   (MFU, HFU, the peak used), the peak raised to the
                                                           achieved rate when the model ran faster than it

On a CPU the peak is measured, at the model's own shapes: one timed square product (kiln.perf.flops.cpu_peak,
256-1024) is not what the model runs. On an AMD EPYC (Zen 4, AVX512-BF16, no AVX512-FP16; 2 cores, shared) a 256³
fp16 product ran at 1.3 GFLOP/s while the nano model's own (2048×256)·(256×768) ran at 12.6 under fp16 autocast,
and MFU read 170-205%; on an AMX Xeon the square bf16 product gave 1,385 GFLOP/s while torch reached 2.1-3.5
TFLOP/s on the model's shapes, so MFU read too high there too. So the peak is the best rate of the model's own
linear shapes (rows = the micro-batch's tokens), timed as the model runs them: F.linear under the run's autocast
dtype, and of the square product (the floor for a model so small that its shapes time the CPU's overhead). Each is
measured once per machine (CPU model, threads, torch version) and kept in kiln's cache (kiln.perf.measured):
later runs and `kiln profile` read the same number and start without the measurement, and each run times the
shape that sets the peak once more, so a first measurement made while the machine was busy rises to the best seen.
The attention matmuls and everything else are not in it, and a CPU's rate moves with the other work on the
machine, so the loop still raises the peak to the rate the model achieved if that is higher: MFU is then 100%,
never more, and each train record carries the peak used (`mfu_peak_flops`). The raise holds for that record only,
so one interval whose rate was misjudged (a window cut by an evaluation) cannot lower every later MFU.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kiln.models import family
from kiln.perf import cpu_linear
from kiln.perf.flops import device_peak_flops
from kiln.perf.measured import remembered, store
from kiln.precision import mode

MAX_ROWS, MAX_OUT = 2048, 4096  # the largest product timed: a 50k-vocabulary head is timed on 4096 of its rows
# FLOPs of one timed product: rows are cut to fit it (never below 64). Timed at the run's own rows, not on a ladder
# that stops early: fp16 on the Zen 4 CPU runs (64×256)·(256×768) at 0.48 GFLOP/s and (2048×256)·(256×768) at 2.2
# (both measured under a load of ~10 on its 2 cores), so a ladder that a busy machine cut short measured the slow end.
FLOP_BUDGET = 2e9
TRIES = 5  # timed calls after a first one (which picks the kernel); the best is kept: it is measured once
_cache: dict[tuple, float] = {}
_timed_here: set[tuple] = set()  # measured in this process: not measured again by refresh_rate


def linear_shapes(cfg, rows: int) -> list[tuple[int, int, int]]:
    """(rows, in, out) of the model's linears per micro-batch: each block matmul of the family's description (an
    expert's rows are its average share of the routed tokens) and the LM head."""
    shapes = [(max(1, rows * lin.active // lin.copies), lin.n_in, lin.n_out) for lin in family(cfg.arch).linears(cfg)]
    return list(dict.fromkeys(shapes + [(rows, cfg.d_model, cfg.padded_vocab)]))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _timed_shape(rows: int, k: int, n: int) -> tuple[int, int, int]:
    n = min(n, MAX_OUT)
    return min(rows, MAX_ROWS, max(64, int(FLOP_BUDGET // (2 * k * n)))), k, n


def linear_rate(rows: int, k: int, n: int, precision: str, onednn: bool = False) -> float:
    """Best FLOP/s of F.linear((rows, k), (n, k)) on this CPU, run as a `precision` run runs its linears (`onednn`:
    through kiln.perf.cpu_linear, train.cpu_linear=onednn): measured once per machine, then read from kiln's cache."""
    m, k, n = _timed_shape(rows, k, n)
    key = (m, k, n, precision, onednn)
    if key not in _cache:
        _cache[key] = remembered("matmul_flops", _stored_key(key), lambda: _measure_linear(key))
    return _cache[key]


def _stored_key(key: tuple) -> str:
    m, k, n, precision, onednn = key
    return f"{precision}{' onednn' if onednn else ''} linear {m}x{k}x{n}"


def refresh_rate(rows: int, k: int, n: int, precision: str, onednn: bool = False) -> float:
    """linear_rate, measured once more (one warm-up and TRIES timed calls of one product) and stored if higher: a
    peak first measured while the machine was busy (on a shared 2-core CPU: 10.6 GFLOP/s for a shape that runs at
    50 when the other work pauses) rises to the best any run has seen, instead of staying low for good."""
    m, k, n = _timed_shape(rows, k, n)
    key = (m, k, n, precision, onednn)
    known = linear_rate(m, k, n, precision, onednn)
    if key in _timed_here:
        return known
    best = max(known, _measure_linear(key))
    if best > known:
        _cache[key] = best
        store("matmul_flops", _stored_key(key), best)
    return best


def _measure_linear(key: tuple) -> float:
    m, k, n, precision, onednn = key
    _timed_here.add(key)
    product = cpu_linear.linear if onednn else F.linear
    gen = torch.Generator().manual_seed(0)  # never the global stream: training RNG stays untouched
    row = mode(precision)  # kiln.precision: the autocast dtype and the parameters' (a CPU runs no fp8)
    autocast, dtype = row.autocast, row.param_dtype
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        product(x, w)  # picks the kernel, warms the caches
        t = min(_timed(lambda: product(x, w)) for _ in range(TRIES))
    return 2 * m * k * n / t


def model_peak_flops(device: torch.device, precision: str, cfg=None, rows: int = 0,
                     onednn: bool = False) -> float | None:
    """The peak MFU divides by: CUDA's datasheet; on a CPU the best measured rate of the model's own linear shapes
    (`cfg` a resolved ModelConfig, `rows` the tokens of a micro-batch; `onednn`: as train.cpu_linear=onednn runs
    them) and of a square product (cached), or of the square product alone (measured in this process) without a
    model."""
    if device.type != "cpu" or cfg is None or not rows:
        return device_peak_flops(device, precision)
    shapes = linear_shapes(cfg, rows)
    fastest = max(shapes, key=lambda s: linear_rate(*s, precision, onednn))  # measured now, or read back
    refresh_rate(*fastest, precision, onednn)  # read back: the shape that sets the peak is timed again, can only rise
    return max([square_rate(precision)] + [linear_rate(*s, precision, onednn) for s in shapes])


def square_rate(precision: str) -> float:
    """kiln.perf.flops.cpu_peak (a square product, 256-1024), measured once per machine and then read back: the
    floor of the peak, for a model so small that its own shapes measure the CPU's overhead rather than its
    arithmetic (a (8×32)·(32×96) product runs at a fraction of a GFLOP/s)."""
    key = ("square", precision)
    if key not in _cache:
        _cache[key] = remembered("matmul_flops", f"{precision} square", lambda: device_peak_flops(
            torch.device("cpu"), precision))
    return _cache[key]


def utilisation(model_flops: float, hardware_flops: float, rate: float,
                peak: float | None) -> tuple[float | None, float | None, float | None]:
    """(MFU, HFU, the peak used) for `rate` units per second on one device. A rate above the peak raises the
    peak to it: a peak the model beats was not the peak, and a utilisation above 100% is not one."""
    if not peak:
        return None, None, peak
    peak = max(peak, hardware_flops * rate)
    return model_flops * rate / peak, hardware_flops * rate / peak, peak
