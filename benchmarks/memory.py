"""What activation recomputation saves and what it costs, on the default job's shape.

For each policy (none, selective, every_k, full) on the same model and batches: bytes saved for backward
(measured with saved_tensors_hooks, and predicted), the step peak (live tensor bytes on CPU, max_memory_allocated
on CUDA, and predicted), and the step time. Policies are timed in alternating rounds inside one process, so a
noisy shared machine slows them alike; the ratios to `none` are the result.

    .venv/bin/python benchmarks/memory.py [--rounds 5] [--steps 3] [--threads 1] [overrides...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kiln.config import load_config
from kiln.memory.devices import local_device
from kiln.memory.estimate import estimate, peak_allocated
from kiln.memory.levers import JobSections, job_for
from kiln.memory.measure import measure_saved
from kiln.run.lm import build_lm
from kiln.run.measure import measure_step
from kiln.train.step import train_step

POLICIES = ("none", "selective", "every_k", "full")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    p.add_argument("--steps", type=int, default=3, help="steps per policy per round")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    args, overrides = p.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = ["--model.preset=tiny", "--optim.lr=1e-3", "--train.device=" + device.type] + overrides  # docs: 6 x 384
    rigs, rows = {}, {}
    for policy in POLICIES:
        cfg = load_config(None, base + [f"--memory.recompute={policy}"])
        rigs[policy] = (cfg, build_lm(cfg, device=device, with_data=False).state)
        pred = estimate(job_for(JobSections.of(cfg), local_device(device)))
        B, T, V = cfg.train.micro_batch_size, cfg.data.seq_len, rigs[policy][1].model.cfg.vocab_size
        x, y = (torch.randint(0, V, (B, T), device=device) for _ in range(2))
        saved = measure_saved(rigs[policy][1].model, x, y, rigs[policy][1].precision)
        peak = measure_step(cfg, device, steps=2)
        rows[policy] = {"saved_measured": saved.total, "saved_predicted": sum(pred.activations_saved.values()),
                        "peak_measured": peak.step_peaks[-1], "peak_predicted": peak_allocated(pred),
                        "recompute_flops_per_micro_batch": pred.recompute_flops, "times": []}
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.rounds):
        for policy in POLICIES:
            cfg, rig = rigs[policy]
            B, T, V = cfg.train.micro_batch_size, cfg.data.seq_len, rig.model.cfg.vocab_size
            for step in range(args.steps + 1):
                xy = torch.randint(0, V, (B, T + 1), generator=gen).to(device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                train_step(rig.step_model, [(xy[:, :-1], xy[:, 1:])], rig.objective, rig.optimizer, rig.precision,
                           rig.scaler, cfg.optim, rig.masters)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if step:  # the first step of each block warms caches
                    rows[policy]["times"].append(time.perf_counter() - t0)
    base_time = statistics.median(rows["none"]["times"])
    for policy, row in rows.items():
        row["step_s_median"] = statistics.median(row.pop("times"))
        row["time_vs_none"] = row["step_s_median"] / base_time
        row["saved_vs_none"] = row["saved_measured"] / rows["none"]["saved_measured"]
    print(json.dumps({"device": local_device(device).name, "threads": torch.get_num_threads(),
                      "overrides": overrides, "policies": rows}, indent=2))


if __name__ == "__main__":
    main()
