"""MFU of one run against the two CPU peaks: the square product kiln used to divide by, and the model's shapes.

Builds the configured language-model run (default: the nano GPT, fp16 — the case that read 205% on an AMD Zen 4
CPU without AVX512-FP16), trains --steps steps through kiln's loop, and prints the achieved model FLOP/s with the
MFU it gives against each peak, side by side from the same steps:
    square   kiln.perf.flops.cpu_peak: one square product 256..1024 in the precision's dtype (before issue 25)
    shapes   kiln.perf.peak.model_peak_flops: the best of that and the model's own linears under autocast

    .venv/bin/python benchmarks/mfu_peak.py [--steps 6] [overrides, e.g. --precision.mode=bf16]
"""
from __future__ import annotations

import argparse
import io
import platform
import tempfile
import time

from rich.console import Console

from kiln.config import load_config
from kiln.perf.flops import cpu_peak, flops_per_token
from kiln.perf.peak import model_peak_flops
from kiln.run.lm import build_lm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args, overrides = parser.parse_known_args()
    cfg = load_config(None, ["--precision.mode=fp16", "--train.device=cpu", "--train.sample_tokens=0",
                             "--log.progress=off", "--log.tensorboard=false", *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        lm = build_lm(cfg, tmp, log=lambda msg: None)
        c, mode = lm.cfg, lm.state.precision.mode
        rows = c.train.micro_batch_size * c.data.seq_len
        square, shapes = cpu_peak(mode), model_peak_flops(lm.state.device, mode, c.model, rows)
        trainer = lm.trainer(tmp, Console(file=io.StringIO()))
        trainer.advance(1)  # warm-up: allocator, kernel choice
        start = time.perf_counter()
        trainer.advance(1 + args.steps)
        seconds = time.perf_counter() - start
        trainer.close()
    achieved = flops_per_token(c.model, c.data.seq_len) * rows * c.train.grad_accum_steps * args.steps / seconds
    print(f"{platform.processor() or platform.machine()}, {mode}, {c.model.preset} ({c.model.arch}), "
          f"{args.steps} steps of {rows} tokens: {seconds / args.steps:.2f} s/step, model {achieved / 1e9:.3g} GFLOP/s")
    for name, peak in (("square", square), ("shapes", shapes)):
        print(f"  peak {name:6s} {peak / 1e9:8.3g} GFLOP/s   MFU {100 * achieved / peak:6.1f}%")


if __name__ == "__main__":
    main()
