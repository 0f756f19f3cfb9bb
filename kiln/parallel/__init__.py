"""Data parallelism on torch.distributed, launched by torchrun: DDP, ZeRO-1 (DDP + ZeroRedundancyOptimizer) and
FSDP2 (fully_shard per transformer block plus the root). Never a home-made engine.

    ParallelConfig                    the `parallel` section
    world = init_world(cfg, device)   the process group from torchrun's environment (or a world of one)
    world.lay_out(plan)               the run's ParallelPlan (built once, with the model) and its DeviceMesh
    parallelize(model, cfg, world, precision)   the model pipeline's parallelize step
    gradient_sync(step_model, on)     accumulation: no gradient reduction until the last micro-batch
    world.all_reduce(t, op, dim)      in place, over every rank or one mesh dim ("dp"); a no-op in a world of one
    layout_event(world, model)        the run's layout and every rank's parameter bytes, gathered (metrics.jsonl)

Tensor parallelism (kiln.parallel.tensor) splits kiln's Transformer over the mesh's tp dim before data parallelism
wraps it, or a user's own plan splits a model of theirs (kiln.parallel.user_plan, `kiln.fit(tensor_parallel=fn)`);
kiln.parallel.layout's ParallelPlan holds the degrees (world.plan; World keeps none) and world.mesh the DeviceMesh.
Context parallelism (kiln.parallel.context) splits each sequence over mesh["cp"] before FSDP2 shards over dp × cp.

Surviving failures (multi-node, elastic restarts) lives beside it: kiln.parallel.watchdog (a collective that fails or
times out becomes one line naming the rank, the step and the collective), kiln.parallel.elastic (--auto-resume under
torchrun --max-restarts, the restart record), kiln.parallel.stragglers (a rank slower than the others, named).

A plain `kiln train` without torchrun is a world of one with strategy none: no process group, nothing changes.

The modules: world (init_world, World, device_for, layout_event), apply (parallelize, fsdp_options, shard_blocks,
gradient_sync), comm (CommTimer), config (ParallelConfig), layout (ParallelPlan), strategy; tensor, context,
expert, pipeline, user_plan for the model-parallel dims (fused: the row order of fused weights under tp); watchdog,
elastic, stragglers for failures. DTensor (torch.distributed.tensor, with sympy: ~1 s of CPU) is imported only where a
layout needs it (tp, ep, cp; FSDP2 brings its own), never by a one-process run's imports.
"""
from __future__ import annotations

from kiln.parallel.apply import fsdp_options, gradient_sync, parallelize, shard_blocks
from kiln.parallel.comm import CommTimer
from kiln.parallel.config import ParallelConfig
from kiln.parallel.layout import ParallelPlan, check_degrees
from kiln.parallel.strategy import Strategy, strategy
from kiln.parallel.world import TORCHRUN_ENV, World, device_for, init_world, launched_by_torchrun, layout_event

__all__ = [
    "ParallelConfig", "ParallelPlan", "World", "init_world", "launched_by_torchrun", "device_for", "layout_event",
    "parallelize", "fsdp_options", "shard_blocks", "gradient_sync", "CommTimer", "Strategy", "strategy",
    "check_degrees", "TORCHRUN_ENV",
]
