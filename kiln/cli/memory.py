"""`kiln memory [CONFIG.toml] [--section.key=value ...] [--device NAME] [--ranks N] [--measure] [--json] [--out PNG]`.

With --ranks N and parallel.tp / pp / cp: one rank's bytes under that layout (kiln.memory.levers.rank_jobs); with
pipeline stages, every stage is estimated and the worst one is shown in full."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kiln.cli.common import add_config_arguments, config_from
from kiln.config import ConfigError
from kiln.memory.devices import get_device, local_device
from kiln.memory.estimate import (COMPONENTS, estimate, fmt_bytes, local_parameter_shapes, peak_allocated,
                                  trainable)
from kiln.memory.experts import worst_case_note
from kiln.memory.levers import JobSections, rank_jobs
from kiln.memory.plots import breakdown_bar, timeline
from kiln.perf.hardware import precision_notice
from kiln.run.measure import measure_step


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="predict (and measure) the memory of one training step, by component",
                       description="Bytes of one training step of CONFIG: parameters, gradients, master weights, "
                                   "optimizer state, activations, logits, temporaries, device overhead.")
    add_config_arguments(p)
    p.add_argument("--device", default="", help="device to predict for: H100, H200, A100-80GB, A100-40GB, V100-32GB, "
                                                "L4, RTX 4090 or cpu (default: this machine's)")
    p.add_argument("--measure", action="store_true", help="also run a few steps here and measure (saved tensors, "
                                                          "peak, timeline; CUDA: allocator peaks and a snapshot)")
    p.add_argument("--steps", type=int, default=3, help="steps to measure with --measure")
    p.add_argument("--ranks", type=int, default=1, help="processes of the run (torchrun's world): split by "
                                                      "parallel.tp × parallel.pp × parallel.cp, the rest data "
                                                      "parallel under parallel.strategy; one rank's bytes")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", default="memory.png", help="stacked bar chart PNG ('' = no file: no chart, no "
                                                       "default timeline, no CUDA snapshot)")
    p.add_argument("--timeline", default=None, help="timeline PNG of one step (default with --measure: "
                                                    "memory-timeline.png, unless --out is '')")


def _device(name: str):
    if name:
        return get_device(name)
    return local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def run(args, overrides) -> int:
    cfg = config_from(args, overrides)
    device = _device(args.device)
    if args.ranks < 1:
        raise ConfigError(f"--ranks must be ≥ 1, got {args.ranks}")
    plan, jobs = rank_jobs(JobSections.of(cfg), device, args.ranks)
    stages = [estimate(j) for j in jobs]
    worst = max(range(len(stages)), key=lambda s: stages[s].total_bytes)
    job, b = jobs[worst], stages[worst]
    note = _precision_note(cfg.precision.mode, device)
    measured = _measure(cfg, args, device) if args.measure else None
    title = (f"{cfg.model.preset} ({job.model.arch}), {job.precision}, micro-batch {job.micro_batch}×{job.seq_len}"
             f", recompute {cfg.memory.recompute}, {device.name}"
             + (f", {job.parallel} × {job.world} (per rank)" if job.parallel != "none" and job.world > 1 else "")
             + (f", {_layout(plan)}" if plan.model_parallel or plan.cp > 1 or getattr(plan, "ep", 1) > 1 else "")
             + (f", stage {worst} of {plan.pp}" if plan.pp > 1 else ""))
    files = _charts(args, b, measured, title, device)
    if args.json:
        print(json.dumps(_as_json(plan, jobs, stages, worst, note, measured), indent=2))
        return 0
    print(title)
    if note:
        print(f"note: {note}")
    _print_layout(plan, jobs, stages, worst)
    _print_breakdown(plan, b, device, measured)
    for f in files:
        print(f"wrote {Path(f)}")
    return 0


def _measure(cfg, args, device):
    """A few steps of cfg on this machine's device, measured (kiln.run.measure)."""
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device and device.kind != here.type:
        print(f"note: measuring on this machine's {here.type}, predicting for {device.name}")
    snapshot = "memory-snapshot.pickle" if here.type == "cuda" and args.out else None
    return measure_step(cfg, here, steps=args.steps, snapshot_path=snapshot)


