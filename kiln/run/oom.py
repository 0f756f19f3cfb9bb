"""Out of memory, told before and after.

Before: on a CPU, the estimator's peak for the configuration against the RAM the machine has free, checked before
any data is prepared (`kiln train --force` trains anyway). After: a step that runs out of memory ends the run with
a report (what the estimator predicted, what was measured, what the device holds, what `kiln plan` would change)
and, on CUDA, a memory snapshot for https://pytorch.org/memory_viz; the CLI exits with OOM_EXIT.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.memory.devices import available_memory, local_device
from kiln.memory.estimate import COMPONENTS, estimate, fmt_bytes
from kiln.memory.levers import JobSections, runtime_job
from kiln.memory.planner import search
from kiln.perf.hardware import resolve_mode
from kiln.train.metrics import peak_memory_bytes

OOM_EXIT = 3  # `kiln train`'s exit status when a step ran out of memory (2: bad input; 128+N: signal N)
SNAPSHOT = "oom-snapshot.pickle"


class OutOfMemory(RuntimeError):
    """A step ran out of memory; `report` holds the lines printed for it."""

    def __init__(self, report: list[str]):
        super().__init__("\n".join(report))
        self.report = report


def predicted_peak(cfg, device: torch.device) -> int:
    """The estimator's peak bytes for cfg trained on `device` (nothing built, nothing measured)."""
    sections = JobSections.of(cfg)
    return estimate(runtime_job(sections, sections.resolved_model(), resolve_mode(cfg.precision.mode, device),
                                device)).total_bytes


def ram_check(cfg, device: torch.device, force: bool, log) -> None:
    """On a CPU: refuse a configuration whose predicted peak exceeds the free RAM (warn only with force)."""
    if device.type != "cpu":
        return
    need, free = predicted_peak(cfg, device), available_memory()
    if need <= free:
        return
    message = (f"the estimator predicts a peak of {fmt_bytes(need)} for this configuration, and this machine has "
               f"{fmt_bytes(free)} of RAM free")
    if not force:
        raise KilnError(f"{message}; `kiln plan --memory={fmt_bytes(free).replace(' ', '')}` finds a configuration "
                        f"that fits, or pass --force to train anyway",
                        key="--force", value=fmt_bytes(need), fix="or pass --force to train anyway")
    log(f"warning: {message}; training anyway (--force): expect swapping or the kernel's OOM killer")


@dataclass
class OomContext:
    cfg: object  # the resolved Config
    device: torch.device
    step: int  # the step that ran out
    checkpoint: Path | None  # the newest checkpoint, which the run resumes from


def oom_report(ctx: OomContext, error: BaseException, run_dir: Path) -> list[str]:
    """The lines that explain an out-of-memory step; writes the CUDA memory snapshot into run_dir."""
    cfg, device = ctx.cfg, ctx.device
    target = local_device(device)
    sections = JobSections.of(cfg)
    b = estimate(runtime_job(sections, cfg.model, resolve_mode(cfg.precision.mode, device), device))
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    lines = [f"out of memory in step {ctx.step} on {target.name}: {first}",
             f"  predicted peak {fmt_bytes(b.total_bytes)} ("
             + ", ".join(f"{name} {fmt_bytes(b.components[name])}" for name in COMPONENTS if b.components[name])
             + ")",
             f"  measured peak so far {fmt_bytes(peak_memory_bytes(device))}"
             + (" (max_memory_allocated)" if device.type == "cuda" else " (process RSS)")
             + f"; the device holds {fmt_bytes(target.memory)}"]
    plan = search(sections, target, target.memory)
    if plan.best is not None:
        changed = {k: v for k, v in plan.best.overrides.items() if _current(cfg, k) != v}
        flags = " ".join(f"--{k}={v}" for k, v in changed.items()) or "(the configuration as it is)"
        lines.append(f"  kiln plan: {plan.best.choice.describe()} is predicted to fit "
                     f"({fmt_bytes(plan.best.total_bytes)}): {flags}")
    else:
        lines.append(f"  kiln plan: {plan.shortfall()}")
    if device.type == "cuda":
        path = run_dir / SNAPSHOT
        torch.cuda.memory._dump_snapshot(str(path))
        lines.append(f"  memory snapshot: {path} (drag into https://pytorch.org/memory_viz)")
    else:
        lines.append("  no memory snapshot: PyTorch records one for CUDA memory only")
    resume = f"resume from {ctx.checkpoint}: `kiln train --resume {run_dir}` with the flags above" \
        if ctx.checkpoint else "no checkpoint was written before it"
    lines.append(f"  {resume} (exit status {OOM_EXIT})")
    return lines


def _current(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)
