"""Elastic restarts: the same command line, re-run by `torchrun --max-restarts=K`, picks its run up by itself.

    restarts(world)                     how many times torchrun has restarted the worker group (0: first start)
    last_logged_step(run_dir)           the newest step metrics.jsonl holds (what the failed attempt reached)
    restart_record(run_dir, step, world, resumed_world)   the `restart` event of a restarted attempt, or None
    batch_after_resharding(dp_before, dp, tc)   the line a resume on another number of data-parallel ranks prints
    round_store(rank, size, timeout)    the store a worker group bootstraps its process group from: a namespace of
                                        its own in torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE)

`kiln train --auto-resume` resumes from the run directory's latest verified checkpoint when there is one and starts
fresh when there is none (kiln.cli.train); a restart with another world size resumes through DCP's resharding
(kiln.train.checkpoint). torchrun itself restarts the group and runs the rendezvous: nothing is launched here.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def restarts(world=None) -> int:
    """torchrun's count of restarts of the worker group (TORCHELASTIC_RESTART_COUNT; 0 without torchrun), the
    largest over the ranks: each node's agent counts only the restarts its own workers' failures caused (the
    others restart for the membership change without counting), so the node of a surviving rank 0 says 0."""
    try:
        mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        mine = 0
    if world is None or world.size < 2:
        return mine
    counts = torch.tensor([mine], dtype=torch.int64)
    world.all_reduce(counts, op=dist.ReduceOp.MAX)
    return int(counts.item())


def last_logged_step(run_dir: Path) -> int | None:
    """The largest step of a train record in RUN_DIR/metrics.jsonl; lines that are not JSON (a line cut by the
    crash, damage) are passed over. None when there is no such record."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") == "train" and isinstance(record.get("step"), int):
            last = max(last or 0, record["step"])
    return last


def last_logged_world(run_dir: Path) -> int | None:
    """The world size of the newest `layout` record in RUN_DIR/metrics.jsonl (its param_bytes_per_rank has one
    entry per rank): the world of the last attempt that started. None when there is none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    size = None
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == "layout" and isinstance(
                record.get("param_bytes_per_rank"), list):
            size = len(record["param_bytes_per_rank"])
    return size


def restart_record(run_dir: Path, step: int, world=None, resumed_world: dict | None = None) -> dict | None:
    """After torchrun restarted the group: {"event": "restart", "step": S, "restarts": N, "steps_lost": L,
    "world_size": W, "world_size_before": B}, where S is the step training continues from (0: no checkpoint yet),
    L the steps the failed attempt logged past it (trained again now; at log.interval > 1, the steps after the last
    record are not counted), W this attempt's processes and B the failed attempt's (its layout record; else the
    world that wrote the checkpoint resumed, `resumed_world`; None when neither is known). None on a first
    start."""
    n = restarts(world)
    if n == 0:
        return None
    last = last_logged_step(run_dir)
    before = last_logged_world(run_dir)
    if before is None and resumed_world is not None:
        before = resumed_world["size"]
    return {"event": "restart", "step": step, "restarts": n, "steps_lost": max(0, (last or step) - step),
            "world_size": world.size if world is not None else 1, "world_size_before": before}


def batch_after_resharding(resumed_dp: int, dp: int, tc) -> str | None:
    """The line a resume on another number of data-parallel ranks prints (None when it is the same): with
    train.global_batch_size the global batch is kept and accumulation follows the world; without it each rank
    keeps its accumulation and the global batch changes with the world, said with the number to set. tc: the run's
    train section, grad_accum_steps resolved for this world (kiln.run.builder.accumulation_for)."""
    if resumed_dp == dp:
        return None
    ranks = f"resumed on {dp} data-parallel rank{'s' if dp > 1 else ''}, the checkpoint's world had {resumed_dp}"
    if tc.global_batch_size:
        before = tc.global_batch_size // (tc.micro_batch_size * resumed_dp)
        return (f"{ranks}: grad_accum_steps {before} → {tc.grad_accum_steps} keeps train.global_batch_size="
                f"{tc.global_batch_size}")
    now = tc.micro_batch_size * tc.grad_accum_steps
    return (f"{ranks}: grad_accum_steps {tc.grad_accum_steps} kept (train.global_batch_size is not set), so a step "
            f"takes {now * dp} sequences, was {now * resumed_dp}; --train.global_batch_size={now * resumed_dp} "
            f"keeps it")


def agent_store_in_use() -> bool:
    """torchrun hands its workers the agent's own TCP store (torch ≥ 2.5's default with the c10d rendezvous and
    --standalone; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 turns it off): the store outlives the workers, and every
    rendezvous round of the agent reuses it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


POLL_S = 0.02  # how often a worker looks at the store while the group meets (a TCP round trip: ~0.1 ms locally)


def round_store(rank: int, size: int, timeout: timedelta) -> dist.Store:
    """The store this worker group initialises its process group from, under torchrun's shared agent store.

    Why: the agent keeps one TCP store for all rounds, and init_process_group writes the same keys in it every
    round (gloo's and NCCL's bootstrap: each rank's address, the unique id). A restarted worker that reads before
    its peer has written gets the dead worker's address from the previous round: measured with torch 2.13 under
    `torchrun --standalone --max-restarts=1`, one worker SIGKILLed after step 12: the restarted group failed with
    "Gloo connectFullMesh failed ... Connection refused" (or hung in connect). TORCHELASTIC_RESTART_COUNT cannot
    name the round: each agent counts only its own workers' failures (pytorch/pytorch#135712, #108158), so two
    nodes of one round can disagree.

    So the group agrees on a namespace of its own first: rank 0 (a new process every round) publishes a fresh
    random token; every other rank registers a token of its own under the leader's and waits for rank 0 to
    acknowledge it by name. A rank that read the previous round's leader token is never acknowledged there (that
    leader is gone) and registers again when the token changes; an acknowledgement cannot be stale (its key is
    the rank's own fresh token). Returns PrefixStore("kiln/round/TOKEN", agent store): keys kiln/round/TOKEN/KEY."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timeout)
    deadline = time.monotonic() + timeout.total_seconds()

    def wait(what: str) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the {size} workers of this torchrun round did not meet in the agent's "
                               f"store within parallel.timeout={timeout.total_seconds():g} s ({what}); is every "
                               f"node's torchrun running?")
        time.sleep(POLL_S)

    leader_key = "kiln/round/leader"
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(leader_key, token)
        while (joined := store.add(f"kiln/round/{token}/joined", 0)) < size - 1:
            wait(f"{joined} of the {size - 1} other ranks arrived")
        for i in range(1, size):
            store.set(f"kiln/round/ack/{store.get(f'kiln/round/{token}/joiner/{i}').decode()}", token)
        return dist.PrefixStore(f"kiln/round/{token}", store)
    me, token = uuid.uuid4().hex, None
    ack = f"kiln/round/ack/{me}"
    while not store.check([ack]):
        current = store.get(leader_key).decode() if store.check([leader_key]) else None
        if current is not None and current != token:  # a new leader (or the first one seen): register with it
            token = current
            store.set(f"kiln/round/{token}/joiner/{store.add(f'kiln/round/{token}/joined', 1)}", me)
        wait("rank 0 never acknowledged this rank")
    return dist.PrefixStore(f"kiln/round/{store.get(ack).decode()}", store)
