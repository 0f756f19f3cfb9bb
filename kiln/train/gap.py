"""What each evaluation is compared against: the training losses logged since the last one (the generalisation gap,
with a warning when it keeps growing) and the best validation loss so far (early stopping).

    gap = GapMonitor(cfg.train)
    gap.observe(loss)                            every logged training loss
    warning = gap.compare(record)                an eval record gains train_loss and gap; the overfitting warning
    stop = gap.early_stop(state, val_loss, last) the stop reason once patience ran out
"""
from __future__ import annotations

import math

from kiln.train.settings import TrainConfig


class GapMonitor:
    """train.gap_patience (the overfitting warning) and train.early_stop_patience / early_stop_min_delta."""

    def __init__(self, tc: TrainConfig):
        self.gap_patience = tc.gap_patience
        self.patience, self.min_delta = tc.early_stop_patience, tc.early_stop_min_delta
        self.train_losses: list[float] = []  # logged since the last evaluation
        self.gaps: list[tuple[float, float, float]] = []  # (gap, train loss, val loss) per evaluation
        self.warned = False

    def observe(self, loss: float) -> None:
        """A logged training loss: the next evaluation's gap compares against these."""
        self.train_losses.append(loss)

    def compare(self, record: dict) -> str | None:
        """Add train_loss (the mean logged since the last evaluation) and gap (val − train) to an eval record
        holding val_loss; returns the overfitting warning the first time it fires."""
        warning = None
        if self.train_losses and all(math.isfinite(x) for x in self.train_losses):
            record["train_loss"] = sum(self.train_losses) / len(self.train_losses)  # logged since the last eval
            record["gap"] = record["val_loss"] - record["train_loss"]
            warning = self.watch(record)
        self.train_losses = []
        return warning

    def watch(self, record: dict) -> str | None:
        """Warn once when the generalisation gap grew train.gap_patience evaluations in a row while the training
        loss fell: the model is learning its training data rather than the task."""
        k = self.gap_patience
        self.gaps.append((record["gap"], record["train_loss"], record["val_loss"]))
        if not k or self.warned or len(self.gaps) <= k:
            return None
        recent = self.gaps[-(k + 1):]
        if all(b[0] > a[0] and b[1] < a[1] for a, b in zip(recent, recent[1:])):
            self.warned = True
            rise = recent[-1][2] - recent[0][2]
            return (f"overfitting: the gap val − train grew {recent[0][0]:.3f} → {recent[-1][0]:.3f} over {k} "
                    f"evaluations while train loss fell (val loss {rise:+.3f}); consider more data, dropout "
                    f"(model.dropout), or early stopping (train.early_stop_patience)")
        return None

    def early_stop(self, state, val_loss: float, last: bool) -> str | None:
        """Count this evaluation against the best so far (state.best_val, state.evals_since_best: checkpointed);
        the stop reason once train.early_stop_patience evaluations brought nothing better (never at the last step)."""
        if val_loss < state.best_val - self.min_delta:
            state.best_val, state.evals_since_best = val_loss, 0
        else:
            state.evals_since_best += 1
        if self.patience and state.evals_since_best >= self.patience and not last:
            return f"early stop: no val improvement in {self.patience} evaluations"
        return None
