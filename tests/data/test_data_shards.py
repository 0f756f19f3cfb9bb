"""Shard files: header, round trips, and each kind of damage giving its own error."""
import struct

import numpy as np
import pytest

from kiln.data.shards import (
    HEADER_SIZE,
    MAGIC,
    ShardError,
    ShardWriter,
    dtype_for_vocab,
    read_header,
    read_shard,
    write_shard,
)

FP = "0123456789abcdef"


@pytest.mark.parametrize("dtype, top", [(np.uint8, 255), (np.uint16, 65535), (np.uint32, 2**32 - 1)])
def test_round_trip(tmp_path, dtype, top):
    tokens = np.array([0, 1, 2, top, 7, top - 1], dtype=dtype)
    path = tmp_path / "s.bin"
    write_shard(path, tokens, FP, dtype=dtype)
    back = read_shard(path, FP)
    assert isinstance(back, np.memmap) and back.dtype == dtype
    np.testing.assert_array_equal(back, tokens)
    assert read_header(path) == (np.dtype(dtype), len(tokens), FP)
    assert path.stat().st_size == HEADER_SIZE + tokens.nbytes
    assert path.read_bytes()[:8] == MAGIC


def test_dtype_follows_vocab_size(tmp_path):
    assert dtype_for_vocab(256) == np.uint8 and dtype_for_vocab(257) == np.uint16  # bytes: uint8; BPE: wider
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32
    write_shard(tmp_path / "big.bin", np.array([70000]), FP)  # default dtype picked from the largest id
    assert read_shard(tmp_path / "big.bin").dtype == np.uint32


def test_streamed_writes_concatenate(tmp_path):
    with ShardWriter(tmp_path / "s.bin", np.uint16, FP) as w:
        w.append(np.arange(5))
        w.append(np.array([], dtype=np.int64))
        w.append(np.arange(5, 9, dtype=np.uint8))
    np.testing.assert_array_equal(read_shard(tmp_path / "s.bin"), np.arange(9))


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "s.bin", np.uint16, FP) as w:
            w.append(np.arange(5))
            raise RuntimeError("tokenizer crashed")
    assert list(tmp_path.iterdir()) == []


def test_id_too_large_for_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not fit"):
        write_shard(tmp_path / "s.bin", np.array([65536]), FP, dtype=np.uint16)


def test_empty_shard(tmp_path):
    write_shard(tmp_path / "s.bin", np.array([], dtype=np.uint16), FP)
    assert len(read_shard(tmp_path / "s.bin", FP)) == 0


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "train.bin"
    write_shard(path, np.arange(100, dtype=np.uint16), FP)
    return path


def test_wrong_magic_is_corrupt(shard):
    data = bytearray(shard.read_bytes())
    data[:4] = b"GPT2"
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"train\.bin is corrupt \(wrong magic.*delete it and re-run"):
        read_shard(shard, FP)


def test_truncated_data(shard):
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(ShardError, match=r"train\.bin is truncated .*header says 100 tokens.*delete it"):
        read_shard(shard, FP)


def test_truncated_header(shard):
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(ShardError, match=r"truncated .*shorter than its 64-byte header"):
        read_shard(shard)


def test_trailing_bytes_are_corrupt(shard):
    shard.write_bytes(shard.read_bytes() + b"\0\0")
    with pytest.raises(ShardError, match="corrupt .*2 bytes after"):
        read_shard(shard)


def test_unsupported_version(shard):
    data = bytearray(shard.read_bytes())
    data[8:12] = struct.pack("<I", 99)
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="format version 99, this kiln reads version 1"):
        read_shard(shard)


def test_tokenizer_fingerprint_mismatch(shard):
    read_shard(shard)  # no expectation: no check
    with pytest.raises(ShardError, match=f"written by tokenizer {FP}.*fedcba9876543210.*mismatch.*delete it"):
        read_shard(shard, "fedcba9876543210")


def test_missing_shard(tmp_path):
    with pytest.raises(ShardError, match="does not exist"):
        read_shard(tmp_path / "nope.bin")
