"""`kiln memory --measure` and `kiln plan --verify`: a few real train steps of a configuration, measured.

    measure_step(cfg, device, steps)   model state, saved bytes, peak and a timeline (kiln.memory.measure's
                                       instruments) over steps on random tokens, built by kiln.run.lm.build_lm
    measure_rank_peaks(cfg, device, steps)   each step's peak of everything this rank's allocator holds, from
                                       before the model is built (the CPU allocator through the profiler: FSDP2's
                                       gathered parameters and DDP's buckets included); runs under torchrun too
"""
from __future__ import annotations

import gc
import resource
import time
from dataclasses import dataclass

import torch

from kiln.memory.measure import AllocatedBytes, LiveBytes, SavedBytes, measure_saved, optimizer_state_tensors, tensor_bytes
from kiln.run.lm import build_lm
from kiln.train.step import train_step


@dataclass
class StepMeasure:
    components: dict[str, int]  # measured with the estimate's names where measurable
    peak_bytes: int  # allocator peak (CUDA) or live tensor bytes peak (CPU) over the measured steps
    reserved_bytes: int | None  # CUDA max_memory_reserved
    rss_peak_bytes: int | None  # CPU: process peak RSS (includes Python, libraries, data)
    saved: SavedBytes
    timeline: list[tuple[float, int, str]]  # (seconds, bytes, label) across the steps
    step_peaks: list[int]  # peak bytes of each step
    step_seconds: list[float]
    snapshot: str | None = None  # CUDA memory snapshot (pytorch.org/memory_viz)


def measure_step(cfg, device: torch.device, steps: int = 3, snapshot_path: str | None = None) -> StepMeasure:
    """Build the run as `kiln train` does (build_lm: levers, precision, optimizer), train `steps` steps on random
    tokens and measure. The batch shape, precision and levers come from cfg."""
    lm = build_lm(cfg, device=device, with_data=False)
    rig = lm.state
    model, precision = rig.model, rig.precision
    B, T, V = cfg.train.micro_batch_size, cfg.data.seq_len, lm.cfg.model.vocab_size
    gen = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, V, (B, T + 1), generator=gen)
        return x[:, :-1].to(device), x[:, 1:].to(device)

    # Saved tensors of one micro-batch (forward + backward, nothing else kept).
    x, y = batch()
    saved = measure_saved(rig.step_model, x, y, precision)
    # Model state: a forward/backward to materialize gradients, counted before any step.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        if snapshot_path:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
    params = tensor_bytes(list(model.parameters()))
    buffers = tensor_bytes(list(model.buffers()))
    masters = tensor_bytes(rig.masters.masters) if rig.masters is not None else 0

    tracker = LiveBytes(device, baseline=params + buffers + masters)
    step_peaks, step_seconds = [], []
    handles = [model.register_forward_pre_hook(lambda *a: tracker.mark("forward")),
               model.register_forward_hook(lambda *a: tracker.mark("backward"))]
    if hasattr(rig.optimizer, "register_step_pre_hook"):
        handles.append(rig.optimizer.register_step_pre_hook(lambda *a: tracker.mark("optimizer")))
    store = {"grads": 0}
    if hasattr(rig.optimizer, "register_step_pre_hook"):
        handles.append(rig.optimizer.register_step_pre_hook(lambda *a: _note_grads(model, rig, store)))
    state_bytes = 0
    try:
        for _ in range(steps):
            batches = [batch() for _ in range(cfg.train.grad_accum_steps)]
            tracker.peak = tracker.current()  # optimizer state made in step 1 is live in the tracker's count
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            with tracker:
                train_step(rig.step_model, batches, rig.objective, rig.optimizer, precision, rig.scaler, cfg.optim,
                           rig.masters)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                step_peaks.append(torch.cuda.max_memory_allocated(device))
            else:
                step_peaks.append(tracker.peak)
            step_seconds.append(time.perf_counter() - t0)
            state_bytes = tensor_bytes(optimizer_state_tensors(rig.optimizer))
    finally:
        for h in handles:
            h.remove()
        if hasattr(rig.optimizer, "close"):
            rig.optimizer.close()
    grads = store["grads"]
    snap = None
    if device.type == "cuda" and snapshot_path:
        torch.cuda.memory._dump_snapshot(snapshot_path)
        torch.cuda.memory._record_memory_history(enabled=None)
        snap = snapshot_path
    components = {"parameters": params, "gradients": grads, "master_weights": masters,
                  "optimizer_states": state_bytes, "buffers": buffers, **saved.components}
    return StepMeasure(
        components=components, peak_bytes=max(step_peaks),
        reserved_bytes=torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        rss_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if device.type == "cpu" else None,
        saved=saved, timeline=tracker.samples, step_peaks=step_peaks, step_seconds=step_seconds, snapshot=snap)


def _note_grads(model, rig, store):
    """Gradient bytes as the optimizer step starts (bf16-master: on the masters by then)."""
    params = rig.masters.masters if rig.masters is not None else list(model.parameters())
    store["grads"] = tensor_bytes([p.grad for p in params if p.grad is not None])


def measure_rank_peaks(cfg, device: torch.device, steps: int = 2) -> list[int]:
    """Each step's peak bytes on this rank (CPU): the model, its state and everything a step allocates, counted by
    the allocator from before build_lm (kiln.memory.measure.AllocatedBytes), so what no Python hook sees is in it.
    Step 1 makes the optimizer state; later steps are the steady state."""
    if device.type != "cpu":
        raise ValueError("measure_rank_peaks counts the CPU allocator; on CUDA use torch.cuda.max_memory_allocated")
    V, B, T = None, cfg.train.micro_batch_size, cfg.data.seq_len
    gen = torch.Generator().manual_seed(0)
    # an earlier model in this process (cycles keep them alive) must not be collected inside the region: its frees
    # would count against this one
    gc.collect()
    with AllocatedBytes() as live:
        lm = build_lm(cfg, device=device, with_data=False)
        rig, V = lm.state, lm.cfg.model.vocab_size
        for step in range(steps):
            batches = []
            for _ in range(lm.cfg.train.grad_accum_steps):
                x = torch.randint(0, V, (B, T + 1), generator=gen)
                batches.append((x[:, :-1], x[:, 1:]))
            with live.window(f"step {step}"):
                train_step(rig.step_model, batches, rig.objective, rig.optimizer, rig.precision, rig.scaler,
                           lm.cfg.optim, rig.masters)
    return [live.peak(f"step {s}") for s in range(steps)]