def _charts(args, b, measured, title: str, device) -> list[str]:
    """The bar chart (--out) and the one-step timeline (--timeline, or with --measure beside --out): the paths."""
    files = []
    if args.out:
        files.append(str(breakdown_bar(args.out, b.components, title, measured.components if measured else None,
                                       capacity=device.memory, full_sizes=b.held(),
                                       measured_peak=measured.peak_bytes if measured else None)))
    timeline_path = args.timeline if args.timeline is not None else (
        "memory-timeline.png" if args.measure and args.out else "")  # --out '': the user asked for no file
    if timeline_path:
        files.append(str(timeline(timeline_path, b.first_timeline, b.timeline,
                                  measured.timeline if measured else None, args.steps, title)))
    return files


def _as_json(plan, jobs, stages, worst: int, note: str | None, measured) -> dict:
    """--json: the worst rank's breakdown, the layout, every pipeline stage, and what --measure measured."""
    job, b = jobs[worst], stages[worst]
    out = b.to_json()
    out["precision"] = job.precision
    out["layout"] = {"mesh": plan.mesh_shape | ({"cp": plan.cp} if plan.cp > 1 else {}), "strategy": plan.strategy,
                     "sequence_parallel": plan.sequence_parallel}
    if plan.pp > 1:
        out["layout"] |= {"pp_schedule": plan.pp_schedule, "pp_microbatches": job.grad_accum,
                          "worst_stage": worst}
        out["stages"] = [{"stage": s, "blocks": j.model.n_layer, "in_flight_microbatches": j.in_flight(),
                          "total_bytes": e.total_bytes, "components": e.components}
                         for s, (j, e) in enumerate(zip(jobs, stages))]
    if note:
        out["precision_note"] = note
    if measured:
        out["measured"] = dict(measured.components)
        out["measured_peak_bytes"] = measured.peak_bytes
        out["predicted_peak_allocated_bytes"] = peak_allocated(b)
        if measured.reserved_bytes is not None:
            out["measured_reserved_bytes"] = measured.reserved_bytes
        if measured.rss_peak_bytes is not None:
            out["measured_peak_rss_bytes"] = measured.rss_peak_bytes
        if measured.snapshot:
            out["snapshot"] = measured.snapshot
    return out


def _print_layout(plan, jobs, stages, worst: int) -> None:
    """What is measured and what modelled for this layout, and every pipeline stage's peak."""
    job = jobs[worst]
    if job.dp_strategy.reduces and job.world > 1:
        print(f"note: one rank's whole-step peak under {job.parallel} (model state, saved tensors, DDP's buckets, "
              f"FSDP2's gathered parameters) is measured on CPU gloo within 5% (tests/memory/test_rank_peak.py); "
              f"on GPUs the collectives' buffers are modelled from torch's documentation")
    if plan.model_parallel or plan.cp > 1:
        print("note: whole-step peaks under tp2 (the embedding, head and logits split over the vocabulary) and pp2 "
              "(also pp2 × fsdp) are measured on CPU gloo within 5% "
              "(tests/memory/test_rank_peak.py); other layouts are modelled (docs/parallel.md); context "
              "parallelism is modelled as ring attention (training all-gathers k and v: docs/parallel.md)")
    if plan.pp > 1:
        print(f"pipeline {plan.pp_schedule}, {job.grad_accum} micro-batches of {job.micro_batch} sequences; every "
              f"stage (the worst in full below):")
        for s, (j, e) in enumerate(zip(jobs, stages)):
            print(f"  stage {s}: {j.model.n_layer} blocks, {j.in_flight():g} micro-batches in flight, "
                  f"peak {fmt_bytes(e.total_bytes)}" + ("  <- worst" if s == worst else ""))


