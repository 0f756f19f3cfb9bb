"""Llama: RMSNorm, SwiGLU MLP, rotary positions (with Llama 3's scaling), grouped-query attention, untied head.

Its config fields and presets, its block, and its description (kiln.models.family) with the Hugging Face
mapping of LlamaForCausalLM (kiln fuses q/k/v into attn.qkv and gate/up into mlp.fc).
"""
from __future__ import annotations

import math

from kiln.errors import KilnError
from kiln.models.catalog import family
from kiln.models.config import ModelConfig
from kiln.models.costs import make_norm
from kiln.models.family import Family, HFTensor
from kiln.models.parts import Attention, PreNormBlock

DEFAULTS = dict(vocab_size=32000, max_seq_len=2048, bias=False, tie_embeddings=False, norm_eps=1e-6,
                rope_theta=10000.0)
SWITCH = dict(n_kv_head=0, head_dim=0, d_ff=0, bias=False, tie_embeddings=False, norm_eps=1e-6,
              rope_theta=10000.0)


def ffn_width(d_model: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4d, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * d_model / 3) / 256)


def config(n_layer, n_head, n_kv_head, d_model, d_ff, **kw) -> ModelConfig:
    return ModelConfig(arch="llama", n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, d_model=d_model,
                       d_ff=d_ff, **(DEFAULTS | kw))


PRESETS = {
    "llama-125m": config(12, 12, 4, 768, 2048),
    "llama-350m": config(24, 16, 8, 1024, 2816),
    # Shaped like Llama-3.2-1B (tied embeddings, 128k vocabulary) and Llama-2-7B.
    "llama-1b": config(16, 32, 8, 2048, 8192, vocab_size=128256, tie_embeddings=True, rope_theta=500000.0),
    "llama-7b": config(32, 32, 32, 4096, 11008, max_seq_len=4096),
    # Meta-Llama-3-70B's config.json: 80 layers, hidden 8192, 64 heads sharing 8 key/value heads, intermediate
    # 28672, vocabulary 128256, rope_theta 500000, rms_norm_eps 1e-5, 8192 positions, untied embeddings.
    "llama-70b": config(80, 64, 8, 8192, 28672, vocab_size=128256, max_seq_len=8192, rope_theta=500000.0,
                        norm_eps=1e-5),
}


class LlamaBlock(PreNormBlock):
    def __init__(self, cfg: ModelConfig):
        fam = family(cfg.arch)  # its parts, with the run's recipe keys (model.mlp, model.qk_norm)
        super().__init__(make_norm("rmsnorm", cfg.d_model, cfg.norm_eps),
                         Attention(cfg, rotary=True, qk_norm=fam.qk_norm_of(cfg)),
                         make_norm("rmsnorm", cfg.d_model, cfg.norm_eps), fam.mlp_of(cfg).build(cfg, False),
                         cfg.dropout)


def rope_from_hf(hf: dict, source: str) -> tuple[float, tuple]:
    """(rope_theta, Llama 3 scaling or ()) of a config.json: transformers 5 keeps them in rope_parameters,
    earlier versions in rope_theta and rope_scaling."""
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind not in (None, "default", "llama3"):
        raise KilnError(f"{source}: rope_scaling of type {kind!r} is not one kiln's RoPE has (it has plain "
                        f"rope_theta and Llama 3's 'llama3')", key="rope_scaling", value=kind,
                        fix="start from a checkpoint with plain or 'llama3' RoPE")
    llama3 = (float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]),
              float(scaling["original_max_position_embeddings"])) if kind == "llama3" else ()
    return float(theta), llama3


def rope_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.rope_scaling:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    factor, low, high, original = cfg.rope_scaling
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(original)}


