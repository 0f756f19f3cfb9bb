"""Qwen3-MoE: Qwen3's attention (QK-norm, GQA) with a mixture of SwiGLU experts in place of the MLP in every
block: dropless top-k routing as Hugging Face computes it (kiln.models.moe), a load-balancing loss
(model.moe_aux_coef) and an optional router z-loss (model.moe_z_coef).

Its config fields and presets, its block, and its description (kiln.models.family) with the Hugging Face
mapping of Qwen3MoeForCausalLM in the Hub's per-expert layout (mlp.gate, mlp.experts.{e}.{gate,up,down}_proj),
which every transformers version that knows the family loads; kiln stacks each block's experts into two 3-D
weights (mlp.experts.fc.weight (E, 2F, C), mlp.experts.proj.weight (E, C, F): kiln.models.moe).

FLOPs count the active parameters (top-k experts per token); memory counts all of them. Expert parallelism
gives each of `ep` ranks n_experts / ep whole experts: Linear.tp == "expert".
"""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.models import llama, qwen3
from kiln.models.catalog import family
from kiln.models.config import ModelConfig
from kiln.models.costs import make_norm
from kiln.models.family import Family, HFTensor
from kiln.models.moe import MoE
from kiln.models.parts import Attention, PreNormBlock

DEFAULTS = dict(vocab_size=151936, max_seq_len=40960, bias=False, tie_embeddings=False, norm_eps=1e-6,
                rope_theta=1000000.0, moe_norm_topk=True, moe_aux_coef=0.001, moe_z_coef=0.0)
SWITCH = dict(n_kv_head=0, head_dim=0, d_ff=0, bias=False, tie_embeddings=False, norm_eps=1e-6,
              rope_theta=1000000.0, n_experts=8, n_experts_active=2, moe_d_ff=0, moe_norm_topk=True,
              moe_aux_coef=0.001, moe_z_coef=0.0)


def config(n_layer, n_head, n_kv_head, d_model, n_experts, n_experts_active, moe_d_ff, head_dim=128,
           **kw) -> ModelConfig:
    return ModelConfig(arch="qwen3_moe", n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
                       d_model=d_model, d_ff=3 * d_model, n_experts=n_experts, n_experts_active=n_experts_active,
                       moe_d_ff=moe_d_ff, **(DEFAULTS | kw))


PRESETS = {
    # 8 experts of width 128, 2 per token, byte vocabulary: a mixture of experts a CPU trains in minutes
    "qwen3-moe-nano": config(2, 4, 2, 256, 8, 2, 128, head_dim=64, vocab_size=0, max_seq_len=256),
    # the shapes of Qwen3-30B-A3B and Qwen3-235B-A22B (their config.json files)
    "qwen3-moe-30b-a3b": config(48, 32, 4, 2048, 128, 8, 768),
    "qwen3-moe-235b-a22b": config(94, 64, 4, 4096, 128, 8, 1536),
}


class Qwen3MoeBlock(PreNormBlock):
    def __init__(self, cfg: ModelConfig):
        fam = family(cfg.arch)  # its parts, with the run's recipe keys (model.mlp, model.qk_norm)
        moe = MoE(cfg.d_model, cfg.n_experts, cfg.n_experts_active, cfg.moe_d_ff, norm_topk=bool(cfg.moe_norm_topk),
                  z_loss=bool(cfg.moe_z_coef))
        super().__init__(make_norm("rmsnorm", cfg.d_model, cfg.norm_eps),
                         Attention(cfg, rotary=True, qk_norm=fam.qk_norm_of(cfg)),
                         make_norm("rmsnorm", cfg.d_model, cfg.norm_eps), moe, cfg.dropout)


def from_hf(hf: dict, source: str) -> ModelConfig:
    qwen3.check_window(hf, source)
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise KilnError(f"{source}: mlp_only_layers / decoder_sparse_step make some blocks dense; every block of "
                        f"kiln's qwen3_moe has experts", key="mlp_only_layers" if hf.get("mlp_only_layers")
                        else "decoder_sparse_step", fix="start from a checkpoint whose every block has experts")
    return ModelConfig(preset="qwen3-moe-30b-a3b", d_ff=hf.get("intermediate_size") or 3 * hf["hidden_size"],
                       n_experts=hf.get("num_experts") or hf["num_local_experts"],
                       n_experts_active=hf["num_experts_per_tok"], moe_d_ff=hf["moe_intermediate_size"],
                       moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
                       moe_aux_coef=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_coef=0.0,
                       **llama.shape_from_hf(hf, source, "qwen3_moe"))


def to_hf(cfg: ModelConfig, vocab: int, eos: int | None) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **llama.shape_to_hf(cfg, vocab, eos),
            "intermediate_size": cfg.d_ff, "use_sliding_window": False, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "num_experts": cfg.n_experts, "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.n_experts_active, "moe_intermediate_size": cfg.moe_d_ff,
            "norm_topk_prob": bool(cfg.moe_norm_topk), "router_aux_loss_coef": cfg.moe_aux_coef}


def hf_names(cfg: ModelConfig) -> list[HFTensor]:
    blocks = []
    for i in range(cfg.n_layer):
        b, h = f"blocks.{i}.mlp", f"model.layers.{i}.mlp"
        blocks += llama.attention_names(cfg, i, qk_norm=True) + [HFTensor(f"{b}.router.weight", (f"{h}.gate.weight",))]
        F, E = cfg.moe_d_ff, cfg.n_experts  # kiln's stacked experts: each expert's [gate; up], then its down
        blocks += [HFTensor(f"{b}.experts.fc.weight", tuple(f"{h}.experts.{e}.{w}_proj.weight" for e in range(E)
                                                            for w in ("gate", "up")), rows=(F,) * (2 * E)),
                   HFTensor(f"{b}.experts.proj.weight", tuple(f"{h}.experts.{e}.down_proj.weight" for e in range(E)),
                            rows=(cfg.d_model,) * E)]
    return llama.ends(cfg, blocks)


FAMILY = Family(
    name="qwen3_moe", summary="Qwen3 attention with a dropless top-k mixture of SwiGLU experts in every block",
    block=Qwen3MoeBlock, norm="rmsnorm", mlp="moe", positions="rope", qk_norm=True,
    defaults=SWITCH, d_ff=lambda d: 3 * d, presets=PRESETS,
    hf_model_type="qwen3_moe", hf_config_in=from_hf, hf_config_out=to_hf, hf_names=hf_names)
