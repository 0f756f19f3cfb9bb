"""A mixture of SwiGLU experts with dropless top-k token routing, as Hugging Face's Qwen3-MoE computes it.

    MoE(d_model, n_experts, top_k, d_ff, norm_topk)   the block's MLP: router + experts
    ExpertLinear(n_experts, n_in, n_out)  every expert's weight of one matmul, stacked: .weight (E, n_out, n_in)
    experts(w_fc, w_proj, h_sorted, counts)   the experts' SwiGLUs on rows already grouped by expert (the seam)
    stack_experts(state) / per_expert_key(keys)   a state dict of the earlier per-expert layout, stacked / found
    moe_losses(layers)    (load-balancing loss, router z-loss or None) of the last forward, summed as HF sums them
    routing_sums(layers) / losses_of(sums, E, z)   the same through the sums they pool (a pipeline adds its stages')
    moe_metrics(model)    {moe_aux_loss, moe_load_max, moe_load_min} since the last call (one host sync)

Routing: probabilities = softmax(router(x)) in fp32, the top-k of them per token, renormalised to sum to 1 when
norm_topk, cast back to x's dtype; each token's output is the weighted sum of its k experts' outputs. Dropless:
every expert takes every token routed to it (no capacity factor), so the result does not depend on the batch.

The experts' weights are two 3-D parameters per block, mlp.experts.fc.weight (E, 2F, C: each expert's [gate; up],
as SwiGLUMLP fuses them) and mlp.experts.proj.weight (E, C, F); Hugging Face's per-expert tensors map onto their
rows (kiln.models.qwen3_moe). A checkpoint of the earlier layout (mlp.experts.{e}.fc.weight, one nn.Linear per
expert) is converted where weights are read: `stack_experts` (kiln export, kiln sample, MoE.load_state_dict);
resuming its optimizer state is refused in one line (kiln.train.state, kiln.train.checkpoint), naming the way on:
export the weights and start a run from them (--model.init=hf:DIR).

No host sync: the per-expert counts stay on the device (a scatter-add, not bincount, which reads its max back on
CUDA), the (token, slot) pairs are sorted by expert with argsort, and `experts` runs every expert in one
torch.nn.functional.grouped_mm per matmul, with the counts' cumulative sum as its group offsets. grouped_mm is
chosen by a one-time probe per (device type, dtype) (`grouped_mm_works`): torch 2.13 runs it on CPU in fp32 and
bf16, forward and backward, but not fp64; where the probe fails (fp64 references, an older torch) `experts` loops
over the experts, which reads the counts back (one host sync per block). Every expert's weight gets a gradient
every step, zero for an expert no token reached, so DDP, the optimizers and the memory accounting see the same
tensors whatever the routing.

The seam for expert parallelism: MoE.forward routes (`route`), counts the (token, slot) pairs per expert, and
hands the tokens, their top-k experts and weights and the counts to `dispatch(h, weights, chosen, counts)`, which
returns each token's combined output. The local `dispatch` sorts the pairs by expert, calls `experts` and scatters
the weighted outputs back; expert parallelism replaces it per module (`moe.dispatch = fn`, an instance attribute
with the same signature) with one that exchanges the sorted rows by all-to-all, calls `experts` on this rank's
whole experts (its rows of the stacked weights) and exchanges back. The counts that the load-balancing loss reads
are MoE.forward's, this rank's tokens', whatever dispatch does.

Under tensor parallelism the router and experts are replicated over the tp ranks (kiln.parallel.tensor): their
weights are DTensors there and run here as local tensors (`_local`), on the same tokens on every tp rank.
"""
from __future__ import annotations

import concurrent.futures
import functools
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F


class ExpertLinear(nn.Module):
    """One matmul of every expert, stacked: weight (E, n_out, n_in), row block e is expert e's nn.Linear weight."""

    def __init__(self, n_experts: int, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, n_out, n_in))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default, per expert (fan_in = n_in)


@torch.compiler.disable  # a probe on a thread of its own: never traced into a compiled graph
@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch.nn.functional.grouped_mm runs forward and backward for this device type and dtype here: tried
    once on a few rows (an empty group included), so a torch that lacks it or a dtype it refuses falls back. The
    probe runs on a thread of its own, outside the caller's autocast, saved-tensor hooks, function modes and
    compiled graph (all per thread): a memory measurement or a sync counter sees only the step."""
    if not hasattr(F, "grouped_mm"):
        return False
    device = torch.device(device_type, torch.accelerator.current_device_index()) if device_type != "cpu" else "cpu"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_probe, device, dtype).result()


def _probe(device, dtype) -> bool:
    try:
        a = torch.ones(3, 16, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([0, 3], device=device, dtype=torch.int32)
        y = F.grouped_mm(a, b.transpose(-2, -1), offs=offs)
        y.backward(torch.ones_like(y))
        return y.shape == (3, 16) and b.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward refuses an expanded
    one (the gradient of a .sum(), strides 0), which whatever follows the experts may hand it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A weight as this process's tensor: a DTensor replicated over tensor parallelism runs as its local copy."""
    return t.to_local() if hasattr(t, "to_local") else t


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype


def experts(w_fc: torch.Tensor, w_proj: torch.Tensor, h: torch.Tensor, counts: torch.Tensor,
            grouped: bool | None = None) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert: h (S, C), rows [Σ_{j<e} counts_j, Σ_{j≤e} counts_j) going to
    expert e; w_fc (E, 2F, C) each expert's [gate; up], w_proj (E, C, F); counts (E,) integers on h's device, summing
    to S (rows past their sum would come back undefined: grouped_mm does not write them). Returns (S, C) in the compute dtype
    (autocast's, or h's). grouped: None = grouped_mm where the probe says it works and the widths are whole
16-byte multiples (its kernel's rule: C and F multiples of 4 in fp32, of 8 in bf16), else the loop (one sync)."""
    dtype = _compute_dtype(h)
    h, w_fc, w_proj = h.to(dtype), w_fc.to(dtype), w_proj.to(dtype)
    if grouped is None:  # grouped_mm's rows must start on 16-byte boundaries: C and F a multiple of 16 bytes
        aligned = all(n * h.element_size() % 16 == 0 for n in (w_proj.shape[1], w_proj.shape[2]))
        grouped = aligned and grouped_mm_works(h.device.type, dtype)
    if not grouped:
        return _experts_loop(w_fc, w_proj, h, counts)
    return _experts_grouped(w_fc, w_proj, h, counts)


@torch.compiler.disable  # torch 2.13's fake (tracing) grouped_mm takes bf16 only: a compiled model calls it eagerly
def _experts_grouped(w_fc, w_proj, h, counts):
    offs = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert's group
    with torch.autocast(h.device.type, enabled=False):  # operands already in the compute dtype
        gate, up = F.grouped_mm(h, w_fc.transpose(-2, -1), offs=offs).chunk(2, dim=-1)  # (S, F) each
        y = F.grouped_mm(_ContiguousGrad.apply(F.silu(gate) * up), w_proj.transpose(-2, -1), offs=offs)  # (S, C)
    return _ContiguousGrad.apply(y)


def _experts_loop(w_fc, w_proj, h, counts):
    """The reference: one expert at a time on its rows (the split sizes read back to the host: one sync)."""
    sizes = counts.tolist()
    parts = h[:sum(sizes)].split(sizes)
    ys = []
    for e, part in enumerate(parts):
        gate, up = F.linear(part, w_fc[e]).chunk(2, dim=-1)
        ys.append(F.linear(F.silu(gate) * up, w_proj[e]))
    y = torch.cat(ys)
    return torch.cat([y, y.new_zeros(h.shape[0] - y.shape[0], y.shape[1])]) if y.shape[0] < h.shape[0] else y


class MoE(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, d_ff: int, norm_topk: bool = True,
                 z_loss: bool = False):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk, self.z_loss = n_experts, top_k, norm_topk, z_loss
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.Module()
        self.experts.fc = ExpertLinear(n_experts, d_model, 2 * d_ff)  # each expert's gate and up in one matmul
        self.experts.proj = ExpertLinear(n_experts, d_ff, d_model)
        self.experts.proj.residual = True  # scaled at init like every residual projection (kiln.models.transformer)
        self.grouped: bool | None = None  # None: grouped_mm where the probe says so; False: the loop (benchmark)
        # What the last forward routed, for the losses and the metrics (not parameters, not buffers: they are
        # not state, and must not follow the model's dtype).
        self.routed: torch.Tensor | None = None  # (E,) tokens sent to each expert by the last forward
        self.prob_sum: torch.Tensor | None = None  # (E,) fp32 sum over tokens of the routing probabilities
        self.z_sum: torch.Tensor | None = None  # sum over tokens of logsumexp(router logits)²
        self.tokens = 0
        self.load: torch.Tensor | None = None  # (E,) tokens routed to each expert since moe_metrics last read it
        self.register_load_state_dict_pre_hook(_stack_per_expert)

    def forward(self, x):  # (B, T, C)
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, C)
        logits, probs, weights, chosen = self.route(h)
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=h.device)
        counts.scatter_add_(0, chosen.flatten(), torch.ones_like(chosen.flatten()))  # (E,) pairs per expert
        out = self.dispatch(h, weights, chosen, counts)
        if self.training:
            self._record(logits, probs, counts)
        return out.view(shape)

    def route(self, h):  # (N, C)
        """(router logits (N, E), fp32 probabilities (N, E), top-k weights (N, K) in h's dtype, experts (N, K))."""
        logits = self.router(h)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, K) each
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(h.dtype), chosen

    def dispatch(self, h, weights, chosen, counts):
        """Each token's weighted sum of its top-k experts' outputs: h (N, C), weights and chosen (N, K), counts (E,)
        pairs per expert; all experts on this process (module docstring: the seam)."""
        flat = chosen.flatten()  # (N·K,) expert of each (token, slot)
        order = flat.argsort(stable=True)  # slots grouped by expert
        token = order // self.top_k  # (N·K,) the token of each grouped slot
        y = experts(_local(self.experts.fc.weight), _local(self.experts.proj.weight), h[token], counts,
                    self.grouped)  # (N·K, C)
        y = y * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(h).index_add_(0, token, y.to(h.dtype))

    def _record(self, logits, probs, counts):
        # Overwritten with the same values when recompute runs the block again in the backward; the model's
        # forward, which runs once, adds `routed` to `load` (kiln.models.transformer).
        self.routed, self.prob_sum, self.tokens = counts, probs.sum(dim=0), probs.shape[0]
        self.z_sum = torch.logsumexp(logits.float(), dim=-1).square().sum() if self.z_loss else None


