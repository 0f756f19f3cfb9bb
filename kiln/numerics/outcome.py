"""Whether a run's losses ended finite: a run that learned nothing because every loss was NaN must not look done.

    watch = LossWatch()
    watch.observe(step, loss)                  each logged train loss (a float the loop already read back)
    watch.failure(val_loss, stop_reason)       at the end: one line saying what went non-finite, or None

`kiln train` exits with NONFINITE_EXIT when there is a failure (the checkpoint and metrics are kept for the
post-mortem); a library caller finds the same line in TrainResult.failure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

NONFINITE_EXIT = 4  # `kiln train`'s exit status when the loss ended non-finite (2 bad input, 3 OOM, 128+N signal)
HINT = ("nonfinite_report.json in the run directory names where the NaN/Inf first appeared; check the model config, "
        "optim.lr and the data")


@dataclass
class LossWatch:
    logged: int = 0  # train losses logged by this process
    finite: int = 0  # of which finite
    first_step: int | None = None
    last_step: int | None = None
    last_loss: float | None = None

    def observe(self, step: int, loss: float) -> None:
        self.logged += 1
        self.finite += math.isfinite(loss)
        self.first_step = self.first_step if self.first_step is not None else step
        self.last_step, self.last_loss = step, loss

    def failure(self, val_loss: float | None, stop_reason: str | None) -> str | None:
        """Why the run's outcome is not a trained model, or None: every logged loss non-finite, the run stopped
        for non-finite steps, its last loss or its final validation loss non-finite."""
        if self.logged and not self.finite:
            steps = (f"step {self.first_step}" if self.first_step == self.last_step
                     else f"steps {self.first_step}-{self.last_step}")
            return (f"the loss was non-finite ({self.last_loss}) at every logged step ({steps}): nothing was "
                    f"learned; {HINT}")
        if stop_reason and stop_reason.startswith("numerics:") and "non-finite" in stop_reason:
            return f"the run stopped on non-finite steps ({stop_reason.removeprefix('numerics: ')}); {HINT}"
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            return (f"the run ended on a non-finite loss ({self.last_loss}) at step {self.last_step}, the last "
                    f"logged; {HINT}")
        if val_loss is not None and not math.isfinite(val_loss):
            return f"the final validation loss is {val_loss}: the weights are not usable; {HINT}"
        return None
