"""Checkpoints: written atomically, the last K kept, a `latest` pointer, weights exportable as safetensors.

Layout of a run directory:
    config.toml                      the resolved config
    checkpoints/step_000400/         state.pt (everything needed to resume), config.toml, model.safetensors
    checkpoints/latest               text file naming the newest complete checkpoint directory

Under data parallelism (kiln.parallel) a checkpoint is written by every rank into one temporary directory and
renamed by rank 0 once all are done:
    sharded/                         torch.distributed.checkpoint: model and optimizer, each rank its shards
    optimizer.pt                     parallel.strategy=zero1: the optimizer state consolidated on rank 0
    state.pt                         step, tokens, data position, loss scaler, numerics (rank 0)
    rank_00001.pt                    each rank's RNG streams
    model.safetensors, config.toml   the consolidated weights and the config (rank 0)
DCP reshards on load, so a run resumes on another world size, strategy or tensor-parallel degree (fsdp × 2 -> ddp × 1
and back, tp2 × dp2 -> one process, fsdp × 2 -> tp2): what is saved is in the model's own layout (a tensor-parallel
run's fused rows are put back in the model's order on the way out and reordered on the way in, kiln.parallel.tensor).

checkpoint.async_save: the training thread only copies the state to host memory, into buffers kept from the last
save (one process: Staging; data parallelism: DCP's stager), and goes on; the files are written, sealed and
published by a background thread (under data parallelism DCP's async_save, whose coordination runs on a process
group of its own so that it never interleaves with training's collectives). At most one save is in flight: the
next one, the end of the run and `wait()` wait for it. `latest` still moves only once the checkpoint is complete
and sealed.
"""
from __future__ import annotations

import fcntl
import json
import threading
import time
import mmap
import os
import pickle
import random
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kiln.errors import KilnError
from kiln.models.moe import per_expert_key, stack_experts
from kiln.parallel.strategy import STRATEGIES
from kiln.parallel.fused import canonical, from_canonical, fused_rows


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0: only at the end of training)
    keep_last: int = 3  # number of checkpoints kept on disk (oldest deleted first)
    safetensors: bool = True  # also export the weights as model.safetensors in each checkpoint
    every_minutes: float = 30.0  # also save when this much wall-clock time passed since the last save (0: off)
    on_error: str = "stop"  # a save that fails (full disk, quota): stop the run cleanly, or warn and train on
    async_save: bool = False  # write in the background (DCP async_save; one process: a thread) while training goes on

    def validate(self):
        if self.interval < 0:
            raise KilnError(f"checkpoint.interval must be ≥ 0, got {self.interval}",
                            key="checkpoint.interval", value=self.interval, fix="give a number of steps ≥ 0 (0: off)")
        if self.every_minutes < 0:
            raise KilnError(f"checkpoint.every_minutes must be ≥ 0 (0: off), got {self.every_minutes}",
                            key="checkpoint.every_minutes", value=self.every_minutes, fix="give minutes ≥ 0 (0: off)")
        if self.on_error not in ("stop", "warn"):
            raise KilnError(f"checkpoint.on_error={self.on_error!r}; use 'stop' or 'warn'",
                            key="checkpoint.on_error", value=self.on_error, fix="use 'stop' or 'warn'")
        if self.keep_last < 1:
            raise KilnError(f"checkpoint.keep_last must be ≥ 1 (otherwise nothing could resume), got {self.keep_last}",
                            key="checkpoint.keep_last", value=self.keep_last, fix="give a count ≥ 1")


def saved_world(state: dict) -> dict:
    """The world a checkpoint's state was written by: {"size": processes, "dp": data-parallel copies}. A checkpoint
    from before kiln recorded it says only its data position's world (the dp ranks), which serves for both."""
    if "world" in state:
        return dict(state["world"])
    dp = int(state.get("data", {}).get("world", 1))
    return {"size": dp, "dp": dp}


def global_tokens_seen(state: dict) -> int:
    """The tokens (or samples) every data-parallel copy saw together, as the state stores them. A checkpoint from
    before kiln recorded its world counted one rank's share: times its own dp ranks, not the resuming run's."""
    if "world" in state:
        return int(state["tokens_seen"])
    return int(state["tokens_seen"]) * saved_world(state)["dp"]


