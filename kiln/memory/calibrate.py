"""`kiln plan --calibrate`: the planner's time constants measured on this machine's device, then cached.

    time_model = measure(device, torch_device, precision)   matmul and bandwidth efficiency, seconds per op
    save(device, time_model); load(device) -> the Device with its measured time model (or as it was)

The planner's step time (kiln.memory.planner.step_time) is a roofline per operation plus a fixed cost per op.
Three numbers set it, and each is measured here the way the step uses the device:
- matmul efficiency: the FLOP/s of matrix products of transformer-block shapes (N tokens × d → 4d and back, in
  the run's dtype) over the device's peak (on a CPU the peak is itself measured, on large square products);
- bandwidth efficiency: an elementwise add over 32M floats (read two, write one) over the device's bandwidth;
- seconds per op: a chain of small elementwise ops with autograd, forward and backward, per op: on a GPU the
  launch, on a CPU the dispatcher and Python around each op.
The cache is per device name and torch version, under kiln's cache directory (KILN_CACHE).
"""
from __future__ import annotations

import datetime
import json
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from kiln.data import DataConfig, cache_root
from kiln.precision import PRECISIONS

SHAPES = ((2048, 256, 1024), (2048, 1024, 256), (2048, 768, 3072), (2048, 3072, 768))  # (N, k, n)


def _best(fn, device: torch.device, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def measure(spec, device: torch.device, precision: str) -> dict:
    dtype = PRECISIONS[precision].matmul if precision in PRECISIONS else torch.float32
    rates = []
    for n_tok, k, n in SHAPES:
        a = torch.randn(n_tok, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        rates.append(2 * n_tok * k * n / _best(lambda: torch.mm(a, b), device))
    matmul = statistics.median(rates) / spec.flops(precision)
    x = torch.randn(32 * 2**20, device=device)
    y = torch.randn_like(x)
    bandwidth = 3 * x.numel() * 4 / _best(lambda: x.add_(y), device) / spec.bandwidth
    chain = 20
    w = torch.ones(8, device=device, requires_grad=True)

    def ops():
        h = w
        for _ in range(chain):
            h = h * 1.0001
        h.sum().backward()

    per_op = _best(ops, device, repeats=20) / (2 * chain)  # each op once forward and once backward
    return {"matmul_efficiency": min(matmul, 1.0), "bandwidth_efficiency": min(bandwidth, 1.0),
            "op_overhead_s": per_op, "precision": precision, "torch": torch.__version__,
            "measured": datetime.date.today().isoformat()}


def cache_path(spec) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.name)
    return cache_root(DataConfig()) / "calibration" / f"{name}-torch{torch.__version__}.json"


def save(spec, time_model: dict) -> Path:
    path = cache_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(time_model, indent=2) + "\n")
    tmp.replace(path)
    return path


def load(spec):
    """`spec` with the time model measured on it, when `kiln plan --calibrate` has run for it; else as it is."""
    path = cache_path(spec)
    if not path.is_file():
        return spec
    try:
        return replace(spec, time_model=json.loads(path.read_text()))
    except (json.JSONDecodeError, OSError):
        return spec  # a damaged cache file: the defaults, and the next --calibrate rewrites it
