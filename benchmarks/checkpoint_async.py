"""How long a checkpoint stops training: a synchronous save against checkpoint.async_save, side by side.

    .venv/bin/python benchmarks/checkpoint_async.py [--rounds 5] [--steps 4] [overrides]   (default job's model)

For one process (a host copy written by a thread) and for the data-parallel path (DCP in a world of one: dcp.save
against dcp.async_save on its own gloo group), in one process, rounds of: STEPS training steps alone; a sync save
then STEPS steps; an async save then STEPS steps (the write runs beside them), then waiting for it. The stall of a
save is what it adds to the STEPS steps' time, so it includes what the background write takes from the steps
(threads share the GIL and, on a small CPU, the cores). Printed: the medians and the async / sync ratio of stalls.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.run.lm import build_lm
from kiln.train import checkpoint as ck


def measure(cfg, run_dir: Path, rounds: int, steps: int) -> dict[str, list[float]]:
    lm = build_lm(cfg, run_dir, log=lambda m: None, with_data=False)
    state = lm.state
    x = torch.randint(0, 256, (cfg.train.micro_batch_size, cfg.data.seq_len))

    def train(n):
        for _ in range(n):
            state.objective(state.step_model, (x, x)).backward()
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)

    train(2)  # warm-up; the optimizer state exists, as in any checkpoint after step 1
    savers = {a: ck.Checkpointer(replace(cfg.checkpoint, keep_last=2, async_save=a), run_dir / f"a{a}")
              for a in (False, True)}
    times = {"steps alone": [], "sync save + steps": [], "async save + steps": [], "async save returns": [],
             "async on disk": []}
    for step in range(1, rounds + 1):
        start = time.perf_counter()
        train(steps)
        times["steps alone"].append(time.perf_counter() - start)
        for a, saver in savers.items():
            start = time.perf_counter()
            if state.world.sharded:
                saver.save_sharded(step, state, "")
            else:
                saver.save(step, state.state_dict(), "", state.model)
            returned = time.perf_counter() - start
            train(steps)
            saver.wait()  # an async write not done by now would hold up the next save: it counts
            took = time.perf_counter() - start
            times["async save + steps" if a else "sync save + steps"].append(took)
            if a:
                times["async save returns"].append(returned)
                times["async on disk"].append(saver.written_at - start)
    lm.state.world.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    args, overrides = ap.parse_known_args()
    base = load_config(None, ["--train.device=cpu", "--precision.mode=fp32", *overrides])
    with tempfile.TemporaryDirectory() as d:
        for name, strategy in (("one process (torch.save)", "none"), ("data parallel (DCP), world of one", "ddp")):
            cfg = replace(base, parallel=replace(base.parallel, strategy=strategy))
            times = measure(cfg, Path(d) / strategy, args.rounds, args.steps)
            size = sum(f.stat().st_size for f in (Path(d) / strategy / "aFalse").rglob("*") if f.is_file())
            med = {k: statistics.median(v) * 1000 for k, v in times.items()}
            print(f"{name}: {cfg.model.preset}, {size / 2 / 1e6:.1f} MB per checkpoint, {args.steps} steps, "
                  f"median of {args.rounds}")
            for key, ms in med.items():
                print(f"  {key:<20}{ms:>8.1f} ms")
            sync, background = (med[k] - med["steps alone"] for k in ("sync save + steps", "async save + steps"))
            print(f"  stall: sync {sync:.1f} ms, async {background:.1f} ms; async / sync {background / sync:.2f}x")


if __name__ == "__main__":
    main()
