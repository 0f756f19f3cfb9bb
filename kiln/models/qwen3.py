"""Qwen3 (dense): Llama's block with an RMSNorm over each head of q and k before RoPE (QK-norm), grouped-query
attention, a head width of its own (128 whatever d_model), RoPE base 1e6, tied embeddings in the small sizes.

Its config fields and presets, its block, and its description (kiln.models.family) with the Hugging Face
mapping of Qwen3ForCausalLM (Llama's names plus self_attn.q_norm and k_norm).
"""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.models import llama
from kiln.models.catalog import family
from kiln.models.config import ModelConfig
from kiln.models.costs import make_norm
from kiln.models.family import Family
from kiln.models.parts import Attention, PreNormBlock

DEFAULTS = dict(vocab_size=151936, max_seq_len=40960, bias=False, norm_eps=1e-6, rope_theta=1000000.0)
SWITCH = dict(n_kv_head=0, head_dim=0, d_ff=0, bias=False, tie_embeddings=True, norm_eps=1e-6,
              rope_theta=1000000.0)


def config(n_layer, n_head, n_kv_head, d_model, d_ff, head_dim=128, tie_embeddings=True, **kw) -> ModelConfig:
    return ModelConfig(arch="qwen3", n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
                       d_model=d_model, d_ff=d_ff, tie_embeddings=tie_embeddings, **(DEFAULTS | kw))


PRESETS = {  # the shapes of the Qwen3 releases (their config.json files)
    "qwen3-0.6b": config(28, 16, 8, 1024, 3072),
    "qwen3-1.7b": config(28, 16, 8, 2048, 6144),
    "qwen3-4b": config(36, 32, 8, 2560, 9728),
    "qwen3-8b": config(36, 32, 8, 4096, 12288, tie_embeddings=False),
}


class Qwen3Block(PreNormBlock):
    def __init__(self, cfg: ModelConfig):
        fam = family(cfg.arch)  # its parts, with the run's recipe keys (model.mlp, model.qk_norm)
        super().__init__(make_norm("rmsnorm", cfg.d_model, cfg.norm_eps),
                         Attention(cfg, rotary=True, qk_norm=fam.qk_norm_of(cfg)),
                         make_norm("rmsnorm", cfg.d_model, cfg.norm_eps), fam.mlp_of(cfg).build(cfg, False),
                         cfg.dropout)


def check_window(hf: dict, source: str) -> None:
    if hf.get("use_sliding_window"):
        raise KilnError(f"{source}: use_sliding_window=true; kiln's attention is full causal attention",
                        key="use_sliding_window", value=True, fix="start from a checkpoint without a sliding window")


def from_hf(hf: dict, source: str) -> ModelConfig:
    check_window(hf, source)
    return ModelConfig(preset="qwen3-0.6b", d_ff=hf["intermediate_size"], **llama.shape_from_hf(hf, source, "qwen3"))


def to_hf(cfg: ModelConfig, vocab: int, eos: int | None) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **llama.shape_to_hf(cfg, vocab, eos),
            "intermediate_size": cfg.d_ff, "use_sliding_window": False}


def hf_names(cfg: ModelConfig):
    blocks = []
    for i in range(cfg.n_layer):
        blocks += llama.attention_names(cfg, i, qk_norm=True)
        blocks += llama.swiglu_names(f"blocks.{i}.mlp", f"model.layers.{i}.mlp", cfg.d_ff)
    return llama.ends(cfg, blocks)


FAMILY = Family(
    name="qwen3", summary="Llama's block with QK-norm, GQA, head width of its own, RoPE base 1e6",
    block=Qwen3Block, norm="rmsnorm", mlp="swiglu", positions="rope", qk_norm=True,
    defaults=SWITCH, d_ff=lambda d: 3 * d, presets=PRESETS,
    hf_model_type="qwen3", hf_config_in=from_hf, hf_config_out=to_hf, hf_names=hf_names)