def rng_state() -> dict:
    """Every RNG stream training draws from: python, numpy, torch CPU and CUDA."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


MANIFEST = "manifest.json"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, quota, read-only directory); earlier ones are intact."""


class CheckpointCorrupt(KilnError):
    """A checkpoint whose files do not match its manifest, or that does not load; `file`: the damaged file's name
    inside the checkpoint, when one file is to blame."""

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message, key=file)
        self.file = file


WEIGHTS = "model.safetensors"  # an export of the weights: where state.pt holds them too, it can be written again


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path, kind: str = "xxh3") -> str:
    """A file's checksum: xxh3-64 over the file mapped into memory (~25 GB/s from the page cache here, so the
    manifest costs a few percent of a save) catches truncation, flipped bytes and torn writes; a checkpoint needs
    corruption caught, not an adversary. "crc32": manifests written before xxh3 still verify. Measured in
    docs/benchmarks.md."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            data = b""
        else:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return xxhash.xxh3_64(data).hexdigest() if kind == "xxh3" else f"{zlib.crc32(data):08x}"
        finally:
            if data:
                data.close()


def _dir_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def seal(directory: Path) -> None:
    """Make a written checkpoint directory durable and checkable: a manifest (name, size, xxh3 of each file),
    then every file and the manifest fsynced, then the directories. The manifest need not be written after the
    fsyncs: the checkpoint only becomes visible when its directory is renamed into place, after all of this."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {str(f.relative_to(directory)): {"bytes": f.stat().st_size, "xxh3": _digest(f)} for f in files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for f in [*files, directory / MANIFEST]:
        _fsync(f)
    for d in {f.parent for f in files} | {directory}:
        _fsync(d)


def verify(directory: Path, skip: str | None = None) -> None:
    """Raise CheckpointCorrupt naming what is wrong: a missing manifest or file, a size or a checksum. skip: a file
    not to check (the others must still verify)."""
    manifest_path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointCorrupt(f"{directory.name} does not exist")
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"{directory.name} has no {MANIFEST}: its save never finished")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointCorrupt(f"{directory.name}/{MANIFEST} is not valid JSON (damaged)") from None
    if not isinstance(manifest, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and ("xxh3" in v or "crc32" in v)
            for v in manifest.values()):
        raise CheckpointCorrupt(f"{directory.name}/{MANIFEST} is JSON but not a manifest (name -> bytes, checksum)")
    for name, expected in manifest.items():
        f = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointCorrupt(f"{directory.name}/{MANIFEST} names {name!r}, outside the checkpoint")
        if name == skip:
            continue
        if not f.is_file():
            raise CheckpointCorrupt(f"{directory.name}/{name} is missing", name)
        if f.stat().st_size != expected["bytes"]:
            raise CheckpointCorrupt(f"{directory.name}/{name} has {f.stat().st_size} bytes, the manifest "
                                    f"{expected['bytes']} (truncated?)", name)
        kind = "xxh3" if "xxh3" in expected else "crc32"
        if _digest(f, kind) != expected[kind]:
            raise CheckpointCorrupt(f"{directory.name}/{name} does not match its checksum (corrupted)", name)


