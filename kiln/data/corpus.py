"""Where the text comes from: the stdlib default corpus, a file, a directory (glob), a `datasets` directory.

A *document* is one text file or one record (JSONL line, Parquet or Arrow row). Its split is decided by a hash of
its key (the path relative to the source, or the record's text: kiln.data.records), so it never depends on how
many documents there are or on their order, and a document never straddles the two splits.
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

from kiln.errors import KilnError

STDLIB = "stdlib"
# Directories of the standard library that are not "the standard library" as prose: installed third-party
# packages, and test suites / IDLE, which on 3.11 would add ~900 files of repetitive fixtures to the 674 we keep.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})


# What data.format=auto reads a file as, by its extension (after a compression suffix, which JSONL may carry);
# any other file is text. kiln.data.prepare.file_kind dispatches on these tables, and what data.source accepts is
# written from them (sources(): the key's help and the errors), so the words cannot fall behind the code.
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSIONS = {".gz": "gz", ".zst": "zst"}  # read for JSONL only (a stream: no byte ranges to cut)
FORMAT_NAMES = {"jsonl": "JSONL", "parquet": "Parquet", "arrow": "Arrow"}


def by_extension() -> str:
    """data.format=auto's rule in words, from EXTENSIONS: '.jsonl, .json, .ndjson (.gz, .zst too): jsonl; ...'."""
    rules = []
    for fmt in dict.fromkeys(EXTENSIONS.values()):
        packed = f" ({', '.join(COMPRESSIONS)} too)" if fmt == "jsonl" else ""
        rules.append(f"{', '.join(ext for ext, f in EXTENSIONS.items() if f == fmt)}{packed}: {fmt}")
    return "; ".join(rules) + "; any other: text"


def sources() -> str:
    """What data.source accepts, in words: the forms source_files and token_files take, and the file kinds of
    EXTENSIONS."""
    kinds = []
    for fmt in dict.fromkeys(EXTENSIONS.values()):
        shown = ", ".join(ext for ext, f in EXTENSIONS.items() if f == fmt)
        packed = f"; {' or '.join(COMPRESSIONS)} compressed too" if fmt == "jsonl" else ""
        kinds.append(f"a{'n' if FORMAT_NAMES[fmt][0] in 'AEIOU' else ''} {FORMAT_NAMES[fmt]} file ({shown}{packed})")
    forms = [f"'{STDLIB}' (this Python's standard library .py files)", "a text file (any other extension)", *kinds,
             "a directory (its files matching data.pattern, each read by its extension)",
             "a `datasets` save_to_disk directory (its state.json's Arrow shards)",
             "token files (data.format=tokens: nanoGPT train.bin/val.bin or llm.c shards)"]
    return ", ".join(forms[:-1]) + ", or " + forms[-1]


class CorpusError(KilnError):
    """The source cannot be read as configured (missing path, no matching files, malformed JSONL)."""


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
    raise CorpusError(f"data.source={source!r} does not exist; give {sources()}")
