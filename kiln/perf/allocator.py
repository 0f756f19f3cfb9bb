"""glibc malloc tuned for a CPU training step (train.cpu_allocator).

    allocator_setting(value)           "auto" | "tuned" | "system"
    decide_allocator(value, device)    (tune or not, one line why)
    tune()                             mallopt(M_MMAP_THRESHOLD, 32 MiB), mallopt(M_TRIM_THRESHOLD, 1 GiB)

glibc hands a freed block above its mmap threshold back to the kernel (munmap), and trims the heap's free top above
its trim threshold. A CPU step frees and takes back the same buffers every update, faulting their pages in again:
on a 2-core Xeon (AMX, one thread) 8% of kiln's bf16 step was minor page faults (0.4-1.5 M a run); with the
thresholds fixed at 32 MiB (glibc's most on 64-bit) and 1 GiB, 0.18 M: kiln-bf16 went from 0.86x to 0.99x the plain
bf16 loop, max RSS from 843 to 957 MiB (docs/benchmarks.md).
"""
from __future__ import annotations

import ctypes
import os
import platform

from kiln.errors import KilnError

SETTINGS = ("auto", "tuned", "system")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 1 << 30  # glibc refuses a larger mmap threshold on 64-bit
ENV, OTHER_ALLOCATORS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"), ("jemalloc", "tcmalloc", "mimalloc")
TUNED = "glibc malloc keeps freed step buffers (mmap threshold 32 MiB, trim threshold 1 GiB)"


def allocator_setting(value: str) -> str:
    if value not in SETTINGS:
        raise KilnError(f"train.cpu_allocator={value!r}; use one of {SETTINGS}", key="train.cpu_allocator",
                        value=value, fix=f"use one of {SETTINGS}")
    return value


def _mallopt():
    """glibc's mallopt, or None where the C library is not glibc (musl, macOS, Windows)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL(None), "mallopt", None)
    except OSError:
        return None


def _left_to_user() -> str | None:
    """Why the process's allocator is the user's choice, not kiln's: their environment says how to tune it."""
    for name in ENV:
        if name in os.environ:
            return f"{name}={os.environ[name]} is set"
    preload = os.environ.get("LD_PRELOAD", "")
    other = next((a for a in OTHER_ALLOCATORS if a in preload), None)
    return f"LD_PRELOAD loads {other}" if other else None


def decide_allocator(value: str, device) -> tuple[bool, str]:
    """(tune glibc malloc or not, why) for train.cpu_allocator=`value` on `device` (a torch.device)."""
    setting = allocator_setting(value)
    if setting == "system":
        return False, "train.cpu_allocator=system"
    glibc = _mallopt() is not None
    if setting == "tuned" and not glibc:
        raise KilnError(f"train.cpu_allocator=tuned sets glibc's malloc, and this C library is "
                        f"{platform.libc_ver()[0] or 'not glibc'}: use --train.cpu_allocator=auto",
                        key="train.cpu_allocator", value="tuned", fix="use --train.cpu_allocator=auto")
    user = _left_to_user()
    if user:
        return False, f"{setting}: system, {user}"
    if setting == "tuned":
        return True, f"train.cpu_allocator=tuned: {TUNED}"
    if device.type != "cpu":
        return False, f"auto: system, a {device.type} run (the host allocator does not hold the step's tensors)"
    if not glibc:
        return False, "auto: system, the C library is not glibc"
    return True, f"auto: tuned, {TUNED}"


def tune() -> bool:
    """Set glibc's thresholds for this process; whether glibc took both."""
    mallopt = _mallopt()
    return bool(mallopt) and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