class RunLock:
    """One run per directory: an OS lock on RUN_DIR/.lock (released by the OS when the process dies, so a crashed
    run leaves nothing stale), holding the PID for the message a second run gets."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path, self.enabled, self.fd = Path(run_dir) / ".lock", enabled, None

    def __enter__(self) -> "RunLock":
        if not self.enabled:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise FileExistsError(f"{self.path.parent} is in use by process {holder} (a run trains there now); wait "
                                  f"for it, or choose another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class Checkpointer:
    """Durable checkpoints: written to a temporary directory, sealed (fsync + manifest), renamed; a good checkpoint
    is never removed before its replacement is complete; loading takes the newest one that verifies."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, warn=print):
        self.cfg = cfg
        self.dir = Path(run_dir) / "checkpoints"
        self.warn = warn  # one line when a checkpoint is skipped on load, or leftovers are removed
        self._warned: set[str] = set()
        self._inflight: threading.Thread | None = None  # checkpoint.async_save: the save being written
        self._failure: BaseException | None = None  # what the background save raised, for wait() to raise
        self._staging = Staging()  # checkpoint.async_save: the host buffers the state is copied into
        self._dcp_stager = None  # ... and DCP's stager, which keeps its own (under data parallelism)

    def wait(self) -> None:
        """Until the save in flight (checkpoint.async_save) is written and published; raises what it raised."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _in_background(self, work) -> None:
        def run():
            try:
                work()
            except BaseException as e:  # raised in the training thread by the next wait()
                self._failure = e
        self._inflight = threading.Thread(target=run, name="kiln-checkpoint", daemon=True)
        self._inflight.start()

    def save(self, step: int, state: dict, config_toml: str, model: torch.nn.Module | None = None) -> Path:
        """Write to a temporary directory, seal it, then rename: a crash never leaves a half-written checkpoint.
        checkpoint.async_save: a copy of the state is written by a background thread; returns at once."""
        self.wait()  # at most one save in flight
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step_{step:06d}"
        tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        weights = None  # the state's own model weights when it has them (a LoRA run's: the adapters only)
        if self.cfg.safetensors and model is not None:
            weights = state["model"] if "model" in state else model.state_dict()
        if self.cfg.async_save:  # training changes the originals from now on
            state, weights = self._staging.copy((state, weights))
            self._in_background(lambda: self._write_whole(tmp, final, state, config_toml, weights))
            return final
        self._write_whole(tmp, final, state, config_toml, weights)
        return final

    def _write_whole(self, tmp: Path, final: Path, state: dict, config_toml: str, weights: dict | None) -> None:
        try:
            tmp.mkdir()
            write_state(state, tmp / "state.pt")
            (tmp / "config.toml").write_text(config_toml)
            if weights is not None:
                export_tensors(weights, tmp / "model.safetensors")
            seal(tmp)
        except (OSError, RuntimeError) as e:
            written = _dir_bytes(tmp) if tmp.exists() else 0
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, RuntimeError) and "inline_container" not in str(e) and "write" not in str(e):
                raise
            free = shutil.disk_usage(self.dir).free
            why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else "the write failed"
            previous = self.latest()
            need = (f"; one checkpoint of this run takes {_dir_bytes(previous):,} bytes" if previous is not None
                    else "")
            raise CheckpointWriteError(f"could not write checkpoint {final} ({why}): {written:,} bytes written "
                                       f"before it failed, {free:,} bytes free on that disk{need}; earlier "
                                       f"checkpoints are intact; free space (or lower checkpoint.keep_last) and "
                                       f"resume") from None
        self._publish(tmp, final)

    def save_sharded(self, step: int, state, config_toml: str) -> Path:
        """Every rank calls this with the same step: a TrainState under data parallelism (kiln.parallel)."""
        import torch.distributed.checkpoint as dcp  # lazy: 1.9 s of imports (DTensor, FSDP); sharded runs only
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # lazy: as dcp
        self.wait()  # at most one save in flight
        world = state.world
        final = self.dir / f"step_{step:06d}"
        tmp = self.dir / f".tmp-{final.name}"
        if world.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        world.barrier()
        model_sd, optim_sd = _sharded_state_dicts(state)
        sharded = {"model": model_sd} | ({"optimizer": optim_sd} if optim_sd is not None else {})
        written = None
        if self.cfg.async_save:  # staged (copied to host memory) now, written by DCP's thread
            if self._dcp_stager is None:  # one for the run: it keeps its host buffers from save to save (Staging)
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # lazy: as dcp

                # pinned host buffers for a GPU's copies; staged before async_save returns (its future is the write)
                self._dcp_stager = DefaultStager(StagingOptions(use_pinned_memory=state.device.type == "cuda",
                                                                use_shared_memory=False, use_async_staging=False,
                                                                use_non_blocking_copy=False))
            written = dcp.async_save(sharded, checkpoint_id=tmp / "sharded", process_group=world.side_group(),
                                     async_stager=self._dcp_stager)
        else:
            dcp.save(sharded, checkpoint_id=tmp / "sharded")
        if optim_sd is None:  # ZeroRedundancyOptimizer: consolidated on rank 0
            state.optimizer.consolidate_state_dict(to=0)
            if world.main:
                torch.save(state.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"rng": rng_state()}, tmp / f"rank_{world.rank:05d}.pt")
        full = full_weights(state)
        if world.main:
            torch.save(state.shared_state_dict(), tmp / "state.pt")
            (tmp / "config.toml").write_text(config_toml)
            if self.cfg.safetensors:
                export_tensors(self._staging.copy(full) if written is not None else full, tmp / "model.safetensors")
        world.barrier()
        if written is not None:
            # DCP's future completes on rank 0 once every rank's shards and the metadata are written (its last
            # step gathers them all); every rank's other files were written before the barrier above.
            self._in_background(lambda: (written.result(), self._seal_publish(tmp, final) if world.main else None))
            return final
        if world.main:
            self._seal_publish(tmp, final)
        world.barrier()
        return final

    def _seal_publish(self, tmp: Path, final: Path) -> None:
        seal(tmp)
        self._publish(tmp, final)

    def load_sharded(self, state) -> Path:
        """Resume a TrainState under data parallelism from the latest checkpoint, whatever world wrote it."""
        import torch.distributed.checkpoint as dcp  # lazy: 1.9 s of imports (DTensor, FSDP); sharded runs only
        from torch.distributed.checkpoint.state_dict import (  # lazy: as dcp
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)
        path = self.latest()
        if path is None:
            raise self.none_error()
        if not (path / "sharded").is_dir():
            self._load_whole(path, state)
            return path
        zero1 = (path / "optimizer.pt").exists()
        if zero1 != state.world.dp_strategy.zero_optimizer:
            fits = " or ".join(n for n, s in STRATEGIES.items() if s.reduces and s.zero_optimizer == zero1)
            raise KilnError(f"{path} holds {'ZeRO-1' if zero1 else 'per-parameter'} optimizer state; resume it "
                            f"with --parallel.strategy={fits}",
                            key="parallel.strategy", fix=f"resume it with --parallel.strategy={fits}")
        refuse_per_expert(path, dcp.FileSystemReader(path / "sharded").read_metadata().state_dict_metadata)
        model_sd, optim_sd = _sharded_state_dicts(state, _flat_optimizer(path / "sharded"))
        target = {"model": model_sd} | ({"optimizer": optim_sd} if optim_sd is not None else {})
        dcp.load(target, checkpoint_id=path / "sharded")
        _layout_order(state, model_sd, optim_sd, from_canonical)  # the model's rows into this run's TP order
        set_model_state_dict(state.model, target["model"])
        if optim_sd is not None:
            set_optimizer_state_dict(state.model, state.optimizer, target["optimizer"],
                                     options=StateDictOptions(flatten_optimizer_state_dict=_flat_optimizer(
                                         path / "sharded")))
        else:
            state.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=state.device,
                                                       weights_only=False))
        state.load_shared_state_dict(torch.load(path / "state.pt", map_location=state.device, weights_only=True))
        mine = path / f"rank_{state.world.rank:05d}.pt"
        if mine.exists():  # a rank the writing world did not have keeps the RNG streams it was seeded with
            set_rng_state(torch.load(mine, weights_only=True)["rng"])
        return path

    def _load_whole(self, path: Path, state) -> None:
        """A checkpoint one process wrote, into a data-parallel run: every rank reads the whole state.pt and keeps
        its part (FSDP2 shards the full tensors; ZeRO-1 takes its partition of the optimizer state)."""
        from torch.distributed.checkpoint.state_dict import (  # lazy: as dcp
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        if state.world.plan.pp > 1:
            raise KilnError(f"{path} was written by one process without parallel.strategy (a whole state.pt), "
                            f"which a pipeline-parallel run cannot split; resume it on one process with "
                            f"--parallel.strategy=ddp for a checkpoint (DCP, by parameter name), then under "
                            f"parallel.pp",
                            key="parallel.pp", value=state.world.plan.pp,
                            fix="resume it on one process with --parallel.strategy=ddp")
        saved = self.load(map_location="cpu", path=path, rewrite=state.world.main)
        refuse_per_expert(path, saved["model"])
        # a LoRA checkpoint on model.init holds the adapters only: the frozen base came from its files at build
        full = StateDictOptions(full_state_dict=True, strict=getattr(state, "base", None) is None)
        optim_sd = None if type(state.optimizer).__name__ == "ZeroRedundancyOptimizer" else \
            _by_name(saved["optimizer"], state)
        _layout_order(state, saved["model"], optim_sd, from_canonical)
        set_model_state_dict(state.model, saved["model"], options=full)
        if optim_sd is None:
            state.optimizer.load_state_dict(saved["optimizer"])  # the consolidated layout one process writes
        else:
            set_optimizer_state_dict(state.model, state.optimizer, optim_sd, options=full)
        state.load_shared_state_dict(saved)
        if state.world.rank == 0:  # the other ranks keep the RNG streams they were seeded with
            set_rng_state(saved["rng"])

    def _publish(self, tmp: Path, final: Path) -> None:
        self.written_at = time.perf_counter()  # when the last checkpoint became `latest` (benchmarks read it)
        aside = None
        if final.exists():  # re-saving a step: the old one moves aside, and goes only once the new one is in place
            aside = self.dir / f".old-{final.name}-{os.getpid()}"
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync(self.dir)
        pointer = self.dir / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        _fsync(pointer)
        os.replace(pointer, self.dir / "latest")
        _fsync(self.dir)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest keep_last checkpoints that verify by size (a full checksum is paid on load only)."""
        done = sorted(p for p in self.dir.glob("step_*") if p.is_dir() and (p / MANIFEST).is_file())
        for old in done[: -self.cfg.keep_last]:
            shutil.rmtree(old)

    def clean_leftovers(self) -> list[str]:
        """Remove the temporary directories a crash left behind; a checkpoint set aside for a re-save whose
        replacement never arrived is put back. Returns what was done, one entry each."""
        gone = []
        for p in sorted(self.dir.glob(".old-*")):
            name = p.name[len(".old-"):].rsplit("-", 1)[0]  # .old-step_000010-PID
            if not (self.dir / name).exists():
                os.replace(p, self.dir / name)
                gone.append(f"{p.name} restored as {name}")
            else:
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
        for p in sorted(self.dir.glob(".tmp-*")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(p.name)
        if gone:
            self.warn(f"checkpoint: removed {len(gone)} leftover(s) of an interrupted save: {', '.join(gone)}")
        return gone

    def pointer(self) -> tuple[Path | None, str | None]:
        """(the checkpoint `latest` names, None) or (None, why it names none usable); (None, None) without one.
        It holds a directory name, step_000400; a bare step number (400) is read as that step too."""
        path = self.dir / "latest"
        if not path.is_file():
            return None, None
        raw = path.read_bytes()[:200]
        text = raw.decode("utf-8", errors="replace").strip()
        shown = repr(text[:40] + ("..." if len(text) > 40 else ""))
        if "\ufffd" in text or not text.isprintable():
            return None, f"{path} holds binary bytes ({shown}), not a step"
        name = f"step_{int(text):06d}" if text.isdigit() else text
        if not re.fullmatch(r"step_\d+", name):
            return None, f"{path} holds {shown}, which is not a step (it should read like step_000400)"
        if not (self.dir / name).is_dir():
            return None, f"{path} names {name}, which is not in {self.dir}"
        return self.dir / name, None

    def candidates(self) -> list[Path]:
        """Checkpoints to resume from, best first: the one `latest` names, then the others newest first."""
        steps = sorted((p for p in self.dir.glob("step_*") if p.is_dir()), reverse=True)
        named, _ = self.pointer()
        if named is not None and named in steps:
            steps.remove(named)
            steps.insert(0, named)
        return steps

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (None when there is none at all)."""
        path, _ = self._first_good(load=False)
        return path

    def _first_good(self, load: bool, map_location="cpu"):
        _, problem = self.pointer()
        if problem is not None and problem not in self._warned:
            self._warned.add(problem)  # said once, however often the latest checkpoint is looked up
            self.warn(f"checkpoint: {problem}; using the newest checkpoint that verifies instead")
        for path in self.candidates():
            try:
                weights = None  # a damaged model.safetensors beside a state.pt that holds the weights
                if (path / MANIFEST).exists():
                    weights = verify_but_weights(path)
                elif not (path / "state.pt").is_file():
                    raise CheckpointCorrupt(f"{path.name} has no state.pt")
                if not load:
                    return path, None
                state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
                if weights is not None:
                    self._rewrite_weights(path, state, weights)
                return path, state
            except (CheckpointCorrupt, RuntimeError, EOFError, OSError, pickle.UnpicklingError, ValueError) as e:
                why = str(e) if isinstance(e, CheckpointCorrupt) else f"{path.name}/state.pt does not load ({e})"
                self.warn(f"checkpoint: skipping {path.name}: {why.splitlines()[0]}")
        return None, None

    def _rewrite_weights(self, path: Path, state: dict, damage: CheckpointCorrupt) -> None:
        """model.safetensors again from the weights in state.pt (verified), the manifest resealed with it, said in one
        line; a state.pt without the weights (written by several ranks: DCP shards) is damage like any other."""
        if "model" not in state:
            raise damage
        try:
            tmp = path / f".{WEIGHTS}.tmp"
            export_tensors(state["model"], tmp)
            _fsync(tmp)
            os.replace(tmp, path / WEIGHTS)
            manifest = json.loads((path / MANIFEST).read_bytes())
            manifest[WEIGHTS] = {"bytes": (path / WEIGHTS).stat().st_size, "xxh3": _digest(path / WEIGHTS)}
            tmp = path / f".{MANIFEST}.tmp"
            tmp.write_text(json.dumps(manifest, indent=1) + "\n")
            _fsync(tmp)
            os.replace(tmp, path / MANIFEST)
            _fsync(path)
        except OSError as e:  # a read-only run directory: the weights still come from state.pt
            self.warn(f"checkpoint: {damage}; using {path.name}/state.pt, which verifies, but could not rewrite "
                      f"{WEIGHTS} ({e.strerror or e})")
            return
        self.warn(f"checkpoint: {damage}; {path.name}/state.pt verifies and holds the weights: rewrote {WEIGHTS} "
                  f"from it and resealed the manifest")

    def none_error(self) -> FileNotFoundError:
        """What a run without a usable checkpoint says to whoever wanted one (resume, sample, export)."""
        run = self.dir.parent
        found = [p.name for p in self.dir.glob("step_*") if p.is_dir()] if self.dir.is_dir() else []
        if not found:
            return FileNotFoundError(f"{run} has no checkpoint: the run saved none yet (it saves every "
                                     f"checkpoint.interval steps and at its end); train it first")
        return FileNotFoundError(f"{run} has {len(found)} checkpoint(s) and none verifies (`kiln checkpoints "
                                 f"{run}` says what is wrong with each)")

    def load_weights(self, map_location="cpu", path: Path | None = None) -> dict:
        """The newest checkpoint's model weights (`path`: that checkpoint's): state.pt's (one process), or the
        consolidated model.safetensors rank 0 wrote from every rank's shards (data, tensor parallelism), in the
        model's own layout either way."""
        state = self.load(map_location=map_location, path=path)
        if path is not None:
            self.loaded = path
        if "model" in state:
            return stack_experts(state["model"])
        exported = self.loaded / "model.safetensors"
        if not exported.is_file():
            raise FileNotFoundError(f"{self.loaded} was written by several ranks without checkpoint.safetensors: its "
                                    f"weights are DCP shards only; resume it in one process (--parallel.strategy=ddp) "
                                    f"and save again")
        from safetensors.torch import load_file  # lazy: as export_tensors

        return stack_experts(load_file(str(exported), device=str(map_location)))

    def load(self, map_location="cpu", path: Path | None = None, rewrite: bool = True) -> dict:
        """The newest checkpoint that verifies and loads; `path`: that checkpoint only (an error if it fails).
        rewrite=False: a damaged model.safetensors is left for another process to write again (one rank of many)."""
        if path is not None:
            weights = verify_but_weights(path) if (path / MANIFEST).exists() else None
            state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
            if weights is not None and rewrite:
                self._rewrite_weights(path, state, weights)
            return state
        found, state = self._first_good(load=True, map_location=map_location)
        if found is None:
            raise self.none_error()
        self.loaded = found
        return state


