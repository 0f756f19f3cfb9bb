"""This process's place in a run: init_world (the process group from torchrun's environment, or a world of one),
World (rank, size, collectives; the layout is its ParallelPlan's, set by lay_out with the run's DeviceMesh), each
rank's device, and the layout record every rank's parameter bytes are gathered into (metrics.jsonl)."""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from kiln.errors import KilnError
from kiln.parallel.comm import CommTimer
from kiln.parallel.config import ParallelConfig
from kiln.parallel.context import check_context_parallel
from kiln.parallel.elastic import agent_store_in_use, round_store
from kiln.parallel.layout import ParallelPlan, check_degrees
from kiln.parallel.strategy import Strategy, strategy
from kiln.util import is_dtensor

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class World:
    """This process's place in the run: rank, size, collectives; the layout is world.plan's (set by lay_out)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    comm: CommTimer | None = None  # ddp, zero1: the gradient all-reduces timed (FSDP2 offers no hook to time)
    timeout: float = 300.0  # parallel.timeout: how long a collective waits for the others
    broken: bool = False  # a collective failed (a rank died or hung): no further collective is attempted
    _side: object = None  # side_group()
    plan: ParallelPlan | None = field(default_factory=lambda: ParallelPlan(1))  # None from init_world to lay_out
    mesh: object = None  # the DeviceMesh (dims pp, dp, tp) of a run under torchrun, else None
    device_type: str = "cpu"  # the mesh's, built by lay_out when launched by torchrun
    torchrun: bool = False

    def lay_out(self, plan: ParallelPlan) -> "World":
        """Take the run's plan (built once, with the model: kiln.run.builder) and, under torchrun, its mesh."""
        if plan.world_size != self.size:
            raise ValueError(f"a plan for {plan.world_size} ranks laid over a world of {self.size}")
        self.plan = plan
        self.mesh = _mesh(plan, self.device_type) if self.torchrun else None
        return self

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def strategy(self) -> str:  # parallel.strategy, as the plan holds it
        return self.plan.strategy

    @property
    def dp_strategy(self) -> Strategy:
        """What parallel.strategy does over the data-parallel ranks (kiln.parallel.strategy)."""
        return self.plan.dp_strategy

    @property
    def sharded(self) -> bool:
        """Collectives and a sharded checkpoint: data parallelism (gradients averaged over the dp ranks), or the
        model split over ranks (tp, pp)."""
        return self.dp_strategy.reduces or self.plan.model_parallel

    @property
    def splits_weights(self) -> bool:
        """No rank holds the whole model: FSDP shards it, tensor or pipeline parallelism splits it."""
        return self.size > 1 and (self.dp_strategy.shards_parameters or self.plan.model_parallel)

    @property
    def dp_size(self) -> int:
        """Model copies that see different data: the ranks a batch is shared by, and gradients averaged over."""
        return self.plan.dp

    @property
    def grad_ranks(self) -> int:
        """The ranks data parallelism averages gradients over: the dp copies, times the cp ranks that each computed
        part of every sequence (FSDP2 shards over dp × cp)."""
        return self.plan.dp * self.plan.cp

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel copies: which share of the data it reads (tp ranks of one copy
        read the same)."""
        return self.plan.coords(self.rank)["dp"]

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, dim: str | None = None) -> torch.Tensor:
        """Reduce over every rank, or over the ranks of one mesh dim (dim="dp": the copies that saw different data;
        a sum of token counts or losses over all ranks would count each tp rank's identical copy again)."""
        group = None
        if dim is not None and self.mesh is not None and self.plan.mesh_shape.get(dim, 1) < self.size:
            if self.plan.mesh_shape.get(dim, 1) == 1:  # ("cp" is in the mesh only when cp > 1)
                return t
            group = self.mesh.get_group(dim)
        if self.size > 1:
            # NCCL reduces device tensors only: a host tensor (a count, a flag) goes through the GPU and back
            on = t.cuda() if t.device.type == "cpu" and dist.get_backend() == "nccl" else t
            dist.all_reduce(on, op=op, group=group)
            if on is not t:
                t.copy_(on)
        return t

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def broadcast_object(self, obj):
        """rank 0's object on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj) -> list:
        """Every rank's object, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def side_group(self):
        """A gloo process group of its own for a background thread's collectives (DCP async_save), which must
        never interleave with the training thread's on the default group. Created on first use, by every rank."""
        if self._side is None:
            self._side = dist.new_group(backend="gloo")
        return self._side

    def close(self) -> None:
        """The end of a run. The process group stays for the next run in this process (re-creating one in the same
        rendezvous store can hang gloo) and is destroyed when the process exits. After a failed collective there is
        nothing to wait for: a dead peer never arrives."""
        if not self.broken:
            self.barrier()


def layout_event(world: World, model: nn.Module) -> dict:
    """The record that says how a multi-process run is laid out: the mesh, and every rank's parameter bytes as it
    holds them (its local shards; a collective: every rank calls it), against one whole copy of the model."""
    params = list(dict.fromkeys(model.parameters()))
    held = sum(_local(p).numel() * p.element_size() for p in params)
    duplicate = getattr(model, "duplicate", None)  # a pipeline's last-stage copy of a tied embedding: counted once
    whole = sum(p.numel() * p.element_size() for p in params if p is not duplicate)
    plan = world.plan
    per_rank = world.gather_objects((held, whole))
    if plan.pp > 1:  # each pipeline rank holds its stage's part: one copy's stages summed
        whole = sum(w for r, (_, w) in enumerate(per_rank) if plan.coords(r)["dp"] == plan.coords(r)["tp"] == 0)
    one = not world.torchrun and not plan.dp_strategy.reduces  # a plain world of one: {"dp": 1}, as ever
    return {"event": "layout", "mesh": {"dp": world.size} if one else plan.mesh_record,
            "strategy": world.strategy, "sequence_parallel": plan.sequence_parallel,
            "param_bytes_per_rank": [h for h, _ in per_rank], "param_bytes_unsharded": whole}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE"))


def init_world(cfg: ParallelConfig, device_type: str) -> World:
    """The world this process is part of: the process group, not yet its layout (the run builder builds the
    ParallelPlan once the model is known and calls world.lay_out). Errors name the fix for a launch that does not
    match the config: the degrees are checked against the world here, before any rank reads data."""
    check_context_parallel(cfg)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    timeout = timedelta(seconds=cfg.timeout)
    if not launched_by_torchrun():
        if cfg.tp * cfg.pp * cfg.cp > 1:
            what = f"parallel.tp={cfg.tp} × parallel.pp={cfg.pp}" + (f" × parallel.cp={cfg.cp}" if cfg.cp > 1 else "")
            n = cfg.tp * cfg.pp * cfg.cp
            raise KilnError(f"{what} splits the model over {n} processes: launch with torchrun "
                            f"--nproc_per_node={n} (or a multiple)", key="parallel.tp" if cfg.tp > 1 else
                            "parallel.pp" if cfg.pp > 1 else "parallel.cp", value=n,
                            fix=f"launch with torchrun --nproc_per_node={n} (or a multiple)")
        if not strategy(cfg.strategy).reduces:
            return World(plan=None, device_type=device_type)
        # A world of one: the same code path without torchrun (tests, resuming a parallel run on one device).
        if not dist.is_initialized():
            _init(backend, timeout, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        check_degrees(cfg, dist.get_world_size())
        return World(0, dist.get_world_size(), 0, timeout=cfg.timeout, plan=None, device_type=device_type)
    size = int(os.environ["WORLD_SIZE"])
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise KilnError(f"the distributed environment lacks {', '.join(missing)}; launch with torchrun "
                        f"(torchrun --standalone --nproc_per_node=N -m kiln train ...), which sets them",
                        key=missing[0], fix="launch with torchrun")
    if not strategy(cfg.strategy).reduces and size > cfg.tp * cfg.pp:
        raise KilnError(f"torchrun started {size} processes but parallel.strategy=none would train {size} "
                        f"independent copies; set --parallel.strategy=ddp, zero1 or fsdp", key="parallel.strategy",
                        value=cfg.strategy, fix="set --parallel.strategy=ddp, zero1 or fsdp")
    check_degrees(cfg, size)
    if not dist.is_initialized():
        rank = int(os.environ["RANK"])
        if agent_store_in_use():  # torchrun's store, shared by its rounds: a namespace of this round's own
            _init(backend, timeout, store=round_store(rank, size, timeout), rank=rank, world_size=size)
        else:
            _init(backend, timeout)
    elif hasattr(dist.distributed_c10d, "_set_pg_timeout"):  # a later run in this process: its own timeout
        dist.distributed_c10d._set_pg_timeout(timeout)
    return World(int(os.environ["RANK"]), size, int(os.environ["LOCAL_RANK"]), timeout=cfg.timeout, plan=None,
                 device_type=device_type, torchrun=True)


_MESHES: dict = {}  # (shape, device type) -> DeviceMesh: like the process group, one per process, kept across runs


def _mesh(plan: ParallelPlan, device_type: str):
    """The run's DeviceMesh, made once per layout in a process (each one creates a process group per dim, and a
    later run in the same process, a test's, reuses them)."""
    key = (tuple(plan.mesh_shape.items()), plan.ep, device_type)
    if key not in _MESHES:
        _MESHES[key] = plan.device_mesh(device_type)
    return _MESHES[key]


def _init(backend: str, timeout: timedelta, **kw) -> None:
    # parallel.timeout, not torch's default (30 min for gloo, 10 for NCCL): a dead or hung rank stops the others
    # within it. On CUDA, NCCL's watchdog enforces it (TORCH_NCCL_ASYNC_ERROR_HANDLING, docs/distributed.md).
    dist.init_process_group(backend, timeout=timeout, **kw)
    atexit.register(dist.destroy_process_group)


def _free_port() -> int:
    import socket  # lazy: only a world of one without torchrun needs a port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(world: World, device: torch.device) -> torch.device:
    """Each rank's device: cuda:LOCAL_RANK on a GPU machine; the CPU is shared."""
    if device.type == "cuda" and world.size > 1:
        return torch.device("cuda", world.local_rank)
    return device
