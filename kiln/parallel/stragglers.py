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

Under FSDP2 every transformer block gathers its parameters before its forward and before its backward and
reduce-scatters its gradients after its backward, so the fast ranks wait for the slow one in every block. There the
own time is the data wait plus the compute between those collectives: hooks on each module FSDP2 manages note when
one of its collectives begins (before FSDP2's pre-forward and pre-backward hooks, and where a block's input gradient
reaches FSDP2's post-backward) and when the compute resumes (after the all-gather was waited for). The CPU-time
analogue of nvidia-resiliency-ext's per-rank score from compute kernels only (communication kernels left out).
Under tensor parallelism inside the blocks, the tp ranks of one copy also wait for each other inside that compute.
Every clock here is the host's (perf_counter): on CPU that is the compute itself; on CUDA the host queues kernels
ahead of the device, so the figures follow the GPU only where the host waits for it (CUDA events at the same
points would time the device; not built, no GPU to check it on).
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
        """model: the module inside DDP (its forward starts after DDP's buffer broadcast), or the model FSDP2 shards."""
        self.world, self.factor, self.patience = world, cfg.straggler_factor, cfg.straggler_intervals
        self.enabled = world.size > 1 and self.patience > 0
        self.own, self.steps, self._began = 0.0, 0, None
        self._forwards: list[float] = []  # when this step's forwards of the inner model started
        # FSDP2: this step's compute seconds between collectives so far, and when the current stretch began (None:
        # inside a collective, or outside a step)
        self._compute, self._since = 0.0, None
        self._sharded = False  # model holds modules FSDP2 manages: the compute between its collectives is timed
        if self.enabled and model is not None:
            from torch.distributed.fsdp import FSDPModule  # lazy: torch.distributed.fsdp loads only where needed

            managed = [m for m in model.modules() if isinstance(m, FSDPModule)]
            for module in managed:
                self._time_between_collectives(module)
            self._sharded = bool(managed)
            if not managed:
                model.register_forward_pre_hook(lambda module, args: self._forwards.append(time.perf_counter()))
        self.slow_for = [0] * world.size  # consecutive intervals each rank was slow
        self.named: set[int] = set()  # ranks warned about (once each)

    def _time_between_collectives(self, module) -> None:
        """Hooks on one FSDP2 module around FSDP2's own (its pre-forward hook is first in line and its post-forward
        hook last, so ours go before and after them): a collective begins before its all-gather in the forward,
        before its pre-backward (an all-gather again, on the output's gradient) and when the gradient reaches its
        inputs (its post-backward's reduce-scatter follows); the compute resumes after each all-gather."""

        def on_tensors(value, hook) -> None:
            if isinstance(value, torch.Tensor):
                if value.requires_grad:
                    value.register_hook(hook)
            elif isinstance(value, (tuple, list)):
                for v in value:
                    on_tensors(v, hook)
            elif isinstance(value, dict):
                for v in value.values():
                    on_tensors(v, hook)

        def gathered(module, args, kwargs):  # after FSDP2's pre-forward: its inputs wear the post-backward hook
            self._resume()
            if torch.is_grad_enabled():
                on_tensors((args, kwargs), self._pause)

        module.register_forward_pre_hook(lambda module, args: self._pause(), prepend=True)
        module.register_forward_pre_hook(gathered, with_kwargs=True)
        module.register_forward_hook(
            lambda module, args, output: on_tensors(output, self._pause) if torch.is_grad_enabled() else None,
            prepend=True)
        module.register_forward_hook(
            lambda module, args, output: on_tensors(output, self._resume) if torch.is_grad_enabled() else None)

    def _pause(self, *_) -> None:
        """A collective begins: the stretch of compute since the last one ends."""
        if self._since is not None:
            self._compute += time.perf_counter() - self._since
            self._since = None

    def _resume(self, *_) -> None:
        """A collective ended: compute again (counted only inside a step)."""
        if self._began is not None:
            self._since = time.perf_counter()

    def step_began(self) -> None:
        if self.enabled:
            self._began = time.perf_counter()
            self._forwards.clear()
            self._compute, self._since = 0.0, None

    def step_ended(self, data_ready: float) -> None:
        if not self.enabled:
            return
        forwards = self._forwards or [time.perf_counter()]
        own = data_ready - self._began  # waiting for data, before any collective of the step
        comm = self.world.comm
        if self._sharded:  # FSDP2: every micro-batch's compute between the collectives
            self._pause()
            own += self._compute
        elif comm is not None and comm.last_launch is not None and comm.last_launch > forwards[-1]:
            own += comm.last_launch - forwards[-1]  # the last micro-batch's forward and backward
        self.own += own
        self.steps += 1
        self._began = None

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
