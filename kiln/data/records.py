"""Read one *piece* of a corpus, split its documents between train and val, tokenize them, and write the tokens.

This module is what a `data.workers` process runs, so it imports nothing from kiln and never torch: a worker
costs the interpreter, numpy, `tokenizers` and its piece's buffers (about 60 MB; see docs/benchmarks.md), not
torch's 300+ MB. The parent starts it as `python -I records.py` and talks to it in JSON lines on stdin/stdout.

A piece is a deterministic slice of the input, fixed by the plan and never by the worker count:

    text      a byte range of one text file, cut at line breaks (a text file is one document)
    jsonl     a byte range of a plain .jsonl file, cut at line breaks, or a whole .jsonl.gz / .jsonl.zst file
    parquet   a run of row groups of one Parquet file
    arrow     one `datasets` Arrow shard

Its output is two raw token files (no header), `<out>.train` and `<out>.val`, in the cache's dtype; the parent
copies them into shards in piece order, so any worker count writes the same bytes.
"""
from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import json
import sys

import numpy as np

SUB_CHUNK = 1 << 20  # BPE encodes a long document in line-aligned pieces of about 1 MiB: bounded Encoding objects
FLUSH_TOKENS = 1 << 22  # buffered tokens per split before they are appended to the output file (8-16 MB)
MAX_EXAMPLES = 3  # skipped-record messages kept per piece for the summary


class BadRecord(ValueError):
    """A record that cannot be read: the message names the file, the line or row, and the fix."""


def split_hash(key: str | bytes) -> int:
    """The document's split position as a 64-bit integer (position = hash / 2**64, as kiln.data.corpus); a key
    given as bytes is its UTF-8 encoding."""
    if isinstance(key, str):
        key = key.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


# ---------------------------------------------------------------- encoding


class Encoder:
    """Text -> token ids with the cache's tokenizer: raw UTF-8 bytes, or a `tokenizers` JSON file."""

    def __init__(self, tokenizer_file: str | None, eot_id: int, dtype: str) -> None:
        self.eot = eot_id
        self.dtype = np.dtype(dtype)
        self._tok = None
        if tokenizer_file:
            from tokenizers import Tokenizer  # lazy: the bytes tokenizer needs no `tokenizers`

            self._tok = Tokenizer.from_file(tokenizer_file)
            self._tok.encode_special_tokens = True  # a document quoting <|endoftext|> must not end early

    @property
    def raw_bytes(self) -> bool:
        """True when a document's tokens are its UTF-8 bytes (encode_bytes applies)."""
        return self._tok is None

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self._tok is None:
            return [np.frombuffer(t.encode("utf-8", "surrogatepass"), dtype=np.uint8) for t in texts]
        parts, owners = [], []
        for i, text in enumerate(texts):
            for part in _line_chunks(text):
                parts.append(part)
                owners.append(i)
        encoded = self._tok.encode_batch(parts, add_special_tokens=False)
        out: list[list[np.ndarray]] = [[] for _ in texts]
        for owner, enc in zip(owners, encoded):
            out[owner].append(np.asarray(enc.ids, dtype=np.uint32))
        return [np.concatenate(o) if len(o) != 1 else o[0] for o in out]


def _line_chunks(text: str) -> list[str]:
    """text cut after a line break every SUB_CHUNK characters or so (the whole text when shorter)."""
    if len(text) <= SUB_CHUNK:
        return [text]
    parts, start = [], 0
    while start < len(text):
        end = text.find("\n", start + SUB_CHUNK)
        end = len(text) if end == -1 else end + 1
        parts.append(text[start:end])
        start = end
    return parts


