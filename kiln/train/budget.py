"""The run's time: a wall-clock limit (train.max_time) and, with train.max_steps=0, the length fixed from the
measured time of the first steps so that they fill train.time_budget.

    budget = TimeBudget(cfg.train, cfg.schedule, first_step=state.step)
    budget.measure(step, device)        before each step of a budgeted run
    steps, message = budget.size(state) at step budget.sized_at: the run's max_steps
    budget.out_of_time(now)             train.max_time crossed
"""
from __future__ import annotations

import time

import torch

from kiln.errors import KilnError
from kiln.train.schedule import ScheduleConfig
from kiln.train.settings import TrainConfig, parse_duration

# train.max_steps=0: the step time is measured from step 3 (1-2 warm the allocator up) to step 10 at least, and up to
# 30 while the warm-up lasts. Early steps still run slower than later ones (default job on a 2-core Xeon: 13,600
# tok/s over steps 3-30, 17,000 after), so a run ends 10-20% under its budget rather than over it.
CALIBRATION_STEPS, CALIBRATION_MAX = 10, 30


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimeBudget:
    """With train.max_steps=0 the run is sized by train.time_budget: steps 3..10 (up to 30) are timed, and max_steps
    is set so that the steps take the budget. Those first steps are inside the linear warm-up, whose lr does not
    depend on the horizon yet. Also holds train.max_time, the wall-clock limit of any run."""

    def __init__(self, tc: TrainConfig, sched: ScheduleConfig, first_step: int):
        self.time_budget, self.warmup_steps, self.total_steps = tc.time_budget, sched.warmup_steps, sched.total_steps
        self.budgeted = tc.max_steps == 0
        self.first = first_step  # a budgeted run resumed before it was sized measures from where it resumed
        # Until the run is sized its lr must not depend on its length: true of a constant schedule or an explicit
        # horizon, and of any schedule during its linear warm-up.
        horizon_free = bool(sched.total_steps) or sched.name == "constant"
        self.sized_at = self.first + (CALIBRATION_MAX if horizon_free else
                                      min(CALIBRATION_MAX, max(sched.warmup_steps - self.first, 0)))
        if self.budgeted and self.sized_at < self.first + CALIBRATION_STEPS:
            raise KilnError(f"train.max_steps=0 measures steps {self.first + 1}-{self.first + CALIBRATION_STEPS} "
                            f"before it knows the run's length, so the {sched.name} schedule needs "
                            f"schedule.warmup_steps ≥ {self.first + CALIBRATION_STEPS} (got {sched.warmup_steps}); "
                            f"raise it, or set train.max_steps",
                            key="schedule.warmup_steps", value=sched.warmup_steps,
                            fix="raise it, or set train.max_steps")
        # While a budgeted run is measured, any horizon past the warm-up gives the same lr.
        self.horizon = sched.total_steps or tc.max_steps or 1 << 30
        self.clock: dict[int, float] = {}  # budgeted run: step -> when it ended (the first one, two after it)
        self.max_time = parse_duration(tc.max_time)
        self.started = time.monotonic()

    def out_of_time(self, now: float) -> bool:
        """train.max_time has passed since the run started (`now` from time.monotonic)."""
        return self.max_time is not None and now - self.started >= self.max_time

    def measure(self, step: int, device: torch.device) -> None:
        """Budgeted run, before a step: note when the first step and the two after it ended (device idle)."""
        if step in (self.first, self.first + 2):
            synchronize(device)
            self.clock[step] = time.perf_counter()

    def size(self, state) -> tuple[int, str]:
        """Budgeted run, at the end of its measured steps (state.step == sized_at): max_steps from the measured step
        time, decided by rank 0, and the line that says so."""
        synchronize(state.device)
        now = time.perf_counter()
        step_time = (now - self.clock[self.first + 2]) / (state.step - self.first - 2)
        left = self.time_budget - (now - self.clock[self.first])
        floor = max(state.step, self.warmup_steps)  # a shorter run would change the warm-up
        steps = state.world.broadcast_object(max(floor, state.step + int(left / step_time)))  # rank 0 decides
        self.budgeted = False
        self.horizon = self.total_steps or steps
        return steps, (f"max_steps {steps:,}: train.time_budget {self.time_budget:g} s at {step_time:.3f} s/step "
                       f"(steps {self.first + 3}-{state.step} on this {state.device.type}); "
                       f"--train.max_steps={steps} repeats this run exactly")
