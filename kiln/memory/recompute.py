"""Activation recomputation, applied to a built model from outside.

    apply_recompute(model, plan)      plan: one policy per block ("none" | "selective" | "full" | "seg")
    plan_for(policy, every, budget, job)  the per-block plan of a `memory` section (solves `budget`)
    remove_recompute(model)

A recomputed block stays the same module: its class is swapped for a subclass whose forward runs under
torch.utils.checkpoint (the way FSDP2's fully_shard swaps a module's class), so parameter names, state_dict keys
and module hooks are untouched. "full" checkpoints a segment: its first block runs every block of the segment —
calling each as a module, so their hooks fire — under one checkpoint; the later blocks of the segment ("seg")
return their input when the model's own loop calls them. "selective" keeps the outputs of the matmuls
(aten.mm/addmm, an MoE's aten._grouped_mm) and recomputes the rest of the block — norms, attention core, MLP
activation — through torch.utils.checkpoint's selective checkpoint contexts.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import replace

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, SelectiveCheckpointContext, checkpoint,
                                    create_selective_checkpoint_contexts)

from kiln.memory.estimate import block_flops, fmt_bytes, parse_bytes, recompute_plan, saved_tensors
from kiln.perf.cpu_linear import onednn_available
from kiln.errors import KilnError

POLICIES = ("none", "full", "every_k", "selective", "budget")
_KEPT_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
if hasattr(torch.ops.aten, "_grouped_mm"):  # an MoE's experts (kiln.models.moe), one product per matmul
    _KEPT_MATMULS.add(torch.ops.aten._grouped_mm.default)
if onednn_available():  # train.cpu_linear=onednn's products (kiln.perf.cpu_linear)
    _KEPT_MATMULS.add(torch.ops.mkldnn._linear_pointwise.default)

# Callbacks told about every tensor a recompute region keeps alive outside autograd's saved tensors (the
# region's input and, for selective, the cached matmul outputs); kiln.memory.measure counts them.
_observers: list = []


@contextlib.contextmanager
def observe_kept(callback):
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def _kept(t):
    for callback in _observers:
        callback(t)


# torch ≥ 2.12 hands the policy the op's output (ctx.op_output); before that the policy runs before the op, and
# the kept outputs are observed by a dispatch mode above the checkpoint's own (2.11 is what GPU images carry).
_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def _selective_policy(ctx, op, *args, **kwargs):
    if op in _KEPT_MATMULS:
        if _POLICY_SEES_OUTPUT:
            _kept(ctx.op_output)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _ObserveKeptMatmuls(TorchDispatchMode):
    """Tells the observers about each kept matmul output, for a torch whose policy cannot see it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _KEPT_MATMULS:
            _kept(out)
        return out


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield


def _selective_contexts():
    forward, recompute = create_selective_checkpoint_contexts(_selective_policy)
    if _observers and not _POLICY_SEES_OUTPUT:
        forward = _both(forward, _ObserveKeptMatmuls())  # entered last, so it sees each op first
    return forward, recompute


class Recomputed:
    """Mixed in before a block's own class. kiln_recompute: "full" | "selective" (opens a segment) | "seg"."""

    kiln_recompute: str
    kiln_segment: list  # the blocks after this one that its checkpoint runs ("full" over several blocks)
    kiln_inside: bool  # "seg": being run by its segment's first block, not by the model's loop

    def forward(self, x, rope_cache=None):
        if self.kiln_recompute == "seg":
            return super().forward(x, rope_cache) if self.kiln_inside else x  # the first block computed it
        _kept(x)
        extra = {"context_fn": _selective_contexts} if self.kiln_recompute == "selective" else {}
        return checkpoint(self._run_segment, x, rope_cache, use_reentrant=False, **extra)

    def _run_segment(self, x, rope_cache):
        x = super().forward(x, rope_cache)
        for block in self.kiln_segment:
            block.kiln_inside = True
            try:
                x = block(x, rope_cache)  # a module call: its hooks fire, inside the checkpoint and in recompute
            finally:
                block.kiln_inside = False
        return x


_subclasses: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, mixin: type) -> None:
    """Make `module` an instance of (mixin, its class): same object, same parameters, new forward."""
    cls = type(module)
    key = (mixin, cls)
    if key not in _subclasses:
        _subclasses[key] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"kiln_base": cls})
    module.__class__ = _subclasses[key]


def unswap_class(module: nn.Module, mixin: type) -> None:
    if isinstance(module, mixin):
        module.__class__ = module.kiln_base


