"""LoRA against a full fine-tune of one model on this CPU: step time and peak memory, estimated and measured
(issue #38; docs/benchmarks.md, "LoRA").

    PYTHONPATH=. python benchmarks/lora_memory.py [--preset qwen3-0.6b] [--seq-len 64] [--batch 1] [--steps 3]
                                                   [--rank 16] [--precision bf16]

The model is the preset at random init (its own vocabulary). Both runs are built as `kiln train` builds them and
train on random tokens (kiln.run.measure.measure_step, what `kiln memory --measure` runs: for LoRA the base frozen
and stored in the mode's frozen dtype, fp32 adapters on every linear of the blocks; all parameters trained for the
full fine-tune); the measured peak is the live tensor bytes of the steady step (parameters, gradients, optimizer
state and what the step allocates), the estimate is kiln.memory.estimate's peak_allocated for the same
configuration on this CPU (kiln.memory.devices.get_device("cpu")) and the predicted step time is
kiln.memory.planner.step_time's with the default constants (or `kiln plan --calibrate`'s, when kept). Step times are
the median of the steps after the first.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kiln.config import load_config  # noqa: E402
from kiln.memory.devices import get_device  # noqa: E402
from kiln.memory.estimate import estimate, fmt_bytes, peak_allocated  # noqa: E402
from kiln.memory.levers import JobSections, job_for  # noqa: E402
from kiln.memory.planner import step_time  # noqa: E402
from kiln.run.measure import measure_step  # noqa: E402


def run(preset: str, seq_len: int, batch: int, steps: int, rank: int, precision: str) -> dict:
    cfg = load_config(None, [f"--model.preset={preset}", f"--data.seq_len={seq_len}",
                             f"--train.micro_batch_size={batch}", f"--precision.mode={precision}",
                             f"--lora.rank={rank}", "--train.device=cpu"])
    cpu = get_device("cpu")
    job = job_for(JobSections.of(cfg), cpu)
    b = estimate(job)
    torch.manual_seed(0)
    m = measure_step(cfg, torch.device("cpu"), steps=steps)
    peaks, seconds = m.step_peaks, m.step_seconds
    return {"lora_rank": rank, "parameters": b.param_count, "estimated_peak": peak_allocated(b),
            "measured_peak": peaks[-1], "measured_first_step_peak": peaks[0], "estimated_first_step_peak":
            b.first_step_peak, "estimated_step_s": step_time(job, cpu)["total"],
            "measured_step_s": statistics.median(seconds[1:] or seconds), "step_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run(args.preset, args.seq_len, args.batch, args.steps, r, args.precision) for r in (args.rank, 0)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.preset}, random init, {args.batch}×{args.seq_len} tokens, {args.precision}, torch "
          f"{torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"{'run':<16}{'peak est.':>12}{'peak meas.':>12}{'':>8}{'step est.':>11}{'step meas.':>12}")
    for r in rows:
        name = f"LoRA r={r['lora_rank']}" if r["lora_rank"] else "full fine-tune"
        err = r["estimated_peak"] / r["measured_peak"] - 1
        print(f"{name:<16}{fmt_bytes(r['estimated_peak']):>12}{fmt_bytes(r['measured_peak']):>12}{err:>+8.1%}"
              f"{r['estimated_step_s']:>10.2f}s{r['measured_step_s']:>11.2f}s")


if __name__ == "__main__":
    main()
