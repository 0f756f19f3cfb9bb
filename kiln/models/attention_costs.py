"""What the attention core and QK-norm cost, stated by the parts (kiln/models/costs.py's siblings, which that file's
400 lines leave no room for): the bytes they save for backward, the attention core's FLOPs and the bytes it moves.
The estimator (kiln.memory.estimate) and the planner (kiln.memory.planner) ask these objects.

    ATTENTION   kiln.models.parts.Attention's core, torch's scaled_dot_product_attention (causal, no mask):
                the kernel torch picks, saved tensors, forward FLOPs, bytes read and written
    QK_NORM     the RMSNorm over each head of q and k before RoPE (Qwen3; model.qk_norm): saved tensors

Every family has the one attention core; QK-norm is there when its family (or model.qk_norm) says so
(kiln.models.family.Family.qk_norm_of). As in costs.py, `num` holds the step's bytes per element (compute, param)
and autocast flags, `target` the device's allocation rules (kind, mask_bytes); N is tokens (B sequences of T).
"""
from __future__ import annotations

import math

from kiln.models.config import ModelConfig


class AttentionCore:
    """softmax(q·kᵀ/√hd)·v over q (n_head heads), k and v (n_kv_head heads, grouped-query), causal."""

    def backend(self, cfg: ModelConfig, num, target) -> str:
        """The SDPA kernel torch picks while training: "flash", "efficient" or "math"."""
        if target.kind != "cuda":
            return "math" if cfg.dropout > 0 else "flash"  # CPU flash kernel has no dropout
        if num.compute == 2 and target.capability >= 8.0 and cfg.head_dim <= 256:
            return "flash"
        return "efficient" if cfg.n_kv_head == cfg.n_head else "math"  # mem-efficient kernel has no GQA

    def saved(self, cfg: ModelConfig, B: int, T: int, num, target, backend: str, rotary: bool,
              normed_qk: bool = False) -> dict[str, int]:
        """What the core saves for backward on B sequences of T; rotary: q and k were rotated (new tensors),
        normed_qk: QK-norm made them (new tensors too)."""
        H, KV, hd, c = cfg.n_head, cfg.n_kv_head, cfg.head_dim, num.compute
        N = B * T
        out = {}
        if backend in ("flash", "efficient"):
            # q, k, v are views of the qkv output; with RoPE, q and k are new tensors and only v's view keeps
            # the qkv storage alive (all of it: q, k and v columns). QK-norm's outputs are new tensors too, in the
            # qkv layout (B, T, H, hd) transposed: the kernel's output is then a view for the projection.
            out["attn.qkv"] = N * (H + 2 * KV) * hd * c
            if rotary or normed_qk:
                out["attn.q_rot"] = N * H * hd * c
                out["attn.k_rot"] = N * KV * hd * c
            out["attn.out"] = N * H * hd * c
            if rotary and target.kind != "cuda":
                # CPU kernels write the output in q's layout; RoPE's q is a contiguous (B, H, T, hd) tensor, so
                # (B, H, T, hd) -> (B, T, C) is a copy for the projection. CUDA kernels write (B, T, H, hd): a view.
                out["attn.proj_input"] = N * H * hd * c
            t_lse = T if backend == "flash" else 32 * math.ceil(T / 32)
            out["attn.logsumexp"] = B * H * t_lse * 4
            return out
        # math backend: q, k, v upcast to fp32 and (k, v) expanded to H heads; q·scale and k·scale are copies, v is
        # made contiguous; the probabilities are kept (and with dropout: the mask and the dropped probabilities).
        out["attn.qk_scaled"] = 2 * B * H * T * hd * 4
        out["attn.v"] = B * H * T * hd * 4
        out["attn.probs"] = B * H * T * T * 4
        if cfg.dropout > 0:
            out["attn.dropout_mask"] = B * H * T * T * target.mask_bytes(4)
            out["attn.dropped_probs"] = B * H * T * T * 4
        out["attn.out"] = N * H * hd * c  # (B, H, T, hd) -> (B, T, C) copy fed to the projection
        return out

    def flops(self, cfg: ModelConfig, queries: int, context: int, causal_kernel: bool) -> float:
        """Forward FLOPs of q·kᵀ and p·v for `queries` query tokens, each against `context` keys: 2 matmuls of 2
        FLOPs per multiply-add over every head; a causal kernel skips the masked half."""
        return 4 * queries * cfg.n_head * context * cfg.head_dim * (0.5 if causal_kernel else 1.0)

    def io_bytes(self, cfg: ModelConfig, queries: int, context: int, dtype_bytes: int, fused: bool) -> int:
        """Bytes the forward reads and writes (the planner's memory-bound time): q, k, v in and the output out, in
        the compute dtype; the math path also writes and reads the fp32 (queries, context) scores per head."""
        H, KV, hd, N = cfg.n_head, cfg.n_kv_head, cfg.head_dim, queries
        return (N * (H + 2 * KV) * hd * dtype_bytes + N * H * hd * dtype_bytes
                + (0 if fused else 4 * N * H * context * 4))


class QKNorm:
    """An RMSNorm over each head of q and k (rows of head_dim), whatever the family's own norm
    (kiln.models.parts.Attention)."""

    def saved(self, cfg: ModelConfig, N: int, num, backend: str) -> dict[str, int]:
        """An RMSNorm over N·heads rows of head_dim. Its input is a view of the qkv output unless RMSNorm makes an
        fp32 copy of a half input; the flash kernels keep that storage anyway (v is a view of it), the math path
        does not (it copies v), so there the norm's input keeps it alive. `{name}.weight_fp32` is a weight copy
        (the estimator counts it with the weight casts)."""
        hd, out = cfg.head_dim, {}
        if num.compute == 4 and backend == "math":
            out["attn.qkv"] = N * (cfg.n_head + 2 * cfg.n_kv_head) * hd * 4
        for name, heads in (("attn.q_norm", cfg.n_head), ("attn.k_norm", cfg.n_kv_head)):
            rows = N * heads
            out[f"{name}.input"] = rows * hd * 4 if num.compute != 4 else 0
            out[f"{name}.stats"] = rows * 4
            out[f"{name}.normed"] = rows * hd * 4
            if num.half_weights:
                out[f"{name}.weight_fp32"] = hd * 4
        return out


ATTENTION = AttentionCore()
QK_NORM = QKNorm()
