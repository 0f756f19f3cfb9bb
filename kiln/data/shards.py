"""Token shard files: a 64-byte header followed by the raw token array, read back with np.memmap.

Header layout (little-endian, 64 bytes):

    offset  size  field
         0     8  magic b"KILNTOK\\0"
         8     4  format version (uint32), currently 1
        12     4  dtype code (uint32): bytes per token, 1 = uint8, 2 = uint16, 4 = uint32
        16     8  token count (uint64)
        24    16  tokenizer fingerprint, 16 ASCII hex digits
        40    24  zero padding (room for later fields without moving the data offset)

64 bytes keeps the token data 64-byte aligned in the file, so the memmap is aligned for any dtype.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

MAGIC = b"KILNTOK\0"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQ16s")  # 40 bytes used, padded to HEADER_SIZE
DTYPES = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}
REBUILD = "delete it and re-run to rebuild the cache"


class ShardError(KilnError):
    """A shard file that cannot be used as is; the message names the file and the fix."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    # The smallest that holds every id: uint8 for the bytes tokenizer (256 ids; its shards are the text's own bytes,
    # no widening), uint16 up to 2**16 ids, else uint32. Each halves the disk and page-cache cost of the next.
    return DTYPES[1] if vocab_size <= 2**8 else DTYPES[2] if vocab_size <= 2**16 else DTYPES[4]


class ShardWriter:
    """Streams token arrays into one shard; the file appears under its final name only when complete.

    Usage: `with ShardWriter(path, dtype, fingerprint) as w: w.append(ids)`. Writes go to a temporary file
    beside the target that is renamed over it with os.replace, so a crash leaves no half-written shard.
    """

    def __init__(self, path: Path, dtype: np.dtype, fingerprint: str) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype.itemsize not in DTYPES:
            raise KilnError(f"shard dtype must be uint8, uint16 or uint32, got {dtype}", key="dtype", value=str(dtype))
        if len(fingerprint) != 16:
            raise KilnError(f"tokenizer fingerprint must be 16 hex digits, got {fingerprint!r}", key="fingerprint",
                            value=fingerprint)
        self.fingerprint = fingerprint
        self.count = 0
        self._max_id = np.iinfo(self.dtype).max
        self._tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._tmp.open("wb")
        self._file.write(self._header())  # placeholder; the count is patched in at close

    def _header(self) -> bytes:
        fields = _HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.count, self.fingerprint.encode("ascii"))
        return fields.ljust(HEADER_SIZE, b"\0")

    def append(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.dtype != self.dtype:  # the same dtype needs no check (and no copy)
            if ids.size and int(ids.max()) > self._max_id:
                raise KilnError(f"token id {int(ids.max())} does not fit the shard dtype {self.dtype} of {self.path}",
                                key=str(self.path), value=int(ids.max()))
            ids = ids.astype(self.dtype)
        self._file.write(memoryview(np.ascontiguousarray(ids)))
        self.count += ids.size

    def close(self) -> None:
        self._file.seek(0)
        self._file.write(self._header())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shard(path: Path, tokens: np.ndarray, fingerprint: str, dtype: np.dtype | None = None) -> None:
    """Write one array as a shard (dtype defaults to the smallest of uint8/uint16/uint32 that holds the ids)."""
    tokens = np.asarray(tokens)
    if dtype is None:
        dtype = dtype_for_vocab(int(tokens.max()) + 1 if tokens.size else 0)
    with ShardWriter(path, dtype, fingerprint) as writer:
        writer.append(tokens)


def read_header(path: Path) -> tuple[np.dtype, int, str]:
    """(dtype, token count, fingerprint) of a shard, after checking magic, version and size."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"shard {path} does not exist; {REBUILD}")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(HEADER_SIZE)
    if head[: len(MAGIC)] != MAGIC[: len(head)]:  # a short file whose bytes match the magic is truncated, below
        raise ShardError(f"shard {path} is corrupt (wrong magic bytes {head[:8]!r}, expected {MAGIC!r}); {REBUILD}")
    if len(head) < HEADER_SIZE:
        raise ShardError(
            f"shard {path} is truncated ({size} bytes, shorter than its {HEADER_SIZE}-byte header); {REBUILD}"
        )
    _, version, code, count, fingerprint = _HEADER.unpack_from(head)
    if version != VERSION:
        raise ShardError(
            f"shard {path} has format version {version}, this kiln reads version {VERSION}; {REBUILD}"
        )
    if code not in DTYPES:
        raise ShardError(f"shard {path} is corrupt (dtype code {code}, expected 1, 2 or 4); {REBUILD}")
    expected = HEADER_SIZE + count * code
    if size < expected:
        raise ShardError(
            f"shard {path} is truncated ({size} bytes, header says {count} tokens = {expected} bytes); {REBUILD}"
        )
    if size > expected:
        raise ShardError(f"shard {path} is corrupt ({size - expected} bytes after its {count} tokens); {REBUILD}")
    return DTYPES[code], count, fingerprint.decode("ascii", errors="replace")


def read_shard(path: Path, fingerprint: str | None = None) -> np.ndarray:
    """The shard's tokens as a read-only memory map; checks the tokenizer fingerprint when one is given."""
    dtype, count, found = read_header(path)
    if fingerprint is not None and found != fingerprint:
        raise ShardError(
            f"shard {path} was written by tokenizer {found}, but the tokenizer in use is {fingerprint} "
            f"(tokenizer mismatch); {REBUILD}"
        )
    if count == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses to map zero bytes
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(count,))


class ShardedTokens:
    """Several shards read as one 1-D token array, without concatenating them: len(), slicing, integer-array
    indexing (a batch's windows, which may cross a shard boundary) and a chunked max().

    One shard is returned as its own memory map by `open_shards`, so the common small case stays a plain array.
    """

    ndim = 1

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.ends = np.cumsum([len(p) for p in parts])  # exclusive end of each shard in the joint index
        self.starts = self.ends - [len(p) for p in parts]
        self.dtype = parts[0].dtype
        self.shape = (int(self.ends[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            pieces = []
            for part, first, end in zip(self.parts, self.starts, self.ends):
                lo, hi = max(start, first), min(stop, end)
                if lo < hi:
                    pieces.append(part[lo - first: hi - first])
            if len(pieces) == 1:
                return pieces[0]
            return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)
        index = np.asarray(key)
        if index.dtype.kind not in "iu":
            raise TypeError(f"ShardedTokens takes a slice or an integer array, got {type(key).__name__}")
        flat = np.where(index < 0, index + len(self), index).ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range for {len(self)} tokens")
        shard = np.searchsorted(self.ends, flat, side="right")
        out = np.empty(flat.shape, self.dtype)
        for s in np.unique(shard):
            mine = shard == s
            out[mine] = self.parts[s][flat[mine] - self.starts[s]]
        return out.reshape(index.shape)

    def max(self, axis=None, out=None, **unused) -> int:  # np.max(view) calls this
        if axis not in (None, 0) or out is not None:
            raise TypeError("ShardedTokens.max takes no axis or out")
        return max(int(part.max()) for part in self.parts if len(part))

    def __array__(self, dtype=None, copy=None):
        joined = np.concatenate(self.parts)
        return joined.astype(dtype) if dtype is not None else joined

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


def open_shards(paths: list[Path], fingerprint: str | None = None):
    """The shards as one token array: the memory map itself for one shard, a ShardedTokens view for several."""
    parts = [read_shard(p, fingerprint) for p in paths]
    parts = [p for p in parts if len(p)] or parts[:1]
    return parts[0] if len(parts) == 1 else ShardedTokens(parts)
