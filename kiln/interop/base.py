"""The base model a LoRA run's checkpoints refer to instead of holding its frozen weights.

    ref = base_reference("hf:DIR")    {"init": "hf:DIR", "files": {"config.json": xxh3, "model.safetensors": ...}}
    check_base(ref, where[, now])     BaseChanged (one line) when those files are gone or differ now (or differ
                                      from `now`, the reference of the base a resuming run loaded)

The digest is xxh3-64 over each file read_hf reads (config.json, model.safetensors or the index and its shards):
the checksum kiln's checkpoint manifests use, which catches any change to the bytes; it is not a defence against
an adversary. A base whose weights changed would silently give other logits under the same adapters.
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path

import xxhash

from kiln.errors import KilnError
from kiln.interop.hf import INDEX

HF_PREFIX = "hf:"


class BaseChanged(KilnError):
    """The base model a LoRA checkpoint was trained on is not on disk as it was."""


def base_files(directory: Path) -> list[Path]:
    """The files of a Hugging Face model directory that make its weights: config.json and the safetensors."""
    files = [directory / "config.json"]
    if (directory / "model.safetensors").is_file():
        return files + [directory / "model.safetensors"]
    index = directory / INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return files + [index] + [directory / s for s in shards]
    return files + [directory / "model.safetensors"]  # missing: named as such by check_base


def _xxh3(path: Path) -> str:
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size == 0:
            return xxhash.xxh3_64(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return xxhash.xxh3_64(data).hexdigest()


def base_reference(init: str) -> dict:
    """What a checkpoint records of model.init=hf:DIR: the path as given and each weight file's xxh3 (the files
    there are: a missing one is what check_base names)."""
    directory = Path(init.removeprefix(HF_PREFIX))
    files = base_files(directory) if directory.is_dir() else []
    return {"init": init, "files": {f.name: _xxh3(f) for f in files if f.is_file()}}


def check_base(saved: dict, where: str, now: dict | None = None) -> None:
    """Refuse (BaseChanged, one line) when the base `saved` names differs from `now` (what this run loaded; None:
    its files on disk now): a file gone, added or changed."""
    init = saved["init"]
    now = base_reference(init) if now is None else now
    fix = (f"put the base it was trained on back at {init.removeprefix(HF_PREFIX)}, or start a new run on this base "
           f"from the adapters (`kiln export RUN_DIR --peft DIR`, then --lora.init=peft:DIR)")
    said = f"{where} was trained on the base model.init={init}"
    if now["init"] != init:
        said += f" (this run loads {'model.init=' + now['init'] if now['init'] else 'no model.init'})"
    for name, digest in saved["files"].items():
        if name not in now["files"]:
            raise BaseChanged(f"{said}, whose {name} is not there now; {fix}", key="model.init", value=init, fix=fix)
        if now["files"][name] != digest:
            raise BaseChanged(f"{said}, whose {name} is not the same file now (xxh3 {now['files'][name]}, the "
                              f"checkpoint recorded {digest}); {fix}", key="model.init", value=init, fix=fix)
    added = sorted(set(now["files"]) - set(saved["files"]))
    if added:
        raise BaseChanged(f"{said}, which has other weight files now ({', '.join(added)}); {fix}",
                          key="model.init", value=init, fix=fix)
