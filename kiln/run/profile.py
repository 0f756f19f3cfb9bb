"""`kiln profile`: a configuration's steps timed part by part, then traced by torch.profiler, then judged.

    result = profile_run(cfg, run_dir, steps=10)

Three passes over one built run (build_lm, the Trainer: the steps `kiln train` would run):
1. warm-up steps (allocator, caches, compile), untimed;
2. `steps` steps timed by a clock that hooks the loader, the model's forward, the optimizer and the logging, and
   synchronises the device at each mark (CUDA), so each part is that part's time; the step's wall time is timed
   around the whole, and what no part claims is reported, not hidden;
3. a few steps under torch.profiler (CPU and CUDA activities, shapes, memory, FLOPs): the Chrome trace, the top
   operations and, on CUDA, the memory timeline (a snapshot for https://pytorch.org/memory_viz).
Nothing of this is installed in a plain `kiln train`: the hooks exist only inside profile_run.
"""
from __future__ import annotations

import io
import json
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console

from kiln.config import apply_overrides
from kiln.errors import KilnError
from kiln.memory.devices import local_device
from kiln.memory.estimate import estimate, fmt_bytes
from kiln.memory.levers import JobSections, job_for
from kiln.parallel.expert import all_to_all_seconds
from kiln.perf.bottleneck import MATMUL_OPS, Breakdown, Op, Verdict, verdict
from kiln.perf.flops import flops_per_token
from kiln.perf.peak import model_peak_flops
from kiln.precision import mode
from kiln.run.lm import build_lm

TRACE_STEPS = 3
PARTS = ("data", "forward", "backward", "optimizer", "logging")


@dataclass
class ProfileResult:
    breakdown: Breakdown
    verdict: Verdict
    files: dict[str, str]
    steps: int
    matmul_rates: dict[str, float] | None = None  # CPU: measured FLOP/s at the model's linear shapes, per precision
    all_to_all_s: float | None = None  # expert parallelism: seconds per step in the experts' all-to-alls

    def summary(self) -> dict:
        """RUN_DIR/profile/summary.json (read by `kiln report`)."""
        b = self.breakdown
        return {"step_s": b.step_s, "breakdown": dict(b.parts) | {"unaccounted": b.unaccounted_s},
                "verdict": self.verdict.kind, "why": self.verdict.why, "advice": self.verdict.advice,
                "device": b.device, "steps": self.steps, "device_idle_share": b.device_idle_share,
                "comm_s": b.comm_s, "all_to_all_s": self.all_to_all_s,
                "peak_flops": b.peak_flops, "bandwidth": b.bandwidth, "ridge": b.ridge,
                "model_flops_per_step": b.model_flops_per_step,
                "matmul_rates": self.matmul_rates, "mfu": b.model_flops_per_step / b.step_s / b.peak_flops,
                "top_ops": [{"name": o.name, "calls": o.calls, "self_s": o.self_s, "flops": o.flops, "bytes": o.bytes,
                             "intensity": o.intensity} for o in b.ops[:15]], "files": self.files}


class _Clock:
    """Seconds per part, from marks: a part runs from its mark to the next one (or to `idle`)."""

    def __init__(self, device: torch.device):
        self.totals: dict[str, float] = defaultdict(float)
        self.part, self.since = None, 0.0
        self.cuda = device.type == "cuda"

    def mark(self, part: str | None) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.part is not None:
            self.totals[self.part] += now - self.since
        self.part, self.since = part, now

    def timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            self.mark(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(None)
        return wrapper


def _install(clock: _Clock, trainer) -> list:
    """Hooks and wrappers on this trainer's objects only; returns how to undo them."""
    state = trainer.state
    undo = []
    for obj, name, part in ((state.loader, "next", "data"), (state.optimizer, "step", "optimizer"),
                            (trainer, "_log", "logging"), (trainer.numerics, "review", "logging")):
        setattr(obj, name, clock.timed(part, getattr(obj, name)))
        undo.append(lambda obj=obj, name=name: delattr(obj, name))
    undo.append(state.step_model.register_forward_pre_hook(lambda *a: clock.mark("forward")).remove)
    undo.append(state.step_model.register_forward_hook(lambda *a: clock.mark("backward")).remove)
    return undo


def _linear_flops(name: str, shapes) -> float:
    """2·M·N·K of a oneDNN linear (train.cpu_linear=onednn), input (M, K) and weight (N, K): the profiler counts
    FLOPs of aten's matmuls only."""
    if name != "mkldnn::_linear_pointwise" or not shapes or len(shapes) < 2 or len(shapes[1]) != 2:
        return 0.0
    (n, k), rows = shapes[1], 1
    for d in shapes[0][:-1]:
        rows *= d
    return 2.0 * rows * n * k


def _ops(prof, steps: int, element_bytes: int) -> list[Op]:
    """Operations by self time per step (device time on CUDA), with FLOPs and an estimate of the bytes read."""
    by_name: dict[str, dict] = defaultdict(lambda: {"calls": 0, "self": 0.0, "flops": 0.0, "bytes": 0.0})
    for e in prof.key_averages(group_by_input_shape=True):
        if not e.key.startswith("aten::") and e.key not in MATMUL_OPS:
            continue
        row = by_name[e.key]
        row["calls"] += e.count
        row["self"] += (e.self_device_time_total if e.self_device_time_total else e.self_cpu_time_total) / 1e6
        row["flops"] += e.flops or _linear_flops(e.key, e.input_shapes) * e.count
        numel = 0
        for shape in e.input_shapes or []:
            if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape) and shape:
                n = 1
                for d in shape:
                    n *= d
                numel += n
        row["bytes"] += numel * element_bytes * e.count
    ops = [Op(name, r["calls"] / steps, r["self"] / steps, r["flops"] / steps, r["bytes"] / steps)
           for name, r in by_name.items()]
    return sorted(ops, key=lambda o: -o.self_s)


