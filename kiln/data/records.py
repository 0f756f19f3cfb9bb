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

Speed (the bytes tokenizer has no model to run, so reading is the work): a text file's tokens are its own bytes,
checked as UTF-8 a block at a time (`bytes.isascii` first, the strict decoder only for blocks that are not ASCII)
and never decoded to a str; a JSONL block is decoded once and each line parsed by json's C scanner, with
`json.loads` of the line's bytes as the judge of every line the fast path does not take (so the verdicts and error
messages are json.loads's); tokens are gathered in one preallocated buffer per split, not a list of arrays.
"""
from __future__ import annotations

import codecs
import gzip
import io
import json
import math
import sys
from hashlib import sha1 as _sha1

import numpy as np

SUB_CHUNK = 1 << 20  # BPE encodes a long document in line-aligned pieces of about 1 MiB: bounded Encoding objects
FLUSH_TOKENS = 1 << 22  # buffered tokens per split before they are appended to the output file (4-16 MB)
READ_BYTES = 1 << 20  # a JSONL piece is read and decoded this many bytes at a time
TEXT_BLOCK = 1 << 24  # a text file is read, checked and handed on this many bytes at a time
MAX_EXAMPLES = 3  # skipped-record messages kept per piece for the summary
_scan = json.JSONDecoder().scan_once  # json.loads less its Python wrapper: (value, end) of the value at an index


class BadRecord(ValueError):
    """A record that cannot be read: the message names the file, the line or row, and the fix. A ValueError, not a
    KilnError: a worker runs this file importing nothing from kiln; kiln.data.prepare raises it on as a CorpusError."""


def split_hash(key: str | bytes) -> int:
    """The document's split position as a 64-bit integer (position = hash / 2**64, as kiln.data.corpus): the first
    8 bytes of the SHA-1 of the key's UTF-8 bytes, big-endian (a key given as bytes is its UTF-8 encoding).

    Any deterministic hash of the content keeps the split's promises (order-independent; exact duplicates share a
    split); SHA-1 mixes like a cryptographic hash and runs in the CPU's SHA instructions where it has them (x86
    SHA-NI, ARMv8), 0.8 us for a 900-byte record against blake2b's 1.1-1.3 us here: a tenth of a bytes-tokenizer
    prepare's time on JSONL. Not used for security.
    """
    if isinstance(key, str):
        key = key.encode("utf-8", "surrogatepass")
    return int.from_bytes(_sha1(key, usedforsecurity=False).digest()[:8], "big")


def split_rule(val_fraction: float, flip: int | None) -> tuple[bytes, bytes | None]:
    """split_hash's verdict on digests: (threshold, flip) as 8-byte big-endian strings, so that for a document's
    SHA-1 digest d, `d < threshold` is `split_hash < val_fraction * 2**64` (bytes compare like the big-endian
    integers they spell, and a 20-byte digest whose first 8 equal the threshold is the larger) and
    `d[:8] == flip` picks the one document moved across; no int per document."""
    return split_threshold(val_fraction).to_bytes(8, "big"), None if flip is None else flip.to_bytes(8, "big")


def split_threshold(val_fraction: float) -> int:
    """The integer t with split_hash < t exactly when split_hash < val_fraction * 2**64 (an int-to-int compare)."""
    return math.ceil(val_fraction * 2**64)  # h < x  <=>  h < ceil(x) for an integer h (val_fraction < 1: t < 2**64)


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
        """True when a document's tokens are its UTF-8 bytes (the bytes tokenizer)."""
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
    """Gathers the tokens of one split in a preallocated buffer of FLUSH_TOKENS and hands them on when it is full:
    appended to the file `path` (a worker process), or to `sink(tokens)` (the parent, encoding in-process, writes
    shards directly). An array at least as long as the buffer goes on as it is, without a copy."""

    def __init__(self, path: str, dtype: np.dtype, sink=None) -> None:
        self.path, self.dtype, self.sink = path, np.dtype(dtype), sink
        self.file = open(path, "wb") if sink is None else None
        self._out = np.empty(FLUSH_TOKENS, self.dtype)  # reused: a fresh array per flush costs its page faults
        self.fill = 0
        self.tokens = 0
        self.docs = 0

    def add(self, ids: np.ndarray) -> None:
        """Append token ids (any integer dtype; the cache's dtype holds every id, the parent chose it so)."""
        n = len(ids)
        if n >= len(self._out):
            self.flush()
            self._emit(ids if ids.dtype == self.dtype else ids.astype(self.dtype))
            return
        if n > len(self._out) - self.fill:
            self.flush()
        np.copyto(self._out[self.fill: self.fill + n], ids, casting="unsafe")
        self.fill += n

    def add_id(self, token: int) -> None:
        if self.fill == len(self._out):
            self.flush()
        self._out[self.fill] = token
        self.fill += 1

    def flush(self) -> None:
        if self.fill:
            self._emit(self._out[: self.fill])
            self.fill = 0

    def _emit(self, tokens: np.ndarray) -> None:
        if self.sink is not None:
            self.sink(tokens)
        else:
            self.file.write(memoryview(tokens))
        self.tokens += len(tokens)

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
    """(line, text) of each record of a JSONL piece, `line` its 0-based index in the piece ((line, BadRecord) for a
    bad one: its message names file:line); blank lines are skipped. `where(piece, line)` names a record."""
    path, compression = piece["file"], piece.get("compression")
    with io.BufferedReader(_open_lines(path, compression, piece.get("start", 0), piece.get("end")), 1 << 20) as f:
        i, pending = 0, []  # pending: the start of a line whose end is not read yet
        while True:
            block = f.read(READ_BYTES)
            if block:
                cut = block.rfind(b"\n") + 1
                if not cut:  # no line ends in it: read on (a long line is joined once, not grown block by block)
                    pending.append(block)
                    continue
                head = block[:cut]
                if pending:
                    head = b"".join([*pending, head])
                pending = [block[cut:]] if cut < len(block) else []
                block = head
            elif pending:  # the last line, without its line break
                block, pending = b"".join([*pending, b"\n"]), []
            else:
                return
            try:  # one decode for the block; a block that is not UTF-8 is judged line by line below
                lines, fast = block.decode("utf-8").split("\n"), True
            except UnicodeDecodeError:
                lines, fast = block.split(b"\n"), False
            lines.pop()  # the empty string after the block's last line break
            for line in lines:
                if fast:
                    try:
                        record, end = _scan(line, 0)
                        if end == len(line) or not line[end:].strip(" \t\r"):
                            text = record[text_field]
                            if type(text) is str:
                                yield i, text
                                i += 1
                                continue
                    except (StopIteration, ValueError, LookupError, TypeError):
                        pass
                    line = line.encode("utf-8", "surrogatepass")  # the line's own bytes (it decoded strictly)
                verdict = _judge(line, text_field, piece, i)
                if verdict is not None:
                    yield i, verdict
                i += 1


