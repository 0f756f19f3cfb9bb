"""torch.compile's cost and gain on kiln's LM job, per precision: compile time, eager vs compiled step time, and the
run length from which compiling pays. Records them in kiln's per-machine measurements (kiln.perf.measured), where
train.compile=auto reads them (kiln.perf.compile).

Two trainers of the same run (kiln.run.lm.build_lm), one eager and one with train.compile=true, in one process.
The compile time is the compiled model's first step minus an eager step (the first forward and backward compile;
a second step is run before timing in case of a recompile). Then blocks of --block steps alternate eager and
compiled, so machine noise hits both alike; per-step times are medians over the blocks.

    PYTHONPATH=. python benchmarks/compile_gain.py [--precision fp32] [--rounds 3] [--block 2] [overrides...]

Default shape: benchmarks/vs_plain_loop.py's (kiln's tiny preset: 6 layers × 384, seq 256, batch 8).
"""
from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time

import torch
from rich.console import Console

from kiln.config import load_config
from kiln.perf.compile import compile_key, cpu_compiler, record_compile
from kiln.perf.measured import machine
from kiln.run.lm import build_lm

SHAPE = ["--model.preset=tiny", "--data.seq_len=256", "--train.micro_batch_size=8", "--train.sample_tokens=0"]


def trainer(overrides: list[str], run_dir: str):
    cfg = load_config(None, SHAPE + overrides + ["--train.max_steps=1000"])
    lm = build_lm(cfg, run_dir, log=lambda m: None)
    return lm, lm.trainer(run_dir, Console(file=io.StringIO()))


def timed(t, until: int) -> float:
    start = time.perf_counter()
    t.advance(until)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block", type=int, default=2)
    ap.add_argument("--no-record", action="store_true", help="print only; do not store the measurement")
    args, overrides = ap.parse_known_args()
    print(f"machine: {machine()} | C++ compiler for inductor: {cpu_compiler() or 'none'}")
    common = overrides + [f"--precision.mode={args.precision}"]
    with tempfile.TemporaryDirectory() as tmp:
        lm, eager = trainer(common + ["--train.compile=false"], f"{tmp}/eager")
        _, compiled = trainer(common + ["--train.compile=true"], f"{tmp}/compiled")
        eager_first = timed(eager, 1)
        eager_second = timed(eager, 2)
        compile_first = timed(compiled, 1)
        compile_second = timed(compiled, 2)
        print(f"first steps: eager {eager_first:.2f} s, {eager_second:.2f} s | compiled {compile_first:.2f} s, "
              f"{compile_second:.2f} s", flush=True)
        e_steps, c_steps = [], []
        step = 2
        for r in range(args.rounds):
            step += args.block
            e_steps.append(timed(eager, step) / args.block)
            c_steps.append(timed(compiled, step) / args.block)
            print(f"round {r}: eager {e_steps[-1]:.3f} s/step, compiled {c_steps[-1]:.3f} s/step", flush=True)
        eager.close()
        compiled.close()
    e, c = statistics.median(e_steps), statistics.median(c_steps)
    cost = max(0.0, compile_first + compile_second - 2 * e)
    c_cfg = lm.cfg
    rows = c_cfg.train.micro_batch_size * c_cfg.data.seq_len
    key = compile_key(c_cfg.model, args.precision, rows)
    print(f"{key}: compile {cost:.1f} s | eager {e:.3f} s/step, compiled {c:.3f} s/step ({e / c:.2f}x) | "
          + (f"pays after {cost / (e - c):,.0f} steps" if c < e else "never pays"))
    if not args.no_record:
        record_compile(key, cost, e, c, lm.state.device)
        print("recorded for train.compile=auto")


if __name__ == "__main__":
    main()