def shape_from_hf(hf: dict, source: str, family: str) -> dict:
    """The ModelConfig fields every Llama-like config.json gives (llama, qwen3, qwen3_moe)."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise KilnError(f"{source}: biases in the attention or MLP (attention_bias, mlp_bias) are not in kiln's "
                        f"{family} block",
                        key="attention_bias" if hf.get("attention_bias") else "mlp_bias", value=True,
                        fix="start from a checkpoint without attention or MLP biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise KilnError(f"{source}: hidden_act={hf['hidden_act']!r}; kiln's {family} MLP is SwiGLU (silu)",
                        key="hidden_act", value=hf["hidden_act"], fix="start from a checkpoint with hidden_act silu")
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    theta, scaling = rope_from_hf(hf, source)
    return dict(arch=family, n_layer=hf["num_hidden_layers"], n_head=H, n_kv_head=hf.get("num_key_value_heads") or H,
                head_dim=hf.get("head_dim") or d // H, d_model=d, vocab_size=hf["vocab_size"],
                max_seq_len=hf["max_position_embeddings"], bias=False,
                tie_embeddings=hf.get("tie_word_embeddings", False), norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=theta, rope_scaling=scaling)


def shape_to_hf(cfg: ModelConfig, vocab: int, eos: int | None) -> dict:
    return {"num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim, "hidden_size": cfg.d_model,
            "max_position_embeddings": cfg.max_seq_len, "vocab_size": vocab, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "hidden_act": "silu", "rope_parameters": rope_to_hf(cfg),
            "rope_scaling": rope_to_hf(cfg) if cfg.rope_scaling else None,
            "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": False, "torch_dtype": "float32",
            "bos_token_id": eos, "eos_token_id": eos}


def from_hf(hf: dict, source: str) -> ModelConfig:
    return ModelConfig(preset="llama-125m", d_ff=hf["intermediate_size"], **shape_from_hf(hf, source, "llama"))


def to_hf(cfg: ModelConfig, vocab: int, eos: int | None) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape_to_hf(cfg, vocab, eos),
            "intermediate_size": cfg.d_ff, "mlp_bias": False}


def attention_names(cfg: ModelConfig, i: int, qk_norm: bool = False) -> list[HFTensor]:
    """Layer i's norms and attention under HF's Llama names (Qwen3 adds q_norm and k_norm)."""
    h, b = f"model.layers.{i}.", f"blocks.{i}."
    H, KV, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    out = [HFTensor(f"{b}norm1.weight", (f"{h}input_layernorm.weight",)),
           HFTensor(f"{b}attn.qkv.weight", tuple(f"{h}self_attn.{p}_proj.weight" for p in "qkv"),
                    rows=(H * hd, KV * hd, KV * hd))]
    if qk_norm:
        out += [HFTensor(f"{b}attn.q_norm.weight", (f"{h}self_attn.q_norm.weight",)),
                HFTensor(f"{b}attn.k_norm.weight", (f"{h}self_attn.k_norm.weight",))]
    out += [HFTensor(f"{b}attn.proj.weight", (f"{h}self_attn.o_proj.weight",)),
            HFTensor(f"{b}norm2.weight", (f"{h}post_attention_layernorm.weight",))]
    return out


def swiglu_names(kiln: str, hf: str, d_ff: int) -> list[HFTensor]:
    """A SwiGLU MLP: kiln's fused fc is HF's gate_proj over up_proj."""
    return [HFTensor(f"{kiln}.fc.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), rows=(d_ff, d_ff)),
            HFTensor(f"{kiln}.proj.weight", (f"{hf}.down_proj.weight",))]


def ends(cfg: ModelConfig, blocks: list[HFTensor]) -> list[HFTensor]:
    """Embedding, blocks, final norm and (untied) head under HF's Llama-style names."""
    out = [HFTensor("embed.weight", ("model.embed_tokens.weight",), vocab=True), *blocks,
           HFTensor("norm.weight", ("model.norm.weight",))]
    if not cfg.tie_embeddings:
        out.append(HFTensor("head.weight", ("lm_head.weight",), vocab=True))
    return out


def hf_names(cfg: ModelConfig) -> list[HFTensor]:
    blocks = []
    for i in range(cfg.n_layer):
        blocks += attention_names(cfg, i) + swiglu_names(f"blocks.{i}.mlp", f"model.layers.{i}.mlp", cfg.d_ff)
    return ends(cfg, blocks)


FAMILY = Family(
    name="llama", summary="RMSNorm, SwiGLU MLP, RoPE (Llama 3 scaling), grouped-query attention",
    block=LlamaBlock, norm="rmsnorm", mlp="swiglu", positions="rope", rope_scaling=True,
    defaults=SWITCH, d_ff=ffn_width, presets=PRESETS,
    hf_model_type="llama", hf_config_in=from_hf, hf_config_out=to_hf, hf_names=hf_names)
