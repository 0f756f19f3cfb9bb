"""Callbacks: a user's objects called by the training loop at three points, each able to end the run.

    on_step_end(trainer, record)   after every optimizer step; `record` is the step's metrics.jsonl train record
                                   on logged steps (every log.interval), else {"step": n, "lr": lr}
    on_eval(trainer, record)       after each evaluation, with its eval record (val_loss, val_<metric>, ...)
    on_checkpoint(trainer, path)   after each checkpoint is written (the final one included)

A callback implements any of the three. `trainer.request_stop(reason)` ends the run at the end of the current step
(final checkpoint included); `reason` becomes the run's stop_reason. Under data parallelism every rank calls its
callbacks: a stop must be decided the same on all of them (from logged values, which are the same everywhere).
"""
from __future__ import annotations

HOOKS = ("on_step_end", "on_eval", "on_checkpoint")


class Callbacks:
    """The run's callbacks, checked once: each object must implement at least one hook."""

    def __init__(self, callbacks=()):
        if callbacks is None:
            callbacks = ()
        if not isinstance(callbacks, (list, tuple)):
            callbacks = [callbacks]
        for i, cb in enumerate(callbacks):
            if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
                raise TypeError(f"callbacks[{i}] ({type(cb).__name__}) has none of {', '.join(HOOKS)}; give it at "
                                f"least one, e.g. def on_step_end(self, trainer, record)")
        self.callbacks = list(callbacks)

    def _call(self, hook: str, trainer, arg) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(trainer, arg)

    def step_end(self, trainer, record: dict) -> None:
        self._call("on_step_end", trainer, record)

    def eval(self, trainer, record: dict) -> None:
        self._call("on_eval", trainer, record)

    def checkpoint(self, trainer, path) -> None:
        self._call("on_checkpoint", trainer, path)

    def __bool__(self) -> bool:
        return bool(self.callbacks)
