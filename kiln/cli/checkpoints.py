"""`kiln checkpoints RUN_DIR`: a run's checkpoints with step, size and whether each verifies."""
from __future__ import annotations

from pathlib import Path

from kiln.config import ConfigError
from kiln.memory.estimate import fmt_bytes
from kiln.train.checkpoint import CheckpointConfig, CheckpointCorrupt, Checkpointer, verify_but_weights


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoints", help="list a run's checkpoints: step, size, verified or corrupt",
                       description="Every checkpoint of RUN_DIR, newest first, checked against its manifest. "
                                   "`kiln train --resume RUN_DIR` takes the first one marked ok.")
    p.add_argument("run_dir", help="a run directory written by `kiln train` or fit()")


def run(args, overrides) -> int:
    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    checkpointer = Checkpointer(CheckpointConfig(), Path(args.run_dir))
    if not checkpointer.dir.is_dir():
        raise FileNotFoundError(f"{checkpointer.dir} does not exist; is {args.run_dir} a kiln run directory?")
    pointer, problem = checkpointer.pointer()
    named = pointer.name if pointer is not None else None
    if problem is not None:
        print(f"note: {problem}; resume takes the newest checkpoint that verifies")
    rows = checkpointer.candidates()
    if not rows:
        print(f"no checkpoints in {checkpointer.dir}")
        return 1
    resume = None
    for path in rows:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        try:
            damaged = verify_but_weights(path)
            status = "ok" if damaged is None else f"ok: {damaged}, written again from state.pt when it is loaded"
            resume = resume or path
        except CheckpointCorrupt as e:
            status = f"CORRUPT: {e}"
        mark = "  (latest)" if path.name == named else ""
        print(f"{path.name}  {fmt_bytes(size):>10}  {status}{mark}")
    leftovers = sorted(p.name for p in checkpointer.dir.glob(".tmp-*")) + sorted(
        p.name for p in checkpointer.dir.glob(".old-*"))
    if leftovers:
        print(f"leftovers of an interrupted save (removed at the next start): {', '.join(leftovers)}")
    print(f"resume takes: {resume.name if resume else 'nothing (no checkpoint verifies)'}")
    return 0 if resume else 1
