"""Two evaluation levers of `train`: the whole validation split (train.eval_batches=0), and stopping at a target
validation loss (train.stop_at_val_loss).

    eval_batch_count(tc, n_tokens, seq_len)     validation micro-batches per evaluation (0: every window)
    TargetStop(tc)                               .check(step, val_loss) -> (stop reason, event record) or None
"""
from __future__ import annotations

import time


def eval_batch_count(tc, n_tokens: int, seq_len: int) -> int:
    """train.eval_batches, or with 0 as many micro-batches as hold all (n_tokens - 1) // seq_len non-overlapping
    windows of the split: kiln.data.loader.val_batches then takes window k at token k·seq_len, every one once, in
    order (its evenly spread starts are k·available//available·seq_len = k·seq_len)."""
    if tc.eval_batches:
        return tc.eval_batches
    windows = (n_tokens - 1) // seq_len
    return max(1, -(-windows // tc.micro_batch_size))


class TargetStop:
    """train.stop_at_val_loss: the first evaluation at or below the target ends the run (its stop reason and a
    `target_reached` event record); elapsed_s counts from this object's creation (the Trainer's)."""

    def __init__(self, tc):
        self.target = tc.stop_at_val_loss
        self.started = time.perf_counter()

    def check(self, step: int, val_loss: float) -> tuple[str, dict] | None:
        if not self.target or not val_loss <= self.target:  # a NaN loss never reaches it
            return None
        elapsed = time.perf_counter() - self.started
        return (f"target: val_loss {val_loss:.4f} ≤ {self.target:g} at step {step}",
                {"step": step, "event": "target_reached", "val_loss": val_loss, "elapsed_s": round(elapsed, 3)})
