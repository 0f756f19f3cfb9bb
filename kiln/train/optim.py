"""The `optim` section: optimizers built with parameter groups, and gradient clipping.

The step that withholds an update on the device is kiln.train.masked.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from kiln.errors import KilnError
from kiln.train.adam8bit import AdamW8bit
from kiln.train.host_optimizer import HostOptimizer
from kiln.train.masked import MaskedAdam, MaskedSGD
from kiln.train.muon import MuonAdamW, muon_param_groups

OPTIMIZERS = ("adamw", "adam", "sgd", "adamw8bit", "muon")
OFFLOAD_MODES = ("none", "host", "host-async")


CLIP_MODES = ("norm", "value", "adaptive")
LR_SCALING = ("none", "linear", "sqrt")


@dataclass
class OptimConfig:
    name: str = "adamw"  # "adamw" | "adam" | "sgd" | "adamw8bit" (block-wise 8-bit moments, ~4x less state) | "muon" (torch.optim.Muon on the hidden matrices, AdamW on the rest)
    lr: float = 2e-3  # peak learning rate (the schedule scales it); the default job's, by sweep. muon: the AdamW groups' peak
    muon_lr: float = 0.02  # muon: the Muon groups' peak learning rate (the schedule scales it as optim.lr); by sweep on the tiny model
    muon_momentum: float = 0.95  # muon: Muon's (Nesterov) momentum
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per matrix per step (torch's 5; each is ~1/5 of Muon's cost)
    weight_decay: float = 0.1  # decoupled (adamw) or L2 (adam, sgd) decay on matmul weights only
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.95  # Adam second-moment decay (0.95: LLM default, steadier than 0.999 on spikes)
    eps: float = 1e-8  # Adam denominator epsilon
    momentum: float = 0.9  # SGD momentum
    nesterov: bool = False  # SGD Nesterov momentum
    implementation: str = "auto"  # "auto" (fused when supported, else foreach) | "fused" | "foreach" | "loop"
    grad_clip: float = 1.0  # clip threshold (norm, value); 0 disables clipping
    clip_mode: str = "norm"  # "norm" (global L2 norm) | "value" (elementwise) | "adaptive" (AutoClip: a percentile of the norms so far)
    clip_percentile: float = 10.0  # adaptive: clip the global norm at this percentile of the pre-clip norms seen so far
    clip_history: int = 10000  # adaptive: the most recent norms the percentile is taken over
    offload: str = "none"  # Adam state + fp32 masters on the host: none | host | host-async (1 update stale)
    lr_scaling: str = "none"  # none | linear (lr ∝ batch, Goyal 2017) | sqrt (lr ∝ √batch, Hoffer 2017, Malladi 2022)
    reference_batch_tokens: int = 0  # lr_scaling: the global batch (tokens; samples for fit()) optim.lr was tuned at

    def validate(self):
        if self.name not in OPTIMIZERS:
            raise KilnError(f"optim.name={self.name!r} is unknown; use one of {OPTIMIZERS}",
                            key="optim.name", value=self.name, fix=f"use one of {OPTIMIZERS}")
        if self.lr <= 0:
            raise KilnError(f"optim.lr must be > 0, got {self.lr}",
                            key="optim.lr", value=self.lr, fix="give a learning rate > 0, e.g. 3e-4")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise KilnError(f"optim.{key} must be in [0, 1), got {getattr(self, key)}",
                                key=f"optim.{key}", value=getattr(self, key),
                                fix="give a value in [0, 1), e.g. 0.9 or 0.95")
        if self.weight_decay < 0 or self.eps <= 0 or self.grad_clip < 0:
            raise KilnError("optim.weight_decay and optim.grad_clip must be ≥ 0 and optim.eps > 0",
                            key="optim.weight_decay")
        if self.clip_mode not in CLIP_MODES:
            raise KilnError(f"optim.clip_mode={self.clip_mode!r}; use one of {CLIP_MODES}",
                            key="optim.clip_mode", value=self.clip_mode, fix=f"use one of {CLIP_MODES}")
        if not 0 < self.clip_percentile <= 100:
            raise KilnError(f"optim.clip_percentile must be in (0, 100], got {self.clip_percentile}",
                            key="optim.clip_percentile", value=self.clip_percentile,
                            fix="give a percentile in (0, 100]")
        if self.clip_history < 1:
            raise KilnError(f"optim.clip_history must be ≥ 1, got {self.clip_history}",
                            key="optim.clip_history", value=self.clip_history, fix="give a number of steps ≥ 1")
        if self.implementation not in ("auto", "fused", "foreach", "loop"):
            raise KilnError(f"optim.implementation={self.implementation!r}; use auto, fused, foreach or loop",
                            key="optim.implementation", value=self.implementation,
                            fix="use auto, fused, foreach or loop")
        if self.lr_scaling not in LR_SCALING:
            raise KilnError(f"optim.lr_scaling={self.lr_scaling!r}; use one of {LR_SCALING}",
                            key="optim.lr_scaling", value=self.lr_scaling, fix=f"use one of {LR_SCALING}")
        if self.lr_scaling != "none" and self.reference_batch_tokens < 1:
            raise KilnError(f"optim.lr_scaling={self.lr_scaling} scales optim.lr from the batch it was tuned at: set "
                            f"optim.reference_batch_tokens (e.g. the global batch of the run that found the lr)",
                            key="optim.reference_batch_tokens", value=self.reference_batch_tokens,
                            fix="set optim.reference_batch_tokens (e.g. the global batch of the run that found the lr)")
        if self.offload not in OFFLOAD_MODES:
            raise KilnError(f"optim.offload={self.offload!r}; use one of {OFFLOAD_MODES}",
                            key="optim.offload", value=self.offload, fix=f"use one of {OFFLOAD_MODES}")
        if self.name == "muon":
            if self.muon_lr <= 0 or not 0.0 <= self.muon_momentum < 1.0:
                raise KilnError(f"optim.muon_lr must be > 0 and optim.muon_momentum in [0, 1), got "
                                f"{self.muon_lr} and {self.muon_momentum}", key="optim.muon_lr",
                                value=self.muon_lr, fix="e.g. --optim.muon_lr=0.02 --optim.muon_momentum=0.95")
            if self.muon_ns_steps < 1:
                raise KilnError(f"optim.muon_ns_steps={self.muon_ns_steps}: Muon needs at least one Newton-Schulz "
                                f"iteration to orthogonalise its update", key="optim.muon_ns_steps",
                                value=self.muon_ns_steps, fix="e.g. --optim.muon_ns_steps=5 (torch's default)")
            if self.offload != "none":
                raise KilnError(f"optim.offload={self.offload} runs AdamW or AdamW8bit on the host and optim.name=muon "
                                f"keeps torch's Muon on the device: use --optim.offload=none with muon",
                                key="optim.offload", value=self.offload, fix="use --optim.offload=none with muon")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matmul weights only; biases, norm weights and embeddings are not decayed.

    Decaying embeddings pulls rare tokens' rows to zero; decaying norm gains fights the scale they exist to learn.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in embedding_params else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def optimizer_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """The parameter groups optim.name builds over: Muon's split (kiln.train.muon) or the decay split."""
    if cfg.name == "muon":
        return muon_param_groups(model, cfg.weight_decay, cfg.muon_lr / cfg.lr)
    return param_groups(model, cfg.weight_decay)


