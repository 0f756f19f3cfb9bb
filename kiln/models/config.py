"""The `model` section: one config for every family; the presets and family defaults live in the family files.

A preset gives every shape field; `model.arch` picks the family (kiln/models/<family>.py). Switching the arch of
a preset keeps the preset's size (layers, heads, width, vocabulary, context) and takes everything else from the
new family's defaults, so `--model.preset=nano --model.arch=llama` is a valid Llama of nano's size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from kiln.errors import KilnError
from kiln.models.catalog import PRESETS, family
from kiln.models.values import SENTINEL_MEANING, check_values
from kiln.util import closest

# What a preset keeps when `model.arch` switches it to another family; every other field is the family's.
SIZE_FIELDS = ("n_layer", "n_head", "d_model", "vocab_size", "max_seq_len", "dropout", "init")
# How a model trains rather than what it is: a Hugging Face checkpoint (model.init) sets the rest, the user these.
# The soft cap is one of them: it holds no weights, and a Hub model fine-tuned under a cap is a model of its own
# (Gemma 2 caps at 30). The other recipe parts are refused with model.init (with_training_fields, check).
TRAINING_FIELDS = ("dropout", "moe_aux_coef", "moe_z_coef", "logit_softcap")


@dataclass
class ModelConfig:
    """The `model` section. Shape fields left at 0 (None) take the preset's value."""

    preset: str = "nano"  # one of PRESETS: nano, tiny, gpt2-124m .. gpt2-1.5b, llama-*, qwen3-*, qwen3-moe-*
    arch: str = ""  # model family: gpt2 | llama | qwen3 | qwen3_moe ("" = the preset's; docs/models.md)
    n_layer: int = 0  # transformer blocks
    n_head: int = 0  # attention (query) heads
    n_kv_head: int = 0  # key/value heads for grouped-query attention (llama, qwen3); gpt2 uses n_head
    head_dim: int = 0  # width of one attention head (0 = d_model / n_head; Qwen3 sets it on its own)
    d_model: int = 0  # hidden width
    d_ff: int = 0  # MLP width (gpt2: 4*d_model; llama, qwen3: SwiGLU inner width)
    vocab_size: int = 0  # 0 = the tokenizer's; padded up to a multiple of 64 in the model
    max_seq_len: int = 0  # longest sequence the position table / RoPE cache supports
    bias: bool | None = None  # biases in linears and LayerNorms (gpt2 only)
    tie_embeddings: bool | None = None  # share the token embedding with the output head
    dropout: float = 0.0  # dropout on attention probabilities and residual branches
    norm_eps: float = 0.0  # epsilon of LayerNorm / RMSNorm
    rope_theta: float = 0.0  # RoPE base frequency (llama, qwen3)
    rope_scaling: tuple = ()  # Llama 3's RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_len)
    n_experts: int = 0  # mixture of experts (qwen3_moe): expert MLPs per block
    n_experts_active: int = 0  # experts each token is routed to (top-k)
    moe_d_ff: int = 0  # width of one expert's SwiGLU (HF moe_intermediate_size)
    moe_norm_topk: bool | None = None  # renormalise the top-k routing weights to sum to 1 (Qwen3-MoE: true)
    moe_aux_coef: float | None = None  # load-balancing loss weight (HF router_aux_loss_coef; Qwen3-MoE 0.001)
    moe_z_coef: float | None = None  # router z-loss weight (ST-MoE; 0 = off)
    # The recipe's parts (docs/models.md, "Recipe parts"): each overrides the family's own for this run.
    mlp: str = ""  # "" = the family's | gelu (tanh GELU) | gelu_exact (erf GELU, nanoGPT's) | relu2 (squared ReLU, modded-nanogpt) | swiglu
    qk_norm: bool | None = None  # RMSNorm over each head of q and k before attention (none = the family's)
    zero_init_proj: bool = False  # attention's and the MLP's output projections start at zero (not with model.init)
    logit_softcap: float = 0.0  # logits become cap·tanh(logits/cap) before the loss and sampling (0 = off)
    init: str = ""  # hf:DIR: start from a Hugging Face checkpoint (its config.json sets the family and shape)

    def resolve(self) -> "ModelConfig":
        """Fill every 0/None field from the preset (and, when `arch` switches family, from the family's
        defaults); check the shape is buildable."""
        if self.preset not in PRESETS:
            raise KilnError(
                f"model.preset={self.preset!r} is not a preset; did you mean {closest(self.preset, PRESETS)!r}? "
                f"Presets: {', '.join(PRESETS)}",
                key="model.preset", value=self.preset, fix=f"Presets: {', '.join(PRESETS)}")
        for f in fields(self):  # a size given below 0 is named before anything is derived from it (head_dim)
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                also = f", or {SENTINEL_MEANING[f.name]}" if f.name in SENTINEL_MEANING else ""
                raise KilnError(f"model.{f.name} must be ≥ 1 (0: the preset's{also}), got {value}",
                                key=f"model.{f.name}", value=value)
        base = PRESETS[self.preset]
        if self.arch and self.arch != base.arch:
            fam = family(self.arch)  # raises for an unknown arch, naming the known ones
            kept = {name: getattr(base, name) for name in SIZE_FIELDS}
            base = replace(ModelConfig(**fam.defaults), arch=self.arch, **kept)
        values = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(base, f.name)
            values[f.name] = theirs if _unset(mine, f) else mine
        cfg = replace(self, **values)
        family(cfg.arch).complete(cfg)
        cfg.check()
        return cfg

    def validate(self) -> None:
        self.resolve()

    def check(self) -> None:
        fam = family(self.arch)
        for name in ("n_layer", "n_head", "n_kv_head", "head_dim", "d_model", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise KilnError(f"model.{name} must be ≥ 1, got {getattr(self, name)}",
                                key=f"model.{name}", value=getattr(self, name), fix="give a whole number ≥ 1")
        if self.n_head % self.n_kv_head:
            raise KilnError(f"model.n_head={self.n_head} must be a multiple of model.n_kv_head={self.n_kv_head}",
                            key="model.n_head", value=self.n_head,
                            fix="pick model.n_head and model.n_kv_head so that n_kv_head divides n_head")
        if self.init and not self.init.startswith("hf:"):
            raise KilnError(f"model.init={self.init!r}; write hf:DIR, a local directory saved by save_pretrained",
                            key="model.init", value=self.init,
                            fix="write hf:DIR, a local directory saved by save_pretrained")
        if self.init and self.zero_init_proj:  # the weights come from the checkpoint: nothing would start at 0
            fix = "drop --model.zero_init_proj (set it false) with model.init"
            raise KilnError(f"model.zero_init_proj=true starts the output projections at 0, and model.init={self.init} "
                            f"loads them from the checkpoint; {fix}",
                            key="model.zero_init_proj", value=True, fix=fix)
        if not 0.0 <= self.dropout < 1.0:
            raise KilnError(f"model.dropout must be in [0, 1), got {self.dropout}",
                            key="model.dropout", value=self.dropout, fix="give a value in [0, 1) (0 = off)")
        check_values(self)  # values no family can train with, first: its message names the fix
        fam.check(self)

    @property
    def padded_vocab(self) -> int:
        """Vocabulary rounded up to a multiple of 64: tensor-core friendly matmul shapes."""
        if self.vocab_size < 1:
            raise KilnError("model.vocab_size is unknown: set it, or let `kiln train` take it from the tokenizer",
                            key="model.vocab_size", fix="set it, or let `kiln train` take it from the tokenizer")
        return 64 * math.ceil(self.vocab_size / 64)


def _unset(value, f) -> bool:
    """Whether a field is left to the preset: None for the fields that may be None (so 0.0 and False are set),
    else 0, "" or ()."""
    if value is None or "None" in str(f.type):
        return value is None
    return value in (0, "", ())


def param_count(cfg: ModelConfig) -> int:
    """Number of trainable parameters of `Transformer(cfg)`, from the config alone."""
    cfg = cfg.resolve() if not cfg.arch else cfg
    return sum(math.prod(shape) for _, shape in family(cfg.arch).parameter_shapes(cfg))


def with_training_fields(shape: ModelConfig, mine: ModelConfig) -> ModelConfig:
    """A checkpoint's shape with the training fields the user set (dropout, the MoE's loss coefficients, the logit
    soft cap). A model.mlp or model.qk_norm other than the checkpoint's is refused: its weights were trained
    through its own MLP and attention, and another would compute another function of them (QK-norm's gains would
    start untrained; SwiGLU's fc would not even fit GELU's)."""
    fam = family(shape.arch)
    theirs = fam.mlp_of(shape).name
    if mine.mlp and fam.mlp_of(replace(shape, mlp=mine.mlp)).name != theirs:
        fix = f"drop --model.mlp (or give {theirs!r}) with model.init, or train from scratch without model.init"
        raise KilnError(f"model.mlp={mine.mlp!r} with model.init={mine.init}: the checkpoint's MLP is {theirs!r} and "
                        f"its weights were trained through it; {fix}", key="model.mlp", value=mine.mlp, fix=fix)
    if mine.qk_norm is not None and bool(mine.qk_norm) != fam.qk_norm_of(shape):
        has = fam.qk_norm_of(shape)
        fix = "drop --model.qk_norm with model.init, or train from scratch without model.init"
        raise KilnError(f"model.qk_norm={str(bool(mine.qk_norm)).lower()} with model.init={mine.init}: the "
                        f"checkpoint's {shape.arch} {'has' if has else 'has no'} QK-norm and its weights were trained "
                        f"{'with' if has else 'without'} it; {fix}", key="model.qk_norm", value=mine.qk_norm, fix=fix)
    return replace(shape, **{name: getattr(mine, name) for name in TRAINING_FIELDS
                             if name == "dropout" or getattr(mine, name) is not None})
