"""The planner's optimizer time against a measured optimizer step on this CPU: optim.name=muon vs adamw (issue #40).

For each optimizer it builds the run `kiln train` would (the tiny preset, batch 8 × 256, fp32 parameters so both
update fp32 tensors), gives every parameter a random gradient, and times what step_time's "optimizer" part models:
kiln's gradient clipping and the optimizer's step (MuonAdamW: its Muon part and its AdamW part timed apart too).
The two optimizers alternate round by round, so the machine's load falls on both alike; times are the thread's CPU
seconds (one thread: the work is this thread's), median over the rounds. The prediction is
kiln.memory.planner.step_time on this CPU as `kiln plan --device=cpu` sees it (peaks measured in this process, at
the thread count set here; the time model's constants, calibrated or the defaults).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/muon_step_time.py [--rounds 7] [--threads 1]

Prints one JSON line per optimizer and one for the difference (muon − adamw), with the CPU, threads and load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from kiln.config import load_config
from kiln.memory.devices import cpu_device
from kiln.memory.levers import JobSections, job_for
from kiln.memory.estimate import local_parameter_shapes
from kiln.memory.muon_cost import NS_STEPS, muon_cost
from kiln.memory.planner import step_time, time_constants
from kiln.perf.measured import cpu_model
from kiln.run.lm import build_lm
from kiln.train.optim import clip_gradients

SHAPE = ["--model.preset=tiny", "--data.seq_len=256", "--train.micro_batch_size=8", "--train.grad_accum_steps=1",
         "--precision.mode=fp32", "--train.device=cpu"]


def _cpu_seconds(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="timed steps per optimizer (after 2 untimed)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (torch.set_num_threads)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = cpu_device()  # its matmul peaks measured now, at this thread count
    rigs, predicted, times = {}, {}, {}
    for name in ("adamw", "muon"):
        cfg = load_config(None, SHAPE + [f"--optim.name={name}"])
        rig = build_lm(cfg, device=torch.device("cpu"), with_data=False).state
        gen = torch.Generator().manual_seed(0)
        for q in rig.model.parameters():
            q.grad = torch.randn(q.shape, generator=gen) * 1e-2
        rigs[name] = (cfg, rig)
        predicted[name] = step_time(job_for(JobSections.of(cfg), device), device)
        times[name] = {"optimizer": [], "muon": [], "adamw_part": []}
    for r in range(args.rounds + 2):
        for name, (cfg, rig) in rigs.items():
            params = list(rig.model.parameters())
            clip = _cpu_seconds(lambda: clip_gradients(params, cfg.optim))
            if name == "muon":  # MuonAdamW.step steps these two; timed apart
                muon = _cpu_seconds(rig.optimizer.muon.step)
                adam = _cpu_seconds(rig.optimizer.adam.step)
            else:
                muon, adam = 0.0, _cpu_seconds(rig.optimizer.step)
            if r >= 2:
                times[name]["optimizer"].append(clip + muon + adam)
                times[name]["muon"].append(muon)
                times[name]["adamw_part"].append(adam)
    me, be, op_s, source = time_constants(device)
    # the Muon part's model, split: the products' rooflines, the elementwise passes, the per-op time; and torch's
    # own Newton-Schulz (a private function: the products and the normalisation alone) timed on the same matrices
    cfg, rig = rigs["muon"]
    cost = muon_cost(local_parameter_shapes(job_for(JobSections.of(cfg), device)))
    split = {"products_s": cost.seconds(device.flops("bf16"), device.bandwidth, me, be, 0.0)
             - cost.elementwise_bytes / (device.bandwidth * be), "elementwise_s":
             cost.elementwise_bytes / (device.bandwidth * be), "ops_s": cost.ops * op_s}
    hidden = [q.grad for g in rig.optimizer.param_groups if g.get("muon") for q in g["params"]]
    ns = statistics.median(_cpu_seconds(lambda: [_zeropower_via_newtonschulz(h, (3.4445, -4.7750, 2.0315), NS_STEPS,
                                                                             1e-7) for h in hidden])
                           for _ in range(args.rounds))
    where = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2),
             "bf16_peak_gflops": round(device.flops("bf16") / 1e9, 1), "fp32_peak_gflops":
             round(device.flops("fp32") / 1e9, 1), "bandwidth_gbs": round(device.bandwidth / 1e9, 1),
             "time_model": source}
    measured = {n: {k: statistics.median(v) for k, v in t.items() if any(v)} for n, t in times.items()}
    for name in rigs:
        row = {"optimizer": name, "predicted_s": round(predicted[name]["optimizer"], 5),
               "measured_s": round(measured[name]["optimizer"], 5),
               "predicted/measured": round(predicted[name]["optimizer"] / measured[name]["optimizer"], 3)}
        if name == "muon":
            row |= {"muon_part_predicted_s": round(predicted[name]["muon"], 5),
                    "muon_part_measured_s": round(measured[name]["muon"], 5),
                    "muon_part_predicted/measured": round(predicted[name]["muon"] / measured[name]["muon"], 3),
                    "muon_part_model": {k: round(v, 5) for k, v in split.items()},
                    "newton_schulz_measured_s": round(ns, 5), "newton_schulz_gflop": round(cost.flops / 1e9, 2),
                    "newton_schulz_gflops_reached": round(cost.flops / ns / 1e9, 1)}
        print(json.dumps(row | where))
    dp = predicted["muon"]["optimizer"] - predicted["adamw"]["optimizer"]
    dm = measured["muon"]["optimizer"] - measured["adamw"]["optimizer"]
    print(json.dumps({"muon - adamw": True, "predicted_s": round(dp, 5), "measured_s": round(dm, 5),
                      "predicted/measured": round(dp / dm, 3),
                      "predicted_total_step_s": {n: round(predicted[n]["total"], 4) for n in rigs}} | where))


if __name__ == "__main__":
    main()
