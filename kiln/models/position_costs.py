"""What each kind of positions costs (the POSITIONS table of kiln/models/costs.py, which documents the contract):
the parameters, buffers and saved tensors of learned positions and of RoPE."""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.models.config import ModelConfig


class Positions:
    name = ""
    rotary = False  # q and k are rotated inside attention (new tensors, not views of the qkv output)

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a shape these positions cannot encode."""

    def parameters(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        raise NotImplementedError(f"positions {self.name!r} state no parameters")

    def buffer_bytes(self, cfg: ModelConfig, num) -> int:
        """Non-parameter model state."""
        raise NotImplementedError(f"positions {self.name!r} state no buffers")

    def embed_saved(self, T: int) -> dict[str, int]:
        """What the embedding saves for backward for them, per sequence of T."""
        raise NotImplementedError(f"positions {self.name!r} state no saved tensors")

    def block_saved(self, cfg: ModelConfig, T: int, num) -> dict[str, int]:
        """What each block's attention saves for them."""
        raise NotImplementedError(f"positions {self.name!r} state no saved tensors")


class LearnedPositions(Positions):
    name = "learned"  # a (max_seq_len, d_model) table added to the token embedding

    def parameters(self, cfg):
        return [("pos_embed.weight", (cfg.max_seq_len, cfg.d_model))]

    def buffer_bytes(self, cfg, num):
        return 0

    def embed_saved(self, T):
        return {"embed.positions": T * 8}  # the int64 positions the table lookup keeps

    def block_saved(self, cfg, T, num):
        return {}


class RotaryPositions(Positions):
    name = "rope"  # rotate-half RoPE of q and k from fp32 cos/sin tables
    rotary = True

    def check(self, cfg):
        if cfg.head_dim % 2:
            raise KilnError(f"RoPE needs an even head dimension; model.head_dim = {cfg.head_dim}",
                            key="model.head_dim", value=cfg.head_dim)  # (rope_theta: check_values, first)

    def parameters(self, cfg):
        return []

    def buffer_bytes(self, cfg, num):
        # the cos/sin tables (fp32; bf16 after .to(bf16) in bf16-master)
        return 2 * cfg.max_seq_len * (cfg.head_dim // 2) * (2 if num.param == 2 else 4)

    def embed_saved(self, T):
        return {}

    def block_saved(self, cfg, T, num):
        if not num.autocast:
            return {}
        return {"attn.rope_tables": 4 * T * (cfg.head_dim // 2) * num.compute}  # cos, sin cast, per q and k call