def _judge(raw: bytes, text_field: str, piece: dict, i: int):
    """json.loads's verdict on one line: its text, a BadRecord naming file:line, or None for a blank line."""
    try:
        record = json.loads(raw)  # bytes: json decodes them as UTF-8 itself
    except UnicodeDecodeError as e:
        return BadRecord(f"{where(piece, i)}: byte {e.start} of the line is not UTF-8 ({e.reason}); convert the file "
                         f"to UTF-8, or set data.on_bad_record=skip to skip such records")
    except json.JSONDecodeError as e:
        if not raw.strip():
            return None  # a blank line (often the trailing one) is not a record
        return BadRecord(f"{where(piece, i)}: not valid JSON ({e.msg}); each line must be one JSON object, or set "
                         f"data.on_bad_record=skip to skip such lines")
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        return BadRecord(f"{where(piece, i)}: no field {text_field!r} (found {keys}); set data.text_field to the "
                         f"field holding the text, or data.on_bad_record=skip to skip such records")
    text = record[text_field]
    if not isinstance(text, str):
        return BadRecord(f"{where(piece, i)}: field {text_field!r} is {type(text).__name__}, expected a string; or "
                         f"set data.on_bad_record=skip to skip such records")
    return text


def where(piece: dict, i: int, count_lines: bool = True) -> str:
    """file:line of record `i` of a JSONL piece, file:row N of a table's. The line number of a record in a later
    piece of a plain file costs a read of the file up to it: count_lines=False names it by the piece's byte offset."""
    path = piece["file"]
    if piece["fmt"] != "jsonl":
        return f"{path}:row {i}"
    start = piece.get("start", 0)
    if piece.get("compression") or start == 0:
        return f"{path}:{i + 1}"
    if not count_lines:
        return f"{path}: line {i + 1} after byte {start}"
    return f"{path}:{_line_number(path, start) + i}"


