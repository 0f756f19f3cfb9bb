"""How long a checkpoint stops training: a synchronous save against checkpoint.async_save, per save, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint_async.py [--rounds 8] [--steps 4] [overrides]
    e.g. --model.d_model=384 --model.n_layer=6 (10.8 M parameters, 173 MB per checkpoint with Adam and safetensors)

OMP_NUM_THREADS=1 on a shared 2-core machine: with 2 OpenMP threads and other jobs on the cores, a step took 3-10×
longer and varied by seconds from round to round (OpenMP's threads wait for each other at every parallel region),
which buried the saves (docs/benchmarks.md).

For one process (host copies written by a thread) and for the data-parallel path (DCP in a world of one: dcp.save
against dcp.async_save on its own gloo group), in one process. Each round, in turn: STEPS training steps alone; a
sync save, then STEPS steps; an async save, then STEPS steps (the write runs beside them), then waiting for the
write. The stall of a save is what training lost to it:
    sync:  the save call
    async: the save call (staging: the host copy) + the wait for the write after the steps + how much longer the
           STEPS steps took than the same round's steps alone (what the background write took from them: threads
           share the GIL and, on a small CPU, the cores)
Printed per save: the first (set-up: buffers, process group, thread) and the median of the others (steady).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.perf.measured import cpu_model
from kiln.run.lm import build_lm
from kiln.train import checkpoint as ck


def measure(cfg, run_dir: Path, rounds: int, steps: int) -> tuple[dict[str, list[float]], int, int]:
    lm = build_lm(cfg, run_dir, log=lambda m: None, with_data=False)
    state = lm.state
    x = torch.randint(0, 256, (cfg.train.micro_batch_size, cfg.data.seq_len))

    def train(n) -> float:
        start = time.perf_counter()
        for _ in range(n):
            state.objective(state.step_model, (x, x)).backward()
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    train(2)  # warm-up; the optimizer state exists, as in any checkpoint after step 1
    savers = {a: ck.Checkpointer(replace(cfg.checkpoint, keep_last=2, async_save=a), run_dir / f"a{a}")
              for a in (False, True)}

    def save(saver, step) -> float:
        start = time.perf_counter()
        if state.world.sharded:
            saver.save_sharded(step, state, "")
        else:
            saver.save(step, state.state_dict(), "", state.model)
        return time.perf_counter() - start

    times = {k: [] for k in ("steps alone", "sync: save", "sync: steps after", "async: save call",
                             "async: steps beside", "async: wait after", "sync stall", "async stall")}
    for step in range(1, rounds + 1):
        alone = train(steps)
        times["steps alone"].append(alone)
        call = save(savers[False], step)
        times["sync: save"].append(call)
        times["sync: steps after"].append(train(steps))
        times["sync stall"].append(call)
        call = save(savers[True], step)
        beside = train(steps)
        start = time.perf_counter()
        savers[True].wait()
        wait = time.perf_counter() - start
        times["async: save call"].append(call)
        times["async: steps beside"].append(beside)
        times["async: wait after"].append(wait)
        times["async stall"].append(call + wait + beside - alone)
    size = sum(f.stat().st_size for f in savers[False].latest().rglob("*") if f.is_file())
    params = sum(p.numel() for p in state.model.parameters())
    lm.state.world.close()
    return times, size, params


def staging(cfg, run_dir: Path, rounds: int) -> dict[str, list[float]]:
    """The async save's blocking part alone: the state copied to fresh host memory (as before kiln.train.checkpoint
    .Staging; the page faults of a new allocation every save) against into the buffers kept from the last save."""
    lm = build_lm(cfg, run_dir, log=lambda m: None, with_data=False)
    state = lm.state
    x = torch.randint(0, 256, (cfg.train.micro_batch_size, cfg.data.seq_len))
    state.objective(state.step_model, (x, x)).backward()
    state.optimizer.step()  # the Adam moments exist
    kept = ck.Staging()
    times = {"fresh copy": [], "into kept buffers": []}
    for _ in range(rounds):
        tree = (state.state_dict(), state.model.state_dict())
        start = time.perf_counter()
        ck.Staging().copy(tree)
        times["fresh copy"].append(time.perf_counter() - start)
        start = time.perf_counter()
        kept.copy(tree)
        times["into kept buffers"].append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    args, overrides = ap.parse_known_args()
    base = load_config(None, ["--train.device=cpu", "--precision.mode=fp32", "--train.micro_batch_size=1",
                              "--data.seq_len=64", *overrides])
    print(f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} at the start")
    with tempfile.TemporaryDirectory(dir=os.environ.get("KILN_BENCH_DIR")) as d:
        for name, strategy in (("one process (torch.save)", "none"), ("data parallel (DCP), world of one", "ddp")):
            cfg = replace(base, parallel=replace(base.parallel, strategy=strategy))
            times, size, params = measure(cfg, Path(d) / strategy, args.rounds, args.steps)
            print(f"{name}: {params / 1e6:.1f} M parameters, {size / 1e6:.0f} MB per "
                  f"checkpoint, {args.steps} steps between saves, {args.rounds} saves each "
                  f"(ms: first save, median of the others)")
            for key, v in times.items():
                print(f"  {key:<22}{1000 * v[0]:>9.1f}{1000 * statistics.median(v[1:]):>9.1f}")
            sync, background = (statistics.median(times[k][1:]) for k in ("sync stall", "async stall"))
            print(f"  steady stall: sync {1000 * sync:.1f} ms, async {1000 * background:.1f} ms; async / sync "
                  f"{background / sync:.2f}x")
        times = staging(base, Path(d) / "staging", args.rounds)
        print(f"staging (one process), {args.rounds} copies each (ms: first, median of the others)")
        for key, v in times.items():
            print(f"  {key:<22}{1000 * v[0]:>9.1f}{1000 * statistics.median(v[1:]):>9.1f}")
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end")


if __name__ == "__main__":
    main()
