"""What durability costs a checkpoint save: page cache only vs fsync vs fsync + the xxh3 manifest, side by side.

    .venv/bin/python benchmarks/checkpoint_cost.py [--rounds 10] [overrides]   (default: the default job's model)
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.run.lm import build_lm
from kiln.train import checkpoint as ck


def fsync_only(directory: Path) -> None:
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        ck._fsync(f)
    ck._fsync(directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    args, overrides = ap.parse_known_args()
    cfg = load_config(None, ["--train.device=cpu", *overrides])
    with tempfile.TemporaryDirectory() as d:
        state = build_lm(cfg, Path(d) / "run", log=lambda m: None, with_data=False).state
        x = torch.randint(0, 256, (2, 32))
        state.objective(state.model, (x, x)).backward()
        state.optimizer.step()  # the optimizer state exists, as in any checkpoint after step 1
        saver = ck.Checkpointer(ck.CheckpointConfig(keep_last=1000), Path(d) / "run")  # no pruning: rmtree is not the manifest's cost
        real = ck.seal
        modes = {"page cache only": lambda p: None, "fsync, no manifest": fsync_only, "fsync + xxh3 manifest": real}
        times = {m: [] for m in modes}
        step = 0
        try:
            for _ in range(args.rounds):  # the three alternate, so machine noise hits all alike
                for mode, seal in modes.items():
                    ck.seal, step = seal, step + 1
                    start = time.perf_counter()
                    path = saver.save(step, state.state_dict(), "", state.model)
                    times[mode].append(time.perf_counter() - start)
        finally:
            ck.seal = real
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    medians = {m: statistics.median(v) * 1000 for m, v in times.items()}
    print(f"{cfg.model.preset}: {size / 1e6:.1f} MB per checkpoint, median of {args.rounds}")
    for mode, ms in medians.items():
        print(f"  {mode:<26}{ms:>8.1f} ms")
    print(f"manifest over a durable save: {medians['fsync + xxh3 manifest'] / medians['fsync, no manifest']:.2f}x")


if __name__ == "__main__":
    main()