def _advice(v: Verdict, b: Breakdown, cfg, target) -> list[str]:
    t, mem = cfg.train, cfg.memory
    if v.kind == "data-bound":
        return [f"batches take {1000 * b.parts['data']:.1f} ms per step to arrive: raise data.prefetch (now "
                f"{cfg.data.prefetch}) so the loader works ahead of the step, move the data to a faster disk, or "
                f"pre-tokenize it (kiln caches shards: a first run builds them once)"]
    if v.kind == "communication-bound":
        return ["raise train.micro_batch_size or train.grad_accum_steps: more compute per all-reduce",
                "parallel.strategy=fsdp with parallel.reshard_after_forward=false trades memory for fewer gathers"]
    if v.kind == "host-overhead-bound":
        bigger = apply_overrides(cfg, {"train.micro_batch_size": 2 * t.micro_batch_size})
        peak = estimate(job_for(JobSections.of(bigger), target)).total_bytes
        fits = "fits" if peak <= target.memory else "does NOT fit"
        out = [f"raise train.micro_batch_size to {2 * t.micro_batch_size}: the same operations do twice the work "
               f"({fits}: {fmt_bytes(peak)} predicted of {fmt_bytes(target.memory)})"]
        if not t.compile:
            out.append("train.compile=true: torch.compile fuses the small operations and cuts their launches")
        return out
    if v.kind == "compute-bound":
        out = [f"the matmuls already set the pace ({b.model_flops_per_step / b.step_s / 1e9:,.1f} GFLOP/s of "
               f"{b.peak_flops / 1e9:,.0f}): a faster precision where the device has one (kiln plan ranks them)"]
        if mem.recompute != "none":
            out.append(f"memory.recompute={mem.recompute} adds FLOPs (HFU > MFU): turn it off if memory allows")
        return out
    return ["train.kernels=triton fuses norms, activations and the loss (CUDA)",
            "train.compile=true fuses elementwise chains into fewer passes over memory"]


def profile_run(cfg, run_dir: Path, steps: int = 10, warmup: int = 3, log=print) -> ProfileResult:
    if steps < 1 or warmup < 0:
        raise KilnError(f"--steps must be ≥ 1 and --warmup ≥ 0, got steps={steps}, warmup={warmup}",
                        key="--steps", value=steps, fix="--steps must be ≥ 1 and --warmup ≥ 0")
    run_dir = Path(run_dir)
    total = warmup + steps + TRACE_STEPS
    # One step more than is run, so no final evaluation or save falls inside the measured steps.
    cfg = replace(cfg, train=replace(cfg.train, max_steps=total + 1, eval_interval=0, sample_tokens=0),
                  checkpoint=replace(cfg.checkpoint, interval=0, every_minutes=0))
    lm = build_lm(cfg, run_dir, log=log)
    state = lm.state
    trainer = lm.trainer(run_dir, Console(file=io.StringIO()))
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    try:
        trainer.advance(warmup)
        clock = _Clock(state.device)
        undo = _install(clock, trainer)
        comm_before = state.world.comm.take() if state.world.comm is not None else None
        expert_parallel = state.world.plan is not None and state.world.plan.ep > 1
        all_to_all_seconds(state.model)  # the warm-up's, dropped
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.advance(warmup + steps)
        clock.mark(None)
        step_s = (time.perf_counter() - start) / steps
        comm = state.world.comm.take() / steps if comm_before is not None else None
        all_to_all = all_to_all_seconds(state.model) / steps if expert_parallel else None
        for u in undo:
            u()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if state.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        cuda = state.device.type == "cuda"
        if cuda:  # the memory timeline: every allocation of the traced steps, for https://pytorch.org/memory_viz
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                    with_flops=True) as prof:
            t0 = time.perf_counter()
            trainer.advance(total)
            if cuda:
                torch.cuda.synchronize()
            traced_s = time.perf_counter() - t0
        files = {"trace": str(out / "trace.json")}
        prof.export_chrome_trace(files["trace"])
        if cuda:
            files["memory_timeline"] = str(out / "memory-snapshot.pickle")
            torch.cuda.memory._dump_snapshot(files["memory_timeline"])
            torch.cuda.memory._record_memory_history(enabled=None)
        element = 2 if state.precision.row.half else 4  # bytes of a matmul's elements (fp64 timed as fp32's)
        ops = _ops(prof, TRACE_STEPS, element)
        idle = None
        if state.device.type == "cuda":
            busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
            idle = max(0.0, 1 - busy / traced_s)
    finally:
        trainer.close()
    target = local_device(state.device)
    c = lm.cfg
    tokens = c.train.micro_batch_size * c.train.grad_accum_steps * c.data.seq_len
    peak, rates = target.flops(state.precision.mode), None
    if state.device.type == "cpu":  # the rate torch reaches on the model's own linears (measured once, cached)
        rows = c.train.micro_batch_size * c.data.seq_len
        onednn = c.train.cpu_linear == "onednn"  # the fp32 rate of the products the run makes
        rates = {p: model_peak_flops(state.device, p, c.model, rows, onednn=onednn and mode(p).plain_fp32)
                 for p in dict.fromkeys((state.precision.mode, "fp32", "bf16"))}
        # a peak the model beat was measured while the machine was busier: MFU ≤ 100%, as in the train records
        peak = max(rates[state.precision.mode], flops_per_token(c.model, c.data.seq_len) * tokens / step_s)
    b = Breakdown(step_s=step_s, parts={p: clock.totals.get(p, 0.0) / steps for p in PARTS}, ops=ops,
                  device=state.device.type, peak_flops=peak,
                  bandwidth=target.bandwidth, model_flops_per_step=flops_per_token(c.model, c.data.seq_len) * tokens,
                  device_idle_share=idle, comm_s=comm)
    v = verdict(b)
    v.advice = _advice(v, b, c, target)
    result = ProfileResult(b, v, files, steps, rates, all_to_all)
    (out / "summary.json").write_text(json.dumps(result.summary(), indent=2) + "\n")
    return result


