"""One rank's whole-step peak under expert parallelism on N CPU gloo ranks, against the estimate (issue #41;
docs/memory.md, "Expert parallelism"; docs/benchmarks.md has the numbers). tests/parallel/test_expert_parallel.py
holds the ep2 scenarios within 5% on 4 ranks inside its launch (tests/parallel/ep_worker.py imports SHAPE and
SCENARIOS from here).

    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node=N benchmarks/ep_rank_peaks.py OUT
    PYTHONPATH=. python benchmarks/ep_rank_peaks.py --compare OUT

The first command measures each scenario's step peaks on every rank (kiln.run.measure.measure_rank_peaks: the CPU
allocator from before the model is built) into OUT/rank{R}.json; the second prints them beside the estimate of
rank 0 (kiln.memory.levers.rank_jobs), steady state as the least of the later steps.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SHAPE = ["--model.preset=qwen3-moe-nano", "--model.n_layer=2", "--model.d_model=128", "--model.n_head=4",
         "--model.n_kv_head=2", "--model.head_dim=32", "--model.n_experts=8", "--model.n_experts_active=2",
         "--model.moe_d_ff=64", "--model.vocab_size=256", "--model.max_seq_len=32", "--data.seq_len=16",
         "--train.micro_batch_size=2", "--train.device=cpu"]
SCENARIOS = {"ep1 ddp fp32": ["--parallel.strategy=ddp", "--precision.mode=fp32"],
             "ep2 ddp fp32": ["--parallel.strategy=ddp", "--precision.mode=fp32", "--parallel.ep=2"],
             "ep2 fsdp fp32": ["--parallel.strategy=fsdp", "--precision.mode=fp32", "--parallel.ep=2"],
             "ep2 fsdp bf16": ["--parallel.strategy=fsdp", "--precision.mode=bf16", "--parallel.ep=2"]}


def measure(out: Path) -> None:
    import torch

    from kiln.config import load_config
    from kiln.run.measure import measure_rank_peaks

    peaks = {name: measure_rank_peaks(load_config(None, SHAPE + extra), torch.device("cpu"), steps=4)
             for name, extra in SCENARIOS.items()}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(peaks))


def compare(out: Path) -> None:
    from kiln.config import load_config
    from kiln.memory.devices import get_device
    from kiln.memory.estimate import estimate, peak_allocated
    from kiln.memory.levers import JobSections, rank_jobs

    world = len(list(out.glob("rank*.json")))
    measured = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    print(f"{'scenario':<16}{'estimate':>12}{'rank 0 steady':>15}{'':>8}{'first est.':>12}{'first meas.':>13}")
    for name, extra in SCENARIOS.items():
        _, jobs = rank_jobs(JobSections.of(load_config(None, SHAPE + extra)), get_device("cpu"), world)
        b = estimate(jobs[0])
        first, *later = measured[0][name]
        steady = min(later)
        print(f"{name:<16}{peak_allocated(b):>12,}{steady:>15,}{peak_allocated(b) / steady - 1:>+8.1%}"
              f"{b.first_step_peak:>12,}{first:>13,}")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        measure(Path(sys.argv[1]))
