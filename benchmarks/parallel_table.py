"""The modelled table of docs/parallel.md: Llama-7B and Llama-70B on 8, 64, 512 and 1024 H100s, the planner's best
layout for each (`kiln plan --gpus G`'s search with its smaller lever set and without the modelled-only context
parallelism: kiln.memory.planner.search(quick=True, context=False)).

Every number is a MODEL (kiln.memory.estimate for the bytes, kiln.memory.planner.step_time for the time, with
the default efficiencies: matmuls at 60% of peak, collectives at 70% of the link), nothing here ran on a GPU.
8 GPUs per node on NVLink 4 (450 GB/s per GPU per direction), InfiniBand NDR between nodes (50 GB/s per GPU).

    .venv/bin/python benchmarks/parallel_table.py [--models llama-7b,llama-70b] [--gpus 8,64,512,1024]
        [--write docs/parallel.md]    (replaces the table between the markers in that file)
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from kiln.config import load_config
from kiln.memory.devices import get_device
from kiln.memory.estimate import GiB
from kiln.memory.levers import JobSections
from kiln.memory.planner import search
from kiln.perf.flops import flops_per_token

# Each model's batch: 4M tokens per step (Llama 2 and Llama 3 both trained at ~4M), at its own context length.
MODELS = {"llama-7b": ["--model.preset=llama-7b", "--data.seq_len=4096", "--data.tokenizer=bpe",
                       "--data.vocab_size=32000"],
          "llama-70b": ["--model.preset=llama-70b", "--data.seq_len=8192", "--data.tokenizer=bpe",
                        "--data.vocab_size=128256"]}
GLOBAL_TOKENS = 4 * 2**20
BEGIN, END = "<!-- parallel_table: begin -->", "<!-- parallel_table: end -->"


def row(name: str, gpus: int, device) -> str:
    cfg = load_config(None, MODELS[name])
    start = time.perf_counter()
    plan = search(JobSections.of(cfg), device, None, GLOBAL_TOKENS, gpus=gpus, quick=True, context=False)
    took = time.perf_counter() - start
    best = plan.best  # no context parallelism searched: what training can run
    print(f"  {name} × {gpus}: {plan.considered} configurations, {took:.0f} s", flush=True)
    if best is None:
        s = plan.smallest
        return (f"| {name} | {gpus} | nothing fits in 80 GB | | smallest found: {s.choice.describe()} | "
                f"{s.total_bytes / GiB:.1f} | | | |")
    c, model = best.choice, cfg.model.resolve()
    tokens_per_s = GLOBAL_TOKENS / best.step_s
    mfu = flops_per_token(model, cfg.data.seq_len) * tokens_per_s / (gpus * device.flops(c.precision))
    rec = c.recompute
    return (f"| {name} | {gpus} | {c.layout(gpus)} | {c.parallel} | {c.precision}, mb {c.micro_batch_size}×"
            f"{c.grad_accum_steps}, recompute {rec}{', chunked loss' if c.chunked_loss else ''} | "
            f"{best.total_bytes / GiB:.1f} | {best.step_s:.2f} | {tokens_per_s / gpus:,.0f} | {mfu:.0%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-7b,llama-70b")
    p.add_argument("--gpus", default="8,64,512,1024")
    p.add_argument("--write", default="", help="a markdown file whose table between the markers is replaced")
    args = p.parse_args()
    device = get_device("H100")
    lines = ["| model | H100s | layout | data parallel | precision, batch, levers | peak per rank GiB (model) | "
             "step s (model) | tokens/s per GPU (model) | MFU (model) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        for gpus in map(int, args.gpus.split(",")):
            lines.append(row(name, gpus, device))
    table = "\n".join(lines)
    print(table)
    if args.write:
        path = Path(args.write)
        text = path.read_text()
        new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), f"{BEGIN}\n{table}\n{END}", text, flags=re.S)
        path.write_text(new)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