def verify_but_weights(path: Path) -> CheckpointCorrupt | None:
    """verify(path), except that a damaged model.safetensors in a checkpoint one process wrote (its state.pt holds
    the weights, and every other file verifies) is returned, not raised: state.pt can write it again."""
    try:
        verify(path)
        return None
    except CheckpointCorrupt as e:
        if e.file != WEIGHTS or (path / "sharded").is_dir():
            raise
        verify(path, skip=WEIGHTS)
        return e


def _by_name(saved: dict, state) -> dict:
    """A torch optimizer state dict keyed by parameter position (what one process saves), re-keyed by the parameter
    names torch.distributed.checkpoint uses, read off this run's optimizer, which lists its parameters in the same
    groups and order (kiln builds both from the same model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # lazy: as dcp
    names = get_optimizer_state_dict(state.model, state.optimizer,
                                     options=StateDictOptions(full_state_dict=True))["param_groups"]
    if [len(g["params"]) for g in names] != [len(g["params"]) for g in saved["param_groups"]]:
        raise KilnError("the checkpoint's optimizer groups its parameters differently from this run's; resume with "
                        "the optimizer settings it was saved with (optim.*)",
                        key="optim", fix="resume with the optimizer settings it was saved with (optim.*)")
    key = {i: n for old, new in zip(saved["param_groups"], names) for i, n in zip(old["params"], new["params"])}
    return {"state": {key[i]: v for i, v in saved["state"].items()},
            "param_groups": [{**old, "params": new["params"]} for old, new in zip(saved["param_groups"], names)]}


def _sharded_state_dicts(state, flat: bool = True):
    """(model, optimizer) state dicts keyed by parameter names, DTensor shards under FSDP2 and TP, in the model's own
    layout (a TP run's fused rows in the model's order: copies, not the live tensors); the optimizer's is None for
    ZeroRedundancyOptimizer, which DCP cannot shard (it is consolidated instead).

    The optimizer's is flat (its param_groups settings per parameter name too): pipeline stages hold different
    parameters, and a list of each group's parameters would differ from rank to rank where DCP expects one value.
    flat=False reads a checkpoint written before (param_groups as lists)."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: as dcp
        StateDictOptions, get_model_state_dict, get_state_dict)

    if type(state.optimizer).__name__ == "ZeroRedundancyOptimizer":
        model_sd, optim_sd = get_model_state_dict(state.model), None
    else:
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=flat))
    _layout_order(state, model_sd, optim_sd, canonical)
    return model_sd, optim_sd


