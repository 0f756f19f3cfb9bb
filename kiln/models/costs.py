"""What each part kind costs, stated by the part: its parameters, its matmuls, the bytes it saves for backward
and its transients (the attention core's and QK-norm's: kiln/models/attention_costs.py). The estimator, the planner
and the FLOPs (kiln.memory.estimate, kiln.memory.planner, kiln.perf.flops) ask these; they never compare a name.

    NORMS["layernorm"] | NORMS["rmsnorm"]            a norm: build, parameters, saved tensors
    MLPS["gelu"] | ["gelu_exact"] | ["relu2"] | ["swiglu"] | ["moe"]  an MLP: module, linears, parameters, saved tensors, backward peak
    POSITIONS["learned"] | POSITIONS["rope"]         positions: parameters, buffers, saved tensors
    part(table, kind, where)                         a kind by name; an unknown one is an error naming the known
    make_norm(kind, dim, eps, bias)                  the norm module of that kind

Adding a part kind is one class here (positions: in kiln/models/position_costs.py; its nn.Module in
kiln/models/parts.py), listed in its table. Every cost
(parameters, linears, saved tensors, widths, backward peak) has no default: a kind that forgets one raises
NotImplementedError when it is first asked, never costed as another kind. The few defaults (no config fields of
its own, no auxiliary loss, its output in the compute dtype) are stated on the base class.

The estimator's arguments are read, never imported (kiln.memory is above kiln.models): `num` holds the bytes
per element of the step's dtypes (compute, residual, param, grad) and its autocast flags (autocast, casts,
half_weights); `target` the device's allocation rules (kind, mask_bytes, layernorm_stat_bytes). N is tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from kiln.errors import KilnError
from kiln.models import parts
from kiln.models.config import ModelConfig
from kiln.models.position_costs import LearnedPositions, Positions, RotaryPositions


@dataclass(frozen=True)
class Linear:
    """One matmul of a block, per token."""

    name: str  # module inside the block: "attn.qkv", "mlp.experts.fc" (one per expert)
    n_in: int
    n_out: int
    tp: str  # tensor parallelism: "column" (output split), "row" (input split), "replicate", "expert" (EP: whole
    #          weights divided among ranks, each rank keeps n_experts / ep of them)
    copies: int = 1  # weight matrices of this shape in the block (an MoE: one per expert)
    active: int = 1  # of them one token multiplies by (an MoE: the top-k)
    parts: tuple[int, ...] = ()  # a fused linear's output rows, part by part ([q; k; v], [gate; up]); () = one

    @property
    def numel(self) -> int:
        """Weight elements of all copies: what the block holds and autocast copies to half precision."""
        return self.n_in * self.n_out * self.copies


def part(table: dict, kind: str, where: str):
    """table[kind], or an error that names the part, the kind and the known ones."""
    if kind not in table:
        raise KilnError(f"{where}={kind!r} is not a part kiln knows; known: {', '.join(table)} "
                        f"(a new kind is one class in kiln/models/costs.py, docs/models.md)", key=where, value=kind)
    return table[kind]


# ---------------------------------------------------------------- norms


class Norm:
    name = ""

    def build(self, dim: int, eps: float, bias: bool) -> nn.Module:
        raise NotImplementedError(f"norm {self.name!r} states no module")

    def parameters(self, name: str, dim: int, bias: bool) -> list[tuple[str, tuple[int, ...]]]:
        raise NotImplementedError(f"norm {self.name!r} states no parameters")

    def saved(self, cfg: ModelConfig, N: int, num, target, name: str, bias: bool) -> dict[str, int]:
        """What the norm saves for backward; its input is the residual stream. `{name}.weight_fp32` is a weight
        copy (the estimator counts it with the weight casts)."""
        raise NotImplementedError(f"norm {self.name!r} states no saved tensors")


class LayerNorm(Norm):
    name = "layernorm"  # nn.LayerNorm: weight, optional bias; saves the input, mean and rstd

    def build(self, dim, eps, bias):
        return nn.LayerNorm(dim, eps=eps, bias=bias)

    def parameters(self, name, dim, bias):
        return [(f"{name}.weight", (dim,))] + ([(f"{name}.bias", (dim,))] if bias else [])

    def saved(self, cfg, N, num, target, name, bias):
        d, r = cfg.d_model, num.residual
        # autocast runs layer_norm in fp32: a bf16 input (FSDP2's bf16 residual) and weight are saved as fp32 copies;
        # but CPU autocast runs a frozen bf16 LayerNorm (LoRA's base) in bf16: input and statistics saved in bf16
        # (measured, tests/memory/test_lora_memory.py)
        x = 4 if num.autocast and not (getattr(num, "frozen", False) and target.kind == "cpu") else r
        out = {f"{name}.input": N * d * x, f"{name}.stats": 2 * N * target.layernorm_stat_bytes(x)}
        if num.autocast and num.half_weights and x == 4:
            out[f"{name}.weight_fp32"] = d * 4 * (2 if bias else 1)
        return out


class RMSNorm(Norm):
    name = "rmsnorm"  # kiln.models.parts.RMSNorm: weight only; statistics in fp32

    def build(self, dim, eps, bias):
        return parts.RMSNorm(dim, eps=eps)

    def parameters(self, name, dim, bias):
        return [(f"{name}.weight", (dim,))]

    def saved(self, cfg, N, num, target, name, bias):
        d = cfg.d_model
        # RMSNorm computes in fp32: x.float() (a copy when x is bf16), rsqrt per token, the normalized y;
        # y * weight.float() keeps the fp32 weight (a copy when the weight is bf16).
        out = {f"{name}.input": N * d * 4, f"{name}.stats": N * 4, f"{name}.normed": N * d * 4}
        if num.half_weights:
            out[f"{name}.weight_fp32"] = d * 4
        return out


def make_norm(kind: str, dim: int, eps: float, bias: bool = False) -> nn.Module:
    """A family's norm by the name its description gives: "layernorm" (GPT-2) or "rmsnorm"."""
    return part(NORMS, kind, "norm").build(dim, eps, bias)


