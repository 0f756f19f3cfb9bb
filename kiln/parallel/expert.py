"""Expert parallelism (parallel.ep): each of ep ranks holds n_experts/ep whole experts, and the (token, slot) pairs
routed to an expert travel to the rank that holds it and back, by torch.distributed all-to-all with variable splits.

    shard_experts(model, ep_mesh)        every MoE's stacked expert weights become DTensors Shard(0) over ep_mesh,
                                         and its dispatch step an ExpertParallel over that group
    ExpertParallel(moe, group)           MoE's dispatch step (moe.dispatch): pairs out, local experts, pairs back
    exchange(counts, group, ep)          the split sizes both ways (the one host sync per MoE block)
    all_to_all(x, out_splits, in_splits, group)   all_to_all_single with autograd (the backward is the reverse)

One forward of a MoE block at ep > 1, on each rank of an ep group (torchtitan's ExpertParallel, without its
permutation kernel):

    1. the pairs sorted by expert (S, C) and their counts per expert (E,), as MoE.forward makes them
    2. counts viewed (ep, E/ep): what goes to each ep rank; all_to_all_single of them: what comes from each
    3. one .tolist() of both (the sizes all_to_all_single needs on the host): the one host sync per MoE block
    4. the pairs all-to-all'd: they arrive by source rank, and by local expert within a source
    5. reordered by local expert (a stable argsort), the local experts run (MoE's own grouped function)
    6. put back in arrival order and all-to-all'd back the way they came: the sender's pairs, in its order

Dropless: every pair is sent and computed, so the result is one process's to the last bit up to the order of sums
(the experts' matmuls see the same rows; only their batching differs). The load-balancing loss is computed before
the dispatch, from this rank's own routing, as with data parallelism.

Gradients: the all-to-all's backward sends each expert's input gradient back to the pair's rank, and an expert's
weight gradient on its holder sums the pairs of the whole ep group. The data-parallel wrapper then averages each
expert over the dp/ep ranks that hold it (mesh["dp_mod_ep"]); the mean over dp the other parameters get needs
1/ep more (the ep group's pairs are in the sum already), which the local weights' backward applies (_ScaleGrad:
exact for a power-of-2 ep).

Sync-free alternative not taken: fixed worst-case splits (every pair of a rank to one expert: S rows to each of ep
ranks) need no sizes on the host, but move ep× the bytes and compute ep× the rows; the sizes' sync is torchtitan's
choice too.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from kiln.errors import KilnError
from kiln.models.moe import MoE, experts


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with the given split sizes; its backward is the all-to-all the other way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, timer):
        ctx.splits, ctx.group, ctx.timer = (out_splits, in_splits), group, timer
        return _exchange(x, out_splits, in_splits, group, timer)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.timer), None, None, None, None


def _exchange(x, out_splits, in_splits, group, timer) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    began = time.perf_counter()
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if timer is not None:
        timer.seconds += time.perf_counter() - began
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, timer=None) -> torch.Tensor:
    """x's rows: in_splits[r] of them to rank r of `group`; returns out_splits[r] rows from each r, in rank order."""
    return _AllToAll.apply(x, out_splits, in_splits, group, timer)