def _flat_optimizer(sharded: Path) -> bool:
    """Whether a DCP checkpoint holds its optimizer state flat (param_groups.<name>.lr), as kiln writes it now, not
    as a list of groups (param_groups.<i>.params, each group's parameter names). By that key: a parameter's name may
    start with a digit too (param_groups.0.weight.lr: an nn.Sequential's)."""
    import torch.distributed.checkpoint as dcp  # lazy: 1.9 s of imports (DTensor, FSDP); sharded runs only

    keys = dcp.FileSystemReader(str(sharded)).read_metadata().state_dict_metadata
    return not any(re.fullmatch(r"optimizer\.param_groups\.\d+\.params", k) for k in keys)


def full_weights(state) -> dict:
    """The whole model's weights on rank 0's host, in the model's own layout, gathered from every rank's shards (a
    collective: every rank calls it; the others get {}). What export and sampling read under FSDP, TP or PP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # lazy: as dcp

    if hasattr(state.model, "full_state_dict"):  # kiln.parallel.pipeline.PipelineModel: every stage's weights
        return state.model.full_state_dict()
    full = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tp = _tp(state)
    for name, parts in (fused_rows(state.model).items() if tp > 1 else ()):
        if name in full:
            full[name] = canonical(full[name], parts, tp)
    return full


def _tp(state) -> int:
    return state.world.plan.tp


def _layout_order(state, model_sd: dict, optim_sd: dict | None, convert) -> None:
    """Each fused parameter (and its optimizer state) of a tensor-parallel run through `convert` (canonical: TP
    order -> the model's; from_canonical: back), replaced in the dicts; nothing without TP. The optimizer's dict
    is nested ({"state": {name: {...}}}) or flat ({"state.<name>.exp_avg": ...})."""
    tp = _tp(state)
    if tp == 1:
        return

    def moment(value):  # exp_avg, exp_avg_sq reordered (not the step count)
        return isinstance(value, torch.Tensor) and value.dim() > 0

    nested = optim_sd is not None and isinstance(optim_sd.get("state"), dict)
    if nested:  # new dicts: the per-parameter ones may be the optimizer's own (live) state
        optim_sd["state"] = dict(optim_sd["state"])
    for name, parts in fused_rows(state.model).items():
        model_sd[name] = convert(model_sd[name], parts, tp)
        if optim_sd is None:
            continue
        if nested and name in optim_sd["state"]:
            optim_sd["state"][name] = {key: convert(value, parts, tp) if moment(value) else value
                                       for key, value in optim_sd["state"][name].items()}
        elif not nested:
            for key in [k for k in optim_sd if k.startswith(f"state.{name}.")]:
                if moment(optim_sd[key]):
                    optim_sd[key] = convert(optim_sd[key], parts, tp)


def write_state(state: dict, path: Path) -> None:
    """state.pt (a seam: the tests slow it down to catch a save in flight)."""
    torch.save(state, path)


class Staging:
    """Host copies of the state for checkpoint.async_save, in buffers kept from one save to the next: what a
    background save writes while training changes the originals. A fresh copy pays the page faults of new memory
    on every save (a 173 MB state: 74-115 ms, against 12-21 ms into the last save's buffers; docs/benchmarks.md);
    the price is one host copy of the state held between saves. Safe because at most one save is in flight: the
    next copy starts after the last write ended. Views of one storage stay one buffer (tied weights; the model's
    weights inside the state and for safetensors)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, tree):
        kept: dict[tuple, torch.Tensor] = {}  # this save's buffers: those of tensors gone since are let go

        def copy(x):
            if isinstance(x, torch.Tensor):
                key = (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(),
                       x.dtype)
                if key not in kept:
                    buffer = self._buffers.get(key)
                    if buffer is None:
                        buffer = torch.empty_like(x, device="cpu")  # its strides (contiguous if x overlaps)
                    kept[key] = buffer.copy_(x.detach())
                return kept[key]
            if isinstance(x, dict):
                return {k: copy(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(copy(v) for v in x) if not hasattr(x, "_fields") else type(x)(*map(copy, x))
            return x

        copied = copy(tree)
        self._buffers = kept
        return copied


def export_tensors(state_dict: dict, path: Path) -> None:
    from safetensors.torch import save_file  # lazy: only checkpoints with checkpoint.safetensors import it

    # Tied weights are one storage; safetensors refuses shared tensors, so each is written once.
    tensors, seen = {}, set()
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(path))


def refuse_per_expert(path, keys) -> None:
    """A checkpoint of kiln's per-expert MoE layout (one nn.Linear per expert, before the stacked experts of
    kiln.models.moe) does not resume: its optimizer state is per expert. Its weights export and start a run."""
    key = per_expert_key(keys)
    if key is not None:
        raise KilnError(f"{path} holds a mixture of experts in kiln's earlier per-expert layout ({key}), whose "
                        f"optimizer state does not resume in the stacked one; export its weights (kiln export "
                        f"RUN --hf DIR) and start a new run from them with --model.init=hf:DIR",
                        key="model.init", value=str(path),
                        fix="export its weights (kiln export RUN --hf DIR) and start a new run from them with "
                        "--model.init=hf:DIR")