_PER_EXPERT = re.compile(r"^((?:.*\.)?experts)\.(\d+)\.(fc|proj)\.weight$")  # kiln's layout before the stacked one


def per_expert_key(keys) -> str | None:
    """The first key of the earlier per-expert layout (blocks.0.mlp.experts.0.fc.weight) among `keys`, or None."""
    return next((k for k in keys if _PER_EXPERT.match(k)), None)


def stack_experts(state: dict) -> dict:
    """A state dict with the earlier layout's per-expert weights stacked into mlp.experts.{fc,proj}.weight (E, out,
    in), in expert order; every other entry as it was. A state dict of the stacked layout comes back as it is."""
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for k, v in state.items():
        m = _PER_EXPERT.match(k)
        if m:
            groups.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = v
        else:
            out[k] = v
    for k, experts_ in groups.items():
        out[k] = torch.stack([experts_[e] for e in sorted(experts_)])
    return out


def _stack_per_expert(module, state, prefix, *args):
    """MoE.load_state_dict of a state dict in the per-expert layout: stacked first (in place, as torch's pre-hooks
    work)."""
    mine = {k: state.pop(k) for k in [k for k in state if k.startswith(prefix) and _PER_EXPERT.match(k)]}
    state.update(stack_experts(mine))


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_losses(layers: list[MoE]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The load-balancing loss of HF's load_balancing_loss_func over all layers' routing of the last forward:
    E · Σ_e f_e · P_e, f_e the share of (token, slot) pairs sent to expert e and P_e its mean routing probability,
    both over every layer's tokens together; and the router z-loss, the mean of logsumexp(logits)²."""
    E = layers[0].n_experts
    n = sum(m.tokens for m in layers)
    routed = torch.stack([m.routed for m in layers]).sum(0).float() / n  # (E,) over K slots: sums to K
    probs = torch.stack([m.prob_sum for m in layers]).sum(0) / n  # (E,)
    z = torch.stack([m.z_sum for m in layers]).sum() / n if layers[0].z_sum is not None else None
    return E * (routed * probs).sum(), z


def routing_sums(layers: list[MoE]) -> torch.Tensor:
    """What the losses pool over layers, summed over `layers`' last forward: (2E + 2,) fp32 [routed pairs per
    expert (E), routing probability sums (E), z sum, tokens]. Sums of sums: a pipeline adds its stages' vectors
    (kiln.parallel.pipeline) and `losses_of` the total is the whole model's; only the probability and z sums carry
    a gradient."""
    z = [m.z_sum for m in layers if m.z_sum is not None]
    p = layers[0].prob_sum
    return torch.cat([torch.stack([m.routed for m in layers]).sum(0).float(),
                      torch.stack([m.prob_sum for m in layers]).sum(0),
                      torch.stack(z).sum().reshape(1) if z else p.new_zeros(1),
                      p.new_full((1,), float(sum(m.tokens for m in layers)))])


def losses_of(sums: torch.Tensor, n_experts: int, z_loss: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(load-balancing loss, z-loss or None) of a routing_sums vector: moe_losses' values, from the pooled sums."""
    E, n = n_experts, sums[-1]
    routed, probs = sums[:E] / n, sums[E:2 * E] / n  # (E,) each; routed over K slots sums to K
    return E * (routed * probs).sum(), sums[2 * E] / n if z_loss else None


@torch.no_grad()
def moe_metrics(model: nn.Module) -> dict[str, float]:
    """{moe_aux_loss: the last forward's load-balancing loss, moe_load_max / moe_load_min: the largest and
    smallest share of routed tokens one expert of one block took since the last call (1/E each when balanced)};
    {} for a model without experts. Resets the load counts."""
    layers = [m for m in _moe_layers(model) if m.load is not None]
    if not layers:
        return {}
    loads = torch.stack([m.load.float() / m.load.sum().clamp(min=1) for m in layers])  # (L, E) shares
    aux = moe_losses(layers)[0].detach().float()
    for m in layers:
        m.load = None
    values = torch.stack([aux, loads.max(), loads.min()]).tolist()
    return dict(zip(("moe_aux_loss", "moe_load_max", "moe_load_min"), values))
