"""The sweep behind the default job's shape, batch, learning rate and schedule (docs/benchmarks.md).

Each candidate is a list of `--section.key=value` overrides on top of kiln's defaults. It trains in this process
with the same time budget (train.max_steps=0: kiln measures steps 3-10 and sizes the run to the budget), so a
candidate's validation loss is what the default job would reach on this CPU in that time. Run it on the CPU that
has to meet the budget, alone (the step count follows the measured speed); to stand in for an AVX2-only CPU on a
newer one, cap the instruction set:

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/python benchmarks/default_job_sweep.py [--budget 125] [--only NAME ...] [--out FILE.jsonl]
"""
from __future__ import annotations

import argparse
import io
import json
import tempfile
import time

from rich.console import Console

from kiln.config import load_config
from kiln.run.lm import train

COMMON = ["--precision.mode=fp32", "--train.sample_tokens=0", "--log.tensorboard=false", "--log.interval=50",
          "--train.max_steps=0"]


def shape(layers: int, width: int, heads: int) -> list[str]:
    return [f"--model.n_layer={layers}", f"--model.d_model={width}", f"--model.n_head={heads}"]


CANDIDATES: dict[str, list[str]] = {
    "6x384-b8-lr1e-3": shape(6, 384, 6),  # the default job's shape before the sweep
    "4x256-b8-lr2e-3": shape(4, 256, 4) + ["--optim.lr=2e-3"],
    "4x256-b8-lr3e-3-w20": shape(4, 256, 4) + ["--optim.lr=3e-3", "--schedule.warmup_steps=20"],
    "4x256-b4-lr2e-3-w20": shape(4, 256, 4) + ["--train.micro_batch_size=4", "--optim.lr=2e-3",
                                               "--schedule.warmup_steps=20"],
    "3x256-b8-lr3e-3-w20": shape(3, 256, 4) + ["--optim.lr=3e-3", "--schedule.warmup_steps=20"],
    "4x192-b8-lr3e-3-w20": shape(4, 192, 3) + ["--optim.lr=3e-3", "--schedule.warmup_steps=20"],
    "6x256-b8-lr2e-3-w20": shape(6, 256, 4) + ["--optim.lr=2e-3", "--schedule.warmup_steps=20"],
    "4x256-b8-lr1.5e-3": shape(4, 256, 4) + ["--optim.lr=1.5e-3"],
    "4x256-b8-lr1e-3": shape(4, 256, 4) + ["--optim.lr=1e-3"],
    "4x256-b8-lr2e-3-wsd": shape(4, 256, 4) + ["--optim.lr=2e-3", "--schedule.name=wsd"],
    "3x256-b8-lr2e-3": shape(3, 256, 4) + ["--optim.lr=2e-3"],
    "4x192-b8-lr2e-3": shape(4, 192, 3) + ["--optim.lr=2e-3"],
    "3x256-b8-lr1.5e-3": shape(3, 256, 4) + ["--optim.lr=1.5e-3"],
    "3x256-b8-lr2e-3-wsd": shape(3, 256, 4) + ["--optim.lr=2e-3", "--schedule.name=wsd"],
    "2x256-b8-lr2e-3": shape(2, 256, 4) + ["--optim.lr=2e-3"],
    "3x192-b8-lr2e-3": shape(3, 192, 3) + ["--optim.lr=2e-3"],
}


def run(name: str, overrides: list[str], budget: float) -> dict:
    cfg = load_config(None, COMMON + [f"--train.time_budget={budget:g}"] + overrides)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        summary = train(cfg, run_dir, console=Console(file=io.StringIO(), width=200))
        records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    wall = time.perf_counter() - start
    rates = sorted(r["tokens_per_s"] for r in records if "tokens_per_s" in r)
    return {"name": name, "overrides": overrides, "budget_s": budget, "val_loss": summary.val_loss,
            "wall_s": round(wall, 1), "tokens_per_s": round(rates[len(rates) // 2]), "steps": summary.step}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="candidate names (default: all)")
    ap.add_argument("--budget", type=float, default=125.0, help="seconds of training steps per candidate")
    ap.add_argument("--out", help="append one JSON line per candidate to this file")
    args = ap.parse_args()
    for name in args.only or list(CANDIDATES):
        result = run(name, CANDIDATES[name], args.budget)
        print(f"{name:24} val_loss {result['val_loss']:.4f} | {result['steps']:>5} steps | {result['wall_s']:6.1f} s | "
              f"{result['tokens_per_s']:>7,} tok/s", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
