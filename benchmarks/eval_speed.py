"""How long one full-split evaluation takes (examples/speedrun_cpu.toml's, train.eval_batches=0): the evaluation as it
was before train.eval_micro_batch_size and the outer autocast region (one autocast region per micro-batch of
train.micro_batch_size windows: every fp32 weight cast to bf16 again for every micro-batch) side by side with
kiln's evaluation today (kiln.run.lm.LMRun.evaluate: the same windows regrouped into train.eval_micro_batch_size's
forwards, one autocast region over them all), in one process, on the same weights and the same windows.

Per precision: the mean loss per token of both (fp32 equal within 1e-6 relative; bf16 within the tolerance stated
in docs/benchmarks.md), the process CPU seconds and the wall seconds of each, alternating which goes first over
--rounds rounds (medians). One torch thread by default, as the speedrun measures it.

    PYTHONPATH=. python benchmarks/eval_speed.py [--precisions bf16,fp32] [--rounds 1] [--threads 1] [overrides...]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from kiln.config import load_config
from kiln.data import val_batches
from kiln.perf.measured import cpu_model
from kiln.run.lm import build_lm
from kiln.train.target import eval_batch_count, eval_micro_batch

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "speedrun_cpu.toml")


@torch.no_grad()
def evaluate_before(lm) -> float:
    """kiln.train.step.evaluate and LMRun._evaluate_on as they were at commit ca3cbd9 (one process): batches of
    train.micro_batch_size windows, one autocast region per batch."""
    c, state = lm.cfg, lm.state
    model, objective, precision = state.model, state.objective, state.precision
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    for batch in val_batches(lm.data.val, c.train.micro_batch_size, c.data.seq_len,
                             eval_batch_count(c.train, len(lm.data.val), c.data.seq_len)):
        with precision.autocast():
            total += objective(model, batch).double()
        count += objective.count(batch)
    model.train(was_training)
    return (total / count.clamp(min=1)).item()


def timed(fn) -> tuple[float, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    loss = fn()
    return loss, time.process_time() - cpu, time.perf_counter() - wall


def measure(precision: str, rounds: int, overrides: list[str]) -> dict:
    cfg = load_config(EXAMPLE, [f"--precision.mode={precision}", "--train.max_steps=1", *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        lm = build_lm(cfg, tmp, log=lambda m: None)
    c = lm.cfg
    windows = (len(lm.data.val) - 1) // c.data.seq_len if not c.train.eval_batches else \
        c.train.eval_batches * c.train.micro_batch_size
    runs = {"before": [], "after": []}
    ways = {"before": lambda: evaluate_before(lm), "after": lambda: lm.evaluate(lm.state.model)}
    for r in range(rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            runs[name].append(timed(ways[name]))
    row = {"precision": lm.state.precision.mode, "windows": windows, "seq_len": c.data.seq_len,
           "micro_batch_size": c.train.micro_batch_size,
           "eval_micro_batch_size": eval_micro_batch(c.train, c.data.seq_len, c.model.padded_vocab, "cpu")}
    for name, rs in runs.items():
        row[name] = {"loss": rs[0][0], "cpu_s": round(statistics.median(r[1] for r in rs), 2),
                     "wall_s": round(statistics.median(r[2] for r in rs), 2)}
    row["rel_diff"] = abs(row["after"]["loss"] - row["before"]["loss"]) / abs(row["before"]["loss"])
    row["cpu_ratio"] = round(row["after"]["cpu_s"] / row["before"]["cpu_s"], 3)
    row["wall_ratio"] = round(row["after"]["wall_s"] / row["before"]["wall_s"], 3)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    args, overrides = ap.parse_known_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_model()}, {args.threads} thread(s), load {os.getloadavg()[0]:.2f} at the start", flush=True)
    rows = []
    for precision in args.precisions.split(","):
        row = measure(precision, args.rounds, overrides)
        rows.append(row)
        b, a = row["before"], row["after"]
        print(f"{row['precision']:5s} {row['windows']} windows x {row['seq_len']}: before (batches of "
              f"{row['micro_batch_size']}) {b['cpu_s']:.2f} cpu s {b['wall_s']:.2f} wall s loss {b['loss']:.10f} | "
              f"after (batches of {row['eval_micro_batch_size']}) {a['cpu_s']:.2f} cpu s {a['wall_s']:.2f} wall s "
              f"loss {a['loss']:.10f} | cpu {row['cpu_ratio']:.3f}x wall {row['wall_ratio']:.3f}x | "
              f"rel diff {row['rel_diff']:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
