"""Measurements of this machine kept across runs: one small JSON file in kiln's cache directory.

    remembered(kind, key, measure)   the value stored for (this machine, kind, key), else measure() stored
    machine()                        what a measurement is only valid on: CPU model (or GPU name), threads, torch
    cache_file()                     $KILN_CACHE/measured.json, else ~/.cache/kiln/measured.json

A matmul rate or a compile time is a property of the machine and the torch build, not of one run: measuring it in
every run costs start-up time (the model-shape peak took 0.5-2 s per precision on a loaded 2-core CPU) and gives a
different, noisier number each time. So it is measured once, carefully, and read back. A key holds everything the
value depends on besides the machine (precision, shapes); the machine part is added here. Delete the file (or
point KILN_CACHE elsewhere) to measure again. A file that cannot be read or written is measured around, never an
error: the cache is an optimisation.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Callable

import torch

FILE = "measured.json"


def cache_file() -> Path:
    root = os.environ.get("KILN_CACHE")  # the directory kiln's token shards are cached in too (kiln.data)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "kiln") / FILE


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | str = "cpu") -> str:
    """The part of every key that names the hardware and software: a measurement from another CPU, GPU, thread
    count or torch build does not apply."""
    device = torch.device(device)
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        hw = f"{cpu_model()} ({os.cpu_count()} cpus, {torch.get_num_threads()} threads, " \
             f"{torch.backends.cpu.get_cpu_capability()})"
    return f"{hw} | torch {torch.__version__}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=FILE, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    except OSError:
        pass


def lookup(kind: str, key: str, device: torch.device | str = "cpu"):
    """The stored value, or None."""
    return _read(cache_file()).get(kind, {}).get(f"{machine(device)} | {key}")


def store(kind: str, key: str, value, device: torch.device | str = "cpu") -> None:
    path = cache_file()
    data = _read(path)  # read again just before writing: another process may have added its own entries
    data.setdefault(kind, {})[f"{machine(device)} | {key}"] = value
    _write(path, data)


def remembered(kind: str, key: str, measure: Callable[[], float], device: torch.device | str = "cpu"):
    """The value of `kind`/`key` on this machine: read back when stored, else measured now and stored."""
    value = lookup(kind, key, device)
    if value is None:
        value = measure()
        store(kind, key, value, device)
    return value
