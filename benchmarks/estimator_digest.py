"""Print every number the estimator, the planner's step-time model and search, and the FLOP counter give for a
grid of presets, levers and parallel layouts, one JSON line per case: run it on two trees and diff the outputs to
show a refactor changed none of them (docs/models.md, issue #37). No timing, no device: pure arithmetic.

    PYTHONPATH=<tree> python benchmarks/estimator_digest.py > digest.jsonl
    sha256sum digest.jsonl

The grids come from the model registry (kiln.models.registry.FAMILIES), so a new family or preset is in the
digest without editing this file:

- cases: every preset of every family with at most 10B parameters × dropout 0 / 0.1 × LEVERS (precisions,
  recompute, chunked loss, 8-bit AdamW, activation and optimizer offload, DDP / ZeRO-1 / FSDP) × CUDA / CPU
  targets: the estimate's breakdown, the FLOPs per token and (CUDA) the step time on an H100. The presets above
  10B parameters (llama-70b, qwen3-moe-30b-a3b, qwen3-moe-235b-a22b) get the LARGE levers only, CUDA, dropout 0:
  one estimate of the 235B MoE takes ~1.5 s (all its experts' parameters are listed), the full grid 100 s.
- plans: the planner's search (kiln.memory.planner.search) on one H100 of 40 GiB and on 8 (quick, with the
  tensor × pipeline × context-parallel layouts), for each family's smallest preset and its smallest of at least
  100M parameters (those ≤ 10B: a search of qwen3-moe-30b-a3b took 181 s).
  The planner's expert-parallel layouts (search(expert=True), issue #41) are a search dimension added after this
  digest was recorded: the plans here leave them out (expert=False), so an MoE's plan lines stay the same.
- layouts: LAYOUTS (tp, sequence parallel, pp under gpipe / 1F1B / interleaved 1F1B, cp, tp × pp × cp, and layouts
  the runtime refuses) × three recompute policies through kiln.memory.levers.rank_jobs, the builder of a rank's
  Job that `kiln memory --ranks` and the planner use: the layout's degrees and, for every pipeline stage, the
  rank's Job shape, estimate, step time and FLOPs. A refused layout (a ValueError) prints `"refused": true`, not
  the error's text, so a refactor that rewords errors (KilnError) keeps the digest.

A refactor changes how this script reaches the numbers (an accessor renamed, Job holding a layout object), never
what it prints: the output must stay byte-identical.

Recorded on main at 2969936 (2026-11-27, torch 2.13.0; 27 s of CPU, 71 s wall on the loaded 2-core Xeon,
family 6 model 167): 1,009 lines (789 cases, 10 plans, 210 layouts), 31,256,346 bytes,
    sha256 12bc854e68308fae0f6df1c11a053015a2b4e8fe74db16a708aea73f75bcc0e6
The 364 cases and the gpt2-124m / llama-125m plan lines of the previous, smaller digest (sha256 4ba235fa…) are in
it byte for byte; its llama-1b plan line is not (llama-1b is not a smallest preset).

Changed on purpose by the experts issue (#41), 2026-11-27: the 78 lines of qwen3-moe presets differ (the experts
stacked into one (E, out, in) weight per matmul with grouped_mm's offsets, and MoE under tp and pp no longer
refused); the other 931 lines are byte-identical to 12bc854e…. Now
    sha256 5743d58e926295d096ea0daf00e738774d53bac047874b2d89e4ff5d22fb5d6e
"""
from __future__ import annotations

import itertools
import json
from dataclasses import replace

from kiln.config import Config
from kiln.memory.devices import get_device
from kiln.memory.estimate import Job, Target, data_parallel, estimate, recompute_plan
from kiln.memory.levers import JobSections, rank_jobs
from kiln.memory.planner import search, step_time
from kiln.models import FAMILIES, ModelConfig, param_count
from kiln.perf.flops import flops_per_token, recompute_flops_per_token