def _print_breakdown(plan, b, device, measured) -> None:
    """The table of components at the peak (and measured), then the totals and the measured comparison."""
    what = "parameters on this rank (before data-parallel sharding)" if plan.model_parallel else "parameters"
    print(f"{what}: {b.param_count:,} | attention backend: {b.backend} | peak at: {b.peak_phase}")
    if b.job.lora:
        print(lora_line(b))
    note = worst_case_note(b.job)
    if note:
        print(f"note: {note}")
    held = b.held()
    print(f"  {'component':<18}{'at peak':>12}{'full size':>12}" + (f"{'measured':>12}" if measured else ""))
    for name in COMPONENTS:
        line = f"  {name:<18}{fmt_bytes(b.components[name]):>12}"
        line += f"{(fmt_bytes(held[name]) if name in held else '-'):>12}"
        if measured:
            meas = measured.components.get(name)
            line += f"{(fmt_bytes(meas) if meas is not None else '-'):>12}"
        print(line)
    print(f"  {'total at peak':<18}{fmt_bytes(b.total_bytes):>12}   of {fmt_bytes(device.memory)} on {device.name}"
          f" ({'fits' if b.total_bytes <= device.memory else 'does NOT fit'})")
    saved = sum(b.activations_saved.values())
    print(f"saved for backward over the whole forward: {fmt_bytes(saved)} "
          f"({', '.join(f'{k} {fmt_bytes(v)}' for k, v in _top(b.activations_saved, 5))})")
    if b.host:
        print("host (pinned) memory: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in b.host.items()))
    print(f"first step peak: {fmt_bytes(b.first_step_peak)} (no optimizer state until its first update)")
    if not measured:
        return
    print(f"measured saved-for-backward: {fmt_bytes(measured.saved.total)} (predicted {fmt_bytes(saved)}, "
          f"{100 * (saved / max(measured.saved.total, 1) - 1):+.2f}%)")
    pk = peak_allocated(b)
    print(f"measured peak: {fmt_bytes(measured.peak_bytes)} (predicted {fmt_bytes(pk)}, "
          f"{100 * (pk / measured.peak_bytes - 1):+.2f}%) over steps "
          + ", ".join(fmt_bytes(p) for p in measured.step_peaks))
    if measured.rss_peak_bytes:
        print(f"process peak RSS: {fmt_bytes(measured.rss_peak_bytes)} (Python, libraries and data included)")
    if measured.snapshot:
        print(f"CUDA memory snapshot: {measured.snapshot} (drag into https://pytorch.org/memory_viz)")


def lora_line(b) -> str:
    """LoRA's adapters and the trainable share of the parameters, as `kiln train`'s start line counts them."""
    a = b.job.lora
    n = sum(math.prod(s) for name, s in local_parameter_shapes(b.job) if trainable(b.job, name))
    where = ", ".join(f"{x} ({len([p for p in a.pairs if p.linear == x])} pairs)" if
                      len([p for p in a.pairs if p.linear == x]) > 1 else x for x in a.linears)
    return (f"lora: rank {a.rank} on {where}; base frozen ({b.job.num.base} bytes a parameter, no "
            f"gradient or optimizer state): trainable {n:,} of {b.param_count:,} parameters "
            f"({100 * n / b.param_count:.2f}%)")


def _layout(plan) -> str:
    """tp2·pp4·dp8 (sp, 1f1b): the split of the world, innermost last."""
    ep = getattr(plan, "ep", 1)
    dims = [f"{k}{v}" + (f"(ep{ep})" if k == "dp" and ep > 1 else "")
            for k, v in (("pp", plan.pp), ("dp", plan.dp), ("cp", plan.cp), ("tp", plan.tp)) if v > 1]
    extra = [x for x in ("sp" if plan.sequence_parallel else "", plan.pp_schedule if plan.pp > 1 else "") if x]
    return "·".join(dims or ["1"]) + (f" ({', '.join(extra)})" if extra else "")


def _precision_note(mode: str, device) -> str | None:
    """On this machine's CPU: why auto chose its precision, or that bf16/fp16 is emulated or slower here."""
    return precision_notice(mode, torch.device("cpu")) if device.kind == "cpu" else None


def _top(d: dict, n: int):
    return sorted(d.items(), key=lambda kv: -kv[1])[:n]
