"""train.cpu_allocator (kiln.perf.allocator): glibc's malloc tuned keeps freed step buffers in the process.

Faults are counted in a fresh subprocess (a process's malloc state is what is measured): 16 tensors of 2 MiB,
filled and freed, 10 times, untuned and then tuned. Measured on a 2-core Xeon (AMX-BF16, family 6 model 167):
untuned 81,469-81,561 minor faults in 6 runs (once 8,623 under pytest: glibc's dynamic thresholds depend on the
process's history), tuned 0. A 64 MiB tensor is not helped (491,550 faults in 30 rounds either way): above 32 MiB,
glibc's largest mmap threshold on 64-bit, every block is mmapped and unmapped, tuned or not.
"""
from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest
import torch

from kiln.errors import KilnError
from kiln.perf import allocator
from kiln.perf.allocator import decide_allocator

GLIBC = platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallopt")
needs_glibc = pytest.mark.skipif(not GLIBC, reason="train.cpu_allocator tunes glibc's malloc; this C library is not glibc")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")

# one fresh process: untuned rounds first, then kiln.perf.allocator's tune() (loaded alone, without kiln.perf's
# package, which imports the models) and the same rounds again
PROBE = """
import importlib.util, resource, sys, torch
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
def step():
    buffers = [torch.empty(2 << 18) for _ in range(16)]  # 16 x 2 MiB of float32
    for b in buffers:
        b.fill_(1.0)
    del buffers
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
step()
system = faults()
assert allocator.tune()
step()
print(system, faults())
"""


@needs_glibc
def test_tuned_malloc_faults_at_least_5x_fewer():
    env = {k: v for k, v in os.environ.items() if k not in allocator.ENV and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", PROBE, allocator.__file__], capture_output=True, text=True, env=env,
                         check=True)
    system, tuned = map(int, out.stdout.split())
    assert system >= 5000 and tuned * 5 <= system, (system, tuned)  # untuned at least ~1 of 10 rounds faulted


@needs_glibc
def test_decided_by(monkeypatch):
    for name in (*allocator.ENV, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    assert decide_allocator("auto", CPU) == (True, f"auto: tuned, {allocator.TUNED}")
    assert decide_allocator("tuned", CUDA) == (True, f"train.cpu_allocator=tuned: {allocator.TUNED}")
    assert decide_allocator("auto", CUDA) == (
        False, "auto: system, a cuda run (the host allocator does not hold the step's tensors)")
    assert decide_allocator("system", CPU) == (False, "train.cpu_allocator=system")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert decide_allocator("auto", CPU) == (False, "auto: system, LD_PRELOAD loads jemalloc")
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert decide_allocator("tuned", CPU) == (False, "tuned: system, MALLOC_TRIM_THRESHOLD_=0 is set")


def test_tuned_off_glibc_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert decide_allocator("auto", CPU) == (False, "auto: system, the C library is not glibc")
    with pytest.raises(KilnError) as e:
        decide_allocator("tuned", CPU)
    assert str(e.value) == ("train.cpu_allocator=tuned sets glibc's malloc, and this C library is musl: "
                            "use --train.cpu_allocator=auto")
    with pytest.raises(KilnError, match="train.cpu_allocator='jemalloc'"):
        decide_allocator("jemalloc", CPU)
