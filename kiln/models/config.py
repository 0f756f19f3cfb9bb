"""Model configuration, presets, and the parameter count computed from the config alone."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from kiln.models.values import check_values
from kiln.util import closest

ARCHS = ("gpt2", "llama")


@dataclass
class ModelConfig:
    """The `model` section. Shape fields left at 0 take the preset's value."""

    preset: str = "nano"  # one of PRESETS: nano, tiny, gpt2-124m .. gpt2-1.5b, llama-125m .. llama-7b
    arch: str = ""  # "gpt2" (LayerNorm, GELU, learned positions) or "llama" (RMSNorm, SwiGLU, RoPE, GQA)
    n_layer: int = 0  # transformer blocks
    n_head: int = 0  # attention (query) heads
    n_kv_head: int = 0  # key/value heads for grouped-query attention (llama); gpt2 uses n_head
    d_model: int = 0  # hidden width
    d_ff: int = 0  # MLP width (gpt2: 4*d_model; llama: SwiGLU inner width)
    vocab_size: int = 0  # 0 = the tokenizer's; padded up to a multiple of 64 in the model
    max_seq_len: int = 0  # longest sequence the position table / RoPE cache supports
    bias: bool | None = None  # biases in linears and LayerNorms (gpt2 only)
    tie_embeddings: bool | None = None  # share the token embedding with the output head
    dropout: float = 0.0  # dropout on attention probabilities and residual branches
    norm_eps: float = 0.0  # epsilon of LayerNorm / RMSNorm
    rope_theta: float = 0.0  # RoPE base frequency (llama)
    rope_scaling: tuple = ()  # Llama 3's RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_len)
    init: str = ""  # hf:DIR: start from a Hugging Face checkpoint (GPT-2, Llama); its config.json sets the shape

    def resolve(self) -> "ModelConfig":
        """Fill every 0/None field from the preset; check the shape is buildable."""
        if self.preset not in PRESETS:
            raise ValueError(
                f"model.preset={self.preset!r} is not a preset; did you mean {closest(self.preset, PRESETS)!r}? "
                f"Presets: {', '.join(PRESETS)}"
            )
        base = PRESETS[self.preset]
        values = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(base, f.name)
            unset = mine is None or (not isinstance(mine, bool) and mine in (0, ""))
            values[f.name] = theirs if unset else mine
        cfg = replace(self, **values)
        if cfg.arch == "gpt2" and cfg.n_kv_head not in (0, cfg.n_head):
            raise ValueError("model.n_kv_head applies to arch='llama' only; gpt2 attention uses n_head key/value heads")
        if cfg.n_kv_head == 0:
            cfg.n_kv_head = cfg.n_head
        if cfg.d_ff == 0:
            cfg.d_ff = 4 * cfg.d_model if cfg.arch == "gpt2" else _llama_ffn(cfg.d_model)
        cfg.check()
        return cfg

    def validate(self) -> None:
        self.resolve()

    def check(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} is unknown; use one of {ARCHS}")
        for name in ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} must be divisible by model.n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head={self.n_head} must be a multiple of model.n_kv_head={self.n_kv_head}")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension; d_model/n_head = {self.head_dim}")
        if self.rope_scaling and (len(self.rope_scaling) != 4 or self.arch != "llama"):
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r}: Llama 3's scaling takes (factor, "
                             f"low_freq_factor, high_freq_factor, original_max_len), arch='llama' only")
        if self.init and not self.init.startswith("hf:"):
            raise ValueError(f"model.init={self.init!r}; write hf:DIR, a local directory saved by save_pretrained")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        check_values(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def padded_vocab(self) -> int:
        """Vocabulary rounded up to a multiple of 64: tensor-core friendly matmul shapes."""
        if self.vocab_size < 1:
            raise ValueError("model.vocab_size is unknown: set it, or let `kiln train` take it from the tokenizer")
        return 64 * math.ceil(self.vocab_size / 64)


def _llama_ffn(d_model: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4d, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * d_model / 3) / 256)


def _gpt2(n_layer, n_head, d_model, **kw) -> ModelConfig:
    defaults = dict(vocab_size=50257, max_seq_len=1024, bias=True, tie_embeddings=True, norm_eps=1e-5)
    return ModelConfig(arch="gpt2", n_layer=n_layer, n_head=n_head, d_model=d_model, **(defaults | kw))


def _llama(n_layer, n_head, n_kv_head, d_model, d_ff, **kw) -> ModelConfig:
    defaults = dict(vocab_size=32000, max_seq_len=2048, bias=False, tie_embeddings=False, norm_eps=1e-6,
                    rope_theta=10000.0)
    return ModelConfig(arch="llama", n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, d_model=d_model,
                       d_ff=d_ff, **(defaults | kw))


PRESETS: dict[str, ModelConfig] = {
    # 1.7M parameters with the byte vocabulary: the default job. Chosen by benchmarks/default_job_sweep.py for the
    # lowest validation loss in 125 s of steps on an AVX2-only 2-core CPU: 2.065 nats/byte in 545 steps, against
    # 2.248 for 3 layers (417 steps) and 2.30 for 4 (310); at this budget more steps beat more layers.
    "nano": _gpt2(2, 4, 256, vocab_size=0, max_seq_len=256, bias=False),
    # 10.8M parameters with the byte vocabulary: nanoGPT's char-level shape (the default job before the sweep).
    "tiny": _gpt2(6, 6, 384, vocab_size=0, max_seq_len=256, bias=False),
    "gpt2-124m": _gpt2(12, 12, 768),
    "gpt2-350m": _gpt2(24, 16, 1024),
    "gpt2-774m": _gpt2(36, 20, 1280),
    "gpt2-1.5b": _gpt2(48, 25, 1600),
    "llama-125m": _llama(12, 12, 4, 768, 2048),
    "llama-350m": _llama(24, 16, 8, 1024, 2816),
    # Shaped like Llama-3.2-1B (tied embeddings, 128k vocabulary) and Llama-2-7B.
    "llama-1b": _llama(16, 32, 8, 2048, 8192, vocab_size=128256, tie_embeddings=True, rope_theta=500000.0),
    "llama-7b": _llama(32, 32, 32, 4096, 11008, max_seq_len=4096),
}
for _name, _cfg in PRESETS.items():
    _cfg.preset = _name


def param_count(cfg: ModelConfig) -> int:
    """Number of trainable parameters of `Transformer(cfg)`, from the config alone."""
    cfg = cfg.resolve() if not cfg.arch else cfg
    d, ff, hd, V = cfg.d_model, cfg.d_ff, cfg.head_dim, cfg.padded_vocab
    gpt2 = cfg.arch == "gpt2"
    bias = bool(cfg.bias) and gpt2
    norm = d + (d if bias else 0)  # LayerNorm weight (+ bias); RMSNorm weight only
    qkv_out = (cfg.n_head + 2 * cfg.n_kv_head) * hd
    attn = d * qkv_out + cfg.n_head * hd * d + ((qkv_out + d) if bias else 0)
    fc_out = ff if gpt2 else 2 * ff  # SwiGLU's gate and up share one matmul
    mlp = d * fc_out + ff * d + ((fc_out + d) if bias else 0)
    block = 2 * norm + attn + mlp
    embeddings = V * d + (cfg.max_seq_len * d if gpt2 else 0)
    head = 0 if cfg.tie_embeddings else V * d
    return embeddings + cfg.n_layer * block + norm + head
