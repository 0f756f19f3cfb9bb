"""Measured memory, to hold the estimate to account.

    measure_saved(model, x, y, precision)   bytes saved for backward, by storage, classified like the estimate
    LiveBytes                               a dispatch mode that follows live tensor bytes op by op (any device)
    (kiln.run.measure.measure_step runs a few real train steps with these instruments)

Saved bytes come from torch.autograd.graph.saved_tensors_hooks: every tensor autograd keeps, deduplicated by
storage (q, k and v are views of one qkv output and cost it once), parameters and buffers excluded. A recomputed
region keeps its input, and selective recompute its matmul outputs, outside autograd's saved tensors: the
recompute wrappers report those through kiln.memory.recompute.observe_kept and they are counted too.
"""
from __future__ import annotations

import contextlib
import os
import resource
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kiln.memory.recompute import observe_kept


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


@dataclass
class SavedBytes:
    components: dict[str, int]  # activations, logits, weight_casts
    per_block: list[int]  # bytes attributed to model.blocks[i] (weight casts included)
    embed: int
    head: int  # final norm + loss
    rows: list[tuple[str, tuple, str, int, str]] = field(default_factory=list)  # (module, shape, dtype, bytes, kind)

    @property
    def total(self) -> int:
        return sum(self.components.values())


class _ModuleStack:
    """Names of the modules whose forward is running, innermost last."""

    def __init__(self, model):
        self.names, self.handles = [], []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self.names.append(n)))
            self.handles.append(module.register_forward_hook(lambda m, a, o: self._pop()))
        self.modules = dict(model.named_modules())

    def _pop(self):
        self.names.pop()

    @property
    def top(self) -> str:
        return self.names[-1] if self.names else ""

    def remove(self):
        for h in self.handles:
            h.remove()


def measure_saved(model, x, y, precision=None, backward: bool = True) -> SavedBytes:
    """Run one forward (loss, reduction='sum') counting what is kept for backward; then backward to free it."""
    state_storages = {_storage_key(t)[0] for t in list(model.parameters()) + list(model.buffers())}
    head_weight = model.head_weight
    n_tokens = x.numel()
    stack = _ModuleStack(model)
    seen: dict[int, tuple[str, int, str]] = {}
    rows = []

    def record(t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        ptr, nbytes = _storage_key(t)
        if ptr in state_storages or nbytes == 0:
            return
        where = stack.top
        weight = head_weight if where == "loss" else getattr(stack.modules.get(where), "weight", None)
        if (isinstance(weight, torch.Tensor) and t.dtype != weight.dtype and weight.dim() == t.dim()
                and tuple(t.shape) in (tuple(weight.shape), tuple(weight.shape)[::-1])):
            kind = "weight_casts"  # autocast's half copy of the module's weight (or its transpose)
        elif where == "loss" and t.dtype == torch.float32 and tuple(t.shape) == (n_tokens, head_weight.shape[0]):
            kind = "logits"
        else:
            kind = "activations"
        rows.append((where, tuple(t.shape), str(t.dtype).replace("torch.", ""), nbytes,
                     kind if ptr not in seen else "dup"))
        if ptr not in seen:
            seen[ptr] = (where, nbytes, kind)

    def pack(t):
        record(t)
        return t

    ctx = precision.autocast() if precision is not None else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observe_kept(record), ctx:
            loss = model(x, y, reduction="sum")
    finally:
        stack.remove()
    components = {"activations": 0, "logits": 0, "weight_casts": 0}
    per_block = [0] * len(model.blocks)
    embed = head = 0
    for where, nbytes, kind in seen.values():
        components[kind] += nbytes
        parts = where.split(".")
        if parts[0] == "blocks":
            per_block[int(parts[1])] += nbytes
        elif parts[0] in ("norm", "loss", "head"):
            head += nbytes
        else:
            embed += nbytes
    if backward:
        loss.backward()
        model.zero_grad(set_to_none=True)
    return SavedBytes(components, per_block, embed, head, rows)


class LiveBytes(TorchDispatchMode):
    """Follows the bytes of tensors created under it, op by op, until they are freed.

    On CPU it counts storages itself (a weakref finalizer per new storage); on CUDA it reads the caching
    allocator's memory_allocated. `mark(label)` tags what follows (forward, backward, optimizer ...).
    """

    def __init__(self, device: torch.device, baseline: int = 0):
        super().__init__()
        self.device, self.baseline = device, baseline
        self.live, self.peak = 0, 0
        self.label = ""
        self.samples: list[tuple[float, int, str]] = []  # (seconds, bytes, label)
        self.t0 = time.perf_counter()
        self._seen: set = set()

    def mark(self, label: str) -> None:
        self.label = label

    def _free(self, key, nbytes):
        self.live -= nbytes
        self._seen.discard(key)

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self.baseline + self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.device.type != "cuda":
            inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    s = t.untyped_storage()
                    key = (s.data_ptr(), s.nbytes())
                    if key[1] and key not in inputs and key not in self._seen:
                        self._seen.add(key)
                        self.live += key[1]
                        weakref.finalize(s, self._free, key, key[1])
        now = self.current()
        self.peak = max(self.peak, now)
        self.samples.append((time.perf_counter() - self.t0, now, self.label))
        return out


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc), in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among tensors."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            ptr, nbytes = _storage_key(t)
            seen[ptr] = nbytes
    return sum(seen.values())


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "inner", None)
    if inner is not None:  # HostOptimizer: the state lives on the host
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
