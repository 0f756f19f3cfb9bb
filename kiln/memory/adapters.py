"""LoRA in the estimator: what a frozen base with low-rank adapters holds in one training step (issue #38).

    Adapters.of(cfg, lora)        the adapter pairs of a `[lora]` section on a model: which block linears, one pair
                                  per Hugging Face module a fused linear is made of (kiln.models.lora.lora_tensors)
    adapter_shapes(adapters, cfg) (name, shape) of every lora_A / lora_B tensor, in model order
    is_adapter(name)              whether a parameter is one of them (the trained ones)
    lora_numerics(num, base)      the bytes per element the forward sees with a frozen base of `base` bytes
    lora_block(kinds, ...)        one block's saved tensors with the base frozen and the adapters' own added
    frozen_head(kinds)            ... of the final norm and the loss (the embedding saves nothing)
    adapter_flops(adapters, N)    the adapters' forward FLOPs of one block (the planner's step time)

What changes against a full fine-tune (docs/memory.md, "LoRA"):
- model state: the base has no gradient, no master copy and no optimizer state; it is stored in the mode's frozen
  dtype (kiln.precision's Mode.frozen: bf16 under bf16 autocast, so autocast makes no copy of it, and under
  bf16-master; the parameters' dtype otherwise); the adapters keep the mode's trainable layout (fp32 parameters,
  gradients and Adam state; bf16 with fp32 masters under bf16-master).
- saved tensors: torch saves a matmul's input only for its weight's gradient (the mm derivative's
  should_compute_output), so a frozen linear without an adapter keeps no input; the adapter's A keeps it instead
  (the same tensor), B keeps A's r-wide output; with lora.dropout the dropped input and its mask. RMSNorm's
  normalised x is kept only for the gain's gradient: gone. The embedding records nothing (its weight is frozen,
  its input integers) and neither does block 0 before its first adapter (nothing there requires a gradient); the
  head keeps no input.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.models.config import ModelConfig
from kiln.models.lora import lora_tensors

# The saved kind that holds each block linear's input (kiln.models.costs and the estimator's names): kept only when
# the linear's weight, or an adapter beside it, needs a gradient. An MoE's router reads the MLP input.
INPUT_KIND = {"attn.qkv": "attn.qkv_input", "attn.proj": "attn.proj_input", "mlp.fc": "mlp.fc_input",
              "mlp.proj": "mlp.proj_input", "mlp.router": "mlp.fc_input", "mlp.experts.fc": "moe.expert_inputs",
              "mlp.experts.proj": "moe.experts.proj_input"}
# Block 0 saves nothing that does not lead to an adapter: its input (the embedding's output) requires no gradient,
# so a tensor there is kept only downstream of the first adapted linear. Each saved kind's place in the block, by
# the first prefix that names it: the linear whose output it follows (norm1's input never requires a gradient in
# block 0; the inputs of INPUT_KIND are kept by the adapter's A whatever the input).
_STAGES = {"attn.qkv": 0, "attn.proj": 1, "mlp.router": 2, "mlp.fc": 2, "mlp.experts.fc": 2, "mlp.proj": 3,
           "mlp.experts.proj": 3}
_PLACE = (("norm1.", -1), ("resid.", 1), ("norm2.", 1), ("attn.", 0), ("moe.", 2), ("mlp.", 2))

@dataclass(frozen=True)
class Pair:
    """One adapter pair on a block linear: A (rank, n_in), B (n_out, rank); `copies` of them (an MoE: per expert)."""

    linear: str  # the block's linear, "attn.qkv"
    part: int  # which Hugging Face module of a fused linear (0 for an unfused one)
    n_in: int
    n_out: int
    copies: int = 1
    active: int = 1  # of the copies one token passes through (an MoE: the top-k)


@dataclass(frozen=True)
class Adapters:
    """The adapters of a `[lora]` section on one model: rank, dropout and the pairs of one block."""

    rank: int
    dropout: float
    pairs: tuple[Pair, ...]

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.linear for p in self.pairs))

    def numel(self) -> int:
        """Adapter elements of one block."""
        return sum(p.copies * self.rank * (p.n_in + p.n_out) for p in self.pairs)

    @staticmethod
    def of(cfg: ModelConfig, lora) -> "Adapters | None":
        """The adapters `lora` (a LoraConfig) puts on `cfg`'s blocks, None with rank 0: block 0's pairs from
        kiln.models.lora.lora_tensors, the builder's own list (its refusals: an unknown target, MoE experts)."""
        if not lora or not lora.rank:
            return None
        pairs, a_in = [], {}
        for t in lora_tensors(cfg, lora):
            if not t.base.startswith("blocks.0."):
                break  # every block has the same pairs
            linear = t.base.removeprefix("blocks.0.").removesuffix(".weight")
            if t.matrix == "lora_A":
                a_in[t.kiln] = t.shape[1]
            else:
                n_in = a_in[t.kiln.replace(".lora_B.", ".lora_A.")]
                pairs.append(Pair(linear, sum(p.linear == linear for p in pairs), n_in, t.shape[0]))
        return Adapters(lora.rank, float(lora.dropout), tuple(pairs))