def _implementation(cfg: OptimConfig, params) -> str:
    """"fused", "foreach" or "loop" for these parameters."""
    if cfg.implementation in ("foreach", "loop"):
        return cfg.implementation
    fusable = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    if cfg.implementation == "fused" and not fusable:
        raise KilnError("optim.implementation='fused' needs floating-point parameters on CPU or CUDA",
                        key="optim.implementation", value="fused", fix="use optim.implementation=auto")
    return "fused" if fusable else "foreach"


def build_optimizer(params_or_model, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Build from a model (parameter groups made here) or from ready parameter groups.

    Every optimizer built here withholds a step on the device (`optimizer_step`): torch's fused Adam, AdamW and
    SGD through `found_inf`, the others (MaskedAdam, MaskedSGD, AdamW8bit, HostOptimizer) through `step(skipped=)`;
    but optim.name=muon, whose step(skipped=) reads the flag on the host once (kiln.train.muon says why).
    """
    groups = (
        optimizer_groups(params_or_model, cfg) if isinstance(params_or_model, nn.Module)
        else params_or_model
    )
    if cfg.name == "muon" and not any(g["params"] for g in groups if g.get("muon")):
        raise KilnError("optim.name=muon found no hidden matrices (nn.Linear weights but the head and routers) in "
                        "these parameter groups: build it from the model (kiln.train.muon.muon_param_groups marks "
                        "them {'muon': True}), or use --optim.name=adamw",
                        key="optim.name", value="muon", fix="or use --optim.name=adamw")
    groups = [g for g in groups if g["params"]]
    if cfg.name == "muon":
        adamw = replace(cfg, name="adamw")
        return MuonAdamW(groups, muon_lr=cfg.muon_lr, momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
                         make_adamw=lambda adam_groups: build_optimizer(adam_groups, adamw))
    if cfg.offload != "none":  # fp32 masters and state on the host; the inner optimizer is built from cfg again
        inner = replace(cfg, offload="none")
        return HostOptimizer(groups, cfg.lr, cfg.offload, make_inner=lambda host_groups: build_optimizer(host_groups, inner))
    if cfg.name == "adamw8bit":
        return AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    impl = _implementation(cfg, [p for g in groups for p in g["params"]])
    betas = (cfg.beta1, cfg.beta2)
    nesterov = cfg.nesterov and cfg.momentum > 0
    if impl == "fused":
        if cfg.name == "adamw":
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=True)
        if cfg.name == "adam":
            return torch.optim.Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=True)
        sgd = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov, fused=True)
        if cfg.momentum > 0:
            # torch's fused SGD gives a first step torch.empty_like momentum buffers and keeps them when found_inf
            # withholds that step: the next step then starts from uninitialized memory (seen: 3.4e38). Zeros make
            # every step buf = μ·buf + g, the first one included (μ·0 + g = g, as torch's first step sets it).
            for p in (p for g in sgd.param_groups for p in g["params"]):
                sgd.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return sgd
    foreach = impl == "foreach"
    if cfg.name in ("adamw", "adam"):
        return MaskedAdam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, decoupled=cfg.name == "adamw", foreach=foreach)
    return MaskedSGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov, foreach=foreach)


def scaled_lr(cfg: OptimConfig, batch: int) -> tuple[float, str | None]:
    """The peak learning rate for a global batch of `batch` tokens (samples) under optim.lr_scaling, and the line
    that says how it was reached (None when nothing is scaled)."""
    if cfg.lr_scaling == "none":
        return cfg.lr, None
    ratio = batch / cfg.reference_batch_tokens
    factor = ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio)
    shown = f"{batch:,}/{cfg.reference_batch_tokens:,}" + (")" if cfg.lr_scaling == "linear" else ")^0.5")
    return cfg.lr * factor, (f"lr {cfg.lr * factor:.3g} = {cfg.lr:.3g} × ({shown}: {cfg.lr_scaling} rule for the "
                             f"global batch of {batch:,} (optim.reference_batch_tokens={cfg.reference_batch_tokens:,})")


class AdaptiveClip:
    """AutoClip (Seetharaman et al. 2020): the global norm is clipped at the p-th percentile of the pre-clip norms
    seen so far (the last `history` of them), the current one included, so a threshold need not be known upfront.
    The history lives on the device (no host sync) and in the checkpoint (resume is exact); a non-finite norm,
    whose step is withheld anyway, does not enter it."""

    def __init__(self, percentile: float, history: int, device):
        self.q = percentile / 100
        self.norms = torch.full((history,), float("nan"), device=device)
        self.seen = torch.zeros((), dtype=torch.long, device=device)

    def threshold(self, norm: torch.Tensor) -> torch.Tensor:
        norm = norm.detach().float().reshape(1)
        finite = torch.isfinite(norm)
        slot = (self.seen % len(self.norms)).reshape(1)
        self.norms.index_put_((slot,), torch.where(finite, norm, self.norms.index_select(0, slot)))
        self.seen += finite.long().squeeze(0)  # a non-finite norm neither enters nor pushes out a finite one
        return torch.nanquantile(self.norms, self.q)

    def state_dict(self) -> dict:
        return {"norms": self.norms.clone(), "seen": self.seen.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["norms"].shape != self.norms.shape:
            raise KilnError(f"the checkpoint's adaptive clipping history holds {len(state['norms'])} norms, this run "
                            f"{len(self.norms)}; resume with its optim.clip_history",
                            key="optim.clip_history", value=len(self.norms), fix="resume with its optim.clip_history")
        self.norms.copy_(state["norms"])
        self.seen.copy_(state["seen"])


def clip_gradients(params, cfg: OptimConfig, adaptive: AdaptiveClip | None = None, norm_of=None):
    """Clip in place; returns (the global L2 norm before clipping, the threshold in force or None), both device
    tensors (no sync). norm_of(params) -> the norm, where it is more than these parameters' (pipeline stages)."""
    params = [p for p in params if p.grad is not None]
    norm_of = norm_of or total_norm
    if cfg.clip_mode == "adaptive":
        if adaptive is None:
            raise ValueError("optim.clip_mode=adaptive needs its norm history (kiln builds it with the TrainState)")
        norm = norm_of(params)
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: the norm over every shard
        threshold = adaptive.threshold(full)
        # torch's clip_grads_with_norm_ takes the threshold as a Python float (a host sync): scale here instead
        coef = torch.clamp(threshold / (full.float() + 1e-6), max=1.0)
        for same_mesh in _by_mesh(params):
            grads = [p.grad for p in same_mesh]
            for dtype in {g.dtype for g in grads}:
                group = [g for g in grads if g.dtype == dtype]
                torch._foreach_mul_(group, coef.to(dtype))
        return norm, threshold
    norm = norm_of(params)
    if cfg.grad_clip > 0 and cfg.clip_mode == "norm":
        for same_mesh in _by_mesh(params):  # = clip_grad_norm_ (foreach ops take one mesh's DTensors at a time)
            torch.nn.utils.clip_grads_with_norm_(same_mesh, cfg.grad_clip, norm, foreach=True)
        return norm, None
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_value_(params, cfg.grad_clip, foreach=True)
    return norm, None


def _by_mesh(params) -> list[list]:
    """The parameters grouped by their gradients' DTensor mesh (one group without DTensors), in first-seen order:
    the same order on every rank, for the norms' collectives."""
    groups: dict = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(groups.values())


def total_norm(params) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients. Gradients that are DTensors on several meshes (expert
    parallelism: the experts' on (dp_mod_ep, ep), the rest on dp or (dp, tp)) are normed per mesh, each over all
    its ranks (full_tensor), and combined: torch's get_total_norm stacks them, which DTensor refuses across meshes."""
    groups = _by_mesh(params)
    if len(groups) < 2:
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    parts = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        parts.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return torch.linalg.vector_norm(torch.stack(parts))