def table_records(piece: dict, text_field: str):
    """(row, text) of each row of a Parquet row-group run or a `datasets` Arrow shard (row: 1-based in the file)."""
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
                    yield row, BadRecord(f"{path}: row {row}: column {text_field!r} is {type(text).__name__}, "
                                         f"expected a string; or set data.on_bad_record=skip")
                    continue
                yield row, text
    except (pa.ArrowInvalid, OSError) as e:
        raise BadRecord(f"{path} does not read as {piece['fmt']} ({e}); check the file, or remove it from the "
                        f"source") from None


def text_parts(segment: dict, on_bad: str, stats: dict, raw: bool = False):
    """The decoded text of a byte range of a text file, in blocks of TEXT_BLOCK bytes (16 MiB).

    raw=True: the blocks' UTF-8 bytes instead (the bytes tokenizer's tokens), checked but never decoded to a str:
    the file's own bytes when they are UTF-8, else (on_bad=skip) with bad bytes replaced by U+FFFD as decoding does.
    """
    path, start, end = segment["file"], segment["start"], segment["end"]
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if on_bad == "error" else "replace")
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        while offset < end:
            block = f.read(min(TEXT_BLOCK, end - offset))
            if not block:
                raise BadRecord(f"{path} changed while it was read (shorter than planned); run the prepare again")
            if offset == 0 and b"\0" in block[: 1 << 16]:  # text never holds NUL; an image or archive does
                raise BadRecord(f"{path} looks binary (it holds NUL bytes); kiln reads UTF-8 text: point "
                                f"data.source (or data.pattern) at text files, or use data.format=tokens for token "
                                f"files")
            final = offset + len(block) >= end
            if raw and block.isascii() and not decoder.getstate()[0]:  # ASCII is UTF-8: nothing to decode
                offset += len(block)
                yield block
                continue
            try:
                text = decoder.decode(block, final=final)
            except UnicodeDecodeError as e:
                raise BadRecord(f"{path}: byte {offset + e.start} is not UTF-8 ({e.reason}); convert the file to "
                                f"UTF-8, or set data.on_bad_record=skip to replace such bytes with U+FFFD") from None
            replaced = on_bad != "error" and "\ufffd" in text and b"\xef\xbf\xbd" not in block
            if replaced:
                stats["skipped"] += 1
                _example(stats, f"{path}: bytes near {offset} are not UTF-8 (replaced with U+FFFD)")
            offset += len(block)
            if raw:  # strict: the block is UTF-8 (a character cut at its end is checked with the next block)
                yield text.encode("utf-8", "surrogatepass") if on_bad != "error" else block
            else:
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
    try:
        if piece["fmt"] == "text":
            for segment in piece["segments"]:  # byte ranges of text files; a file is one document
                writer = writers[segment["split"]]
                for part in text_parts(segment, job["on_bad_record"], stats, raw=encoder.raw_bytes):
                    if encoder.raw_bytes:
                        writer.add(np.frombuffer(part, np.uint8))
                    else:
                        for ids in encoder.encode([part]):
                            writer.add(ids)
                if segment["last"]:  # the document ends in this segment
                    writer.add_id(encoder.eot)
                    writer.docs += 0 if segment.get("tail") else 1  # the val part of a cut document is not another
                    _track_extreme(stats, segment["split"], segment["hash"], segment["file"])
        else:
            _encode_records(piece, job, encoder, writers, stats)
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


