"""Run logging: metrics.jsonl (one JSON object per record), TensorBoard events, a live console progress bar.

Every metrics.jsonl line has a `kind` (its schema is in docs/training.md, "metrics.jsonl"):
    train     step, loss, lr, grad_norm, tokens_per_s | samples_per_s, step_time_s, tokens_seen | samples_seen,
              peak_mem_bytes, mfu (when the FLOPs are known), skipped_steps, loss_scale (fp16)
    eval      step, val_loss, val_ppl (language models)
    numerics  step, event (nonfinite, loss_spike, rollback, loss_scale, fp16_grads, fp16_advice, stop, ...) and
              the event's own fields
    event     step, event (restart, straggler) and the event's own fields: the run's life rather than its numbers
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kiln.errors import KilnError


REFRESH_S = 0.5  # the live progress bar is redrawn at most this often
KINDS = ("train", "eval", "numerics", "event")  # event: the run's life (restart, straggler)


@dataclass
class LogConfig:
    interval: int = 10  # steps between metric records (each one costs a host-device sync)
    tensorboard: bool = True  # write TensorBoard event files beside metrics.jsonl
    progress: str = "auto"  # "auto" (live bar on a terminal, plain lines otherwise) | "bar" | "lines" | "off"

    def validate(self):
        if self.interval < 1:
            raise KilnError(f"log.interval must be ≥ 1, got {self.interval}",
                            key="log.interval", value=self.interval, fix="give a number of steps ≥ 1")
        if self.progress not in ("auto", "bar", "lines", "off"):
            raise KilnError(f"log.progress={self.progress!r}; use auto, bar, lines or off",
                            key="log.progress", value=self.progress, fix="use auto, bar, lines or off")


def _clean(value):
    """JSON has no NaN/Inf: write them as strings so the file stays parseable by every reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    def __init__(self, cfg: LogConfig, run_dir: Path, total_steps: int | None, start_step: int = 0,
                 console: Console | None = None, enabled: bool = True, resumed_at: int | None = None):
        """enabled=False (every rank but 0 under data parallelism): records, lines and the bar go nowhere.
        resumed_at: the step a resumed run continues from; records after it (written before a crash, and about to
        be written again) move to metrics.stale-N.jsonl, and TensorBoard purges them."""
        self.cfg, self.enabled = cfg, enabled
        self.console = console or Console(file=sys.stdout)
        self.file = self.tb = self.progress = None
        self.mode = "off"
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resumed_at is not None:
            self._drop_after(run_dir / "metrics.jsonl", resumed_at)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard only when log.tensorboard

            purge = {"purge_step": resumed_at + 1} if resumed_at is not None else {}
            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), **purge)
        mode = cfg.progress
        if mode == "auto":
            mode = "bar" if self.console.is_terminal else "lines"
        self.mode = mode
        self._refreshed = 0.0
        if mode == "bar":
            # Redrawn from the training thread at most every REFRESH_S: rich's default auto-refresh is a thread
            # waking 10 times a second, and on a 2-core CPU every wake-up takes a core from the step's 2 threads.
            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
                auto_refresh=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self.progress.start()

    def _drop_after(self, path: Path, step: int) -> None:
        """Keep the records up to `step`; move the later ones aside with a note, so each step appears once."""
        if not path.is_file():
            return
        keep, stale = [], []
        # Bytes that are not UTF-8 (a damaged file) are replaced: their lines are not JSON and move aside.
        for line in path.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True):
            try:
                record_step = json.loads(line).get("step", 0)
            except (json.JSONDecodeError, AttributeError):  # a line cut by the crash, or damage
                stale.append(line)
                continue
            if not isinstance(record_step, (int, float)):
                stale.append(line)
                continue
            (stale if record_step > step else keep).append(line)
        if not stale:
            return
        n = 1
        while (path.parent / f"metrics.stale-{n}.jsonl").exists():
            n += 1
        aside = path.parent / f"metrics.stale-{n}.jsonl"
        aside.write_text("".join(stale))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
        self.console.print(f"metrics: {len(stale)} records after step {step}, from before the interruption, moved "
                           f"to {aside.name}", highlight=False)

    def print(self, *args, **kw):
        if self.enabled:
            self.console.print(*args, **kw)

    def set_total(self, total_steps: int) -> None:
        """The run's length, once known (a time-budgeted run measures its first steps to decide it)."""
        if self.progress is not None:
            self.progress.update(self.task, total=total_steps)

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)
            self._refresh()

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._refreshed >= REFRESH_S:
            self.progress.refresh()
            self._refreshed = now

    def log(self, record: dict, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"metrics record kind {kind!r}; use one of {KINDS}")
        if not self.enabled:
            return
        record = {"kind": kind} | {k: _clean(v) for k, v in record.items() if v is not None}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record.get("step", 0)
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, step)
        stats = self._summary(record) if kind != "event" else ""  # an event's val_loss (target_reached) is no eval line
        if self.progress is not None:
            self.progress.update(self.task, stats=stats)
            self._refresh(force=True)
        elif self.mode == "lines" and stats:
            self.console.print(f"step {step} {stats}", highlight=False)

    @staticmethod
    def _summary(r: dict) -> str:
        parts = []
        if "loss" in r:
            parts.append(f"loss {_fmt(r['loss'])}")
        if "val_loss" in r:
            parts.append(f"val_loss {_fmt(r['val_loss'])}")
            # fit(metrics=...): val_<name>
            parts += [f"{k} {_fmt(v)}" for k, v in r.items() if k.startswith("val_") and k not in ("val_loss", "val_ppl")
                      and isinstance(v, float)]
            # train.eval_tasks: each task's acc and acc_norm, or bits per byte (the stderr is in the record)
            parts += [f"{k.removeprefix('task_')} {_fmt(v)}" for k, v in r.items() if k.startswith("task_")
                      and not k.endswith("_stderr")]
        if "lr" in r:
            parts.append(f"lr {r['lr']:.2e}")
        if "tokens_per_s" in r:
            parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
        if "samples_per_s" in r:
            parts.append(f"{r['samples_per_s']:,.0f} samples/s")
        if r.get("mfu") is not None:
            parts.append(f"mfu {100 * r['mfu']:.1f}%")
        if r.get("hfu") is not None and r.get("mfu") is not None and r["hfu"] > r["mfu"]:  # only with recompute
            parts.append(f"hfu {100 * r['hfu']:.1f}%")
        if r.get("utilisation") is not None:
            parts.append(f"busy {100 * r['utilisation']:.0f}%")
        if "comm_s" in r:
            parts.append(f"all-reduce {1000 * r['comm_s']:.1f} ms/step")
        return " | ".join(parts)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)
