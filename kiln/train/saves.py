"""When a run saves, and the save itself: every checkpoint.interval steps, every checkpoint.every_minutes of wall
clock, at a stop signal (SIGTERM, SIGINT, SIGUSR1: what schedulers send before a kill) and at the end.

    saves = Saves(cfg.checkpoint, checkpointer, warn=print)
    with saves.stop_signals(): ...       a signal is noted in saves.signal; the loop ends at the next step boundary
    saves.due(step, last, stop_now, clock_due)
    path = saves.save(state, config_text, run_dir)   None when it failed under checkpoint.on_error=warn
"""
from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from kiln.train.checkpoint import CheckpointConfig, Checkpointer, CheckpointWriteError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Saves:
    """checkpoint.interval, every_minutes, keep_last (the free-space check) and on_error, and the stop signal."""

    def __init__(self, cc: CheckpointConfig, checkpointer: Checkpointer, warn: Callable[[str], None]):
        self.interval, self.every_minutes = cc.interval, cc.every_minutes
        self.keep_last, self.on_error = cc.keep_last, cc.on_error
        self.checkpointer, self.warn = checkpointer, warn
        self.last_save = time.monotonic()
        self.first_save = True
        self.signal: int | None = None  # a stop signal received (SIGTERM, SIGINT, SIGUSR1): the run ends at a step

    def clock_due(self, now: float) -> bool:
        """checkpoint.every_minutes passed since the last save (`now` from time.monotonic)."""
        return bool(self.every_minutes) and now - self.last_save >= 60 * self.every_minutes

    def due(self, step: int, last: bool, stop_now: str | None, clock_due: bool) -> bool:
        """A save after this step (the last step and a stopping one are saved by the run's final save)."""
        return not last and not stop_now and (bool(self.interval and step % self.interval == 0) or clock_due)

    def save(self, state, text: str, run_dir: Path) -> Path | None:
        """Save the state at its step (sharded under data parallelism) with `text` as its config.toml."""
        if self.first_save:
            self.first_save = False
            self.check_free_space(state, run_dir)
        try:
            if state.world.sharded:
                path = self.checkpointer.save_sharded(state.step, state, text)
            else:
                path = self.checkpointer.save(state.step, state.state_dict(), text, state.model)
        except CheckpointWriteError as e:
            if self.on_error != "warn":
                raise
            self.warn(f"checkpoint: {e}; training on (checkpoint.on_error=warn)")
            return None
        self.last_save = time.monotonic()
        return path

    def check_free_space(self, state, run_dir: Path) -> None:
        """Before the first save: warn when keep_last checkpoints of this size will not fit on the disk."""
        if not state.world.main:
            return
        weights = [*state.model_state_dict().values()]  # a LoRA run on model.init: the adapters only
        tensors = weights + [v for s in state.optimizer.state.values() if s  # ZeRO-1: None for others' parameters
                             for v in s.values() if isinstance(v, torch.Tensor)]
        size = sum(t.numel() * t.element_size() for t in tensors)
        size += sum(t.numel() * t.element_size() for t in weights)  # model.safetensors
        target = self.checkpointer.dir if self.checkpointer.dir.exists() else run_dir
        target.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(target).free
        need = size * (self.keep_last + 1)  # the kept ones and the one being written
        if free < need:
            self.warn(f"checkpoint: {self.keep_last} checkpoints of ~{size:,} bytes (and the one being written) "
                      f"need {need:,} bytes, {free:,} are free on {target}; lower checkpoint.keep_last or free space")

    @contextlib.contextmanager
    def stop_signals(self):
        """SIGTERM, SIGINT, SIGUSR1 end the run at the next step boundary with a checkpoint; a second SIGINT stops
        at once."""
        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signal = signum
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only; a loop run elsewhere keeps the handlers it has
            return
        previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
