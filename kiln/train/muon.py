"""`optim.name=muon`: torch.optim.Muon for the hidden matrices, AdamW for everything else, as one optimizer.

    muon_param_groups(model, weight_decay)   [Muon's hidden matrices, AdamW decayed, AdamW not decayed]
    MuonAdamW(groups, cfg)                  one optimizer over the three groups (the schedule, checkpoints, the
                                            withheld step and zero_grad see one object)

The split (Keller Jordan's, modded-nanogpt's): Muon orthogonalises the update of a 2-D weight that maps hidden
activations to hidden activations. So it takes the weight of every nn.Linear except the output head and an MoE
router; the embedding (a lookup, not a map), the head (its rows are per-token outputs), norm gains, biases and
the router go to AdamW. A fused matrix (the attention's qkv, SwiGLU's gate/up) is one nn.Linear and is
orthogonalised as one whole matrix, not per part.

Learning rates: each group carries `lr_ratio`, its peak over optim.lr (muon_lr/lr for Muon, 1 for AdamW); the loop
sets group["lr"] = (optim.lr's scheduled, scaled, rollback-cut value) × lr_ratio, so the schedule, optim.lr_scaling
and the spike guard's lr cut multiply each group's own peak.

A withheld step (fp16 overflow, non-finite gradient, a spike the guard skips): torch's Muon takes no found_inf and
updates its momentum before anything could mask it, so this optimizer reads the skip flag on the host, once per
step (`skipped.item()`), and then steps both parts or neither: every parameter and state tensor stays bit for bit.
That one sync is free on a CPU (it runs the step synchronously anyway); on a GPU it waits for the backward before
the update is queued. The alternative, keeping a copy of every Muon matrix and its momentum to restore after the
step on the device, costs 8 bytes per Muon parameter of peak memory and two more passes over them every step.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kiln.models.moe import MoE


def muon_param_groups(model: nn.Module, weight_decay: float, lr_ratio: float) -> list[dict]:
    """Three groups: Muon's hidden matrices (decayed), AdamW's matmul weights that are not hidden matrices (the
    untied head, an MoE router: decayed), and AdamW's embeddings, norms and biases (not decayed)."""
    inner = getattr(model, "module", model)  # DDP's wrapper
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(inner, "head_weight", None)  # tied: the embedding's (already AdamW's)
    not_hidden = embeddings | {id(m.router.weight) for m in model.modules() if isinstance(m, MoE)}
    if head is not None:
        not_hidden.add(id(head))
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    hidden, decay, no_decay, seen = [], [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim == 2 and id(p) in linear and id(p) not in not_hidden:
            hidden.append(p)
        elif p.ndim >= 2 and id(p) not in embeddings:
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": hidden, "weight_decay": weight_decay, "muon": True, "lr_ratio": lr_ratio},
        {"params": decay, "weight_decay": weight_decay, "lr_ratio": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_ratio": 1.0},
    ]


def group_lrs(optimizer) -> dict:
    """{"muon_lr": the Muon groups' learning rate now} for a MuonAdamW (the metrics record's), else {}."""
    for group in optimizer.param_groups if isinstance(optimizer, MuonAdamW) else ():
        if group.get("muon"):
            return {"muon_lr": group["lr"]}
    return {}


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the groups marked "muon", an AdamW built by `make_adamw` over the others; one
    param_groups list (the same dicts the two inner optimizers read) and one state (keyed by parameter)."""

    takes_skipped = True  # kiln.train.masked.optimizer_step passes the skip flag to step()

    def __init__(self, groups: list[dict], *, muon_lr: float, momentum: float, make_adamw, ns_steps: int = 5):
        muon_groups = [g for g in groups if g.get("muon")]
        adam_groups = [g for g in groups if not g.get("muon")]
        # nesterov=True and Keller Jordan's update scale sqrt(max(1, rows/cols)) ("original"), torch's defaults
        self.muon = torch.optim.Muon(muon_groups, lr=muon_lr, momentum=momentum, nesterov=True, ns_steps=ns_steps) \
            if muon_groups else None
        self.adam = make_adamw(adam_groups) if adam_groups else None
        inners = [o for o in (self.muon, self.adam) if o is not None]
        # add_param_group keeps each dict it is given: self.param_groups holds the inner optimizers' own dicts
        super().__init__([g for o in inners for g in o.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups and state (after construction and after a load, which
        replaces the group dicts)."""
        n = len(self.muon.param_groups) if self.muon is not None else 0
        if self.muon is not None:
            self.muon.param_groups, self.muon.state = self.param_groups[:n], self.state
        if self.adam is not None:
            self.adam.param_groups, self.adam.state = self.param_groups[n:], self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None, skipped: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if skipped is not None and bool(skipped.item()):  # the one host sync (module docstring)
            return loss
        if self.muon is not None:
            self.muon.step()
        if self.adam is not None:
            if getattr(self.adam, "takes_skipped", False):
                self.adam.step(skipped=None)
            else:
                self.adam.step()
        return loss
