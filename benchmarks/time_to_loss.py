"""Time to quality: how long a whole `kiln train` process takes to reach the validation loss that a plain
nanoGPT-style loop reaches after 300 updates, on the same CPU (issue 40's speedrun).

The plain loop (a stand-in for nanoGPT's train.py, set up as the issue states): the tiny shape (6 layers × 384,
6 heads, seq 256, byte vocabulary, tied embeddings, no biases, GPT-2 init), fp32, batch 8 × 256, torch's AdamW
(lr 1e-3, betas 0.9/0.95, weight decay 0.1 on every 2-D parameter as nanoGPT's configure_optimizers does, no
fused kernel on CPU as nanoGPT), global-norm clipping at 1.0, 50 linear warm-up updates then cosine to 10% at 300;
random windows of kiln's train shard as nanoGPT's get_batch draws them. After 300 updates its loss over the full
val split — every (len(val)-1)//256 non-overlapping window, in order, kiln's train.eval_batches=0 windows — is
the target.

kiln: `kiln train examples/speedrun_cpu.toml --train.stop_at_val_loss=TARGET`, whole process (imports,
data, every evaluation, the final checkpoint, exit), stopping at its first evaluation at or below the target.

Each seed runs the plain loop, then kiln with the same seed against that loop's target; the ratio is kiln's
whole-process time over the plain loop's (goal ≤ 0.5, every seed reaching the target).

    PYTHONPATH=. python benchmarks/time_to_loss.py [--seeds 1337,1338,1339] [--json out.json]
    PYTHONPATH=. python benchmarks/time_to_loss.py --target 2.05 --seeds 1337     # kiln only, a known target
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from vs_plain_loop import SHAPE, plain_gpt, prepared_shards, read_shards

UPDATES, WARMUP, LR, MIN_LR_RATIO = 300, 50, 1e-3, 0.1
BETAS, WEIGHT_DECAY, GRAD_CLIP = (0.9, 0.95), 0.1, 1.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "speedrun_cpu.toml")


def plain_child(args) -> dict:
    import math

    import numpy as np
    import torch

    torch.manual_seed(args.seed)
    train, val = read_shards(args.train_bin, args.val_bin)
    B, T = SHAPE["batch"], SHAPE["seq_len"]

    def get_batch(data):  # nanoGPT's get_batch
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    model = plain_gpt(SHAPE, reduction="sum")
    decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT decays every 2-D parameter
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS)
    updates = 3 if args.smoke else UPDATES
    for step in range(updates):
        if step < WARMUP:
            factor = (step + 1) / WARMUP
        else:
            progress = (step - WARMUP) / (UPDATES - WARMUP)
            factor = MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = LR * factor
        x, y = get_batch(train)
        loss = model(x, y) / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    model.eval()
    windows = (len(val) - 1) // T if not args.smoke else 16  # every non-overlapping window of the val split, in order
    total = 0.0
    with torch.no_grad():
        for first in range(0, windows, B):
            starts = range(first * T, min(first + B, windows) * T, T)
            x = torch.stack([torch.from_numpy(val[i:i + T].astype(np.int64)) for i in starts])
            y = torch.stack([torch.from_numpy(val[i + 1:i + 1 + T].astype(np.int64)) for i in starts])
            total += model(x, y).item()
    val_loss = total / (windows * T)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": UPDATES},
               os.path.join(args.run_dir, "ckpt.pt"))
    return {"val_loss": val_loss, "windows": windows, "updates": updates, "threads": torch.get_num_threads()}


def run_plain(seed: int, shards, tmp: str, smoke: bool = False) -> dict:
    run_dir = os.path.join(tmp, f"plain-{seed}")
    os.makedirs(run_dir)
    out = os.path.join(tmp, f"plain-{seed}.json")
    began = time.time()
    subprocess.run([sys.executable, __file__, "--child", *(["--smoke"] if smoke else []), "--seed", str(seed), "--run-dir", run_dir, "--out", out,
                    "--train-bin", shards[0], "--val-bin", shards[1]], check=True, stdout=subprocess.DEVNULL)
    return {"wall_s": time.time() - began, **json.load(open(out))}


def run_kiln(seed: int, target: float, tmp: str, extra: list[str]) -> dict:
    run_dir = os.path.join(tmp, f"kiln-{seed}")
    cmd = [sys.executable, "-m", "kiln", "train", EXAMPLE, "--run-dir", run_dir,
           f"--train.stop_at_val_loss={target}", f"--train.seed={seed}", *extra]
    began = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - began
    if proc.returncode:
        raise SystemExit(f"kiln train exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    reached = [r for r in rows if r.get("event") == "target_reached"]
    evals = [r for r in rows if r["kind"] == "eval"]
    last = evals[-1] if evals else {}
    return {"wall_s": wall, "reached": bool(reached), "step": last.get("step"), "val_loss": last.get("val_loss"),
            "target_elapsed_s": reached[0]["elapsed_s"] if reached else None,
            "evals": [(r["step"], round(r["val_loss"], 4)) for r in evals]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1337,1338,1339")
    ap.add_argument("--target", type=float, default=0.0, help="skip the plain loop: kiln against this val loss")
    ap.add_argument("--plain-only", action="store_true", help="the plain loop alone (its time and target)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--smoke", action="store_true", help="check the script: 3 plain updates, 16 val windows (pass "
                    "kiln e.g. --train.max_steps=2 --train.eval_interval=2 --train.eval_batches=2)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--seed", "--run-dir", "--out", "--train-bin", "--val-bin"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()  # anything else goes to kiln train (e.g. --optim.muon_lr=0.03)
    if args.child:
        args.seed = int(args.seed)
        json.dump(plain_child(args), open(args.out, "w"))
        return
    shards = prepared_shards(1337)  # the data split does not depend on the training seed
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            row = {"seed": seed, "load_before": os.getloadavg()[0]}
            if args.target:
                target = args.target
            else:
                row["plain"] = plain = run_plain(seed, shards, tmp, args.smoke)
                target = plain["val_loss"]
                print(f"seed {seed} plain: val {target:.4f} over {plain['windows']} windows after {plain['updates']} updates, "
                      f"whole process {plain['wall_s']:.1f} s", flush=True)
            row["target"] = target
            if not args.plain_only:
                row["kiln"] = k = run_kiln(seed, target, tmp, extra)
                ratio = k["wall_s"] / row["plain"]["wall_s"] if "plain" in row else None
                print(f"seed {seed} kiln: {'reached' if k['reached'] else 'did NOT reach'} {target:.4f} "
                      f"(val {k['val_loss']} at step {k['step']}), whole process {k['wall_s']:.1f} s"
                      + (f" = {ratio:.2f}x the plain loop's" if ratio else "") + f" | evals {k['evals']}", flush=True)
            row["load_after"] = os.getloadavg()[0]
            rows.append(row)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
