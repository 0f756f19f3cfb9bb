"""A mixture of SwiGLU experts with dropless top-k token routing, as Hugging Face's Qwen3-MoE computes it.

    MoE(d_model, n_experts, top_k, d_ff, norm_topk)   the block's MLP: router + experts
    moe_losses(model)     (load-balancing loss, router z-loss or None) of the last forward, summed as HF sums them
    moe_metrics(model)    {moe_aux_loss, moe_load_max, moe_load_min} since the last call (one host sync)

Routing: probabilities = softmax(router(x)) in fp32, the top-k of them per token, renormalised to sum to 1 when
norm_topk, cast back to x's dtype; each token's output is the weighted sum of its k experts' outputs. Dropless:
every expert takes every token routed to it (no capacity factor), so the result does not depend on the batch.

Every expert runs every step, also on zero tokens: its weights then get a zero gradient rather than none, so
DDP, the optimizers and the memory accounting see the same tensors whatever the routing. Splitting the tokens
by expert needs the per-expert counts on the host: one device sync per MoE block (HF's loop does the same).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.models.parts import SwiGLUMLP


class MoE(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, d_ff: int, norm_topk: bool = True,
                 z_loss: bool = False):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk, self.z_loss = n_experts, top_k, norm_topk, z_loss
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUMLP(d_model, d_ff) for _ in range(n_experts))
        # What the last forward routed, for the losses and the metrics (not parameters, not buffers: they are
        # not state, and must not follow the model's dtype).
        self.routed: torch.Tensor | None = None  # (E,) tokens sent to each expert by the last forward
        self.prob_sum: torch.Tensor | None = None  # (E,) fp32 sum over tokens of the routing probabilities
        self.z_sum: torch.Tensor | None = None  # sum over tokens of logsumexp(router logits)²
        self.tokens = 0
        self.load: torch.Tensor | None = None  # (E,) tokens routed to each expert since moe_metrics last read it

    def forward(self, x):  # (B, T, C)
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, C)
        logits = self.router(h)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, K) each
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        flat = chosen.flatten()  # (N·K,) expert of each (token, slot)
        order = flat.argsort(stable=True)  # slots grouped by expert
        token = order // self.top_k  # (N·K,) the token of each grouped slot
        counts = torch.bincount(flat, minlength=self.n_experts)
        parts = h[token].split(counts.tolist())  # the one host sync
        y = torch.cat([expert(part) for expert, part in zip(self.experts, parts)])  # (N·K, C)
        y = y * weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(h).index_add_(0, token, y)
        if self.training:
            self._record(logits, probs, counts)
        return out.view(shape)

    def _record(self, logits, probs, counts):
        # Overwritten with the same values when recompute runs the block again in the backward; the model's
        # forward, which runs once, adds `routed` to `load` (kiln.models.transformer).
        self.routed, self.prob_sum, self.tokens = counts, probs.sum(dim=0), probs.shape[0]
        self.z_sum = torch.logsumexp(logits.float(), dim=-1).square().sum() if self.z_loss else None


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_losses(layers: list[MoE]) -> tuple[torch.Tensor, torch.Tensor]:
    """The load-balancing loss of HF's load_balancing_loss_func over all layers' routing of the last forward:
    E · Σ_e f_e · P_e, f_e the share of (token, slot) pairs sent to expert e and P_e its mean routing probability,
    both over every layer's tokens together; and the router z-loss, the mean of logsumexp(logits)²."""
    E = layers[0].n_experts
    n = sum(m.tokens for m in layers)
    routed = torch.stack([m.routed for m in layers]).sum(0).float() / n  # (E,) over K slots: sums to K
    probs = torch.stack([m.prob_sum for m in layers]).sum(0) / n  # (E,)
    z = torch.stack([m.z_sum for m in layers]).sum() / n if layers[0].z_sum is not None else None
    return E * (routed * probs).sum(), z


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
