"""Activation offload: a block's saved-for-backward tensors go to pinned host memory while forward runs.

    apply_offload(model, blocks)    blocks: indices into model.blocks

Each saved CUDA tensor (parameters excepted) is copied device→host on a side stream as soon as it is saved;
the allocator is told (record_stream) that the side stream still reads it, so the device memory returns to the
pool when the copy ends without the forward waiting for it. In backward the tensor is copied back on the compute
stream after the copy's event. Blocks under recompute keep nothing worth offloading and are skipped. On a CPU
device there is no separate host memory: nothing is moved, and the run says so in one line at start
(kiln.run.device_levers).
"""
from __future__ import annotations

import torch

from kiln.memory.recompute import Recomputed, swap_class
from kiln.errors import KilnError


class ActivationOffload:
    """The pack/unpack pair of torch.autograd.graph.saved_tensors_hooks; one per model, shared by its blocks."""

    def __init__(self, model: torch.nn.Module):
        self.keep = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.keep |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.stream = None
        self.offloaded_bytes = 0  # running total, for reports and tests

    def pack(self, t: torch.Tensor):
        if t.device.type != "cuda" or t.untyped_storage().data_ptr() in self.keep or t.numel() == 0:
            return t
        if self.stream is None:
            self.stream = torch.cuda.Stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.offloaded_bytes += t.numel() * t.element_size()
        return (host, done, t.device)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, done, device = packed
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)


class Offloaded:
    """Mixed in before a block's own class (kiln.memory.recompute.swap_class): its forward runs under the hooks."""

    kiln_offload_hooks: ActivationOffload

    def forward(self, x, rope_cache=None):
        with torch.autograd.graph.saved_tensors_hooks(self.kiln_offload_hooks.pack, self.kiln_offload_hooks.unpack):
            return super().forward(x, rope_cache)


def parse_blocks(spec: str, n_layer: int | None) -> frozenset[int]:
    """'none' | 'all' | '0-5' | '0,2,4' | '0-3,8' -> block indices; n_layer=None checks the spelling only (and
    returns no indices), for a config whose model is not resolved yet."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return frozenset()
    if spec == "all":
        return frozenset(range(n_layer or 0))
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise KilnError(f"memory.offload_blocks={spec!r}: write none, all, 0-5 or 0,2,4",
                            key="memory.offload_blocks", value=spec, fix="write none, all, 0-5 or 0,2,4") from None
        if not 0 <= a <= b < (n_layer if n_layer is not None else b + 1):
            raise KilnError(f"memory.offload_blocks={spec!r}: blocks run 0..{n_layer - 1}",
                            key="memory.offload_blocks", value=spec, fix=f"give blocks in 0..{n_layer - 1}")
        out.update(range(a, b + 1))
    return frozenset(out) if n_layer is not None else frozenset()


def apply_offload(model, blocks) -> ActivationOffload | None:
    """Offload the saved tensors of model.blocks[i] for i in blocks (those without recompute)."""
    blocks = sorted(blocks)
    if not blocks:
        return None
    hooks = ActivationOffload(model)
    for i in blocks:
        block = model.blocks[i]
        if isinstance(block, Recomputed):
            continue
        swap_class(block, Offloaded)
        block.kiln_offload_hooks = hooks
        block.kiln_offload = True
    return hooks
