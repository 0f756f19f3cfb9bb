"""Where the text comes from: the stdlib default corpus, text files, directories, JSONL; and the train/val split.

A *document* is one file (stdlib, text file, each file of a directory) or one JSONL record. The split is by
document, decided by a hash of the document's key, so it never depends on how many documents there are or on
their order, and a document never straddles the two splits.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

STDLIB = "stdlib"
# Directories of the standard library that are not "the standard library" as prose: installed third-party
# packages, and test suites / IDLE, which on 3.11 would add ~900 files of repetitive fixtures to the 674 we keep.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})


class CorpusError(ValueError):
    """The source cannot be read as configured (missing path, no matching files, malformed JSONL)."""


@dataclass(frozen=True)
class Document:
    key: str  # stable identity used by the split hash: relative path, or the record text for JSONL
    name: str  # human-readable location for messages: "json/decoder.py", "data.jsonl:12"
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The running interpreter's own .py sources, minus tests and installed packages, in sorted order."""
    root = stdlib_root()
    files = []
    for directory, subdirs, names in os.walk(root):
        # Pruning here, rather than filtering rglob's output, skips walking site-packages at all.
        subdirs[:] = [d for d in subdirs if d not in STDLIB_EXCLUDED_DIRS]
        files.extend(Path(directory) / n for n in names if n.endswith(".py"))
    if not files:
        raise CorpusError(f"data.source='stdlib' found no .py files under {root}; point data.source at your own text")
    return sorted(files)


def source_files(source: str, pattern: str) -> tuple[Path, list[Path]]:
    """(root, files) of a source: the files whose contents make up the corpus, sorted.

    The root is what document keys are relative to, so moving a whole corpus directory keeps its split.
    """
    if source == STDLIB:
        return stdlib_root(), stdlib_files()
    path = Path(source).expanduser()
    if path.is_file():
        return path.parent, [path]
    if path.is_dir() and (path / "state.json").is_file():  # a Hugging Face `datasets` save_to_disk directory
        try:
            shards = json.loads((path / "state.json").read_text())["_data_files"]
        except (json.JSONDecodeError, KeyError):
            raise CorpusError(f"{path / 'state.json'} is not a `datasets` state file (no _data_files)") from None
        return path, [path / shard["filename"] for shard in shards]
    if path.is_dir():
        files = sorted(p for p in path.glob(pattern) if p.is_file())
        if not files:
            raise CorpusError(f"data.source={source!r} is a directory but no file matches data.pattern={pattern!r}")
        return path, files
    raise CorpusError(f"data.source={source!r} does not exist; give 'stdlib', a text, JSONL or Parquet file, a "
                      f"directory, or a `datasets` save_to_disk directory")


def file_format(path: Path, fmt: str) -> str:
    """'auto' means by extension: .jsonl is JSONL, .parquet Parquet, .arrow Arrow (`datasets`), the rest text."""
    if fmt != "auto":
        return fmt
    return {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}.get(path.suffix.lower(), "text")


def read_table(path: Path, fmt: str, text_field: str, root: Path) -> list[Document]:
    """The `text_field` column of a Parquet file or a `datasets` Arrow shard, read a batch of rows at a time (no
    other column is read)."""
    try:
        import pyarrow as pa  # lazy: only Parquet and `datasets` sources need it
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path} is {fmt}; reading it needs pyarrow (pip install pyarrow)") from None
    rel = path.relative_to(root).as_posix()
    try:
        if fmt == "parquet":
            table = pq.ParquetFile(path)
            names = table.schema_arrow.names
            batches = table.iter_batches(columns=[text_field], batch_size=4096) if text_field in names else None
        else:
            reader = pa.ipc.open_stream(path)  # what `datasets` writes: the Arrow IPC stream format
            names = reader.schema.names
            batches = (b.select([text_field]) for b in reader) if text_field in names else None
    except (pa.ArrowInvalid, OSError) as e:
        raise CorpusError(f"{path} does not read as {fmt} ({e})") from None
    if batches is None:
        raise CorpusError(f"{path}: no column {text_field!r} (found {names}); set data.text_field to the column "
                          f"holding the text")
    docs, row = [], 0
    for batch in batches:
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                continue
            if not isinstance(text, str):
                raise CorpusError(f"{path}: row {row}: column {text_field!r} is {type(text).__name__}, expected a "
                                  f"string")
            docs.append(Document(key=text, name=f"{rel}:{row}", text=text))
    return docs


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if b"\0" in data[:1 << 16]:  # text never holds NUL; an image, archive or token file does
        raise CorpusError(f"data.source: {path} looks binary (it holds NUL bytes); kiln trains on UTF-8 text or JSONL: "
                          f"point data.source (or data.pattern) at text files")
    # errors="replace": one stray Latin-1 byte should not stop a run; it becomes U+FFFD, which is visible.
    return data.decode("utf-8", errors="replace")