# ---------------------------------------------------------------- MLPs


class MLP:
    name = ""
    dense = True  # one MLP per block: model.mlp may swap it for another dense kind (not an MoE's experts)
    hf_activation = ""  # GPT-2's config.json activation_function ("" = GPT-2 has none)

    def build(self, cfg: ModelConfig, bias: bool) -> nn.Module:  # the block's MLP module
        raise NotImplementedError(f"MLP {self.name!r} states no module")

    def complete(self, cfg: ModelConfig) -> None:
        """Fill the fields this MLP derives when a preset leaves them at 0 (in place)."""

    def check(self, cfg: ModelConfig, family: str) -> None:
        if cfg.n_experts:
            raise KilnError(f"model.n_experts={cfg.n_experts} needs a mixture-of-experts family (model.arch="
                            f"qwen3_moe); {family} has one MLP per block", key="model.n_experts", value=cfg.n_experts)

    def linears(self, cfg: ModelConfig) -> list[Linear]:
        """The MLP's matmuls, in forward order; the last is its output projection."""
        raise NotImplementedError(f"MLP {self.name!r} states no linears")

    def parameters(self, cfg: ModelConfig, prefix: str, bias: bool, lin: dict[str, Linear]) -> list:
        """(name, shape) of its parameters under `prefix` ("blocks.0.mlp"); `lin` the block's linears by name."""
        out = []
        for x in self.linears(cfg):
            name = f"{prefix}.{x.name.removeprefix('mlp.')}"
            out += [(f"{name}.weight", (x.n_out, x.n_in))] + ([(f"{name}.bias", (x.n_out,))] if bias else [])
        return out

    def saved(self, cfg: ModelConfig, N: int, num) -> dict[str, int]:
        """What it saves for backward beyond its input."""
        raise NotImplementedError(f"MLP {self.name!r} states no saved tensors")

    def loss_saved(self, cfg: ModelConfig) -> dict[str, int]:
        """What its auxiliary losses over all blocks save (none but an MoE's)."""
        return {}

    def output_bytes(self, num) -> int:
        """Bytes per element of its output (the dropout mask on it is of this dtype)."""
        return num.compute

    def projection_backward(self, cfg: ModelConfig, N: int, num) -> tuple[int, int, int, int]:
        """The tensors alive when the backward of its output projection peaks: (projection's input width F,
        rows of that product, elements per row of the input gradients, bytes beside them)."""
        raise NotImplementedError(f"MLP {self.name!r} states no backward peak")

    def forward_width(self, cfg: ModelConfig) -> int:
        """Elements per token of its widest tensors alive together in the forward."""
        raise NotImplementedError(f"MLP {self.name!r} states no forward width")

    def elementwise_width(self, cfg: ModelConfig) -> int:
        """Elements per token its elementwise ops read and write (the planner's memory-bound time)."""
        raise NotImplementedError(f"MLP {self.name!r} states no elementwise width")

    def recompute_skips_projection(self) -> bool:
        """Whether torch's checkpoint stops before the output projection of a "full" segment's last block
        (nothing after it saves a tensor)."""
        return True