def adapter_shapes(adapters: Adapters | None, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every adapter tensor, block by block: blocks.{i}.{linear}.lora_A.{piece} (rank, n_in) and
    lora_B.{piece} (n_out, rank), piece numbered here (kiln.models.lora names it after its Hub module)."""
    if adapters is None:
        return []
    r, out = adapters.rank, []
    for i in range(cfg.n_layer):
        for p in adapters.pairs:
            out += [(f"blocks.{i}.{p.linear}.lora_A.{p.part}", (r, p.n_in)),
                    (f"blocks.{i}.{p.linear}.lora_B.{p.part}", (p.n_out, r))]
    return out


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_numerics(num, base: int):
    """The numerics the forward sees with the base frozen and stored in `base` bytes a parameter (kiln.precision's
    Mode.frozen_bytes: bf16 under bf16 autocast; the parameters' dtype otherwise, fp32 under fp16 autocast, which
    then copies it every call). Under autocast a bf16 base is never copied, and its embedding returns bf16, so the
    residual stream is bf16 too (as under FSDP2's bf16 gathering); buffers (RoPE's tables) keep their dtype."""
    if num.autocast and base == 2:
        return replace(num, residual=2, casts=False, frozen=True, base=2)
    return replace(num, frozen=True, base=base)


def lora_block(kinds: dict[str, int], adapters: Adapters, cfg: ModelConfig, N: int, num, target,
               first: bool) -> dict[str, int]:
    """One block's saved tensors with the base frozen (kinds: what the block saves under lora_numerics, nothing
    recomputed), the adapters' own added. first: block 0, which saves nothing before its first adapter."""
    targeted = set(adapters.linears)
    out = {k: v for k, v in kinds.items() if not k.endswith(".normed")}  # RMSNorm's, for the frozen gain only
    # an input is kept by the adapter's A, unless A sees a dropped copy (lora.dropout), which it keeps instead
    kept = {INPUT_KIND[n] for n in targeted} if adapters.dropout == 0 else set()
    out = {k: v for k, v in out.items() if k not in set(INPUT_KIND.values()) - kept}
    start = min(_STAGES[n] for n in targeted) if first else -1
    if first:
        inputs = set(INPUT_KIND.values())
        out = {k: v for k, v in out.items() if k in inputs or k == "weight_casts" or _place(k) >= start}
    c, r = num.compute, adapters.rank
    for p in adapters.pairs:
        rows = N * p.active  # an expert's adapters see its routed pairs: N·K rows over all experts
        key = f"lora.{p.linear}.{p.part}"
        out[f"{key}.a_out"] = rows * r * c  # A's output, B's input
        if adapters.dropout > 0:  # one draw per pair, as PEFT's separate modules: the dropped input and its mask
            # (no mask where the input requires no gradient: block 0's first adapted linear)
            out[f"{key}.dropout"] = rows * p.n_in * (c + (target.mask_bytes(c) if _STAGES[p.linear] > start else 0))
    if num.autocast:
        out["weight_casts"] = out.get("weight_casts", 0) + 2 * adapters.numel()  # autocast's cached copies
    return {k: v for k, v in out.items() if v}


def _place(kind: str) -> int:
    """Where a saved kind sits in block 0 (_PLACE): kept when an adapter is at or before it; norm1's never."""
    return next((at for prefix, at in _PLACE if kind.startswith(prefix)), 0)


def frozen_head(kinds: dict[str, int]) -> dict[str, int]:
    """The final norm and loss with a frozen head: no input kept for the head's weight gradient, no normalised x
    for the norm's gain, and no autocast copy of a bf16 head."""
    return {k: v for k, v in kinds.items() if k != "loss.input" and not k.endswith(".normed")}


def adapter_flops(adapters: Adapters, tokens: int) -> float:
    """Forward FLOPs of one block's adapters on `tokens` tokens: 2·r·(n_in + n_out) per routed row and pair."""
    return sum(2 * tokens * p.active * adapters.rank * (p.n_in + p.n_out) for p in adapters.pairs)
