"""Evaluation levers of `train`: the whole validation split (train.eval_batches=0), the windows per evaluation
forward (train.eval_micro_batch_size), and stopping at a target validation loss (train.stop_at_val_loss).

    eval_batch_count(tc, n_tokens, seq_len)     validation micro-batches per evaluation (0: every window)
    eval_micro_batch(tc, seq_len, vocab, ...)   windows per evaluation forward (0: auto)
    regroup(batches, size)                      the same windows, in the same order, in batches of `size`
    TargetStop(tc)                               .check(step, val_loss) -> (stop reason, event record) or None
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

# train.eval_micro_batch_size=0 on a CPU: windows per forward up to this many tokens. Measured on a 2-core Xeon
# (AMX-BF16), one thread, the tiny preset at seq 256 (docs/benchmarks.md): CPU time per window against 8 windows
# per forward in one autocast region each, with one region for all, bf16 2: 1.13x, 4: 1.07x, 8: 0.95x, 16: 0.89x,
# 32: 0.85x, 64: 0.84x; fp32 (compute-bound) 16: 1.00x, 32: 0.99x, 64: 1.12x. 8,192 tokens (32 windows of 256):
# bf16's gain without fp32's loss.
EVAL_TOKENS = 8192
# ... and without letting the fp32 logits of one forward grow past 64 MiB or, when one training micro-batch's own
# are larger, past twice those (what a training step already holds: its logits and their gradient).
EVAL_LOGITS_BYTES = 64 << 20


def eval_batch_count(tc, n_tokens: int, seq_len: int) -> int:
    """train.eval_batches, or with 0 as many micro-batches as hold all (n_tokens - 1) // seq_len non-overlapping
    windows of the split: kiln.data.loader.val_batches then takes window k at token k·seq_len, every one once, in
    order (its evenly spread starts are k·available//available·seq_len = k·seq_len)."""
    if tc.eval_batches:
        return tc.eval_batches
    windows = (n_tokens - 1) // seq_len
    return max(1, -(-windows // tc.micro_batch_size))


def eval_micro_batch(tc, seq_len: int, vocab: int, device_type: str, pipelined: bool = False) -> int:
    """Windows per evaluation forward: train.eval_micro_batch_size, or with 0 (auto) train.micro_batch_size grown
    on a CPU to at most EVAL_TOKENS tokens and EVAL_LOGITS_BYTES of logits (never below micro_batch_size). auto keeps
    micro_batch_size on other devices (not measured there; their memory is tighter) and under pipeline parallelism
    (its schedule splits each batch into plan.pp_microbatches itself)."""
    if tc.eval_micro_batch_size:
        return tc.eval_micro_batch_size
    mbs = tc.micro_batch_size
    if device_type != "cpu" or pipelined:
        return mbs
    logits = max(1, seq_len * vocab * 4)  # bytes of fp32 logits per window
    most = max(EVAL_TOKENS // max(1, seq_len), 1)
    most = min(most, max(EVAL_LOGITS_BYTES // logits, 2 * mbs))
    return max(mbs, most)


def regroup(batches: Iterable[tuple], size: int) -> Iterator[tuple]:
    """The windows of `batches` (tuples of tensors whose first dimension is the window: (x, y) or (x, y, doc)), in
    the same order, re-cut into batches of `size` windows (the last one smaller): an evaluation's grouping changes,
    never its windows."""
    held: list[tuple] = []
    rows = 0
    for batch in batches:
        held.append(batch)
        rows += batch[0].shape[0]
        while rows >= size:
            joined = tuple(torch.cat(parts) for parts in zip(*held)) if len(held) > 1 else held[0]
            yield tuple(t[:size] for t in joined)
            rest = tuple(t[size:] for t in joined)
            rows -= size
            held = [rest] if rows else []
    if rows:
        yield tuple(torch.cat(parts) for parts in zip(*held)) if len(held) > 1 else held[0]


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