LEVERS = [
    dict(precision="fp32"), dict(precision="bf16"), dict(precision="bf16-master"),
    dict(precision="bf16", recompute="full"), dict(precision="bf16", recompute="selective"),
    dict(precision="bf16", recompute="every_k"), dict(precision="bf16", chunked_loss=512),
    dict(precision="fp32", optimizer="adamw8bit", grad_accum=4), dict(precision="bf16", offload=True),
    dict(precision="bf16", optimizer_offload="host"), dict(precision="bf16", parallel="fsdp", world=4),
    dict(precision="bf16", parallel="zero1", world=8), dict(precision="bf16", parallel="ddp", world=2),
]
LARGE = 10e9  # parameters above which a preset gets LARGE_LEVERS only (see the docstring: seconds an estimate)
LARGE_LEVERS = [dict(precision="bf16"), dict(precision="bf16", recompute="full"),
                dict(precision="bf16", parallel="fsdp", world=8)]

# (ranks, strategy, tp, pp, cp, sequence_parallel, pp_schedule, pp_microbatches): the layouts `kiln memory --ranks`
# and the planner's model-parallel search build, and the refusals of ParallelPlan.build
LAYOUTS = [
    (2, "none", 2, 1, 1, False, "1f1b", 0),  # tensor parallel alone
    (4, "fsdp", 2, 1, 1, True, "1f1b", 0),  # ... with sequence parallel, 2 FSDP copies
    (8, "ddp", 4, 1, 1, True, "1f1b", 0),
    (2, "none", 1, 2, 1, False, "1f1b", 0),  # pipeline alone
    (4, "ddp", 1, 4, 1, False, "gpipe", 0),
    (4, "fsdp", 1, 2, 1, False, "interleaved_1f1b", 8),
    (2, "fsdp", 1, 1, 2, False, "1f1b", 0),  # context parallel (modelled only)
    (8, "zero1", 1, 1, 4, False, "1f1b", 0),
    (16, "fsdp", 2, 2, 2, True, "1f1b", 4),  # all three, 2 data-parallel copies
    (2, "zero1", 2, 1, 1, False, "1f1b", 0),  # refused: ZeRO-1 cannot hold TP parameters
    (4, "zero1", 1, 2, 1, False, "1f1b", 0),  # refused: ZeRO-1 with pp
    (3, "none", 3, 1, 1, False, "1f1b", 0),  # refused unless 3 divides the heads and widths
    (64, "none", 1, 64, 1, False, "1f1b", 0),  # refused: more stages than blocks
    (2, "none", 1, 1, 1, False, "1f1b", 0),  # refused: 2 copies without a data-parallel strategy
]
LAYOUT_RECOMPUTE = ("none", "selective", "full")


def resolved(preset: str, dropout: float = 0.0) -> ModelConfig:
    """The preset resolved; a preset without a vocabulary of its own (the toys) gets 256 (bytes)."""
    own = ModelConfig(preset=preset).resolve().vocab_size
    return ModelConfig(preset=preset, vocab_size=0 if own else 256, dropout=dropout).resolve()


def presets() -> list[str]:
    """Every registered preset, family by family in registry order."""
    return [name for f in FAMILIES.values() for name in f.presets]


def smallest(limit: float = LARGE) -> list[str]:
    """For each family: its smallest preset and its smallest of at least 100M parameters, those ≤ limit."""
    out = []
    for f in FAMILIES.values():
        sizes = sorted((param_count(resolved(p)), p) for p in f.presets)
        picks = [sizes[0]] + [s for s in sizes if s[0] >= 100e6][:1]
        out += [p for n, p in dict.fromkeys(picks) if n <= limit]
    return out


def breakdown(b) -> dict:
    return {"total": b.total_bytes, "components": b.components, "phase": b.peak_phase, "host": b.host,
            "saved": b.activations_saved, "per_block": b.per_block, "model_state": b.model_state,
            "first": b.first_step_peak, "timeline": b.timeline, "recompute_flops": b.recompute_flops,
            "backend": b.backend}


def job_shape(job: Job) -> dict:
    """What a rank's Job says about its layout (set by kiln.memory.levers.for_rank)."""
    return {"n_layer": job.model.n_layer, "micro_batch": job.micro_batch, "grad_accum": job.grad_accum,
            "parallel": job.parallel, "world": job.world, "tp": job.tp, "sequence_parallel": job.sequence_parallel,
            "vocab_parallel": job.vocab_parallel, "cp": job.cp, "pp": job.pp, "stage": job.stage,
            "pp_schedule": job.pp_schedule, "virtual_stages": job.virtual_stages, "recompute": list(job.recompute),
            "tokens": job.tokens}


