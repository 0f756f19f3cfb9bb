"""Cost of kiln's numerics when nothing goes wrong: tracing and spike detection armed vs off.

Two measurements, because a shared CPU is too noisy for one number to carry a 2% claim:

1. End to end, alternating. Identical runs of the configuration (same seed, same data), one per variant,
   take turns one training step at a time, so machine noise lands on every variant alike. Every `--interval`
   steps each run has its sync point, as in `train()`: `numerics.review` and the metrics record. Reports the
   median step time per variant, the median of step-by-step paired ratios to `off`, and total times (which
   contention outliers dominate on a shared machine).
2. The added work alone. The same device-side `StepGuard.check`, `Numerics.begin_step` and `Numerics.review`
   calls, timed in a tight loop on the same device and tensors, divided by the measured step time: an upper
   bound on the overhead that noise cannot blur.

    .venv/bin/python benchmarks/numerics_overhead.py [--steps 200] [--interval 10] [--section.key=value ...]

Variants:
    off       numerics.trace=false, numerics.spike_policy=off: no guard, train_step exactly as without numerics
    armed     trace=true, spike_policy=skip: device-side spike judgement folded into found_inf, review per interval
    rollback  trace=true, spike_policy=rollback, a memory snapshot at every sync point (its worst case)
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
from kiln.train.logging import MetricsLogger
from kiln.train.schedule import lr_factor
from kiln.train.step import train_step

VARIANTS = {
    "off": ["--numerics.trace=false", "--numerics.spike_policy=off"],
    "armed": ["--numerics.trace=true", "--numerics.spike_policy=skip"],
    "rollback": ["--numerics.trace=true", "--numerics.spike_policy=rollback"],
}


class Bench:
    """One run of one variant, stepped from outside exactly as `train()` steps it."""

    def __init__(self, overrides: list[str], interval: int, root: Path, name: str):
        # The shape, length and lr of the default job when docs/numerics.md was measured.
        cfg = load_config(None, ["--model.preset=tiny", "--train.max_steps=400", "--optim.lr=1e-3",
                                 "--train.device=cpu", "--log.tensorboard=false", "--log.progress=off",
                                 f"--log.interval={interval}", f"--numerics.snapshot_interval={interval}",
                                 *overrides])
        self.interval = interval
        lm = build_lm(cfg, root / name, log=lambda msg: None)
        self.cfg, self.run = lm.cfg, lm.state
        self.logger = MetricsLogger(cfg.log, root / name, 10**9)
        self.numerics = lm.trainer(root / name).numerics  # as kiln train builds it; this class steps it itself
        self.numerics.start()
        self.result = None

    def step(self) -> float:
        """One training step, plus the sync point when one is due; returns the wall time."""
        run, numerics, cfg = self.run, self.numerics, self.cfg
        start = time.perf_counter()
        lr = cfg.optim.lr * lr_factor(cfg.schedule, run.step, cfg.train.max_steps) * numerics.lr_factor(run.step)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        batches = numerics.begin_step(run.step + 1, [run.loader.next() for _ in range(cfg.train.grad_accum_steps)])
        self.result = train_step(run.step_model, batches, run.objective, run.optimizer, run.precision, run.scaler,
                                 cfg.optim, run.masters, numerics.guard)
        run.step += 1
        if run.step % self.interval == 0:
            verdict = numerics.review(self.logger)
            assert not verdict.rolled_back and not verdict.stop, "a clean benchmark run must not trip numerics"
            self.logger.log({"step": run.step, "loss": self.result.loss.item(),
                             "grad_norm": self.result.grad_norm.item()}, kind="train")
        return time.perf_counter() - start

    def close(self) -> None:
        self.numerics.close()
        self.logger.close()
        self.run.loader.close()


def added_work_seconds(bench: Bench, repeats: int) -> dict[str, float]:
    """Seconds per call of what numerics adds to a step and to a sync point, on `bench`'s live state."""
    numerics, run = bench.numerics, bench.run
    guard, r = numerics.guard, bench.result
    scale = run.scaler.scale
    out = {}
    start = time.perf_counter()
    for i in range(repeats):
        guard.step = run.step + 1 + i % guard.ring_size
        guard.check(r.loss, r.grad_norm, r.skipped, scale)
    out["check"] = (time.perf_counter() - start) / repeats
    batches = [(torch.zeros(1), torch.zeros(1))]
    start = time.perf_counter()
    for i in range(repeats):
        numerics.begin_step(run.step + 1, batches)
    out["begin_step"] = (time.perf_counter() - start) / repeats
    numerics._batches.clear()
    numerics._positions.clear()
    start = time.perf_counter()
    n = max(1, repeats // 20)
    for _ in range(n):
        numerics.reviewed = run.step - bench.interval  # a full interval of rows to read, as at a real sync point
        if numerics.snapshot_step is not None:
            numerics.snapshot_step = run.step - bench.interval  # so the rollback variant snapshots every time
        numerics.review(bench.logger)
    out["review"] = (time.perf_counter() - start) / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="measured steps per variant (after warmup)")
    ap.add_argument("--interval", type=int, default=10, help="steps between sync points (log.interval)")
    ap.add_argument("--warmup", type=int, default=10, help="steps per variant run first and not counted")
    ap.add_argument("--variants", default="off,armed,rollback")
    args, overrides = ap.parse_known_args()  # the rest: --section.key=value config overrides for every variant
    names = args.variants.split(",")
    with tempfile.TemporaryDirectory(prefix="kiln-numerics-bench-") as tmp:
        benches = {n: Bench([*overrides, *VARIANTS[n]], args.interval, Path(tmp), n) for n in names}
        first = benches[names[0]]
        print(f"{first.cfg.model.preset}: precision {first.run.precision.mode}, batch "
              f"{first.cfg.train.micro_batch_size}×{first.cfg.data.seq_len}, sync every {args.interval} steps, "
              f"{args.steps} steps per variant, "
              f"variants {names}, alternating step by step")
        times = {n: [] for n in names}
        for i in range(args.warmup + args.steps):
            order = names if i % 2 == 0 else names[::-1]  # alternate who goes first as well
            for n in order:
                t = benches[n].step()
                if i >= args.warmup:
                    times[n].append(t)
        work = {n: added_work_seconds(benches[n], 2000) for n in names if benches[n].numerics.guard is not None}
        for b in benches.values():
            b.close()
    base_total, base_median = sum(times[names[0]]), statistics.median(times[names[0]])
    print(f"\n{'variant':10s} {'median s/step':>14s} {'median vs off':>14s} {'paired ratio':>13s} "
          f"{'paired IQR':>16s} {'total s':>9s} {'total vs off':>13s}")
    for n in names:
        # Paired: step i of this variant over step i of `off`, run back to back; robust to slow drifts in load.
        ratios = [a / b for a, b in zip(times[n], times[names[0]])]
        q = statistics.quantiles(ratios, n=4)
        print(f"{n:10s} {statistics.median(times[n]):14.4f} {statistics.median(times[n]) / base_median:14.4f} "
              f"{statistics.median(ratios):13.4f} {f'{q[0]:.3f}-{q[2]:.3f}':>16s} {sum(times[n]):9.2f} "
              f"{sum(times[n]) / base_total:13.4f}")
    print(f"\nadded work alone (µs), and as a share of the median 'off' step ({base_median * 1e3:.0f} ms):")
    for n, w in work.items():
        per_step = w["check"] + w["begin_step"] + w["review"] / args.interval
        print(f"{n:10s} check {w['check'] * 1e6:7.1f}  begin_step {w['begin_step'] * 1e6:6.1f}  review "
              f"{w['review'] * 1e6:8.1f} (once per {args.interval} steps)  -> {per_step * 1e6:7.1f} µs/step = "
              f"{100 * per_step / base_median:.3f}% of a step")


if __name__ == "__main__":
    main()
