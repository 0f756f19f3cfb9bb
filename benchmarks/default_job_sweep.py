"""The sweep behind the default job's shape, step count, learning rate and schedule (docs/benchmarks.md).

Each candidate is a list of `--section.key=value` overrides on top of kiln's defaults; it trains in this process
to its step count and prints its validation loss (the default job's 20 batches) and wall time. The validation loss
after a fixed number of fp32 steps does not depend on the machine's speed, so the loss half of the sweep can run
on any CPU; the time half is each shape's tokens/s on the CPU that has to meet the budget (--time-only measures
that for every candidate without training to the end).

    .venv/bin/python benchmarks/default_job_sweep.py                      # every candidate below
    .venv/bin/python benchmarks/default_job_sweep.py --only 4x256-lr3e-3   # some of them
    .venv/bin/python benchmarks/default_job_sweep.py --time-only          # tokens/s of each shape, 12 steps
"""
from __future__ import annotations

import argparse
import io
import json
import tempfile
import time

from rich.console import Console

from kiln.config import load_config
from kiln.train.trainer import train

COMMON = ["--precision.mode=fp32", "--train.sample_tokens=0", "--log.tensorboard=false", "--log.interval=50"]


def shape(layers: int, width: int, heads: int) -> list[str]:
    return [f"--model.n_layer={layers}", f"--model.d_model={width}", f"--model.n_head={heads}"]


CANDIDATES: dict[str, list[str]] = {
    "6x384-lr1e-3-400": shape(6, 384, 6) + ["--train.max_steps=400"],  # the default job before the sweep
    "4x256-lr2e-3-300": shape(4, 256, 4) + ["--train.max_steps=300", "--optim.lr=2e-3"],
    "4x256-lr3e-3-300": shape(4, 256, 4) + ["--train.max_steps=300", "--optim.lr=3e-3"],
    "4x256-lr3e-3-300-wsd": shape(4, 256, 4) + ["--train.max_steps=300", "--optim.lr=3e-3", "--schedule.name=wsd"],
    "3x256-lr3e-3-390": shape(3, 256, 4) + ["--train.max_steps=390", "--optim.lr=3e-3"],
    "4x192-lr3e-3-500": shape(4, 192, 3) + ["--train.max_steps=500", "--optim.lr=3e-3"],
    "6x192-lr3e-3-330": shape(6, 192, 3) + ["--train.max_steps=330", "--optim.lr=3e-3"],
    "4x320-lr2e-3-195": shape(4, 320, 5) + ["--train.max_steps=195", "--optim.lr=2e-3"],
}


def run(name: str, overrides: list[str], time_only: bool) -> dict:
    if time_only:
        overrides = [o for o in overrides if not o.startswith("--train.max_steps")] + ["--train.max_steps=12",
                                                                                       "--train.eval_batches=1"]
    cfg = load_config(None, COMMON + overrides)
    out = io.StringIO()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        summary = train(cfg, run_dir, console=Console(file=out, width=200))
        records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    wall = time.perf_counter() - start
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return {"name": name, "overrides": overrides, "val_loss": summary["val_loss"], "wall_s": round(wall, 1),
            "tokens_per_s": round(rates[-1]) if rates else None, "steps": summary["step"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="candidate names (default: all)")
    ap.add_argument("--time-only", action="store_true", help="12 steps each: tokens/s of each shape on this CPU")
    ap.add_argument("--out", help="append one JSON line per candidate to this file")
    args = ap.parse_args()
    names = args.only or list(CANDIDATES)
    for name in names:
        result = run(name, CANDIDATES[name], args.time_only)
        print(f"{name:28} val_loss {result['val_loss']:.4f} | {result['wall_s']:6.1f} s | "
              f"{result['tokens_per_s']:>7,} tok/s", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