class SplitWriter:
    """Buffers the token arrays of one split and hands them on FLUSH_TOKENS at a time: appended to the file `path`
    (a worker process), or to `sink(tokens)` (the parent, encoding in-process, writes shards directly)."""

    def __init__(self, path: str, dtype: np.dtype, sink=None) -> None:
        self.path, self.dtype, self.sink = path, dtype, sink
        self.file = open(path, "wb") if sink is None else None
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.tokens = 0
        self.docs = 0
        self._out = np.empty(0, dtype)  # reused: a fresh array per flush costs its page faults (4x a copy)

    def add(self, ids: np.ndarray) -> None:
        self.buffer.append(ids)
        self.buffered += len(ids)
        if self.buffered >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        # The dtype holds every id: the parent chose it from the vocabulary (uint16 up to 2**16 ids).
        if len(self._out) < self.buffered:
            self._out = np.empty(max(self.buffered, FLUSH_TOKENS), self.dtype)
        joined = self._out[: self.buffered]
        np.concatenate(self.buffer, out=joined, casting="unsafe")
        self.buffer, self.buffered = [], 0
        if self.sink is not None:
            self.sink(joined)
        else:
            self.file.write(memoryview(joined))
        self.tokens += joined.size

    def close(self) -> None:
        self.flush()
        if self.file is not None:
            self.file.close()


# ---------------------------------------------------------------- reading