def read_jsonl(path: Path, text_field: str, root: Path) -> list[Document]:
    rel = path.relative_to(root).as_posix()
    docs = []
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # a blank line (often the trailing one) is not a record
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise CorpusError(
                    f"{where}: no field {text_field!r} (found {keys}); "
                    f"set data.text_field to the field holding the text"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise CorpusError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string")
            # Keyed by content, not line number: inserting a line does not reshuffle the split, and exact
            # duplicate records land in the same split, so they cannot leak from train into val.
            docs.append(Document(key=text, name=f"{rel}:{lineno}", text=text))
    return docs


def load_documents(
    source: str, fmt: str = "auto", text_field: str = "text", pattern: str = "**/*.txt"
) -> list[Document]:
    """Every non-empty document of the source, in a deterministic order."""
    root, files = source_files(source, pattern)
    docs: list[Document] = []
    for path in files:
        kind = file_format(path, fmt) if source != STDLIB else "text"
        if kind == "jsonl":
            docs.extend(read_jsonl(path, text_field, root))
        elif kind in ("parquet", "arrow"):
            docs.extend(read_table(path, kind, text_field, root))
        else:
            rel = path.relative_to(root).as_posix()
            docs.append(Document(key=rel, name=rel, text=read_text(path)))
    docs = [d for d in docs if d.text]
    if not docs:
        raise CorpusError(f"data.source={source!r} holds no text (every document is empty)")
    return docs


def split_position(key: str) -> float:
    """A uniform number in [0, 1) fixed by the key alone (8 bytes of blake2b)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, val): a document goes to val when its hash position falls below val_fraction.

    Both splits are always non-empty: a single document is cut at (1 - val_fraction) of its text, at a line
    break near the cut when there is one; with several documents where the hash sent all of them one way, the
    one with the lowest (val) or highest (train) position moves across.
    """
    if len(docs) == 1:
        return _cut_document(docs[0], val_fraction)
    positions = [split_position(d.key) for d in docs]
    train = [d for d, p in zip(docs, positions) if p >= val_fraction]
    val = [d for d, p in zip(docs, positions) if p < val_fraction]
    if not val:
        lowest = min(range(len(docs)), key=positions.__getitem__)
        val = [docs[lowest]]
        train = [d for i, d in enumerate(docs) if i != lowest]
    elif not train:
        highest = max(range(len(docs)), key=positions.__getitem__)
        train = [docs[highest]]
        val = [d for i, d in enumerate(docs) if i != highest]
    return train, val


def _cut_document(doc: Document, val_fraction: float) -> tuple[list[Document], list[Document]]:
    text = doc.text
    if len(text) < 2:
        raise CorpusError(f"{doc.name}: the only document has {len(text)} character(s); too little to split")
    cut = min(max(1, round(len(text) * (1 - val_fraction))), len(text) - 1)
    # Prefer to cut just after a newline within 1% of the text, so val starts on a fresh line.
    newline = text.rfind("\n", max(1, cut - len(text) // 100), cut)
    if newline != -1:
        cut = newline + 1
    train = Document(key=doc.key + "#train", name=doc.name + " (train part)", text=text[:cut])
    val = Document(key=doc.key + "#val", name=doc.name + " (val part)", text=text[cut:])
    return [train], [val]
