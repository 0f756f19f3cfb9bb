"""A mixture of experts' blocks, the loop over experts against grouped_mm: forward + backward of every MoE block.

Builds the model of the kiln config given (default `--model.preset=qwen3-moe-nano`), takes its MoE blocks, and times
forward + backward of all of them on one micro-batch of random hidden states (train.micro_batch_size × data.seq_len
tokens), once with the experts in a Python loop (`MoE.grouped = False`: one host read of the counts per block, one
matmul per expert) and once grouped (torch.nn.functional.grouped_mm, where kiln.models.moe's probe finds it). The two
alternate step by step after warm-up; each step runs under torch.profiler, and its cost is the sum of every event's
self-CPU time (what the CPU spent in torch's ops, nothing counted twice) beside its wall time. Reports the median
of the steps for each, and loop / grouped, side by side, as JSON.

    .venv/bin/python benchmarks/moe_grouped.py [--steps 5] [--warmup 2] [--threads 0] [--dtype fp32|bf16] \\
        [kiln overrides, e.g. --model.preset=qwen3-moe-nano --train.micro_batch_size=8 --data.seq_len=256]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.config import load_config
from kiln.models import build_model
from kiln.models.moe import grouped_mm_works

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def one_step(layers, x: torch.Tensor) -> tuple[float, float]:
    """(self-CPU seconds, wall seconds) of forward + backward of every MoE block on x."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        h = x
        for moe in layers:
            h = moe(h)
        h.float().square().mean().backward()
        wall = time.perf_counter() - start
    self_cpu = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    return self_cpu, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps of each (the median is reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="the blocks' weights and hidden states")
    args, overrides = p.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(None, ["--model.preset=qwen3-moe-nano", *overrides])
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = 256  # the byte tokenizer's; the blocks do not see it
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    model = build_model(cfg.model.resolve(), "cpu").to(dtype).train()
    layers = model.moe
    if not layers:
        raise SystemExit(f"model.arch={model.cfg.arch} has no mixture-of-experts blocks")
    B, T, C = cfg.train.micro_batch_size, cfg.data.seq_len, model.cfg.d_model
    x = torch.randn(B, T, C, dtype=dtype, requires_grad=True)
    costs = {"loop": [], "grouped": []}
    for i in range(args.warmup + args.steps):
        for mode in costs:
            for moe in layers:
                moe.grouped = False if mode == "loop" else None
            model.zero_grad(set_to_none=True)
            x.grad = None
            cost = one_step(layers, x)
            if i >= args.warmup:
                costs[mode].append(cost)
    median = {mode: [statistics.median(c[k] for c in runs) for k in (0, 1)] for mode, runs in costs.items()}
    print(json.dumps({
        "model": f"{model.cfg.preset} ({model.cfg.arch}): {len(layers)} MoE blocks of {model.cfg.n_experts} "
                 f"experts (width {model.cfg.moe_d_ff}), top-{model.cfg.n_experts_active}",
        "tokens": B * T, "dtype": args.dtype, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "grouped_mm_in_use": grouped_mm_works("cpu", dtype), "steps": args.steps,
        "self_cpu_s": {m: round(v[0], 5) for m, v in median.items()},
        "wall_s": {m: round(v[1], 5) for m, v in median.items()},
        "loop_over_grouped": {"self_cpu": round(median["loop"][0] / median["grouped"][0], 2),
                              "wall": round(median["loop"][1] / median["grouped"][1], 2)},
    }, indent=2))


if __name__ == "__main__":
    main()
