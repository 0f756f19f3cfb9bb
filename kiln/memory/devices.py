"""The devices the planner knows: memory, peak FLOP/s, memory and host-link bandwidth; `cpu` measured here.

Memory is what torch reports as total_memory (a little under the marketing number: "80GB" is 79.2 GiB).
Bandwidths are datasheet peaks; the step-time model applies its own efficiency factors. Context bytes are the
CUDA context and kernel images, which live outside the caching allocator (so outside max_memory_allocated).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch

from kiln.memory import calibrate as calibration
from kiln.memory.estimate import GiB, Target
from kiln.memory.measure import rss_bytes
from kiln.perf.flops import DEVICE_PEAKS, cpu_peak, names_gpu
from kiln.perf.hardware import FP8_MIN_CAPABILITY
from kiln.precision import PRECISIONS
from kiln.util import closest
from kiln.errors import KilnError


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes the allocator can hand out at most
    peak_flops: dict  # {precision: FLOP/s}, dense
    bandwidth: float  # device memory, bytes/s
    host_link: float  # device<->host copies, bytes/s (pinned memory)
    host_bandwidth: float  # host DRAM, bytes/s (host optimizer, offload staging)
    capability: float = 0.0  # CUDA compute capability; 0 for CPU
    context_bytes: int = 0  # outside the allocator
    fragmentation: float = 0.05  # allocated-to-reserved allowance, as a share of the peak
    kind: str = "cuda"
    power_w: float | None = None  # board power (TDP) from the datasheet, for energy estimates; None: unknown
    time_model: dict | None = None  # the planner's constants measured on this device (kiln plan --calibrate)

    def flops(self, precision: str) -> float:
        # fp8 counts against bf16's peak, as torchtitan and torchao report it: its speed-up is measured, not assumed
        key = PRECISIONS[precision].peak if precision in PRECISIONS else precision
        if key not in self.peak_flops:
            key = "fp32"
        return self.peak_flops[key]

    def supports(self, precision: str) -> bool:
        row = PRECISIONS.get(precision)
        if row is None:
            return True
        if row.fp8:
            return self.kind == "cuda" and self.capability >= FP8_MIN_CAPABILITY
        if row.half or row.tf32:  # tensor-core dtypes: the device's table has their peak
            return row.peak in self.peak_flops
        return True

    @property
    def target(self) -> Target:
        return Target(self.kind, self.capability, self.context_bytes, self.fragmentation)


def _gpu(name, mem_gib, bw_tbs, link_gbs, capability, power_w, peaks_key=None):
    return Device(name=name, memory=int(mem_gib * GiB), peak_flops=DEVICE_PEAKS[peaks_key or name],
                  bandwidth=bw_tbs * 1e12, host_link=link_gbs * 1e9, host_bandwidth=50e9, capability=capability,
                  context_bytes=int(0.5 * GiB), power_w=power_w)


DEVICES = {  # memory as torch reports it; bandwidth, host link and board power (W) from the datasheets
    "H100": _gpu("H100", 79.2, 3.35, 50, 9.0, 700),  # SXM, HBM3, PCIe Gen5 x16
    "H200": _gpu("H200", 139.8, 4.8, 50, 9.0, 700),
    "A100-80GB": _gpu("A100-80GB", 79.2, 2.04, 25, 8.0, 400, "A100"),  # SXM
    "A100-40GB": _gpu("A100-40GB", 39.4, 1.555, 25, 8.0, 400, "A100"),
    "V100-32GB": _gpu("V100-32GB", 31.7, 0.9, 12, 7.0, 300, "V100"),
    "L4": _gpu("L4", 22.5, 0.3, 25, 8.9, 72),
    "RTX 4090": _gpu("RTX 4090", 23.6, 1.008, 25, 8.9, 450),
}
ALIASES = {"h100": "H100", "h200": "H200", "a100": "A100-80GB", "a100-80gb": "A100-80GB", "a100-40gb": "A100-40GB",
           "v100": "V100-32GB", "v100-32gb": "V100-32GB", "l4": "L4", "rtx4090": "RTX 4090", "4090": "RTX 4090",
           "rtx 4090": "RTX 4090"}


def _meminfo_total() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """RAM a new allocation can have without swapping (Linux MemAvailable; elsewhere, all of it)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _meminfo_total()


_cpu_cache: dict = {}


def measured_bandwidth(n_bytes: int = 256 * 1024**2, seconds: float = 0.2) -> float:
    """Best copy bandwidth (read + write bytes per second) of this CPU's memory."""
    a = torch.empty(n_bytes // 4, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    b.copy_(a)
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * n_bytes / (time.perf_counter() - t))
    return best


def cpu_device() -> Device:
    """This machine's CPU, measured at run time (matmul FLOP/s per precision, copy bandwidth, RAM); cached per
    process. fp32, bf16 and fp16 are all measured, emulated or not: every CPU runs them (`kiln train`
    autocasts on CPU), and the planner ranks them by these rates (emulated bf16 ~1 GFLOP/s vs fp32 ~140)."""
    if "cpu" not in _cpu_cache:
        peaks = {p: cpu_peak(p) for p in ("fp32", "bf16", "fp16")}
        bw = measured_bandwidth()
        _cpu_cache["cpu"] = calibration.load(Device(
            name="cpu", memory=_meminfo_total(), peak_flops=peaks, bandwidth=bw, host_link=bw, host_bandwidth=bw,
            capability=0.0, context_bytes=rss_bytes(), fragmentation=0.0, kind="cpu"))
    return _cpu_cache["cpu"]


def get_device(name: str) -> Device:
    """A device by table name (case-insensitive, common aliases) or 'cpu'."""
    if name.lower() == "cpu":
        return cpu_device()
    key = ALIASES.get(name.lower(), name)
    if key not in DEVICES:
        hint = closest(name, list(DEVICES) + ["cpu"])
        raise KilnError(f"unknown device {name!r}" + (f"; did you mean {hint!r}?" if hint else "")
                        + f" Known: {', '.join(DEVICES)}, cpu",
                        key="device", value=name, fix=f"Known: {', '.join(DEVICES)}, cpu")
    return DEVICES[key]


def local_device(device: torch.device) -> Device:
    """The table entry for the device this process runs on (CUDA matched by name, memory as torch reports it)."""
    if device.type != "cuda":
        return cpu_device()
    props = torch.cuda.get_device_properties(device)
    return calibration.load(cuda_device(props.name, props.total_memory, float(f"{props.major}.{props.minor}")))


def cuda_device(name: str, total_memory: int, capability: float) -> Device:
    """A CUDA device as torch names it: the table entry of its model (of the closest memory size when the table
    has several), else generic numbers; memory and capability as reported."""
    matches = [dev for key, dev in DEVICES.items() if names_gpu(name, key.split("-")[0])]
    base = min(matches, key=lambda dev: abs(dev.memory - total_memory), default=None)
    if base is None:
        base = Device(name=name, memory=total_memory, peak_flops={"fp32": 20e12, "bf16": 100e12}, bandwidth=1e12,
                      host_link=12e9, host_bandwidth=50e9, context_bytes=int(0.5 * GiB))
    return replace(base, name=name, memory=total_memory, capability=capability)
