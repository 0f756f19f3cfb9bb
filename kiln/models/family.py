"""What a model family tells the rest of kiln: the one description every part reads.

    Family      a family's parts (norm, MLP, positions, QK-norm), its block, presets and defaults, its
                Hugging Face mapping; and what kiln derives from them:
      .parameter_shapes(cfg)   every parameter tensor, in model order (parameter count, model-state bytes)
      .linears(cfg)            the matmuls of one block (FLOPs, the planner's roofline, autocast's weight copies,
                               the tensor-parallel layout)
      .hf_tensors(cfg)         kiln's tensors <-> the Hub's names and layouts (kiln.interop.hf)
    Linear, HFTensor           the records those return

The saved-for-backward bytes (kiln.memory.estimate) are derived from the parts named here (`norm`, `mlp`,
`positions`, `qk_norm`), each accounted once, so a family built from known parts is estimated exactly from its
first day. Nothing outside kiln/models/ branches on a family's name: it asks the description (a test greps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from kiln.models.config import ModelConfig

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "moe")
POSITIONS = ("learned", "rope")


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


@dataclass(frozen=True)
class HFTensor:
    """One kiln tensor and the Hugging Face tensors it is made of, concatenated along the first dimension."""

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
    extra_check: Callable | None = None  # (cfg) -> None, raising ValueError for what this family cannot build

    # ------------------------------------------------------------ config

    def complete(self, cfg: ModelConfig) -> None:
        """Fill the derived fields a preset leaves at 0 (in place)."""
        if cfg.n_kv_head == 0:
            cfg.n_kv_head = cfg.n_head
        if cfg.head_dim == 0 and cfg.n_head > 0:
            if cfg.d_model % cfg.n_head:
                raise ValueError(f"model.d_model={cfg.d_model} must be divisible by model.n_head={cfg.n_head} "
                                 f"(or set model.head_dim)")
            cfg.head_dim = cfg.d_model // cfg.n_head
        if cfg.d_ff == 0:
            cfg.d_ff = self.d_ff(cfg.d_model)
        if self.mlp == "moe" and cfg.moe_d_ff == 0:
            cfg.moe_d_ff = 64 * math.ceil(3 * cfg.d_model / 8 / 64)  # Qwen3-30B-A3B's ratio: 768 at d=2048

    def check(self, cfg: ModelConfig) -> None:
        if not self.gqa and cfg.n_kv_head != cfg.n_head:
            raise ValueError(f"model.n_kv_head applies to grouped-query families; {self.name} attention uses "
                             f"n_head key/value heads (set model.n_kv_head=0)")
        if self.positions == "rope" and cfg.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension; model.head_dim = {cfg.head_dim}")
        if self.positions == "rope" and cfg.rope_theta <= 0:
            raise ValueError(f"model.rope_theta={cfg.rope_theta}: RoPE needs a base frequency > 0, e.g. 10000")
        if cfg.rope_scaling and (len(cfg.rope_scaling) != 4 or not self.rope_scaling):
            raise ValueError(f"model.rope_scaling={cfg.rope_scaling!r}: Llama 3's scaling takes (factor, "
                             f"low_freq_factor, high_freq_factor, original_max_len), arch='llama' only")
        if self.mlp == "moe":
            if cfg.n_experts < 1 or not 1 <= cfg.n_experts_active <= cfg.n_experts or cfg.moe_d_ff < 1:
                raise ValueError(f"model.n_experts={cfg.n_experts}, model.n_experts_active={cfg.n_experts_active}, "
                                 f"model.moe_d_ff={cfg.moe_d_ff}: a mixture of experts needs 1 ≤ active ≤ experts "
                                 f"and an expert width ≥ 1")
            if (cfg.moe_aux_coef or 0) < 0 or (cfg.moe_z_coef or 0) < 0:
                raise ValueError("model.moe_aux_coef and model.moe_z_coef must be ≥ 0")
        elif cfg.n_experts:
            raise ValueError(f"model.n_experts={cfg.n_experts} needs a mixture-of-experts family "
                             f"(model.arch=qwen3_moe); {self.name} has one MLP per block")
        if self.extra_check is not None:
            self.extra_check(cfg)

    # ------------------------------------------------------------ what kiln derives

    def linears(self, cfg: ModelConfig) -> list[Linear]:
        """The matmuls of one block, in forward order."""
        d, hd, H, KV = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_head
        out = [Linear("attn.qkv", d, (H + 2 * KV) * hd, "column", parts=(H * hd, KV * hd, KV * hd)),
               Linear("attn.proj", H * hd, d, "row")]
        if self.mlp == "gelu":
            out += [Linear("mlp.fc", d, cfg.d_ff, "column"), Linear("mlp.proj", cfg.d_ff, d, "row")]
        elif self.mlp == "swiglu":
            out += [Linear("mlp.fc", d, 2 * cfg.d_ff, "column", parts=(cfg.d_ff, cfg.d_ff)),
                    Linear("mlp.proj", cfg.d_ff, d, "row")]
        else:
            E, K, F = cfg.n_experts, cfg.n_experts_active, cfg.moe_d_ff
            out += [Linear("mlp.router", d, E, "replicate"),
                    Linear("mlp.experts.fc", d, 2 * F, "expert", copies=E, active=K),
                    Linear("mlp.experts.proj", F, d, "expert", copies=E, active=K)]
        return out

    def parameter_shapes(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter tensor of Transformer(cfg), tied weights once, in model order."""
        d, V = cfg.d_model, cfg.padded_vocab
        bias = bool(cfg.bias) and self.biases

        def norm(name, dim=d):
            return [(f"{name}.weight", (dim,))] + ([(f"{name}.bias", (dim,))] if bias and self.norm == "layernorm"
                                                   else [])

        def linear(name, lin: Linear, with_bias=bias):
            return [(f"{name}.weight", (lin.n_out, lin.n_in))] + ([(f"{name}.bias", (lin.n_out,))] if with_bias
                                                                  else [])

        out = [("embed.weight", (V, d))]
        if self.positions == "learned":
            out.append(("pos_embed.weight", (cfg.max_seq_len, d)))
        lin = {x.name: x for x in self.linears(cfg)}
        for i in range(cfg.n_layer):
            b = f"blocks.{i}"
            out += norm(f"{b}.norm1") + linear(f"{b}.attn.qkv", lin["attn.qkv"])
            if self.qk_norm:
                out += norm(f"{b}.attn.q_norm", cfg.head_dim) + norm(f"{b}.attn.k_norm", cfg.head_dim)
            out += linear(f"{b}.attn.proj", lin["attn.proj"]) + norm(f"{b}.norm2")
            if self.mlp == "moe":
                out += linear(f"{b}.mlp.router", lin["mlp.router"], False)
                for e in range(cfg.n_experts):
                    out += linear(f"{b}.mlp.experts.{e}.fc", lin["mlp.experts.fc"], False)
                    out += linear(f"{b}.mlp.experts.{e}.proj", lin["mlp.experts.proj"], False)
            else:
                out += linear(f"{b}.mlp.fc", lin["mlp.fc"]) + linear(f"{b}.mlp.proj", lin["mlp.proj"])
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
            raise ValueError(f"model.arch={self.name!r} has no Hugging Face mapping")
        return self.hf_names(cfg)
