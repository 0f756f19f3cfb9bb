"""8-bit AdamW against fp32 AdamW on the default job (`kiln train`: tiny preset, stdlib corpus, 300 steps).

Reports, for each optimizer: validation loss after the same steps, optimizer state bytes, mean step time. The
acceptance target: 8-bit state ≈ 4x smaller and validation loss within 1% of fp32 AdamW.

    .venv/bin/python benchmarks/adam8bit.py [--steps 300] [--runs-dir /tmp/kiln-adam8bit] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.memory.measure import optimizer_state_tensors, tensor_bytes
from kiln.run.lm import train


def run(name: str, overrides: list[str], runs_dir: Path) -> dict:
    cfg = load_config(None, ["--model.preset=tiny", "--optim.lr=1e-3", "--train.sample_tokens=0", "--log.progress=off",
                             "--log.tensorboard=false"] + overrides)
    run_dir = runs_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    summary = train(cfg, run_dir)
    seconds = time.perf_counter() - start
    optimizer = summary.state.optimizer
    return {"optimizer": name, "steps": summary.step, "val_loss": summary.val_loss,
            "state_bytes": tensor_bytes(optimizer_state_tensors(optimizer)), "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--runs-dir", default="/tmp/kiln-adam8bit")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default); 1 avoids OpenMP "
                                                          "spin contention on a shared machine")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = Path(args.runs_dir)
    steps = [f"--train.max_steps={args.steps}"]
    rows = [run("adamw", steps, runs), run("adamw8bit", steps + ["--optim.name=adamw8bit"], runs)]
    ref, q = rows
    result = {"threads": torch.get_num_threads(), "rows": rows, "state_ratio": ref["state_bytes"] / q["state_bytes"],
              "val_loss_rel_diff": q.val_loss / ref.val_loss - 1}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
