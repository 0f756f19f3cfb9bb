"""LoRA adapters (the `[lora]` section): low-rank updates W + (alpha/rank)·B·A on a frozen base, PEFT's conventions.

    LoraConfig                      the section: rank (0: off), alpha, dropout, targets, init; .validate()
    lora_tensors(model_cfg, lora)   every adapter tensor of kiln's Transformer, in model order: a LoraTensor
                                    each, with its Hugging Face module (PEFT's name) and its rows of kiln's
                                    fused linear; derived from the family description (Family.linears,
                                    Family.hf_tensors), never from a family's name
    apply_lora(model, lora, cfg)    the targeted linears of `model` become LoraLinear (in place) and every other
                                    parameter is frozen; cfg: kiln's ModelConfig, or None for a user's own model
                                    (kiln.fit: its nn.Linear layers matched by name suffix, as PEFT's
                                    target_modules); returns the adapted modules' names
    LoraLinear                      an nn.Linear (same `weight`, `bias`: the base's state-dict keys do not change)
                                    with one adapter pair per piece: `lora_A[piece]` (r, in), `lora_B[piece]`
                                    (rows, r); y = x Wᵀ + b + scale · concat_p(B_p A_p dropout(x))
    merge_lora(model)               each LoraLinear back to a plain nn.Linear holding W + scale·B·A (export)
    adapter_layout(model), add_adapters(copy, layout)   a plain copy of a model given the same adapters
    trainable_count(model)          (trainable, total) parameters of a built model, tied ones once
    parameter_counts(cfg, lora)     the same from the config alone

A piece is one Hugging Face module of a fused kiln linear (Family.hf_tensors): kiln's `attn.qkv` of Llama/Qwen3
has three (q_proj, k_proj, v_proj: rows H·D, KV·D, KV·D), its `mlp.fc` two (gate_proj, up_proj), GPT-2's
`attn.qkv` one (c_attn, stored transposed on the Hub: fan_in_fan_out). A piece's key in lora_A/lora_B is the last
component of its Hub module name ("q_proj", "c_attn"); a user's own linear has one piece, "default". The state-dict
key of an adapter is "<kiln module>.lora_A.<piece>", e.g. "blocks.0.attn.qkv.lora_A.q_proj", and its PEFT key
"base_model.model.<hub module>.lora_A.weight" (LoraTensor.peft_key). lora_A and lora_B have PEFT's shapes under
fan_in_fan_out too (PEFT transposes only the merged delta).

PEFT's conventions: scale = alpha / rank; A kaiming-uniform(a=√5) (bound 1/√in), B = 0, so a fresh adapter
leaves the model's output unchanged; no adapter bias (the base's bias stays, frozen); dropout on the adapter's
input, one draw per piece as PEFT's separate modules draw. MoE experts and tensor-parallel splits are refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.models.catalog import family
from kiln.models.config import param_count

LORA_TARGETS = ("attn", "mlp", "all")
DEFAULT_PIECE = "default"  # the one piece of a user's own nn.Linear (PEFT's adapter name)


@dataclass
class LoraConfig:
    """The `lora` section: low-rank adapters on a frozen base (rank 0: off, a full fine-tune or pretraining)."""

    rank: int = 0  # adapter rank r; 0 = off. Each targeted linear W gets W + (alpha/r)·B·A, A (r, in), B (out, r) = 0 at start; the rest of the model is frozen
    alpha: float = 16.0  # the scale numerator: updates are multiplied by alpha/rank, as PEFT does
    dropout: float = 0.0  # dropout on the adapter's input (PEFT's lora_dropout), 0 ≤ p < 1
    targets: str = "all"  # attn | mlp | all (every linear of the blocks except an MoE router) | a comma list of the family's linear names (Family.linears), e.g. attn.qkv,mlp.fc; for kiln.fit, nn.Linear names matched by suffix
    init: str = ""  # "" = fresh adapters (A kaiming-uniform, B = 0) | peft:DIR: start from an existing PEFT adapter

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise KilnError(f"lora.rank={self.rank!r} must be a whole number ≥ 0 (0: no adapters)",
                            key="lora.rank", value=self.rank, fix="give e.g. --lora.rank=8, or 0 for none")
        if not self.alpha > 0 or math.isinf(self.alpha):
            raise KilnError(f"lora.alpha={self.alpha!r} must be a finite number > 0 (updates are scaled by "
                            f"alpha/rank)", key="lora.alpha", value=self.alpha, fix="give e.g. --lora.alpha=16")
        if not 0.0 <= self.dropout < 1.0:
            raise KilnError(f"lora.dropout={self.dropout!r} must be in [0, 1)", key="lora.dropout",
                            value=self.dropout, fix="give e.g. --lora.dropout=0.05, or 0 for none")
        if not target_names(self.targets):
            raise KilnError("lora.targets is empty; name what to adapt: attn, mlp, all or the linears' names",
                            key="lora.targets", value=self.targets, fix="give --lora.targets=all")
        if self.init and not self.init.startswith("peft:"):
            raise KilnError(f"lora.init={self.init!r}: use peft:DIR (an adapter_config.json and "
                            f"adapter_model.safetensors) or \"\" for fresh adapters", key="lora.init",
                            value=self.init, fix="give --lora.init=peft:DIR or leave it empty")
        if not self.on and (self.init or self.dropout):
            raise KilnError("lora.init and lora.dropout apply to adapters, and lora.rank=0 builds none",
                            key="lora.rank", value=self.rank, fix="give --lora.rank=8 (or another rank > 0)")


def check_run(lora: LoraConfig, *, tp: int, pp: int, fp8: bool) -> None:
    """What LoRA does not combine with, refused before anything is built (kiln.config's cross-section checks)."""
    if not lora.on:
        return
    if tp > 1:
        raise KilnError(f"lora.rank={lora.rank} with parallel.tp={tp}: the adapters are not split with their "
                        f"linears yet; shard a LoRA run with --parallel.strategy=fsdp (or ddp) and parallel.tp=1",
                        key="parallel.tp", value=tp, fix="use --parallel.tp=1 with --parallel.strategy=fsdp")
    if fp8:
        raise KilnError(f"lora.rank={lora.rank} with precision.mode=fp8: torchao's float8 linears would replace the "
                        f"adapted ones; use --precision.mode=bf16 (the frozen base is stored in bf16)",
                        key="precision.mode", value="fp8", fix="use --precision.mode=bf16")


def target_names(targets: str) -> list[str]:
    return [t.strip() for t in targets.split(",") if t.strip()]


# ---------------------------------------------------------------- the adapter module


class LoraLinear(nn.Linear):
    """A frozen nn.Linear plus adapter pairs, one per piece of its output rows (module docstring)."""

    def __init__(self, base: nn.Linear, pieces: dict[str, int], rank: int, alpha: float, dropout: float,
                 fan_in_fan_out: bool = False, fresh: bool = True):
        nn.Module.__init__(self)  # not nn.Linear's: the base's weight and bias are taken over, not allocated
        for key, value in vars(base).items():  # in/out_features and marks such as `residual` (the init's)
            if not key.startswith("_") and key != "training":
                setattr(self, key, value)
        self.training = base.training
        self.weight, self.bias = base.weight, base.bias
        if sum(pieces.values()) != self.out_features:
            raise KilnError(f"pieces {pieces} do not cover the {self.out_features} output rows", key="pieces",
                            value=dict(pieces), fix=f"give pieces whose rows sum to {self.out_features}")
        self.pieces = dict(pieces)  # piece -> rows, in row order
        self.rank, self.scale = rank, alpha / rank
        self.fan_in_fan_out = fan_in_fan_out  # the Hub stores this base transposed (GPT-2's Conv1D): PEFT's flag
        dtype = self.weight.dtype if self.weight.dtype in (torch.float32, torch.float64) else torch.float32
        like = dict(device=self.weight.device, dtype=dtype)
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()  # filled in row order (a dict given to
        for k, rows in pieces.items():  # ParameterDict is sorted by key: k_proj before q_proj)
            self.lora_A[k] = nn.Parameter(torch.empty(rank, self.in_features, **like))
            self.lora_B[k] = nn.Parameter(torch.zeros(rows, rank, **like))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if fresh:  # else the caller loads them (a copy of a trained model): no draw from torch's generator
            self.reset_adapters()

    @torch.no_grad()
    def reset_adapters(self) -> None:
        """PEFT's fresh adapter: A kaiming-uniform(a=√5), B = 0 (the output is the base's)."""
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        for b in self.lora_B.values():
            nn.init.zeros_(b)

    def forward(self, x):  # x (..., in)
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        delta = [F.linear(F.linear(self.lora_dropout(x), self.lora_A[k]), self.lora_B[k]) for k in self.pieces]
        d = delta[0] if len(delta) == 1 else torch.cat(delta, dim=-1)  # (..., out): the pieces in row order
        return y + self.scale * d.to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """scale · [B_p A_p stacked by rows], (out, in), in kiln's layout (not transposed for fan_in_fan_out)."""
        return self.scale * torch.cat([self.lora_B[k] @ self.lora_A[k] for k in self.pieces], dim=0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora rank={self.rank}, scale={self.scale:g}, pieces={self.pieces}"


# ---------------------------------------------------------------- the mapping (kiln's Transformer)


@dataclass(frozen=True)
class LoraTensor:
    """One adapter tensor of kiln's Transformer and where it goes on the Hub (PEFT's adapter_model.safetensors)."""

    kiln: str  # its state-dict key: "blocks.0.attn.qkv.lora_A.q_proj"
    module: str  # the Hugging Face module it adapts: "model.layers.0.self_attn.q_proj"
    matrix: str  # "lora_A" (rank, in) | "lora_B" (rows, rank)
    shape: tuple[int, int]
    base: str  # the kiln weight it updates: "blocks.0.attn.qkv.weight"
    rows: tuple[int, int]  # [start, stop) of base's output rows (kiln's (out, in) layout) this piece's B·A covers
    fan_in_fan_out: bool  # the Hub stores the base transposed, (in, out): GPT-2's Conv1D (PEFT's fan_in_fan_out)

    @property
    def peft_key(self) -> str:
        """Its key in PEFT's adapter_model.safetensors."""
        return f"base_model.model.{self.module}.{self.matrix}.weight"


@dataclass(frozen=True)
class _Target:
    name: str  # module inside a block: "attn.qkv"
    n_in: int
    pieces: tuple[tuple[str, str, int], ...]  # (piece key, Hub module, rows) in row order
    fan_in_fan_out: bool


def resolve_targets(fam, cfg, targets: str) -> list:
    """The family's block linears (Family.linears) lora.targets names, in forward order; a refusal otherwise."""
    linears = fam.linears(cfg)
    by_name = {x.name: x for x in linears}
    valid = ", ".join(["attn", "mlp", "all", *by_name])
    chosen = []
    for t in target_names(targets):
        if t == "all":
            picked = [x for x in linears if x.tp != "replicate"]  # all but a router: kept whole on every rank
        elif t in ("attn", "mlp"):
            picked = [x for x in linears if x.name.startswith(t + ".") and x.tp != "replicate"]
        elif t in by_name:
            picked = [by_name[t]]
        else:
            raise KilnError(f"lora.targets={targets!r}: {t!r} is not a linear of model.arch={fam.name}; valid: {valid}",
                            key="lora.targets", value=targets, fix=f"use a comma list of: {valid}")
        chosen += [x for x in picked if x not in chosen]
    chosen = [x for x in linears if x in chosen]  # forward order, as the model's state_dict lists them
    experts = [x.name for x in chosen if x.copies > 1]
    if experts:
        raise KilnError(f"lora.targets={targets!r} reaches the MoE experts ({', '.join(experts)}), which LoRA does "
                        f"not adapt yet; adapt attention only: --lora.targets=attn", key="lora.targets",
                        value=targets, fix="--lora.targets=attn")
    return chosen


def _targets(cfg, lora: LoraConfig) -> list[_Target]:
    fam = family(cfg.arch)
    chosen = resolve_targets(fam, cfg, lora.targets)
    hub = {t.kiln: t for t in fam.hf_tensors(cfg)} if fam.hf_names is not None else {}
    out = []
    for i in range(cfg.n_layer):
        for lin in chosen:
            t = hub.get(f"blocks.{i}.{lin.name}.weight")
            if t is None:  # no Hub mapping: the family's own parts (Linear.parts), named by position
                rows = lin.parts or (lin.n_out,)
                pieces = tuple((DEFAULT_PIECE if len(rows) == 1 else f"part{j}", f"blocks.{i}.{lin.name}", r)
                               for j, r in enumerate(rows))
                out.append(_Target(f"blocks.{i}.{lin.name}", lin.n_in, pieces, False))
                continue
            modules = [h.removesuffix(".weight") for h in t.hf]
            rows = t.rows or (lin.n_out,)
            pieces = tuple((m.rsplit(".", 1)[-1], m, r) for m, r in zip(modules, rows))
            out.append(_Target(f"blocks.{i}.{lin.name}", lin.n_in, pieces, t.conv1d))
    return out


def lora_tensors(cfg, lora: LoraConfig) -> list[LoraTensor]:
    """Every adapter tensor apply_lora gives kiln's Transformer of `cfg` (a resolved ModelConfig), in model order
    (per module: each piece's lora_A, then each piece's lora_B, as its state_dict lists them)."""
    if not lora.on:
        return []
    out = []
    for t in _targets(cfg, lora):
        start, spans = 0, []
        for key, module, rows in t.pieces:
            spans.append((key, module, rows, (start, start + rows)))
            start += rows
        for matrix in ("lora_A", "lora_B"):
            for key, module, rows, span in spans:
                shape = (lora.rank, t.n_in) if matrix == "lora_A" else (rows, lora.rank)
                out.append(LoraTensor(f"{t.name}.{matrix}.{key}", module, matrix, shape, f"{t.name}.weight", span,
                                      t.fan_in_fan_out))
    return out


def parameter_counts(cfg, lora: LoraConfig) -> tuple[int, int]:
    """(trainable, all) parameters of kiln's Transformer of `cfg` with lora's adapters, from the config alone (the
    start line's counts; the report's and the estimator's)."""
    adapters = sum(math.prod(t.shape) for t in lora_tensors(cfg, lora))
    total = param_count(cfg) + adapters
    return (adapters if lora.on else total), total


# ---------------------------------------------------------------- applying and undoing


def _adapt(model: nn.Module, name: str, pieces: dict, lora: LoraConfig, fan_in_fan_out: bool,
           fresh: bool = True) -> None:
    module = model.get_submodule(name)
    if not isinstance(module, nn.Linear) or isinstance(module, LoraLinear):
        raise KilnError(f"lora.targets={lora.targets!r}: {name} is a {type(module).__name__}, not an nn.Linear LoRA "
                        f"can adapt", key="lora.targets", value=lora.targets, fix="name nn.Linear layers only")
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf,
            LoraLinear(module, pieces, lora.rank, lora.alpha, lora.dropout, fan_in_fan_out, fresh))


def _user_targets(model: nn.Module, lora: LoraConfig) -> list[str]:
    """A user's model: the nn.Linear modules whose names are a target or end in '.' + a target (PEFT's
    target_modules); `all`: every nn.Linear."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
    names = target_names(lora.targets)
    if names == ["all"]:
        chosen = linears
    else:
        chosen = []
        for t in names:
            hits = [n for n in linears if n == t or n.endswith("." + t)]
            if not hits:
                shown = ", ".join(linears[:12]) + (", ..." if len(linears) > 12 else "")
                raise KilnError(f"lora.targets={lora.targets!r}: no nn.Linear of the model is named {t!r} or ends in "
                                f"'.{t}'; its linears: {shown or 'none'}", key="lora.targets", value=lora.targets,
                                fix="name nn.Linear layers of the model (matched by suffix), or all")
            chosen += [n for n in hits if n not in chosen]
    if not chosen:
        raise KilnError("lora.targets=all: the model holds no nn.Linear for LoRA to adapt", key="lora.targets",
                        value=lora.targets, fix="give the model nn.Linear layers, or set lora.rank=0")
    return chosen


def apply_lora(model: nn.Module, lora: LoraConfig, cfg=None, fresh: bool = True) -> list[str]:
    """The targeted linears of `model` become LoraLinear in place, every other parameter stops requiring a gradient
    (frozen); returns the adapted modules' names. cfg: the resolved ModelConfig of kiln's Transformer (targets from
    its family description), or None for a user's model (nn.Linear names matched by suffix). Adapters are drawn
    from torch's global generator in module order: the same seed gives the same adapters on every rank.
    fresh=False: left uninitialised, for a copy whose state_dict is loaded next (no draw from the generator)."""
    if not lora.on:
        return []
    held = next((n for n, m in model.named_modules() if isinstance(m, LoraLinear)), None)
    if held is not None:
        raise KilnError(f"lora.rank={lora.rank}: the model already holds LoRA adapters ({held}); pass the model "
                        f"without them, or fold them in first with kiln.models.lora.merge_lora(model)",
                        key="lora.rank", value=lora.rank,
                        fix="pass the model without them, or fold them in first with kiln.models.lora.merge_lora(model)")
    if cfg is not None:
        plan = [(t.name, {k: rows for k, _, rows in t.pieces}, t.fan_in_fan_out) for t in _targets(cfg, lora)]
    else:
        plan = [(n, {DEFAULT_PIECE: model.get_submodule(n).out_features}, False) for n in _user_targets(model, lora)]
    for p in model.parameters():
        p.requires_grad_(False)
    for name, pieces, fan_in_fan_out in plan:
        _adapt(model, name, pieces, lora, fan_in_fan_out, fresh)
    return [name for name, _, _ in plan]


def adapter_layout(model: nn.Module) -> dict[str, tuple]:
    """{module name: (pieces, rank, alpha, dropout, fan_in_fan_out)} of the LoraLinear modules of `model`: what
    add_adapters needs to give a plain copy of it the same adapters."""
    return {name: (dict(m.pieces), m.rank, m.scale * m.rank, getattr(m.lora_dropout, "p", 0.0), m.fan_in_fan_out)
            for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def add_adapters(model: nn.Module, layout: dict[str, tuple]) -> None:
    """A plain copy of a model (kiln.parallel.pipeline's whole model, a sample's copy) given the adapters of
    `layout` (adapter_layout of the trained one), uninitialised: its state_dict is loaded next."""
    for name, (pieces, rank, alpha, dropout, fan_in_fan_out) in layout.items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                LoraLinear(model.get_submodule(name), pieces, rank, alpha, dropout, fan_in_fan_out, fresh=False))


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Each LoraLinear of `model` becomes a plain nn.Linear whose weight is W + scale·B·A (in W's dtype, summed in
    fp32 or wider), in place; returns their names."""
    merged = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoraLinear):
            continue
        w = module.weight
        wide = torch.float64 if w.dtype == torch.float64 else torch.float32
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        plain.weight = nn.Parameter((w.to(wide) + module.delta_weight().to(wide)).to(w.dtype),
                                    requires_grad=w.requires_grad)
        plain.bias = module.bias
        for key, value in vars(module).items():
            if not key.startswith("_") and key not in ("training", "pieces", "rank", "scale", "fan_in_fan_out"):
                setattr(plain, key, value)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, plain)
        merged.append(name)
    return merged


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors of `model` by state-dict key (what a LoRA checkpoint needs beside its base)."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(parameters that require a gradient, all parameters), tied ones counted once."""
    params = list(dict.fromkeys(model.parameters()))
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def trainable_line(model: nn.Module) -> str:
    """The start line's `trainable N of M parameters (x%)`."""
    n, m = trainable_count(model)
    return f"trainable {n:,} of {m:,} parameters ({100 * n / max(m, 1):.2f}%)"


def lora_line(lora: LoraConfig, model: nn.Module) -> str:
    """What `kiln train` and kiln.fit print at the start of a LoRA run ("" without adapters)."""
    if not lora.on:
        return ""
    return f"lora: rank {lora.rank}, alpha {lora.alpha:g}, targets {lora.targets} | {trainable_line(model)}"