def exchange(counts: torch.Tensor, group, ep: int) -> tuple[list[int], list[int], torch.Tensor]:
    """counts: (E,) this rank's pairs per expert (experts e·E/ep .. (e+1)·E/ep - 1 on ep rank e). Returns the rows
    sent to each ep rank, the rows received from each, and received (ep, E/ep): pairs from source s for local
    expert j. One host sync: the sizes all_to_all_single needs on the host, in one .tolist()."""
    sent = counts.view(ep, -1)  # (ep, E/ep)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent.contiguous(), group=group)
    sizes = torch.cat([sent.sum(1), received.sum(1)]).tolist()  # the one host sync
    return sizes[:ep], sizes[ep:], received


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class ExpertParallel:
    """A MoE block's dispatch step at ep > 1 (`moe.dispatch`, kiln.models.moe's seam): dispatch(h, weights,
    chosen, counts) -> each token's weighted sum of its top-k experts' outputs, as MoE.dispatch returns it, with
    the experts on the ep ranks that hold them. `seconds`: the all-to-all time (kiln profile's share), host-timed:
    exact on gloo, launch-to-return on NCCL."""

    def __init__(self, moe: nn.Module, group):
        self.moe, self.group, self.ep = moe, group, dist.get_world_size(group)
        self.local = moe.n_experts // self.ep  # experts per ep rank
        self.seconds = 0.0

    def __call__(self, h, weights, chosen, counts):  # h (N, C), weights and chosen (N, K), counts (E,)
        moe = self.moe
        order = chosen.flatten().argsort(stable=True)  # (S,) pairs grouped by expert, S = N·K
        token = order // moe.top_k
        # this rank's experts, their gradients scaled by 1/ep (module docstring: Gradients)
        w_fc, w_proj = (_ScaleGrad.apply(lin.weight.to_local(), 1 / self.ep)
                        for lin in (moe.experts.fc, moe.experts.proj))
        y = self.exchange(lambda x, c: experts(w_fc, w_proj, x, c, moe.grouped), h[token], counts)  # (S, C)
        y = y * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(h).index_add_(0, token, y.to(h.dtype))

    def exchange(self, compute, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # x (S, C), counts (E,)
        """x: the pairs sorted by expert, counts (E,) per expert; compute(x_local, local_counts) runs this rank's
        experts on pairs sorted by local expert. Returns compute's output for every row of x, in x's order."""
        began = time.perf_counter()
        sent, got, received = exchange(counts, self.group, self.ep)
        self.seconds += time.perf_counter() - began
        arrived = all_to_all(x, got, sent, self.group, self)  # (R, C): by source rank, then local expert
        total = sum(got)
        source_expert = torch.arange(received.numel(), device=x.device)  # (ep·E/ep) segments, source-major
        segment = source_expert.repeat_interleave(received.flatten(), output_size=total)  # (R,)
        order = (segment % self.local).argsort(stable=True)  # arrival rows grouped by local expert
        y = compute(arrived[order], received.sum(0))  # (R, C) by local expert
        back = torch.empty_like(order).scatter_(0, order, torch.arange(total, device=x.device))
        return all_to_all(y[back], sent, got, self.group, self)  # (S, C) in x's order

    def take(self) -> float:
        """The all-to-all seconds since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def all_to_all_seconds(model: nn.Module) -> float:
    """The all-to-all seconds of every MoE block since the last call (0.0 without expert parallelism)."""
    return sum(m.dispatch.take() for m in moe_blocks(model) if isinstance(m.dispatch, ExpertParallel))


def shard_experts(model: nn.Module, ep_mesh) -> None:
    """Every MoE block's expert weights (moe.experts' parameters, stacked with the expert as dim 0) become
    DTensors split Shard(0) over ep_mesh: ep rank r keeps experts r·E/ep .. (r+1)·E/ep - 1 (its slice of the
    weights every rank initialised alike), and the block's dispatch step becomes an ExpertParallel over the group.
    The DTensors keep the checkpoint in one layout: DCP and the consolidated export see every expert."""
    blocks = moe_blocks(model)
    if not blocks:  # kiln.fit with a model of the user's: ParallelPlan.build had no family to check
        raise KilnError(f"parallel.ep={ep_mesh.size()} splits the experts of kiln's mixture-of-experts blocks "
                        f"(kiln.models.moe.MoE); {type(model).__name__} has none: use --parallel.ep=1",
                        key="parallel.ep", value=ep_mesh.size(), fix="use --parallel.ep=1")
    from torch.distributed.tensor import Shard, distribute_tensor  # lazy: DTensor's imports, ep > 1 only

    for moe in blocks:
        for lin in (moe.experts.fc, moe.experts.proj):  # (E, n_out, n_in) each
            p = lin.weight
            whole = p.to_local() if hasattr(p, "to_local") else p  # replicated over tp: every tp rank's is whole
            shard = distribute_tensor(whole.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            lin.weight = nn.Parameter(shard, requires_grad=p.requires_grad)
        moe.dispatch = ExpertParallel(moe, ep_mesh.get_group())


def wrap_experts(model: nn.Module, mesh, wrap, options: dict) -> None:
    """The data-parallel wrapper `wrap` (FSDP2's fully_shard or replicate) on every MoE block before the blocks are
    wrapped over all dp: its router over mesh["dp"] first, then the block itself — what is left of it, the experts
    — over mesh["dp_mod_ep"], the dp/ep ranks that hold the same experts. (FSDP2 gathers a module's parameters in
    its forward: the experts' module is never called, MoE's forward reads its weights.) The experts' gradients are
    averaged over dp, not dp/ep: an expert's gradient on its holder already sums the pairs of its ep group's ranks
    (the all-to-all's backward), so the wrapper's mean over dp_mod_ep takes 1/ep more, applied by ExpertParallel
    (FSDP2's set_gradient_divide_factor would do it with ReduceOp.PREMUL_SUM, which gloo lacks)."""
    for moe in moe_blocks(model):
        wrap(moe.router, mesh=mesh["dp"], **options)
        wrap(moe, mesh=mesh["dp_mod_ep"], **options)