def remove_recompute(model) -> None:
    for block in model.blocks:
        unswap_class(block, Recomputed)
        for name in ("kiln_recompute", "kiln_segment", "kiln_inside"):
            block.__dict__.pop(name, None)


def apply_recompute(model, plan) -> None:
    """Install a per-block plan (a tuple with one policy per block) on model.blocks."""
    blocks = list(model.blocks)
    if len(plan) != len(blocks):
        raise KilnError(f"recompute plan has {len(plan)} entries for {len(blocks)} blocks", key="plan",
                        value=tuple(plan), fix=f"give one policy per block ({len(blocks)})")
    if any(getattr(b, "kiln_offload", False) for b in blocks):
        raise KilnError("recompute applied after activation offload (offload skips recomputed blocks)", key="model",
                        fix="apply recompute before activation offload")
    remove_recompute(model)
    i = 0
    while i < len(blocks):
        policy = plan[i]
        if policy == "seg":
            raise KilnError(f"recompute plan: block {i} is 'seg' but no 'full' block opens its segment", key="plan",
                            value=tuple(plan), fix="start each segment with a 'full' block")
        if policy not in ("none", "full", "selective"):
            raise KilnError(f"recompute plan: block {i}'s policy {policy!r} is unknown", key="plan", value=tuple(plan),
                            fix="give each block none, full, selective, or seg after a full one")
        j = i + 1
        if policy == "full":
            while j < len(blocks) and plan[j] == "seg":
                j += 1
        if policy != "none":
            for k, block in enumerate(blocks[i:j]):
                swap_class(block, Recomputed)
                block.kiln_recompute = policy if k == 0 else "seg"
                block.kiln_segment = blocks[i + 1:j] if k == 0 else []
                block.kiln_inside = False
        i = j


# ---------------------------------------------------------------- choosing the plan


def solve_budget(job, budget_bytes: int) -> tuple[str, ...]:
    """Per-block policies whose saved activations fit in budget_bytes at the least recompute FLOPs.

    Blocks are identical, so the answer is a count of blocks at each level (none > selective > full in memory,
    the reverse in FLOPs); every split is tried. Blocks nearest the loss keep their activations (their backward
    runs first, so what they hold is freed first). Raises when even full recomputation does not fit.
    """
    L = job.model.n_layer
    sizes, costs = {}, {}
    mm, attn = block_flops(job.model, job.micro_batch, job.seq_len, job.backend != "math")
    for policy, cost in (("none", 0.0), ("selective", attn), ("full", mm + attn)):
        _, blocks, _ = saved_tensors(replace(job, recompute=(policy,) * L))
        sizes[policy], costs[policy] = sum(blocks[0].values()), cost
    best = None
    for n_full in range(L + 1):
        for n_sel in range(L - n_full + 1):
            n_none = L - n_full - n_sel
            size = n_none * sizes["none"] + n_sel * sizes["selective"] + n_full * sizes["full"]
            cost = n_sel * costs["selective"] + n_full * costs["full"]
            if size <= budget_bytes and (best is None or cost < best[0] or (cost == best[0] and size < best[1])):
                best = (cost, size, n_full, n_sel)
    if best is None:
        raise KilnError(f"memory.recompute_budget={fmt_bytes(budget_bytes)} is below what full recomputation keeps "
                        f"({fmt_bytes(L * sizes['full'])}); raise the budget or lower the micro-batch",
                        key="memory.recompute_budget", value=fmt_bytes(budget_bytes),
                        fix="raise the budget or lower the micro-batch")
    _, _, n_full, n_sel = best
    return ("full",) * n_full + ("selective",) * n_sel + ("none",) * (L - n_full - n_sel)


def plan_for(policy: str, every: int, budget: str, job) -> tuple[str, ...]:
    """The per-block plan for a `memory` section's recompute keys and a Job (shapes, precision, backend)."""
    if policy not in POLICIES:
        raise KilnError(f"memory.recompute={policy!r} is unknown; use one of {POLICIES}",
                        key="memory.recompute", value=policy, fix=f"use one of {POLICIES}")
    if policy == "budget":
        if not budget:
            raise KilnError("memory.recompute='budget' needs memory.recompute_budget, e.g. 4GiB",
                            key="memory.recompute_budget", fix="e.g. 4GiB")
        return solve_budget(job, parse_bytes(budget, "memory.recompute_budget"))
    return recompute_plan(policy, job.model.n_layer, every)