def _encode_records(piece: dict, job: dict, encoder: Encoder, writers: dict, stats: dict) -> None:
    """The records of a JSONL or table piece, each to the split its hash picks; the loop runs once per record, so
    it keeps to locals, compares digests as bytes (split_rule) and, for bytes tokens, copies each text's bytes into
    the split's buffer."""
    records = jsonl_records(piece, job["text_field"]) if piece["fmt"] == "jsonl" else \
        table_records(piece, job["text_field"])
    threshold, flip = split_rule(job["val_fraction"], job.get("flip"))
    sha1, eot, raw = _sha1, encoder.eot, encoder.raw_bytes
    train, val = writers["train"], writers["val"]
    low = high = None  # the lowest train digest and the highest val one, and their records (see _track_extreme)
    batch: list[tuple[SplitWriter, str]] = []
    texts = {train: bytearray(), val: bytearray()}  # bytes tokens, EOT after each text, until FLUSH_TOKENS
    for i, text in records:
        if type(text) is not str:  # a BadRecord
            if job["on_bad_record"] == "error":
                raise text
            stats["skipped"] += 1
            _example(stats, str(text))
            continue
        if not text:
            continue
        # Keyed by content, not line number: inserting a line does not reshuffle the split, and exact duplicates
        # land in the same split, so they cannot leak from train into val. One encode for the key and the tokens.
        data = text.encode("utf-8", "surrogatepass")
        digest = sha1(data, usedforsecurity=False).digest()  # split_hash, compared as bytes (split_rule)
        to_val = digest < threshold
        if flip is not None and digest[:8] == flip:
            to_val = not to_val
        if to_val:
            if high is None or digest > high[0]:
                high = (digest, i)
        elif low is None or digest < low[0]:
            low = (digest, i)
        writer = val if to_val else train
        writer.docs += 1
        if raw:  # bytes tokenizer: the tokens are these bytes
            buffer = texts[writer]
            buffer += data
            buffer.append(eot)
            if len(buffer) >= FLUSH_TOKENS:
                writer.add(np.frombuffer(buffer, np.uint8))
                texts[writer] = bytearray()  # a new one: the old may still be viewed until the add returns
            continue
        batch.append((writer, text))
        if len(batch) >= 256:  # enough for the Rust threads, bounded memory
            _write_batch(batch, encoder)
            batch = []
    _write_batch(batch, encoder)
    for writer, buffer in texts.items():
        if buffer:
            writer.add(np.frombuffer(buffer, np.uint8))
    for split, best in (("train", low), ("val", high)):
        if best is not None:
            stats["extreme"][split] = [int.from_bytes(best[0][:8], "big"), where(piece, best[1], count_lines=False)]


def _track_extreme(stats: dict, split: str, h: int, where: str) -> None:
    """The train document with the lowest hash and the val one with the highest: the ones to move across when
    the hash sent every document of a small corpus to one split."""
    best = stats["extreme"][split]
    if best is None or (h < best[0] if split == "train" else h > best[0]):
        stats["extreme"][split] = [h, where]


def _write_batch(batch: list[tuple[SplitWriter, str]], encoder: Encoder) -> None:
    if not batch:
        return
    for (writer, _), ids in zip(batch, encoder.encode([text for _, text in batch])):
        writer.add(ids)
        writer.add_id(encoder.eot)


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
