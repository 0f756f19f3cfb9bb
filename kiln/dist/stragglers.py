"""Stragglers: a rank whose own work per step is slower than the others', named in a warning and in metrics.jsonl.

    watch = StragglerWatch(world, cfg.parallel)
    watch.step_began(); ...; watch.step_ended()     around each step (data, forward, backward, optimizer)
    watch.observe(step, logger, console)            at each log interval: gathered from every rank, judged

Under data parallelism every rank's step lasts as long as the slowest rank's (the gradient all-reduce waits for
it), so the wall time of a step cannot tell them apart. What differs is the time a rank took to get its gradients
ready: from the start of its step (the data it waited for included) to the moment DDP's last gradient bucket was
handed to the all-reduce (kiln.dist.CommTimer.last_launch). That "own time" per step, averaged over a log
interval, is all-gathered (one small collective per interval); a rank above parallel.straggler_factor × the
median of the other ranks (with 2 ranks: the other one) for parallel.straggler_intervals intervals in a row is
named once, with an `event: straggler` record.
FSDP2 offers no hook at that moment, so its ranks are measured by the whole step (which the slow one sets for
all): stragglers are detected under ddp and zero1 only.
"""
from __future__ import annotations

import statistics
import time

import torch


class StragglerWatch:
    def __init__(self, world, cfg):
        self.world, self.factor, self.patience = world, cfg.straggler_factor, cfg.straggler_intervals
        self.enabled = world.size > 1 and self.patience > 0
        self.own, self.steps, self._began = 0.0, 0, 0.0
        self.slow_for = [0] * world.size  # consecutive intervals each rank was slow
        self.named: set[int] = set()  # ranks warned about (once each)

    def step_began(self) -> None:
        if self.enabled:
            self._began = time.perf_counter()

    def step_ended(self) -> None:
        if not self.enabled:
            return
        comm = self.world.comm
        ready = comm.last_launch if comm is not None and comm.last_launch is not None else time.perf_counter()
        self.own += max(0.0, ready - self._began)
        self.steps += 1

    def observe(self, step: int, logger, console) -> list[int]:
        """Gather the interval's own time per step from every rank; returns the ranks named now."""
        if not self.enabled or not self.steps:
            return []
        mine = torch.tensor([self.own / self.steps], dtype=torch.float64)
        self.own, self.steps = 0.0, 0
        every = [torch.zeros_like(mine) for _ in range(self.world.size)]
        torch.distributed.all_gather(every, mine)
        times = [t.item() for t in every]
        named = []
        for rank, t in enumerate(times):
            median = statistics.median(times[:rank] + times[rank + 1:])
            slow = median > 0 and t > self.factor * median
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
