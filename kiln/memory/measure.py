"""Measured memory, to hold the estimate to account.

    measure_saved(model, x, y, precision)   bytes saved for backward, by storage, classified like the estimate
    LiveBytes                               a dispatch mode that follows live tensor bytes op by op (any device)
    AllocatedBytes                          every byte torch's CPU allocator hands out and takes back, through the
                                            profiler: what LiveBytes cannot see (FSDP2 resizes its parameters'
                                            storages; DDP allocates its buckets in C++)
    (kiln.run.measure.measure_step runs a few real train steps with these instruments)

Saved bytes come from torch.autograd.graph.saved_tensors_hooks: every tensor autograd keeps, deduplicated by
storage (q, k and v are views of one qkv output and cost it once), parameters and buffers excluded. A recomputed
region keeps its input, and selective recompute its matmul outputs, outside autograd's saved tensors: the
recompute wrappers report those through kiln.memory.recompute.observe_kept and they are counted too.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
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


def _expert_cast(t: torch.Tensor, stack) -> bool:
    """A half copy of a stacked expert weight (E, out, in) of the running module's (an MoE's experts, cast to the
    compute dtype for grouped_mm: kiln.models.moe), or its per-expert transpose (E, in, out)."""
    module = stack.modules.get(stack.top)
    if t.dim() != 3 or module is None:
        return False
    for p in module.parameters():
        if p.dim() == 3 and p.dtype != t.dtype and (p.shape == t.shape or p.shape == t.mT.shape):
            return True
    return False


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
                and tuple(t.shape) in (tuple(weight.shape), tuple(weight.shape)[::-1])) or _expert_cast(t, stack):
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


class AllocatedBytes:
    """The CPU allocator's live bytes over a region, from torch.profiler's memory events (profile_memory=True):
    c10's CPU allocator reports each allocation made while profiling and its free, with the running total of
    those still alive, whoever made them (an op, a storage resize, C++ inside DDP or a collective).

        with AllocatedBytes() as live:
            ...
            with live.window("step 1"):
                ...
        live.peak("step 1")   # the most bytes alive during the window, counting from the region's start

    Only allocations made inside the region count (tensors made before it are invisible, even when freed in it),
    so a region that starts before the model is built sees the whole rank: model state, buffers, activations,
    gathered parameters.

    The allocator's running total counts only the threads the profiler watches unless c10's flag
    caffe2_report_cpu_memory_usage is on: a block made here and freed by a collective's worker thread (gloo keeps
    its tensors until the work object dies there) would stay counted for good. The flag is set for the region
    (`_count_every_thread`), so the total is every thread's; the events (allocations on this thread) sample it."""

    def __init__(self):
        self._prof = None
        self.events: list[tuple[int, int]] = []  # (time ns, allocator total after the event)
        self.windows: dict[str, tuple[int, int]] = {}
        self.base = 0  # bytes alive at the region's start: none counted

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile  # lazy: only a measurement starts the profiler

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        _count_every_thread(True)
        self._prof.__enter__()
        return self

    @contextlib.contextmanager
    def window(self, name: str):
        with torch.profiler.record_function(f"kiln.window.{name}"):
            yield

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        _count_every_thread(False)
        events = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            fields = e.extra_fields
            if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
                events.append((e.start_time_ns, fields.total_allocated, fields.alloc_size))
            elif e.name.startswith("kiln.window."):
                self.windows[e.name.removeprefix("kiln.window.")] = (e.start_time_ns, e.end_time_ns)
        events.sort()
        if events:
            self.base = events[0][1] - events[0][2]
        self.events = [(t, total) for t, total, _ in events]
        return False

    def peak(self, name: str) -> int:
        start, end = self.windows[name]
        before = [total for t, total in self.events if t < start]
        inside = [total for t, total in self.events if start <= t <= end]
        return max(inside + before[-1:], default=self.base) - self.base

    def at(self, name: str) -> int:
        """Bytes alive when the window opens."""
        start, _ = self.windows[name]
        before = [total for t, total in self.events if t < start]
        return (before[-1] if before else self.base) - self.base


def _count_every_thread(on: bool) -> None:
    """c10's FLAGS_caffe2_report_cpu_memory_usage (a plain bool in libc10, no Python binding): with it the CPU
    allocator counts the blocks of every thread, not only the profiled one's."""
    lib = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))
    if not lib:
        raise RuntimeError("libc10 not found beside torch: AllocatedBytes cannot count every thread")
    ctypes.c_bool.in_dll(ctypes.CDLL(lib[0]), "FLAGS_caffe2_report_cpu_memory_usage").value = on
