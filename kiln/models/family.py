"""What a model family tells the rest of kiln: the one description every part reads.

    Family      a family's parts (norm, MLP, positions, QK-norm), its block, presets and defaults, its
                Hugging Face mapping; and what kiln derives from them:
      .parameter_shapes(cfg)   every parameter tensor, in model order (parameter count, model-state bytes)
      .linears(cfg)            the matmuls of one block (FLOPs, the planner's roofline, autocast's weight copies,
                               the tensor-parallel layout)
      .hf_tensors(cfg)         kiln's tensors <-> the Hub's names and layouts (kiln.interop.hf)
    Linear, HFTensor           the records those return

The saved-for-backward bytes (kiln.memory.estimate), the planner's widths and the recompute FLOPs are stated by
the parts named here (`norm`, `mlp`, `positions`: kiln.models.costs; `.norm_part`, `.mlp_part`,
`.positions_part`), each accounted once, so a family built from known parts is estimated exactly from its first
day. Nothing outside kiln/models/ branches on a family's name or a part's kind: it asks the description or the
part (tests/models/test_families.py greps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from kiln.errors import KilnError
from kiln.models import costs
from kiln.models.config import ModelConfig
from kiln.models.costs import Linear  # noqa: F401  (re-exported: a block's matmuls are described here)


@dataclass(frozen=True)
class HFTensor:
    """One kiln tensor and the Hugging Face tensors it is made of, concatenated along the first dimension (of a 3-D
    tensor, stacked experts (E, out, in), along its first two flattened: E·out rows)."""

    kiln: str  # "blocks.0.attn.qkv.weight"
    hf: tuple[str, ...]  # ("model.layers.0.self_attn.q_proj.weight", ...k_proj..., ...v_proj...)
    rows: tuple[int, ...] = ()  # first-dimension size of each part (one part: ())
    conv1d: bool = False  # stored transposed, (in, out), as GPT-2's Conv1D does
    vocab: bool = False  # rows are the vocabulary: kiln pads it to a multiple of 64
    zeros: bool = False  # a bias kiln may leave out (model.bias=false): written as zeros


@dataclass(frozen=True)
class Family:
    name: str  # the value of model.arch
    summary: str  # one line for --help and docs
    block: Callable  # block(cfg) -> nn.Module with forward(x, rope_cache)
    norm: str  # "layernorm" (weight, optional bias, mean/rstd saved) | "rmsnorm" (fp32 statistics)
    mlp: str  # "gelu" (fc, tanh GELU, proj) | "swiglu" (fused gate/up, silu·up, proj) | "moe" (router + experts)
    positions: str  # "learned" (a position table) | "rope" (rotary q and k)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    biases: bool = False  # model.bias puts biases in the linears and norms
    gqa: bool = True  # n_kv_head may be below n_head
    rope_scaling: bool = False  # model.rope_scaling (Llama 3's) is accepted
    defaults: dict = field(default_factory=dict)  # the family's fields when model.arch switches a preset to it
    d_ff: Callable[[int], int] = lambda d: 4 * d  # MLP width from d_model when model.d_ff is 0
    presets: dict = field(default_factory=dict)  # name -> ModelConfig
    hf_model_type: str = ""  # config.json's model_type
    hf_config_in: Callable | None = None  # (config.json dict, source) -> ModelConfig
    hf_config_out: Callable | None = None  # (cfg, vocab, eos) -> config.json dict
    hf_names: Callable | None = None  # (cfg) -> [HFTensor] for the whole model
    hf_activation: bool = False  # config.json names the MLP's activation (GPT-2's activation_function)
    extra_check: Callable | None = None  # (cfg) -> None, raising ValueError for what this family cannot build

    def __post_init__(self):
        for table, kind, key in ((costs.NORMS, self.norm, "norm"), (costs.MLPS, self.mlp, "mlp"),
                                 (costs.POSITIONS, self.positions, "positions")):
            costs.part(table, kind, f"family {self.name!r}: {key}")  # an unknown kind fails at registration

    @property
    def norm_part(self) -> costs.Norm:
        return costs.part(costs.NORMS, self.norm, "norm")

    @property
    def mlp_part(self) -> costs.MLP:
        return costs.part(costs.MLPS, self.mlp, "mlp")

    @property
    def positions_part(self) -> costs.Positions:
        return costs.part(costs.POSITIONS, self.positions, "positions")

    # A run's parts: the family's, unless the config's recipe keys (model.mlp, model.qk_norm) override them.
    # Everything that costs or builds a block asks these, never the family's fields alone.

    def mlp_of(self, cfg: ModelConfig) -> costs.MLP:
        return costs.part(costs.MLPS, cfg.mlp or self.mlp, "model.mlp")

    def qk_norm_of(self, cfg: ModelConfig) -> bool:
        return self.qk_norm if cfg.qk_norm is None else bool(cfg.qk_norm)

    def hf_refusal(self, cfg: ModelConfig) -> str:
        """Why this run's parts have no Hugging Face form ("" when they have one): kiln export --hf refuses it."""
        mlp = self.mlp_of(cfg)
        if mlp.name != self.mlp and not (self.hf_activation and mlp.hf_activation):
            return f"model.mlp={mlp.name!r}: {self.hf_model_type}'s Hugging Face config has no such MLP"
        if self.qk_norm_of(cfg) != self.qk_norm:
            return (f"model.qk_norm={self.qk_norm_of(cfg)}: {self.hf_model_type}'s Hugging Face model "
                    f"{'has' if self.qk_norm else 'has no'} QK-norm")
        if cfg.logit_softcap:
            return (f"model.logit_softcap={cfg.logit_softcap:g}: {self.hf_model_type}'s Hugging Face model has no "
                    f"logit soft-capping")
        return ""

    # ------------------------------------------------------------ config

    def check_parts(self, cfg: ModelConfig) -> None:
        """The recipe keys: an MLP kind this family can swap in, a soft cap ≥ 0."""
        if cfg.mlp and (cfg.mlp not in costs.MLPS or not (costs.MLPS[cfg.mlp].dense and self.mlp_part.dense)):
            dense = ", ".join(k for k, p in costs.MLPS.items() if p.dense)
            fix = f"give one of {dense}, or \"\" for the family's own ({self.name}: {self.mlp})"
            raise KilnError(f"model.mlp={cfg.mlp!r} is not an MLP kiln can swap in (an MoE keeps its SwiGLU "
                            f"experts); {fix}", key="model.mlp", value=cfg.mlp, fix=fix)
        if not (math.isfinite(cfg.logit_softcap) and cfg.logit_softcap >= 0):
            fix = "give a cap > 0 (modded-nanogpt: 15; Gemma 2: 30), or 0 for none"
            raise KilnError(f"model.logit_softcap={cfg.logit_softcap:g} must be ≥ 0; {fix}",
                            key="model.logit_softcap", value=cfg.logit_softcap, fix=fix)

    def complete(self, cfg: ModelConfig) -> None:
        """Fill the derived fields a preset leaves at 0 (in place)."""
        self.check_parts(cfg)
        if cfg.n_kv_head == 0:
            cfg.n_kv_head = cfg.n_head
        if cfg.head_dim == 0 and cfg.n_head > 0:
            if cfg.d_model % cfg.n_head:
                raise KilnError(f"model.d_model={cfg.d_model} must be divisible by model.n_head={cfg.n_head} "
                                f"(or set model.head_dim)", key="model.d_model", value=cfg.d_model,
                                fix="or set model.head_dim")
            cfg.head_dim = cfg.d_model // cfg.n_head
        if cfg.d_ff == 0:
            cfg.d_ff = self.d_ff(cfg.d_model)
        self.mlp_of(cfg).complete(cfg)

    def check(self, cfg: ModelConfig) -> None:
        self.check_parts(cfg)
        if not self.gqa and cfg.n_kv_head != cfg.n_head:
            raise KilnError(f"model.n_kv_head applies to grouped-query families; {self.name} attention uses "
                            f"n_head key/value heads (set model.n_kv_head=0)", key="model.n_kv_head",
                            value=cfg.n_kv_head, fix="set model.n_kv_head=0")
        self.positions_part.check(cfg)
        if cfg.rope_scaling and (len(cfg.rope_scaling) != 4 or not self.rope_scaling):
            raise KilnError(f"model.rope_scaling={cfg.rope_scaling!r}: Llama 3's scaling takes (factor, "
                            f"low_freq_factor, high_freq_factor, original_max_len), arch='llama' only",
                            key="model.rope_scaling", value=cfg.rope_scaling,
                            fix="give four numbers (factor, low_freq_factor, high_freq_factor, original_max_len) "
                                "with arch='llama', or none")
        self.mlp_of(cfg).check(cfg, self.name)
        if self.extra_check is not None:
            self.extra_check(cfg)

    # ------------------------------------------------------------ what kiln derives

    def linears(self, cfg: ModelConfig) -> list[Linear]:
        """The matmuls of one block, in forward order."""
        d, hd, H, KV = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_head
        out = [Linear("attn.qkv", d, (H + 2 * KV) * hd, "column", parts=(H * hd, KV * hd, KV * hd)),
               Linear("attn.proj", H * hd, d, "row")]
        return out + self.mlp_of(cfg).linears(cfg)

    def parameter_shapes(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter tensor of Transformer(cfg), tied weights once, in model order."""
        d, V = cfg.d_model, cfg.padded_vocab
        bias = bool(cfg.bias) and self.biases

        def norm(name, dim=d):
            return self.norm_part.parameters(name, dim, bias)

        def linear(name, lin: Linear):
            return [(f"{name}.weight", (lin.n_out, lin.n_in))] + ([(f"{name}.bias", (lin.n_out,))] if bias else [])

        out = [("embed.weight", (V, d))] + self.positions_part.parameters(cfg)
        lin = {x.name: x for x in self.linears(cfg)}
        for i in range(cfg.n_layer):
            b = f"blocks.{i}"
            out += norm(f"{b}.norm1") + linear(f"{b}.attn.qkv", lin["attn.qkv"])
            if self.qk_norm_of(cfg):  # an RMSNorm whatever the family's norm (kiln.models.parts.Attention)
                out += [(f"{b}.attn.{n}.weight", (cfg.head_dim,)) for n in ("q_norm", "k_norm")]
            out += linear(f"{b}.attn.proj", lin["attn.proj"]) + norm(f"{b}.norm2")
            out += self.mlp_of(cfg).parameters(cfg, f"{b}.mlp", bias, lin)
        out += norm("norm")
        if not cfg.tie_embeddings:
            out.append(("head.weight", (V, d)))
        return out

    def block_matmul_numel(self, cfg: ModelConfig) -> int:
        """Weight elements one block multiplies by: all of them (every expert), what autocast copies."""
        return sum(x.numel for x in self.linears(cfg))

    def active_matmul_numel(self, cfg: ModelConfig) -> int:
        """Weight elements one token multiplies by in one block: an MoE's top-k experts, not all of them."""
        return sum(x.n_in * x.n_out * x.active for x in self.linears(cfg))

    def tp_layout(self, cfg: ModelConfig) -> dict[str, str]:
        """Each block linear's split under tensor (and expert) parallelism: {module in the block: column | row |
        replicate | expert}. Attention splits by heads (qkv column, proj row), the MLP by width; an MoE's
        experts are divided among the expert-parallel ranks whole."""
        return {x.name: x.tp for x in self.linears(cfg)}

    def hf_tensors(self, cfg: ModelConfig) -> list[HFTensor]:
        if self.hf_names is None:
            raise KilnError(f"model.arch={self.name!r} has no Hugging Face mapping", key="model.arch", value=self.name,
                            fix="export a family that has one (hf_names in its kiln/models/<family>.py)")
        return self.hf_names(cfg)