def report_lines(r: ProfileResult, top: int = 8) -> list[str]:
    b, v = r.breakdown, r.verdict
    lines = [f"step {1000 * b.step_s:.2f} ms on {b.device} ({r.steps} steps timed, the device synchronised at every "
             f"part's boundary):"]
    for name, seconds in [*b.parts.items(), ("unaccounted", b.unaccounted_s)]:
        lines.append(f"  {name:<12}{1000 * seconds:>9.2f} ms {100 * seconds / b.step_s:>6.1f}%")
    if b.device_idle_share is not None:
        lines.append(f"  device idle {100 * b.device_idle_share:.1f}% of the traced steps")
    if b.comm_s is not None:
        lines.append(f"  all-reduce in flight {1000 * b.comm_s:.2f} ms per step (overlaps the backward)")
    if r.all_to_all_s is not None:  # inside the forward and backward parts above, not beside them
        lines.append(f"  experts' all-to-all {1000 * r.all_to_all_s:.2f} ms per step, "
                     f"{100 * r.all_to_all_s / b.step_s:.1f}% of the step (split sizes and tokens, both ways; "
                     f"within forward and backward)")
    mfu = b.model_flops_per_step / b.step_s / b.peak_flops
    lines.append(f"MFU {100 * mfu:.1f}%: {b.model_flops_per_step / b.step_s / 1e9:,.1f} GFLOP/s of model FLOPs against "
                 f"{b.peak_flops / 1e9:,.1f} GFLOP/s" + (" (the rate torch reaches on the model's own linears in this "
                                                         "precision)" if r.matmul_rates else ""))
    if r.matmul_rates:
        lines.append("matmul rate at the model's shapes (measured once on this machine, cached): " + ", ".join(
            f"{p} {rate / 1e9:,.1f} GFLOP/s" for p, rate in r.matmul_rates.items()))
    lines.append(f"top operations per step (* matmuls; self time; ridge point {b.ridge:.3g} FLOPs/byte = "
                 f"{b.peak_flops / 1e9:,.0f} GFLOP/s ÷ {b.bandwidth / 1e9:,.1f} GB/s):")
    lines.append(f"  {'operation':<36}{'calls':>6}{'ms':>9}{'GFLOP':>8}{'GFLOP/s':>9}{'MB':>8}{'GB/s':>7}{'FLOP/B':>7}")
    for o in b.ops[:top]:
        rate = o.flops / o.self_s / 1e9 if o.self_s and o.flops else 0.0
        bw = o.bytes / o.self_s / 1e9 if o.self_s else 0.0
        ai = f"{o.intensity:.3g}" if o.intensity else "-"
        mark = "*" if o.name in MATMUL_OPS else " "
        name = o.name.removeprefix("aten::")[:36]
        lines.append(f" {mark}{name:<36}{o.calls:>6.0f}{1000 * o.self_s:>9.3f}{o.flops / 1e9:>8.3f}{rate:>9.1f}"
                     f"{o.bytes / 1e6:>8.2f}{bw:>7.2f}{ai:>7}")
    lines.append(f"verdict: {v.kind}: {v.why}")
    lines += [f"  advice: {a}" for a in v.advice]
    lines += [f"wrote {path}" for path in r.files.values()]
    if "memory_timeline" not in r.files:
        lines.append("no memory timeline: PyTorch records one for CUDA memory only (the trace holds CPU allocations)")
    return lines
