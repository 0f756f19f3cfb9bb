"""Pre-tokenized corpora used as they are (`data.format=tokens`): nanoGPT's train.bin/val.bin and llm.c's shards.

    nanoGPT   a directory holding train.bin and val.bin: raw little-endian uint16 token ids, no header
    llm.c     *train*.bin and *val*.bin shards: a header of 256 int32 (magic 20240520, version, token count),
              then the tokens: uint16 for version 1 (GPT-2), uint32 for version 2 (Llama 3)

The files are memory-mapped, never copied. Every id is checked against data.vocab_size once, when the cache entry
(a meta.json recording the check) is made; an id out of range is refused with the file and its offset.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.data.corpus import CorpusError
from kiln.data.shards import ShardedTokens

LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
SCAN = 1 << 24  # tokens checked at a time


def token_files(source: str) -> dict[str, list[Path]]:
    """{"train": [...], "val": [...]} of a nanoGPT or llm.c directory (or one llm.c/nanoGPT train file)."""
    path = Path(source).expanduser()
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise CorpusError(f"data.source={source!r} does not exist; with data.format=tokens give a directory holding "
                          f"train.bin/val.bin (nanoGPT) or *train*.bin/*val*.bin shards (llm.c)")
    files = {"train": sorted(path.glob("*train*.bin")), "val": sorted(path.glob("*val*.bin"))}
    for split, found in files.items():
        if not found:
            raise CorpusError(f"data.source={source!r} holds no *{split}*.bin file; data.format=tokens reads nanoGPT "
                              f"train.bin/val.bin or llm.c shards such as fineweb_{split}_000001.bin")
    return files


def read_tokens(path: Path) -> np.ndarray:
    """The token ids of one file as a read-only memory map: llm.c when it starts with the llm.c magic, else raw
    uint16 (nanoGPT)."""
    size = path.stat().st_size
    if size == 0:
        raise CorpusError(f"{path} is empty; remove it or regenerate it")
    header = np.fromfile(path, dtype="<i4", count=min(LLMC_HEADER_INTS, size // 4))
    if len(header) == LLMC_HEADER_INTS and header[0] == LLMC_MAGIC:
        version, count = int(header[1]), int(header[2])
        if version not in LLMC_DTYPES:
            raise CorpusError(f"{path}: llm.c header version {version} is unknown (kiln reads 1: uint16, 2: uint32)")
        dtype, offset = LLMC_DTYPES[version], LLMC_HEADER_INTS * 4
        if size != offset + count * dtype.itemsize:
            raise CorpusError(f"{path}: the llm.c header says {count} tokens ({offset + count * dtype.itemsize} "
                              f"bytes) but the file has {size} bytes; it is truncated or corrupt: regenerate it")
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    if size % 2:
        raise CorpusError(f"{path} has an odd number of bytes ({size}), so it is not raw uint16 tokens (nanoGPT) and "
                          f"has no llm.c header (magic {LLMC_MAGIC}); regenerate it")
    return np.memmap(path, dtype="<u2", mode="r")


def check_ids(path: Path, tokens: np.ndarray, vocab_size: int) -> int:
    """The largest id in the file; CorpusError with the offset of the first id >= vocab_size."""
    largest = 0
    for start in range(0, len(tokens), SCAN):
        chunk = tokens[start:start + SCAN]
        top = int(chunk.max())
        if top >= vocab_size:
            at = start + int(np.argmax(chunk >= vocab_size))
            raise CorpusError(f"{path}: token {at} is id {int(chunk[at - start])}, outside data.vocab_size="
                              f"{vocab_size}; set data.vocab_size to the tokenizer's vocabulary (50257 for GPT-2)")
        largest = max(largest, top)
    return largest


def join(arrays: list[np.ndarray]):
    arrays = [a for a in arrays if len(a)] or arrays[:1]
    return arrays[0] if len(arrays) == 1 else ShardedTokens(arrays)
