"""Why a step is slow: its time broken into parts, the operations that took it, and one verdict with its numbers.

    verdict(Breakdown) -> Verdict     data-, host-overhead-, memory-bandwidth-, compute- or communication-bound

The rules, in order (the first that holds decides):
- data-bound: the step waits for batches ≥ DATA_SHARE of its time;
- communication-bound: collectives in flight ≥ COMM_SHARE of the step under data parallelism;
- host-overhead-bound: on a GPU, the device sits idle ≥ IDLE_SHARE of the step; on a CPU, the operations average
  under HOST_OP_US each while the step reaches < LOW_UTILISATION of the matmul peak (the framework's per-op cost,
  not arithmetic, sets the pace);
- compute-bound: matrix multiplications take ≥ MATMUL_SHARE of the operations' time;
- memory-bandwidth-bound: otherwise (elementwise, norms, softmax: bytes, not FLOPs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DATA_SHARE = 0.25
COMM_SHARE = 0.25
IDLE_SHARE = 0.30
HOST_OP_US = 40.0
LOW_UTILISATION = 0.10
MATMUL_SHARE = 0.5
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
              "aten::_scaled_mm", "mkldnn::_linear_pointwise")


def rate(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:,.4g} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:,.4g} GFLOP/s"


@dataclass
class Op:
    name: str
    calls: float  # per step
    self_s: float  # per step
    flops: float  # per step (torch.profiler's with_flops: matmuls and convolutions only)
    bytes: float  # per step, estimated from the input shapes at the run's element size

    @property
    def intensity(self) -> float | None:
        return self.flops / self.bytes if self.flops and self.bytes else None


@dataclass
class Breakdown:
    step_s: float  # measured wall time per step
    parts: dict[str, float]  # seconds per step: data, forward, backward, optimizer, logging (and their sum)
    ops: list[Op]  # by self time, per step
    device: str  # "cpu" | "cuda"
    peak_flops: float  # the device's matmul peak in the run's precision
    bandwidth: float  # the device's memory bandwidth, bytes/s
    model_flops_per_step: float
    device_idle_share: float | None = None  # CUDA: share of the step no kernel ran
    comm_s: float | None = None  # data parallelism: collectives in flight per step

    @property
    def unaccounted_s(self) -> float:
        return self.step_s - sum(self.parts.values())

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which an operation is compute-bound on this device (peak / bandwidth)."""
        return self.peak_flops / self.bandwidth


@dataclass
class Verdict:
    kind: str
    why: str  # the numbers that decided it
    advice: list[str] = field(default_factory=list)


def verdict(b: Breakdown) -> Verdict:
    share = {name: seconds / b.step_s for name, seconds in b.parts.items()}
    op_time = sum(op.self_s for op in b.ops) or 1e-12
    op_calls = sum(op.calls for op in b.ops)
    matmul_share = sum(op.self_s for op in b.ops if op.name in MATMUL_OPS) / op_time
    achieved = b.model_flops_per_step / b.step_s / b.peak_flops
    mean_op_us = 1e6 * op_time / op_calls if op_calls else 0.0
    if share.get("data", 0) >= DATA_SHARE:
        return Verdict("data-bound", f"waiting for batches {share['data']:.0%} of the step "
                                     f"({1000 * b.parts['data']:.1f} ms of {1000 * b.step_s:.1f} ms)")
    if b.comm_s is not None and b.comm_s / b.step_s >= COMM_SHARE:
        return Verdict("communication-bound", f"collectives in flight {b.comm_s / b.step_s:.0%} of the step")
    if b.device == "cuda" and b.device_idle_share is not None and b.device_idle_share >= IDLE_SHARE:
        return Verdict("host-overhead-bound", f"device idle {b.device_idle_share:.0%} of the step, waiting on the "
                                              f"host to launch kernels")
    if b.device != "cuda" and mean_op_us < HOST_OP_US and achieved < LOW_UTILISATION:
        return Verdict("host-overhead-bound", f"{op_calls:,.0f} operations per step averaging {mean_op_us:.1f} µs "
                                              f"each; the step reaches {achieved:.1%} of the matmul peak")
    if matmul_share >= MATMUL_SHARE:
        return Verdict("compute-bound", f"matrix multiplications take {matmul_share:.0%} of the operations' time; "
                                        f"the step reaches {achieved:.0%} of the {rate(b.peak_flops)} matmul peak")
    return Verdict("memory-bandwidth-bound", f"matrix multiplications take only {matmul_share:.0%} of the "
                                             f"operations' time; the rest moves bytes (ridge point "
                                             f"{b.ridge:.3g} FLOPs/byte)")
