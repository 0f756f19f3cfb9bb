"""Stragglers: a rank whose own work per step is slower than the others', named in a warning and in metrics.jsonl.

    watch = StragglerWatch(world, cfg.parallel, model)
    watch.step_began(); ...; watch.step_ended(t)    around each step; t: when its batches were ready (perf_counter)
    watch.observe(step, logger, console)            at each log interval: gathered from every rank, judged

Under data parallelism every rank's step lasts as long as the slowest rank's (the collectives wait for it), so the
wall time of a step cannot tell them apart, nor can the forward's (DDP broadcasts the buffers at every forward,
a collective too). What differs is each rank's own work: the time from the start of its step until its batches
were ready (the data it waited for; the step's first collective comes after), plus the time from the start of
the inner model's last forward (after DDP's buffer broadcast) to the moment DDP's last gradient bucket was ready
(kiln.parallel.CommTimer.last_launch): the last micro-batch's forward and backward without the waits. That "own
time" per step, averaged over a log interval, is all-gathered (one small collective
per interval); a rank above parallel.straggler_factor × the median of the other ranks (with 2 ranks: the other
one), and by more than 20 ms, for parallel.straggler_intervals intervals in a row is named once, with an
`event: straggler` record.
FSDP2 offers no hook at the end of the backward, so under fsdp the own time is the wait before the forward only.
"""
from __future__ import annotations

import statistics
import time

import torch

# A rank is not called slow for less than this much extra time a step: on a shared host tiny steps (12 ms measured
# in the tests) vary 2× from noise alone, and a few milliseconds a step are not worth a warning.
MIN_GAP_S = 0.02


class StragglerWatch:
    def __init__(self, world, cfg, model=None):
        """model: the module inside the data-parallel wrapper (its forward starts after DDP's buffer broadcast)."""
        self.world, self.factor, self.patience = world, cfg.straggler_factor, cfg.straggler_intervals
        self.enabled = world.size > 1 and self.patience > 0
        self.own, self.steps, self._began = 0.0, 0, 0.0
        self._forwards: list[float] = []  # when this step's forwards of the inner model started
        if self.enabled and model is not None:
            model.register_forward_pre_hook(lambda module, args: self._forwards.append(time.perf_counter()))
        self.slow_for = [0] * world.size  # consecutive intervals each rank was slow
        self.named: set[int] = set()  # ranks warned about (once each)

    def step_began(self) -> None:
        if self.enabled:
            self._began = time.perf_counter()
            self._forwards.clear()

    def step_ended(self, data_ready: float) -> None:
        if not self.enabled:
            return
        forwards = self._forwards or [time.perf_counter()]
        own = data_ready - self._began  # waiting for data, before any collective of the step
        comm = self.world.comm
        if comm is not None and comm.last_launch is not None and comm.last_launch > forwards[-1]:
            own += comm.last_launch - forwards[-1]  # the last micro-batch's forward and backward
        self.own += own
        self.steps += 1

    def observe(self, step: int, logger, console) -> list[int]:
        """Gather the interval's own time per step from every rank; returns the ranks named now."""
        if not self.enabled or not self.steps:
            return []
        every = torch.zeros(self.world.size, dtype=torch.float64)  # each rank fills its own slot; the sum gathers
        every[self.world.rank] = self.own / self.steps
        self.own, self.steps = 0.0, 0
        times = self.world.all_reduce(every).tolist()
        named = []
        for rank, t in enumerate(times):
            median = statistics.median(times[:rank] + times[rank + 1:])
            slow = median > 0 and t > self.factor * median and t - median > MIN_GAP_S
            self.slow_for[rank] = self.slow_for[rank] + 1 if slow else 0
            if self.slow_for[rank] >= self.patience and rank not in self.named:
                self.named.add(rank)
                named.append(rank)
                message = (f"straggler: rank {rank} took {1000 * t:.1f} ms per step to get its gradients ready, "
                           f"{t / median:.1f}× the other ranks' median {1000 * median:.1f} ms, for {self.patience} "
                           f"log intervals in a row: every rank waits for it; check that rank's node (data, "
                           f"thermals, neighbours)")
                console.print(message, highlight=False)
                logger.log({"step": step, "event": "straggler", "rank": rank, "ratio": round(t / median, 2),
                            "own_ms": round(1000 * t, 2), "median_ms": round(1000 * median, 2),
                            "message": message}, kind="event")
        return named
