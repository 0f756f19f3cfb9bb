"""The model pipeline's parallelize step: tensor parallel over mesh["tp"] (kiln's plan or the user's), context
parallel over mesh["cp"], experts over mesh["ep"], then data parallel (DDP, FSDP2's replicate or fully_shard) over
the dp ranks; gradient_sync turns the gradient reduction off for every micro-batch but a step's last."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from kiln.parallel.comm import CommTimer, timed_allreduce
from kiln.parallel.config import ParallelConfig
from kiln.parallel.context import apply_context_parallel
from kiln.parallel.expert import shard_experts, wrap_experts
from kiln.parallel.strategy import strategy
from kiln.parallel.world import World


def parallelize(model: nn.Module, cfg: ParallelConfig, world: World, device: torch.device,
                param_dtype: torch.dtype | None = None, tensor_plan=None) -> nn.Module:
    """The pipeline's parallelize step: returns what the step calls (DDP wraps; TP and FSDP2 change `model` in
    place). The order is torchtitan's: tensor parallel over mesh["tp"] first (kiln.parallel.tensor, or the user's
    `tensor_plan(model, tp_mesh)`: kiln.parallel.user_plan), then data parallel over mesh["dp"] only (the tp ranks
    of one copy see the same data).

    fsdp: fully_shard on every transformer block (model.blocks) and then the root, so each block's parameters
    are gathered just before it runs; bf16 autocast runs become FSDP2's MixedPrecisionPolicy (bf16 parameters in
    compute, fp32 gradient reduction). Under TP its parameters are DTensors on the 2-D (dp, tp) mesh.
    ddp with tp > 1: FSDP2's replicate (DDP's all-reduce over mesh["dp"], for DTensor parameters).
    ep > 1 (kiln.parallel.expert): each MoE block's experts split over mesh["ep"] and wrapped first, over
    mesh["dp_mod_ep"] (fully_shard, or replicate under ddp), then everything else over mesh["dp"] as above.
    """
    plan = world.plan
    tp = plan is not None and plan.tp > 1
    if tp:
        from kiln.parallel.tensor import apply_tensor_parallel  # lazy: DTensor's imports, tp > 1 only
        from kiln.parallel.user_plan import apply_user_plan  # lazy: as kiln.parallel.tensor
    if tp and tensor_plan is not None:
        apply_user_plan(model, world.mesh["tp"], tensor_plan)
    elif tp:
        apply_tensor_parallel(model, world.mesh["tp"], plan.sequence_parallel)
    if plan is not None and plan.cp > 1:  # each sequence split over the cp ranks; FSDP2 then shards over dp × cp
        apply_context_parallel(model, world.mesh["cp"])
    data = strategy(cfg.strategy)
    if not data.reduces:
        return model
    dp_mesh = world.mesh["dp"] if world.mesh is not None else None
    if plan is not None and plan.cp > 1:  # FSDP2 shards over every rank of a copy's data: dp × cp (dp_shard_cp)
        dp_mesh = world.mesh["dp", "cp"]._flatten("dp_cp")
    ep = plan is not None and plan.ep > 1
    if ep:  # experts split over mesh["ep"], then data-parallel over mesh["dp_mod_ep"] (kiln.parallel.expert)
        shard_experts(model, world.mesh["ep"])
    if data.ddp_reducer and not (tp or ep):
        ids = [device.index] if device.type == "cuda" else None
        group = dp_mesh.get_group() if dp_mesh is not None and plan.dp < world.size else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
        world.comm = CommTimer()
        ddp.register_comm_hook(world.comm, timed_allreduce)
        return ddp
    if not data.shards_parameters:  # ddp with tp: every rank of a dp group keeps whole (TP-split) parameters
        from torch.distributed._composable.replicate_with_fsdp import replicate  # lazy: ddp × tp only

        options = fsdp_options(cfg, param_dtype, replicated=True)
        if ep:
            wrap_experts(model, world.mesh, replicate, options)
        replicate(model, mesh=dp_mesh, **options)
        return model
    if ep:
        from torch.distributed.fsdp import fully_shard  # lazy: fsdp only

        wrap_experts(model, world.mesh, fully_shard, fsdp_options(cfg, param_dtype))
    shard_blocks(model, getattr(model, "blocks", ()), dp_mesh, fsdp_options(cfg, param_dtype))
    return model


def fsdp_options(cfg: ParallelConfig, param_dtype: torch.dtype | None = None, replicated: bool = False) -> dict:
    """FSDP2's keyword arguments for the `parallel` section: bf16 autocast runs gather bf16 parameters and reduce
    fp32 gradients (MixedPrecisionPolicy); replicated (FSDP2's replicate, ddp × tp) takes that policy only."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy  # lazy: fsdp only

    kw = {}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if replicated:
        return kw
    kw["reshard_after_forward"] = cfg.reshard_after_forward
    if cfg.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    return kw


def shard_blocks(root: nn.Module, blocks, mesh, options: dict, keep_root: bool = False) -> None:
    """fully_shard on every transformer block and then on the root (whatever parameters are left: embeddings,
    norm, head), so each block's parameters are gathered just before it runs. mesh: the dp dim (None: every rank).
    keep_root: the root's parameters stay gathered from its forward to the end of the backward (a pipeline stage,
    whose head is applied by the loss, outside the forward)."""
    from torch.distributed.fsdp import fully_shard  # lazy: fsdp only

    kw = options | ({"mesh": mesh} if mesh is not None else {})
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(root, **(kw | ({"reshard_after_forward": False} if keep_root else {})))


@contextlib.contextmanager
def gradient_sync(step_model: nn.Module, on: bool):
    """Reduce gradients on this backward (the last micro-batch of a step) or not (the others)."""
    step_model = getattr(step_model, "_orig_mod", step_model)  # torch.compile's wrapper
    if on:
        yield
    elif isinstance(step_model, nn.parallel.DistributedDataParallel):
        with step_model.no_sync():
            yield
    elif hasattr(step_model, "set_requires_gradient_sync"):  # FSDP2
        step_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            step_model.set_requires_gradient_sync(True)
    else:
        yield