def _dense_saved(kind: str, N: int, F: int, c: int) -> dict[str, int]:
    """A dense MLP of width F on N tokens, beyond its input."""
    if kind == "swiglu":
        t = {"mlp.gate_up": N * 2 * F * c,  # silu(gate) and the product keep the fc output's storage
             "mlp.silu_out": N * F * c}
    else:
        t = {"mlp.act_input": N * F * c}  # GELU saves its input (the fc output)
    t["mlp.proj_input"] = N * F * c
    return t


class GeluMLP(MLP):
    name = "gelu"  # fc, tanh GELU, proj
    hf_activation = "gelu_new"

    def build(self, cfg, bias):
        return parts.GeluMLP(cfg.d_model, cfg.d_ff, bias)

    def linears(self, cfg):
        d = cfg.d_model
        return [Linear("mlp.fc", d, cfg.d_ff, "column"), Linear("mlp.proj", cfg.d_ff, d, "row")]

    def saved(self, cfg, N, num):
        return _dense_saved("gelu", N, cfg.d_ff, num.compute)

    def projection_backward(self, cfg, N, num):
        return cfg.d_ff, N, cfg.d_ff, 0

    def forward_width(self, cfg):
        return 2 * cfg.d_ff

    def elementwise_width(self, cfg):
        return 2 * cfg.d_ff


class GeluExactMLP(GeluMLP):
    # fc, the exact (erf) GELU, proj: nanoGPT's MLP; GELU's matmuls, saved bytes and elementwise passes
    name = "gelu_exact"
    hf_activation = "gelu"  # transformers' ACT2FN["gelu"]: the erf GELU

    def build(self, cfg, bias):
        return parts.GeluExactMLP(cfg.d_model, cfg.d_ff, bias)


class Relu2MLP(GeluMLP):
    # modded-nanogpt's fc, relu(x)², proj: GELU's matmuls and saved bytes (tests/memory/test_recipe_memory.py)
    name = "relu2"
    hf_activation = "relu2"  # transformers' ACT2FN["relu2"]: ReLUSquaredActivation

    def build(self, cfg, bias):
        return parts.Relu2MLP(cfg.d_model, cfg.d_ff, bias)

    def elementwise_width(self, cfg):
        return 4 * cfg.d_ff  # relu reads and writes F, square reads and writes F


class SwiGLUMLP(MLP):
    name = "swiglu"  # fused gate/up, silu(gate)·up, proj

    def build(self, cfg, bias):
        return parts.SwiGLUMLP(cfg.d_model, cfg.d_ff)

    def linears(self, cfg):
        d = cfg.d_model
        return [Linear("mlp.fc", d, 2 * cfg.d_ff, "column", parts=(cfg.d_ff, cfg.d_ff)),
                Linear("mlp.proj", cfg.d_ff, d, "row")]

    def saved(self, cfg, N, num):
        return _dense_saved("swiglu", N, cfg.d_ff, num.compute)

    def projection_backward(self, cfg, N, num):
        return cfg.d_ff, N, 3 * cfg.d_ff, 0  # the projection input's gradient, then the (N, 2F) gate/up one

    def forward_width(self, cfg):
        return 4 * cfg.d_ff  # gate/up, silu, product

    def elementwise_width(self, cfg):
        return 3 * cfg.d_ff


