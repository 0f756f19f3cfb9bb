"""GPT-2: LayerNorm, GELU MLP, learned positions, tied embeddings, optional biases.

Its config fields and presets, its block, and its description (kiln.models.family) with the Hugging Face
mapping of GPT2LMHeadModel (Conv1D stores matrices as (in, out); kiln's Linear as (out, in)).
"""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.models.catalog import family
from kiln.models.config import ModelConfig
from kiln.models.costs import make_norm
from kiln.models.family import Family, HFTensor
from kiln.models.parts import Attention, PreNormBlock

DEFAULTS = dict(vocab_size=50257, max_seq_len=1024, bias=True, tie_embeddings=True, norm_eps=1e-5)
# What `model.arch=gpt2` gives another family's preset: its size, these fields.
SWITCH = dict(n_kv_head=0, head_dim=0, d_ff=0, bias=True, tie_embeddings=True, norm_eps=1e-5)


def config(n_layer, n_head, d_model, **kw) -> ModelConfig:
    return ModelConfig(arch="gpt2", n_layer=n_layer, n_head=n_head, d_model=d_model, **(DEFAULTS | kw))


PRESETS = {
    # 1.7M parameters with the byte vocabulary: the default job. Chosen by benchmarks/default_job_sweep.py for the
    # lowest validation loss in 125 s of steps on an AVX2-only 2-core CPU: 2.065 nats/byte in 545 steps, against
    # 2.248 for 3 layers (417 steps) and 2.30 for 4 (310); at this budget more steps beat more layers.
    "nano": config(2, 4, 256, vocab_size=0, max_seq_len=256, bias=False),
    # 10.8M parameters with the byte vocabulary: nanoGPT's char-level shape (the default job before the sweep).
    "tiny": config(6, 6, 384, vocab_size=0, max_seq_len=256, bias=False),
    "gpt2-124m": config(12, 12, 768),
    "gpt2-350m": config(24, 16, 1024),
    "gpt2-774m": config(36, 20, 1280),
    "gpt2-1.5b": config(48, 25, 1600),
}


class GPT2Block(PreNormBlock):
    def __init__(self, cfg: ModelConfig):
        fam = family(cfg.arch)  # its parts, with the run's recipe keys (model.mlp, model.qk_norm)
        bias = bool(cfg.bias)
        super().__init__(make_norm("layernorm", cfg.d_model, cfg.norm_eps, bias),
                         Attention(cfg, False, bias, qk_norm=fam.qk_norm_of(cfg)),
                         make_norm("layernorm", cfg.d_model, cfg.norm_eps, bias),
                         fam.mlp_of(cfg).build(cfg, bias), cfg.dropout)


def _check(cfg: ModelConfig) -> None:
    if cfg.head_dim * cfg.n_head != cfg.d_model:
        raise KilnError(f"model.d_model={cfg.d_model} must be n_head × head_dim ({cfg.n_head} × {cfg.head_dim}) "
                        f"for gpt2; leave model.head_dim at 0", key="model.head_dim", value=cfg.head_dim,
                        fix="leave model.head_dim at 0")


def from_hf(hf: dict, source: str) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    mlps = {"gelu_new": "", "gelu_pytorch_tanh": "", "gelu": "gelu_exact", "relu2": "relu2"}
    if act not in mlps:
        raise KilnError(f"{source}: activation_function={act!r}; kiln's GPT-2 uses the tanh GELU (gelu_new), the "
                        f"erf GELU (gelu, model.mlp=gelu_exact) or the squared ReLU (relu2, model.mlp=relu2)",
                        key="activation_function", value=act,
                        fix="start from a checkpoint with gelu_new, gelu_pytorch_tanh, gelu or relu2")
    d = hf["n_embd"]
    return ModelConfig(preset="gpt2-124m", arch="gpt2", n_layer=hf["n_layer"], n_head=hf["n_head"],
                       n_kv_head=hf["n_head"], d_model=d, d_ff=hf.get("n_inner") or 4 * d,
                       vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"], bias=True,
                       tie_embeddings=hf.get("tie_word_embeddings", True),
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp=mlps[act])


def to_hf(cfg: ModelConfig, vocab: int, eos: int | None) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_embd": cfg.d_model, "n_inner": cfg.d_ff, "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len, "vocab_size": vocab, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": FAMILY.mlp_of(cfg).hf_activation, "tie_word_embeddings": bool(cfg.tie_embeddings),
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32",
            "bos_token_id": eos, "eos_token_id": eos}


def hf_names(cfg: ModelConfig) -> list[HFTensor]:
    """A missing bias is written as zeros: kiln's bias-free GPT-2 is GPT-2 with every bias 0."""
    out = [HFTensor("embed.weight", ("transformer.wte.weight",), vocab=True),
           HFTensor("pos_embed.weight", ("transformer.wpe.weight",))]
    for i in range(cfg.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for hf, name, conv in (("ln_1", "norm1", False), ("attn.c_attn", "attn.qkv", True),
                               ("attn.c_proj", "attn.proj", True), ("ln_2", "norm2", False),
                               ("mlp.c_fc", "mlp.fc", True), ("mlp.c_proj", "mlp.proj", True)):
            out.append(HFTensor(f"{b}{name}.weight", (f"{h}{hf}.weight",), conv1d=conv))
            out.append(HFTensor(f"{b}{name}.bias", (f"{h}{hf}.bias",), zeros=True))
    out += [HFTensor("norm.weight", ("transformer.ln_f.weight",)),
            HFTensor("norm.bias", ("transformer.ln_f.bias",), zeros=True)]
    if not cfg.tie_embeddings:
        out.append(HFTensor("head.weight", ("lm_head.weight",), vocab=True))
    return out


FAMILY = Family(
    name="gpt2", summary="LayerNorm, GELU MLP, learned positions, tied embeddings, optional biases",
    block=GPT2Block, norm="layernorm", mlp="gelu", positions="learned", biases=True, gqa=False,
    defaults=SWITCH, d_ff=lambda d: 4 * d, presets=PRESETS,
    hf_model_type="gpt2", hf_config_in=from_hf, hf_config_out=to_hf, hf_names=hf_names, extra_check=_check,
    hf_activation=True)
