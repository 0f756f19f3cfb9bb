"""The key/value cache of generation: every block's keys and values of the positions seen so far, so that a new
token runs the model on one position instead of on the whole context again.

    cache = KVCache(n_layer, length, pad)     room for `length` positions; pad (B,): each row's left padding
    model(prompts, cache=cache)               prefill: (B, T) tokens, their keys and values kept at 0..T-1
    model(tokens, cache=cache)                a step: (B, 1) tokens at position T, attending to 0..T

Rows of a batch are left-padded to one length. A row's padding is never attended to (a padded position attends
to itself only, so that no row of the softmax is empty) and its positions count from its first real token, so
each row computes what it would alone. The model reads the cache through three things: `positions(T)`, the
position ids of the next T tokens; `mask`, which cached keys each of them sees; and `layer(i).update(k, v)`.
Keys and values are kept as the attention computes them (after QK-norm and RoPE), in their dtype.
"""
from __future__ import annotations

import torch


class CacheFull(ValueError):
    """More positions than the cache (model.max_seq_len) holds."""


class KVCache:
    def __init__(self, n_layer: int, length: int, pad: torch.Tensor | None = None):
        self.length = length  # positions it holds: at most model.max_seq_len
        self.pad = pad  # (B,) long: left-padding tokens of each row; None = no padding
        self.filled = 0  # positions written so far
        self.keys: list[torch.Tensor | None] = [None] * n_layer  # (B, KV, length, D) each, allocated at first use
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.mask: torch.Tensor | None = None  # (B, 1, T, filled + T) bool for the current forward; None = all

    def positions(self, T: int, device) -> torch.Tensor:
        """Position ids (B, T) (or (1, T) without padding) of the next T tokens; sets `mask` for their forward."""
        if self.filled + T > self.length:
            raise CacheFull(f"the KV cache holds {self.length} positions; {self.filled} are filled and {T} more "
                            f"were given")
        slots = torch.arange(self.filled, self.filled + T, device=device)  # (T,) where the new keys go
        keys = torch.arange(self.filled + T, device=device)  # (S,) every key they may see
        causal = keys[None, :] <= slots[:, None]  # (T, S)
        if self.pad is None:
            # one new token sees every cached key: no mask needed (SDPA's faster path)
            self.mask = None if T == 1 else causal[None, None]
            return slots[None]  # (1, T)
        pad = self.pad.to(device)[:, None, None]  # (B, 1, 1)
        real = (keys[None, None, :] >= pad) | (keys[None, None, :] == slots[None, :, None])  # (B, T, S)
        self.mask = (causal[None] & real)[:, None]  # (B, 1, T, S)
        return (slots[None] - pad[:, :, 0]).clamp(min=0)  # (B, T)

    def layer(self, i: int) -> "LayerCache":
        return LayerCache(self, i)

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep block i's keys and values k, v (B, KV, T, D) of the new positions; return those of every position
        so far, (B, KV, filled + T, D)."""
        if self.keys[i] is None:
            B, KV, _, D = k.shape
            self.keys[i] = k.new_empty(B, KV, self.length, D)
            self.values[i] = v.new_empty(B, KV, self.length, D)
        end = self.filled + k.shape[2]
        self.keys[i][:, :, self.filled:end] = k
        self.values[i][:, :, self.filled:end] = v
        return self.keys[i][:, :, :end], self.values[i][:, :, :end]

    def advance(self, T: int) -> None:
        """The forward of T positions is done: the next one starts after them."""
        self.filled += T


class LayerCache:
    """Block i's view of a KVCache: what its attention reads and writes."""

    def __init__(self, cache: KVCache, i: int):
        self.cache, self.i = cache, i

    @property
    def mask(self) -> torch.Tensor | None:
        return self.cache.mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.i, k, v)
