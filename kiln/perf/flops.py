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
    """Parameters that take part in a matmul per token: every linear, plus the output head (tied or not)."""
    d, ff, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    attn = d * (cfg.n_head + 2 * cfg.n_kv_head) * hd + cfg.n_head * hd * d
    mlp = d * ff * (1 if cfg.arch == "gpt2" else 2) + ff * d
    return cfg.n_layer * (attn + mlp) + cfg.padded_vocab * d


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token (no recomputation)."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layer * seq_len * cfg.n_head * cfg.head_dim


_cpu_peak_cache: dict[torch.dtype, float] = {}


def measured_cpu_peak(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3) -> float:
    """Best matmul FLOP/s measured on this CPU (cached): the CPU's 'peak' for MFU."""
    if dtype not in _cpu_peak_cache:
        gen = torch.Generator().manual_seed(0)  # never the global stream: training RNG stays untouched
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        a @ b  # warm-up: first call allocates and selects the kernel
        best, start = 0.0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - t))
        _cpu_peak_cache[dtype] = best
    return _cpu_peak_cache[dtype]


def names_gpu(name: str, model: str) -> bool:
    """Whether the CUDA device name (e.g. "NVIDIA A100-SXM4-80GB") is of `model` ("A100"), as a whole word:
    "NVIDIA L40S" is not an L4, "NVIDIA H200" not an H100."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(model)}(?![A-Za-z0-9])", name, re.IGNORECASE) is not None


def peak_flops_for(name: str, precision: str) -> float | None:
    """Datasheet peak FLOP/s of the CUDA device called `name` for a precision mode; None when not in the table."""
    key = {"bf16-master": "bf16", "auto": "fp32"}.get(precision, precision)
    for model, peaks in DEVICE_PEAKS.items():
        if names_gpu(name, model):
            return peaks.get(key)
    return None


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s for the concrete precision mode, or None when the device is unknown."""
    if device.type == "cpu":
        key = {"bf16-master": "bf16"}.get(precision, precision)
        return measured_cpu_peak(torch.bfloat16 if key == "bf16" else torch.float32)
    if device.type == "cuda":
        return peak_flops_for(torch.cuda.get_device_name(device), precision)
    return None


def mfu(flops_per_tok: float, tokens_per_s: float, peak: float | None) -> float | None:
    return None if not peak else flops_per_tok * tokens_per_s / peak
