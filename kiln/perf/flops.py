"""FLOPs per token and model FLOPs utilization (MFU).

Training FLOPs per token = 6·N_matmul + 12·L·T·d_attn (PaLM appendix B convention): 2 FLOPs per
multiply-add, ×3 for forward + two backward matmuls; the attention term counts QKᵀ and AV over the full T×T
square, so MFU is comparable with published numbers even though causal kernels skip half of it.
"""
from __future__ import annotations

import re
import time

import torch

from kiln.models.config import ModelConfig
from kiln.models.registry import family
from kiln.perf.cpu_linear import linear, onednn_available
from kiln.perf.measured import remembered
from kiln.precision import PRECISIONS, is_auto, mode

# Dense (no sparsity) peak FLOP/s from vendor datasheets: {name: {dtype: flops}}.
DEVICE_PEAKS = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12},
}


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every linear (an MoE's router and its top-k experts, not
    all experts: 6·N_active), plus the output head (tied or not)."""
    return cfg.n_layer * family(cfg.arch).active_matmul_numel(cfg) + cfg.padded_vocab * cfg.d_model


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token (no recomputation)."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layer * seq_len * cfg.n_head * cfg.head_dim


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, plan: tuple[str, ...]) -> float:
    """Forward FLOPs per token that recomputation runs a second time in the backward: HFU counts them, MFU does
    not. Per block of the plan (kiln.memory.recompute): "selective" the attention core (QKᵀ and PV; the matmuls'
    outputs are kept); "full" and "seg" the whole forward, except that a "full" segment's last block never runs
    its MLP output projection again: nothing in the segment saves that output, and torch's checkpoint stops
    recomputing once it has every saved tensor back (checked against torch's FLOP counter)."""
    attention = 4 * seq_len * cfg.n_head * cfg.head_dim
    block = 2 * (matmul_params(cfg) - cfg.padded_vocab * cfg.d_model) / cfg.n_layer + attention
    fam = family(cfg.arch)
    last = fam.linears(cfg)[-1]  # the MLP's output projection
    # (an MoE weights and scatters its experts' outputs after the projection, saving tensors there: checkpoint
    # recomputes through every expert's projection; the MLP part says which)
    skipped = 2 * last.n_in * last.n_out * last.active if fam.mlp_of(cfg).recompute_skips_projection() else 0
    total = 0.0
    for i, policy in enumerate(plan):
        if policy == "selective":
            total += attention
        elif policy in ("full", "seg"):
            total += block
            if i + 1 == len(plan) or plan[i + 1] != "seg":  # the segment's last block
                total -= skipped
    return total


_cpu_peak_cache: dict[torch.dtype, float] = {}

def _matmul_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of a·b; in fp32 the faster of torch's product and oneDNN's (a·bᵀ, the same FLOPs), which
    train.cpu_linear=onednn runs: the rate this CPU reaches in fp32 through either library."""
    products = [lambda: a @ b]
    if a.dtype == torch.float32 and a.device.type == "cpu" and onednn_available():
        products.append(lambda: linear(a, b))
    times = []
    for product in products:
        start = time.perf_counter()
        product()
        times.append(time.perf_counter() - start)
    return min(times)


def measured_cpu_peak(dtype: torch.dtype = torch.float32, seconds: float = 0.15, max_n: int = 1024,
                      call_s: float = 0.1) -> float:
    """Best square-matmul FLOP/s measured on this CPU (cached per dtype): the CPU's 'peak' for MFU and planning.

    The size doubles from 256 up to max_n while the next size's product would take under call_s (8x the
    time): n=1024 for fp32 and native bf16, while an emulated bf16 product (~1 GFLOP/s: 2 s at 1024³) stays at
    256 (~20-30 ms), so one dtype costs about `seconds` + 0.1 s on any CPU.
    """
    if dtype not in _cpu_peak_cache:
        gen = torch.Generator().manual_seed(0)  # never the global stream: training RNG stays untouched
        n = 256
        while True:
            a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
            t = min(_matmul_seconds(a, b) for _ in range(2))  # the first call at a size also picks the kernel
            if n >= max_n or 8 * t > call_s:
                break
            n *= 2
        best, start = 2 * n**3 / t, time.perf_counter()
        while time.perf_counter() - start < seconds:
            best = max(best, 2 * n**3 / _matmul_seconds(a, b))
        _cpu_peak_cache[dtype] = best
    return _cpu_peak_cache[dtype]


def cpu_peak(precision: str) -> float:
    """Measured matmul FLOP/s of this CPU in a precision mode's matmul dtype (fp32 for fp32, tf32 and auto)."""
    row = PRECISIONS.get(precision)
    return measured_cpu_peak(row.cpu_matmul if row and row.cpu_matmul else torch.float32)


def stored_cpu_peak(precision: str) -> float:
    """cpu_peak, measured once per machine: what this process measured, else what kiln's cache of this machine's
    measurements holds (kiln.perf.measured; the entry kiln.perf.peak's square_rate keeps for the MFU peak), else
    measured now and stored. precision.mode=auto and the precision notice read it at every start: timing the fp32
    and bf16 products again took 0.2-0.3 s of CPU per `kiln train` on a 2-core Xeon (AMX, one thread)."""
    row = PRECISIONS.get(precision)
    dtype = row.cpu_matmul if row and row.cpu_matmul else torch.float32
    if dtype not in _cpu_peak_cache:
        _cpu_peak_cache[dtype] = remembered("matmul_flops", f"{precision} square", lambda: cpu_peak(precision))
    return _cpu_peak_cache[dtype]


def names_gpu(name: str, model: str) -> bool:
    """Whether the CUDA device name (e.g. "NVIDIA A100-SXM4-80GB") is of `model` ("A100"), as a whole word:
    "NVIDIA L40S" is not an L4, "NVIDIA H200" not an H100."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(model)}(?![A-Za-z0-9])", name, re.IGNORECASE) is not None


def peak_flops_for(name: str, precision: str) -> float | None:
    """Datasheet peak FLOP/s of the CUDA device called `name` for a precision mode; None when not in the table."""
    # fp8: MFU against bf16's peak (kiln.precision); auto before it is resolved: fp32's
    key = PRECISIONS[precision].peak if precision in PRECISIONS else mode("fp32").peak if is_auto(precision) \
        else precision
    for model, peaks in DEVICE_PEAKS.items():
        if names_gpu(name, model):
            return peaks.get(key)
    return None


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s for the concrete precision mode, or None when the device is unknown."""
    if device.type == "cpu":  # the measured rate of the dtype the matmuls run in, emulated or not
        return cpu_peak(precision)
    if device.type == "cuda":
        return peak_flops_for(torch.cuda.get_device_name(device), precision)
    return None


def mfu(flops_per_tok: float, tokens_per_s: float, peak: float | None) -> float | None:
    return None if not peak else flops_per_tok * tokens_per_s / peak
