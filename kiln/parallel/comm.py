"""DDP's gradient all-reduce, timed: CommTimer sums the seconds each bucket's all-reduce was in flight (the
straggler report, kiln.parallel.stragglers, reads its last_launch)."""
from __future__ import annotations

import time

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class CommTimer:
    """Seconds DDP's gradient all-reduces were in flight, from launch to completion, summed over its buckets (they
    overlap the backward, so this is communication time, not time the step waited for it)."""

    def __init__(self):
        self.seconds = 0.0
        self.last_launch = None  # perf_counter when this rank's last bucket was ready (its backward done)

    def take(self) -> float:
        """The seconds since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def timed_allreduce(timer, bucket):  # no annotations: DDP checks them, and these modules' are strings
    """DDP's own all-reduce (torch's default hook: average over the ranks) of one dist.GradBucket, timed."""
    start = timer.last_launch = time.perf_counter()

    def done(fut):
        timer.seconds += time.perf_counter() - start
        return fut.value()

    return default_hooks.allreduce_hook(None, bucket).then(done)
