"""Simulated weak scaling (not a measurement): the planner's step-time model of one rank's job on n GPUs, nodes of
`node` GPUs joined by `inter`; a ring across nodes runs at the slowest link's bandwidth. Prints the table of
docs/memory.md ("Simulated, not measured").

    PYTHONPATH=. python benchmarks/scaling_table.py
"""
from __future__ import annotations

from dataclasses import replace

from kiln.memory.devices import get_device
from kiln.memory.estimate import Job, Target, data_parallel
from kiln.memory.planner import INTERCONNECTS, step_time
from kiln.models import ModelConfig


def scaling_table(job: Job, device, counts=(1, 8, 64, 512, 1024), node: int = 8, intra: str = "nvlink4",
                  inter: str = "ib-ndr") -> list[dict]:
    """Simulated weak scaling: job (one rank's micro-batches) on n GPUs, nodes of `node` GPUs joined by `inter`.
    A ring across nodes runs at the slowest link's bandwidth. A model, not a measurement."""
    rows, base = [], None
    for n in counts:
        link = INTERCONNECTS[intra if n <= node else inter]
        t = step_time(replace(job, plan=data_parallel(job.parallel, n)), device, link)
        tokens = n * job.grad_accum * job.micro_batch * job.seq_len
        rate = tokens / t["total"]
        base = base or rate
        rows.append({"gpus": n, "link": intra if n <= node else inter, "step_s": t["total"],
                     "communication_s": t["communication"], "exposed_s": t["exposed_communication"],
                     "tokens_per_s": rate, "scaling_efficiency": rate / (n * base)})
    return rows


def main() -> None:
    h100 = get_device("H100")
    print("| model, strategy | GPUs | link | step s | collectives s | exposed s | tokens/s | scaling efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, parallel, B in (("gpt2-124m", "ddp", 8), ("gpt2-124m", "fsdp", 8), ("llama-7b", "fsdp", 4)):
        model = ModelConfig(preset=preset).resolve()
        job = Job(model=model, micro_batch=B, seq_len=1024, precision="bf16", target=Target("cuda", 9.0),
                  plan=data_parallel(parallel))
        for row in scaling_table(job, h100):
            print(f"| {preset} {parallel}, {B}×1024 per GPU | {row['gpus']} | {row['link']} | {row['step_s']:.3f} | "
                  f"{row['communication_s']:.3f} | {row['exposed_s']:.3f} | {row['tokens_per_s']:,.0f} | "
                  f"{row['scaling_efficiency']:.2f} |")


if __name__ == "__main__":
    main()
