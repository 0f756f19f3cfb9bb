"""A collective that fails or times out, turned into one line that names the rank, the step and the collective.

    with collective_errors(world, step=lambda: state.step):
        ...                                    # training; a gloo/NCCL failure inside raises CollectiveError

A rank that dies (its sockets close: the others fail at once) or hangs (the others wait parallel.timeout seconds,
the process group's timeout) leaves the other ranks inside a collective. The backend's own error names neither the
missing rank nor where training was. Here each failing rank writes its name into the rendezvous store (torchrun's
agent keeps it, so it outlives any one rank) and waits a few seconds for the others to do the same: the ranks that
never write are the dead or hung ones. The collective is the innermost torch.distributed call on the stack (DDP's
gradient all-reduce when the failure surfaces in the backward).
"""
from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Callable

import torch.distributed as dist

GRACE_S = 3.0  # how long a failing rank waits for the other survivors to report (they fail within ~1 s of it)
# Backend errors of a collective whose peer is gone or late (gloo's wording; NCCL's is a DistBackendError).
SIGNS = ("connection closed by peer", "connection reset", "timed out", "timeout", "broken pipe", "gloo", "nccl",
         "connection refused", "socket")


class CollectiveError(RuntimeError):
    """A collective failed: `rank` (this one) was in `collective` at `step`; `missing` never reached it."""

    def __init__(self, rank: int, step: str, collective: str, missing: list[int] | None, timeout: float,
                 cause: str):
        self.rank, self.step, self.collective, self.missing, self.timeout = rank, step, collective, missing, timeout
        if missing:
            who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}"
            who = f"{who} never reached it (dead or hung)"
        elif missing is None:
            who = "the rendezvous store did not answer, so the missing rank is unknown"
        else:
            who = "every rank reported the failure (a network fault?)"
        super().__init__(f"rank {rank}: {collective} {step} failed: {who}; parallel.timeout={timeout:g} s "
                         f"({cause}). Look at that rank's log; the run resumes from its latest checkpoint with "
                         f"--auto-resume (under torchrun --max-restarts) or --resume")


def is_collective_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and not isinstance(e, CollectiveError) and any(
        s in str(e).lower() for s in SIGNS)


def collective_name(tb) -> str:
    """The innermost torch.distributed collective on a traceback; DDP's all-reduce when it surfaced in backward."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        if frame.filename.endswith("distributed_c10d.py") and not frame.name.startswith("_"):
            return frame.name
    if any(f.name == "backward" or "autograd" in f.filename for f in frames):
        return "all_reduce of the gradients (in backward)"
    for frame in reversed(frames):
        if "torch/distributed" in frame.filename.replace(os.sep, "/"):
            return f"a collective ({frame.name})"
    return "a collective"


def _where(tb, step: int) -> str:
    """'in step N' while a step ran (its gradients, its numerics), else 'after step N' (logging, checkpoints)."""
    names = {f.name for f in traceback.extract_tb(tb)}
    return f"in step {step + 1}" if "train_step" in names else f"after step {step}"


def missing_ranks(world, grace: float = GRACE_S) -> list[int] | None:
    """Report this rank's failure in the rendezvous store and return the ranks that did not report theirs within
    `grace` seconds; None when the store cannot be reached."""
    try:
        store = dist.distributed_c10d._get_default_store()
        # The default store is this round's own (kiln.parallel.elastic.round_store, or a fresh one per round);
        # not TORCHELASTIC_RESTART_COUNT, which differs between the nodes of one round.
        prefix = "kiln/failed/"
        store.set(prefix + str(world.rank), b"1")
        others = [r for r in range(world.size) if r != world.rank]
        deadline = time.monotonic() + grace
        while others and time.monotonic() < deadline:
            others = [r for r in others if not store.check([prefix + str(r)])]
            time.sleep(0.1)
        return others
    except Exception:  # the store lived in a rank that is gone (a launch without torchrun's agent)
        return None


@contextlib.contextmanager
def collective_errors(world, step: Callable[[], int]):
    """Turn a failed collective into CollectiveError; mark the world broken (nothing more to wait for)."""
    try:
        yield
    except Exception as e:
        if world.size < 2 or not is_collective_failure(e):
            raise
        world.broken = True
        tb = e.__traceback__
        cause = " ".join(str(e).split())[:160]
        raise CollectiveError(world.rank, _where(tb, step()), collective_name(tb), missing_ranks(world),
                              world.timeout, cause) from None