class MoEMLP(MLP):
    name = "moe"  # kiln.models.moe.MoE: a router and n_experts SwiGLUs, each token to its top-k
    dense = False  # (qwen3_moe's block builds it)

    def complete(self, cfg):
        if cfg.moe_d_ff == 0:
            cfg.moe_d_ff = 64 * math.ceil(3 * cfg.d_model / 8 / 64)  # Qwen3-30B-A3B's ratio: 768 at d=2048

    def check(self, cfg, family):
        if cfg.n_experts < 1 or not 1 <= cfg.n_experts_active <= cfg.n_experts or cfg.moe_d_ff < 1:
            raise KilnError(f"model.n_experts={cfg.n_experts}, model.n_experts_active={cfg.n_experts_active}, "
                            f"model.moe_d_ff={cfg.moe_d_ff}: a mixture of experts needs 1 ≤ active ≤ experts "
                            f"and an expert width ≥ 1", key="model.n_experts_active", value=cfg.n_experts_active)
        if bad := [k for k in ("moe_aux_coef", "moe_z_coef") if (getattr(cfg, k) or 0) < 0]:
            raise KilnError("model.moe_aux_coef and model.moe_z_coef must be ≥ 0", key=f"model.{bad[0]}")

    def linears(self, cfg):
        d, E, K, F = cfg.d_model, cfg.n_experts, cfg.n_experts_active, cfg.moe_d_ff
        return [Linear("mlp.router", d, E, "replicate"),
                Linear("mlp.experts.fc", d, 2 * F, "expert", copies=E, active=K),
                Linear("mlp.experts.proj", F, d, "expert", copies=E, active=K)]

    def parameters(self, cfg, prefix, bias, lin):
        out = [(f"{prefix}.router.weight", (lin["mlp.router"].n_out, lin["mlp.router"].n_in))]
        for name in ("fc", "proj"):  # every expert's weight of one matmul, stacked (kiln.models.moe.ExpertLinear)
            x = lin[f"mlp.experts.{name}"]
            out.append((f"{prefix}.experts.{name}.weight", (x.copies, x.n_out, x.n_in)))
        return out

    def saved(self, cfg, N, num):
        """The routing, then every (token, slot) pair as a row of its expert's SwiGLU — N·K rows over all experts
        whatever the routing — and the weighted sum back."""
        E, K, F, d, c, r = cfg.n_experts, cfg.n_experts_active, cfg.moe_d_ff, cfg.d_model, num.compute, num.residual
        S = N * K  # routed (token, slot) pairs
        t = {"moe.probs": N * E * 4,  # softmax in fp32, kept by topk and by the load-balancing loss
             "moe.topk_index": S * 8}
        if cfg.moe_norm_topk:
            t["moe.topk_weights"] = S * 4 + N * 4  # the division keeps the top-k probabilities and their sum
        if cfg.moe_z_coef:
            t["moe.z_loss"] = N * E * 4 + N * 4  # fp32 logits and their logsumexp
        t["moe.token_index"] = S * 8  # the gather of each pair's token, and the scatter back (one tensor)
        t["moe.expert_inputs"] = S * d * c
        t.update({f"moe.experts.{k.removeprefix('mlp.')}": v for k, v in _dense_saved("swiglu", S, F, c).items()})
        t["moe.order"] = S * 8  # pairs sorted by expert
        t["moe.group_offsets"] = E * 4  # grouped_mm's int32 end row of each expert's group (kiln.models.moe)
        t["moe.slot_weights"] = S * r  # each pair's routing weight, in the residual dtype
        t["moe.expert_outputs"] = S * d * c
        t["moe.weighted"] = S * d * r  # expert output × weight (promoted to the residual dtype), scattered back
        return t

    def loss_saved(self, cfg):
        # kiln.models.moe.moe_losses: the routed shares (fp32, E) and the valid-token count (int64) its product
        # with the summed loss keeps
        return {"moe.aux_loss": cfg.n_experts * 4 + 8}

    def output_bytes(self, num):
        return num.residual  # the experts' outputs are summed in the residual dtype

    def projection_backward(self, cfg, N, num):
        # one expert's share of the routed pairs, beside the gradients of all pairs' outputs
        S = N * cfg.n_experts_active
        return (cfg.moe_d_ff, math.ceil(S / cfg.n_experts), 3 * cfg.moe_d_ff,
                S * cfg.d_model * (num.residual + num.compute))

    def forward_width(self, cfg):
        return cfg.n_experts_active * 4 * cfg.moe_d_ff  # a SwiGLU's for every routed pair

    def elementwise_width(self, cfg):
        return cfg.n_experts_active * (3 * cfg.moe_d_ff + 2 * cfg.d_model) + 2 * cfg.n_experts

    def recompute_skips_projection(self):
        # the MoE weights and scatters its experts' outputs after the projection, saving tensors there:
        # checkpoint recomputes through every expert's projection
        return False


NORMS: dict[str, Norm] = {p.name: p for p in (LayerNorm(), RMSNorm())}
MLPS: dict[str, MLP] = {p.name: p for p in (GeluMLP(), GeluExactMLP(), Relu2MLP(), SwiGLUMLP(), MoEMLP())}
POSITIONS: dict[str, Positions] = {p.name: p for p in (LearnedPositions(), RotaryPositions())}