def _open_lines(path: str, compression: str | None, start: int, end: int | None):
    """A binary stream over the piece's bytes: [start, end) of a plain file, or the whole decompressed file."""
    if compression == "gz":
        return gzip.open(path, "rb")
    if compression == "zst":
        try:
            import zstandard  # lazy: only .zst sources need it
        except ImportError:
            raise BadRecord(f"{path} is zstd-compressed; reading it needs the zstandard package (pip install "
                            f"zstandard)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    f = open(path, "rb")
    f.seek(start)
    return _Limited(f, None if end is None else end - start)


class _Limited(io.RawIOBase):
    """The first `limit` bytes of a binary file (iterating gives its lines)."""

    def __init__(self, f, limit: int | None) -> None:
        self.f, self.left = f, limit

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = len(b) if self.left is None else min(len(b), self.left)
        data = self.f.read(n)
        b[: len(data)] = data
        if self.left is not None:
            self.left -= len(data)
        return len(data)

    def close(self) -> None:
        self.f.close()
        super().close()


def _line_number(path: str, offset: int) -> int:
    """1-based line number of byte `offset` of a plain file (counted only when an error needs it)."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 24, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def jsonl_records(piece: dict, text_field: str):
    """(key, where, text) of each record of a JSONL piece; BadRecord for a bad line (where = file:line)."""
    path, compression = piece["file"], piece.get("compression")
    start = piece.get("start", 0)

    def where(i: int) -> str:  # file:line, counted only when an error needs it
        return f"{path}:{i + 1}" if compression else f"{path}:{_line_number(path, start) + i}"

    with io.BufferedReader(_open_lines(path, compression, start, piece.get("end")), 1 << 20) as f:
        for i, raw in enumerate(f):
            try:
                record = json.loads(raw)  # bytes: json decodes them as UTF-8 itself
            except UnicodeDecodeError as e:
                yield BadRecord(f"{where(i)}: byte {e.start} of the line is not UTF-8 ({e.reason}); convert the file "
                                f"to UTF-8, or set data.on_bad_record=skip to skip such records"), None, None
                continue
            except json.JSONDecodeError as e:
                if not raw.strip():
                    continue  # a blank line (often the trailing one) is not a record
                yield BadRecord(f"{where(i)}: not valid JSON ({e.msg}); each line must be one JSON object, or set "
                                f"data.on_bad_record=skip to skip such lines"), None, None
                continue
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                yield BadRecord(f"{where(i)}: no field {text_field!r} (found {keys}); set data.text_field to the "
                                f"field holding the text, or data.on_bad_record=skip to skip such records"), None, None
                continue
            text = record[text_field]
            if not isinstance(text, str):
                yield BadRecord(f"{where(i)}: field {text_field!r} is {type(text).__name__}, expected a string; or "
                                f"set data.on_bad_record=skip to skip such records"), None, None
                continue
            # Keyed by content, not line number: inserting a line does not reshuffle the split, and exact
            # duplicates land in the same split, so they cannot leak from train into val.
            yield text, f"{path}:{i + 1}", text


def table_records(piece: dict, text_field: str):
    """(key, where, text) of each row of a Parquet row-group run or a `datasets` Arrow shard."""
    try:
        import pyarrow as pa  # lazy: only Parquet and `datasets` sources need it
        import pyarrow.parquet as pq
    except ImportError:
        raise BadRecord(f"{piece['file']} is {piece['fmt']}; reading it needs pyarrow (pip install pyarrow)") from None
    path = piece["file"]
    try:
        if piece["fmt"] == "parquet":
            pf = pq.ParquetFile(path)
            if text_field not in pf.schema_arrow.names:
                raise BadRecord(f"{path}: no column {text_field!r} (found {pf.schema_arrow.names}); set "
                                f"data.text_field to the column holding the text")
            first, last = piece["row_groups"]
            row = sum(pf.metadata.row_group(g).num_rows for g in range(first))
            batches = (pf.read_row_group(g, columns=[text_field]).to_batches() for g in range(first, last))
            batches = (b for group in batches for b in group)
        else:
            reader = pa.ipc.open_stream(path)  # what `datasets` writes: the Arrow IPC stream format
            if text_field not in reader.schema.names:
                raise BadRecord(f"{path}: no column {text_field!r} (found {reader.schema.names}); set "
                                f"data.text_field to the column holding the text")
            row = 0
            batches = (b.select([text_field]) for b in reader)
        for batch in batches:
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    continue
                if not isinstance(text, str):
                    yield BadRecord(f"{path}: row {row}: column {text_field!r} is {type(text).__name__}, expected a "
                                    f"string; or set data.on_bad_record=skip"), None, None
                    continue
                yield text, f"{path}:row {row}", text
    except (pa.ArrowInvalid, OSError) as e:
        raise BadRecord(f"{path} does not read as {piece['fmt']} ({e}); check the file, or remove it from the "
                        f"source") from None


def text_parts(segment: dict, on_bad: str, stats: dict):
    """The decoded text of a byte range of a text file, in blocks of about 16 MiB."""
    path, start, end = segment["file"], segment["start"], segment["end"]
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if on_bad == "error" else "replace")
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        while offset < end:
            block = f.read(min(1 << 24, end - offset))
            if not block:
                raise BadRecord(f"{path} changed while it was read (shorter than planned); run the prepare again")
            if offset == 0 and b"\0" in block[: 1 << 16]:  # text never holds NUL; an image or archive does
                raise BadRecord(f"{path} looks binary (it holds NUL bytes); kiln reads UTF-8 text: point "
                                f"data.source (or data.pattern) at text files, or use data.format=tokens for token "
                                f"files")
            try:
                text = decoder.decode(block, final=offset + len(block) >= end)
            except UnicodeDecodeError as e:
                raise BadRecord(f"{path}: byte {offset + e.start} is not UTF-8 ({e.reason}); convert the file to "
                                f"UTF-8, or set data.on_bad_record=skip to replace such bytes with U+FFFD") from None
            if on_bad != "error" and "\ufffd" in text and b"\xef\xbf\xbd" not in block:
                stats["skipped"] += 1
                _example(stats, f"{path}: bytes near {offset} are not UTF-8 (replaced with U+FFFD)")
            offset += len(block)
            yield text


def _example(stats: dict, message: str) -> None:
    if len(stats["examples"]) < MAX_EXAMPLES:
        stats["examples"].append(message)


# ---------------------------------------------------------------- one piece


def encode_piece(piece: dict, job: dict, encoder: Encoder, out: str, sinks: dict | None = None) -> dict:
    """Tokenize `piece` into `out`.train / `out`.val (or hand the tokens to sinks[split], in order); returns its
    statistics (documents, tokens, bytes, skipped).

    job: text_field, on_bad_record, val_fraction, flip (the split hash of a document sent to the other split).
    """
    stats = {"docs_train": 0, "docs_val": 0, "tokens_train": 0, "tokens_val": 0, "bytes": piece["bytes"],
             "skipped": 0, "examples": [], "extreme": {"train": None, "val": None}}
    writers = {s: SplitWriter(f"{out}.{s}", encoder.dtype, sinks and sinks[s]) for s in ("train", "val")}
    threshold = job["val_fraction"] * 2**64
    flip = job.get("flip")
    eot = np.array([encoder.eot], dtype=np.uint32)
    try:
        if piece["fmt"] == "text":
            for segment in piece["segments"]:  # byte ranges of text files; a file is one document
                writer = writers[segment["split"]]
                for text in text_parts(segment, job["on_bad_record"], stats):
                    for ids in encoder.encode([text]):
                        writer.add(ids)
                if segment["last"]:  # the document ends in this segment
                    writer.add(eot)
                    writer.docs += 0 if segment.get("tail") else 1  # the val part of a cut document is not another
                    _track_extreme(stats, segment["split"], segment["hash"], segment["file"])
        else:
            records = jsonl_records(piece, job["text_field"]) if piece["fmt"] == "jsonl" else \
                table_records(piece, job["text_field"])
            batch: list[tuple[str, str]] = []
            raw = encoder.raw_bytes
            for key, where, text in records:
                if isinstance(key, BadRecord):
                    if job["on_bad_record"] == "error":
                        raise key
                    stats["skipped"] += 1
                    _example(stats, str(key))
                    continue
                if not text:
                    continue
                data = text.encode("utf-8", "surrogatepass")  # a record's key is its text: one encode for both
                h = split_hash(data)
                split = "val" if h < threshold else "train"
                if h == flip:
                    split = "train" if split == "val" else "val"
                _track_extreme(stats, split, h, where)
                if raw:  # bytes tokenizer: the tokens are these bytes
                    writer = writers[split]
                    writer.add(np.frombuffer(data, dtype=np.uint8))
                    writer.add(eot)
                    writer.docs += 1
                    continue
                batch.append((split, text))
                if len(batch) >= 256:  # enough for the Rust threads, bounded memory
                    _write_batch(batch, encoder, writers, eot)
                    batch = []
            _write_batch(batch, encoder, writers, eot)
        for s, w in writers.items():
            w.close()
            stats[f"tokens_{s}"] = w.tokens
            stats[f"docs_{s}"] = w.docs
    except BaseException:
        for w in writers.values():
            if w.file is not None:
                w.file.close()
        raise
    return stats


def _track_extreme(stats: dict, split: str, h: int, where: str) -> None:
    """The train document with the lowest hash and the val one with the highest: the ones to move across when
    the hash sent every document of a small corpus to one split."""
    best = stats["extreme"][split]
    if best is None or (h < best[0] if split == "train" else h > best[0]):
        stats["extreme"][split] = [h, where]


def _write_batch(batch: list[tuple[str, str]], encoder: Encoder, writers: dict, eot: np.ndarray) -> None:
    if not batch:
        return
    for (split, _), ids in zip(batch, encoder.encode([text for _, text in batch])):
        writers[split].add(ids)
        writers[split].add(eot)
        writers[split].docs += 1


# ---------------------------------------------------------------- the worker process


def serve(stdin=sys.stdin, stdout=sys.stdout) -> None:
    """Worker loop: the first line is the job, each further line a piece to encode; one JSON reply per piece."""
    job = json.loads(stdin.readline())
    encoder = Encoder(job["tokenizer_file"], job["eot_id"], job["dtype"])
    for line in stdin:
        task = json.loads(line)
        try:
            reply = {"index": task["index"], "stats": encode_piece(task["piece"], job, encoder, task["out"])}
        except BadRecord as e:
            reply = {"index": task["index"], "error": str(e)}
        except OSError as e:
            reply = {"index": task["index"], "oserror": [e.errno, e.strerror, e.filename]}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


if __name__ == "__main__":
    serve()
