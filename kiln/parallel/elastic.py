"""Elastic restarts: the same command line, re-run by `torchrun --max-restarts=K`, picks its run up by itself.

    restarts(world)                     how many times torchrun has restarted the worker group (0: first start)
    last_logged_step(run_dir)           the newest step metrics.jsonl holds (what the failed attempt reached)
    restart_record(run_dir, step, world)  the `restart` event of a resumed (or restarted-fresh) attempt, or None

`kiln train --auto-resume` resumes from the run directory's latest verified checkpoint when there is one and starts
fresh when there is none (kiln.cli.train); a restart with another world size resumes through DCP's resharding
(kiln.train.checkpoint). torchrun itself restarts the group and runs the rendezvous: nothing is launched here.
"""
from __future__ import annotations

import json
import os
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


def restart_record(run_dir: Path, step: int, world=None) -> dict | None:
    """After torchrun restarted the group: {"event": "restart", "step": S, "restarts": N, "steps_lost": L}, where S
    is the step training continues from (0: no checkpoint yet) and L the steps the failed attempt logged past it
    (trained again now; at log.interval > 1, the steps after the last record are not counted). None on a first
    start."""
    n = restarts(world)
    if n == 0:
        return None
    last = last_logged_step(run_dir)
    return {"event": "restart", "step": step, "restarts": n, "steps_lost": max(0, (last or step) - step)}