def cases(h100) -> None:
    for preset in presets():
        large = param_count(resolved(preset)) > LARGE
        grid = itertools.product((0.0,), LARGE_LEVERS, ("cuda",)) if large else \
            itertools.product((0.0, 0.1), LEVERS, ("cuda", "cpu"))
        for dropout, levers, target in grid:
            cfg = resolved(preset, dropout)
            kw = dict(levers)
            policy = kw.pop("recompute", "none")
            offload = kw.pop("offload", False)
            if "parallel" in kw:  # data parallelism alone: the Job's plan
                kw["plan"] = data_parallel(kw.pop("parallel"), kw.pop("world"))
            T = min(cfg.max_seq_len, 1024)
            job = Job(model=cfg, micro_batch=2, seq_len=T, target=Target(target, 9.0), **kw,
                      recompute=recompute_plan(policy, cfg.n_layer, 2),
                      offload=frozenset(range(0, cfg.n_layer, 2)) if offload else frozenset())
            b = estimate(job)
            out = {"case": [preset, dropout, levers, target], "param_count": param_count(cfg), **breakdown(b),
                   "flops_per_token": flops_per_token(cfg, T),
                   "recompute_flops_per_token": recompute_flops_per_token(cfg, T, job.recompute)}
            if target == "cuda":
                out["step_time"] = step_time(job, h100)
            print(json.dumps(out, sort_keys=True))


def config(preset: str) -> Config:
    c = Config()
    c.model = replace(c.model, preset=preset)
    c.data = replace(c.data, tokenizer="gpt2")  # a toy preset takes data.vocab_size (4096), as with a BPE
    return c


def plans(h100) -> None:
    for preset in smallest():
        plan = search(JobSections.of(config(preset)), h100, 40 * 2**30, 2**19)
        print(json.dumps({"plan": preset, "result": plan.to_json()}, sort_keys=True, default=str))
        plan = search(JobSections.of(config(preset)), h100, 40 * 2**30, 2**20, gpus=8, quick=True, expert=False)
        print(json.dumps({"plan": preset, "gpus": 8, "result": plan.to_json()}, sort_keys=True, default=str))


def layouts(h100) -> None:
    for preset, layout, policy in itertools.product(smallest(), LAYOUTS, LAYOUT_RECOMPUTE):
        ranks, strategy, tp, pp, cp, sp, schedule, micro = layout
        c = config(preset)
        T = min(resolved(preset).max_seq_len, 1024)
        c.data = replace(c.data, seq_len=T)
        c.train = replace(c.train, micro_batch_size=2, grad_accum_steps=4)
        c.precision = replace(c.precision, mode="bf16")
        c.memory = replace(c.memory, recompute=policy)
        c.parallel = replace(c.parallel, strategy=strategy, tp=tp, pp=pp, cp=cp, sequence_parallel=sp,
                             pp_schedule=schedule, pp_microbatches=micro)
        out = {"layout": [preset, list(layout), policy]}
        try:
            plan, jobs = rank_jobs(JobSections.of(c), h100, ranks)
        except ValueError:  # not its text: see the docstring
            out["refused"] = True
            print(json.dumps(out, sort_keys=True))
            continue
        out["plan"] = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "strategy": plan.strategy,
                       "sequence_parallel": plan.sequence_parallel, "pp_schedule": plan.pp_schedule,
                       "pp_microbatches": plan.pp_microbatches, "virtual_stages": plan.virtual_stages,
                       "stage_blocks": [plan.rank_blocks(c.model.resolve().n_layer, s) for s in range(plan.pp)]}
        out["stages"] = [{"job": job_shape(j), **breakdown(estimate(j)), "step_time": step_time(j, h100),
                          "flops_per_token": flops_per_token(j.model, T)} for j in jobs]
        print(json.dumps(out, sort_keys=True))


def main() -> None:
    h100 = get_device("H100")
    cases(h100)
    plans(h100)
    layouts(h100)


if __name__ == "__main__":
    main()
