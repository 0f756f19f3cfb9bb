"""Data: text source -> documents -> train/val split -> tokenizer -> cached token shards -> batches.

    prepare_data(cfg.data, run_dir)      tokenize once into shards under the cache, or reuse them
    TokenLoader(prepared.train, ...)     seeded, resumable random windows for training
    val_batches(prepared.val, ...)       fixed windows for validation

Every document is followed by the tokenizer's end-of-text id (see tokenizer.py), so the model sees where one
file ends and the next begins; windows are sampled across those boundaries like GPT-2's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kiln.data.corpus import STDLIB, CorpusError, Document, load_documents, source_files, split_documents
from kiln.data.loader import TokenLoader, val_batches
from kiln.data.shards import VERSION as SHARD_VERSION
from kiln.data.shards import ShardError, ShardWriter, dtype_for_vocab, read_shard
from kiln.data.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
)

__all__ = [
    "DataConfig", "PreparedData", "prepare_data", "Tokenizer", "ByteTokenizer", "BPETokenizer", "load_tokenizer",
    "TokenLoader", "val_batches", "ShardError", "CorpusError", "unigram_entropy", "cache_root", "cache_dir_for",
    "cached_unigram_loss",
]

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow")
TOKENIZERS = ("bytes", "bpe")
# Bump when the split rule, separator or anything else that changes the tokens (but not the shard layout)
# changes, so old caches are not reused.
PIPELINE_VERSION = 1
_ENCODE_CHUNK = 256  # documents per encode_batch call: enough for the Rust threads, bounded memory


@dataclass
class DataConfig:
    """The `data` section: where text comes from, how it is split and tokenized, and how batches are drawn."""

    source: str = STDLIB  # "stdlib" (this Python's standard library .py files), a file, a directory, or a .jsonl file
    format: str = "auto"  # auto (by extension) | text | jsonl | parquet | arrow (a `datasets` shard; its directory works)
    text_field: str = "text"  # the JSONL field, or the Parquet / `datasets` column, holding each record's text
    pattern: str = "**/*.txt"  # glob of files to read when source is a directory (ignored otherwise)
    tokenizer: str = "bytes"  # "bytes" (256 ids) | "bpe" (byte-level BPE trained on the train split) | hf:DIR (its tokenizer.json)
    vocab_size: int = 4096  # BPE vocabulary size including <|endoftext|>; ignored for bytes (fixed 256)
    val_fraction: float = 0.05  # share of documents held out for validation, chosen by a hash of each document
    seq_len: int = 256  # tokens per training sequence; targets are the inputs shifted by one
    cache_dir: str = ""  # where token shards are cached; "" = $KILN_CACHE, else ~/.cache/kiln
    seed: int = 1337  # seed of the batch sampling order (independent of the model's seed)
    prefetch: int = 2  # batches prepared ahead by a background thread on an accelerator (CPU: on demand); 0 = off
    cache_per_node: bool = False  # multi-node: cache_dir is node-local, so each node's local rank 0 prepares it

    def validate(self) -> None:
        """Raise ValueError naming the field and the fix for the first bad value."""
        if not self.source:
            raise ValueError("data.source is empty; use 'stdlib', a text/JSONL file or a directory")
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r} is unknown; use one of {FORMATS}")
        if not self.text_field:
            raise ValueError("data.text_field is empty; name the JSONL field holding the text, e.g. 'text'")
        if not self.pattern:
            raise ValueError("data.pattern is empty; give a glob such as '**/*.txt'")
        if self.tokenizer.startswith("hf:"):
            if not (Path(self.tokenizer[3:]) / TOKENIZER_FILE).is_file():
                raise ValueError(f"data.tokenizer={self.tokenizer!r}: {Path(self.tokenizer[3:]) / TOKENIZER_FILE} "
                                 f"does not exist; give a Hugging Face model directory that holds one")
        elif self.tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer={self.tokenizer!r} is unknown; use one of {TOKENIZERS} or hf:DIR")
        if self.tokenizer == "bpe" and not 257 <= self.vocab_size <= 2**32:
            raise ValueError(
                f"data.vocab_size={self.vocab_size} is out of range for bpe; it needs 256 byte tokens + "
                f"<|endoftext|>, so use at least 257 (4096-50304 is typical)"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(
                f"data.val_fraction={self.val_fraction} must be strictly between 0 and 1 (e.g. 0.05); "
                f"both splits need text"
            )
        if self.seq_len < 1:
            raise ValueError(f"data.seq_len={self.seq_len} must be >= 1 (e.g. 256)")
        if self.seed < 0:
            raise ValueError(f"data.seed={self.seed} must be >= 0 (numpy seeds are non-negative)")
        if self.prefetch < 0:
            raise ValueError(f"data.prefetch={self.prefetch} must be >= 0 (0 turns prefetching off)")


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train: np.ndarray  # 1-D read-only memory map of token ids (uint16 or uint32)
    val: np.ndarray
    unigram_loss: float  # entropy of the train-split token frequencies, nats/token: the loss of a unigram model
    cache_dir: Path | None = None  # the shard directory in use


def _home_relative(path: Path) -> str:
    """~/... for paths under the home directory: shorter, and the same in every user's logs."""
    try:
        return "~/" + str(Path(path).resolve().relative_to(Path.home().resolve()))
    except ValueError:
        return str(path)


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    env = os.environ.get("KILN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kiln"


def cache_key(cfg: DataConfig) -> str:
    """Hash of everything that decides the tokens: source files (path, size, mtime), split, tokenizer, versions.

    Settings that do not apply are left out (pattern for a file, vocab_size for bytes), so changing them does
    not force a rebuild.
    """
    _, files = source_files(cfg.source, cfg.pattern)
    listing = []
    for path in files:
        st = path.stat()
        listing.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    is_dir = cfg.source != STDLIB and Path(cfg.source).expanduser().is_dir()
    reads_jsonl = cfg.source != STDLIB and cfg.format != "text" and (  # any format whose text is a field
        cfg.format in ("jsonl", "parquet", "arrow")
        or any(p.suffix.lower() in (".jsonl", ".parquet", ".arrow") for p in files)
    )
    recipe = {
        "files": listing,
        "format": cfg.format if cfg.source != STDLIB else None,
        "text_field": cfg.text_field if reads_jsonl else None,
        "pattern": cfg.pattern if is_dir else None,
        "tokenizer": cfg.tokenizer,
        "vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else None,
        "val_fraction": cfg.val_fraction,
        "shard_version": SHARD_VERSION,
        "pipeline_version": PIPELINE_VERSION,
    }
    if cfg.tokenizer.startswith("hf:"):  # only then: the caches of every other recipe keep their keys
        recipe["tokenizer_file"] = _stat(Path(cfg.tokenizer[3:]) / TOKENIZER_FILE)
    blob = json.dumps(recipe, sort_keys=True).encode("utf-8")
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def _stat(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _source_label(source: str) -> str:
    if source == STDLIB:
        return STDLIB
    name = Path(source).expanduser().resolve().name or "data"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """-sum p log p (nats) of the token frequencies: the loss a model predicting only frequencies would get."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk = 1 << 24  # 16M tokens at a time: bincount widens to int64, so whole-array would cost 8 B/token
    for start in range(0, len(tokens), chunk):
        chunk_counts = np.bincount(tokens[start : start + chunk], minlength=vocab_size)
        if len(chunk_counts) > vocab_size:
            raise ValueError(f"token id {len(chunk_counts) - 1} is outside the vocabulary of {vocab_size}")
        counts += chunk_counts
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _write_split(path: Path, docs: list[Document], tok: Tokenizer) -> int:
    eot = np.array([tok.eot_id])
    with ShardWriter(path, dtype_for_vocab(tok.vocab_size), tok.fingerprint) as writer:
        for first in range(0, len(docs), _ENCODE_CHUNK):
            chunk = docs[first : first + _ENCODE_CHUNK]
            encoded = tok.encode_batch([d.text for d in chunk])
            writer.append(np.concatenate([part for ids in encoded for part in (ids, eot.astype(ids.dtype))]))
        return writer.count


def _build(cfg: DataConfig, final: Path, log: Callable[[str], None]) -> None:
    """Read, split, tokenize and write shards into a scratch directory, then rename it into place."""
    docs = load_documents(cfg.source, cfg.format, cfg.text_field, cfg.pattern)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    if cfg.tokenizer == "bpe":
        log(f"data: training BPE tokenizer (vocab {cfg.vocab_size}) on {len(train_docs)} train documents")
    tok = build_tokenizer(cfg.tokenizer, (d.text for d in train_docs), cfg.vocab_size)
    scratch = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        tok.save(scratch)
        train_tokens = _write_split(scratch / "train.bin", train_docs, tok)
        val_tokens = _write_split(scratch / "val.bin", val_docs, tok)
        meta = {
            "built_with": asdict(cfg),
            "docs": len(docs),
            "train_docs": len(train_docs),
            "val_docs": len(val_docs),
            "train_tokens": train_tokens,
            "val_tokens": val_tokens,
            "tokenizer": tok.kind,
            "vocab_size": tok.vocab_size,
            "fingerprint": tok.fingerprint,
        }
        (scratch / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")  # its presence marks "complete"
        try:
            os.rename(scratch, final)
        except OSError:
            if not (final / "meta.json").is_file():
                raise
            # Another process finished the same cache first; its shards are identical, keep them.
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n / 1e3:.1f}k"


def _open_cache(final: Path):
    """(meta, tokenizer, train, val) of a complete cache directory; ShardError (or the loader's own error) when a
    file is missing, unreadable, truncated or holds another number of tokens than meta.json says."""
    meta = json.loads((final / "meta.json").read_text())
    if not (final / TOKENIZER_FILE).is_file():
        raise ShardError(f"{final / TOKENIZER_FILE} is missing from the shard cache")
    tok = load_tokenizer(final)
    train = read_shard(final / "train.bin", tok.fingerprint)
    val = read_shard(final / "val.bin", tok.fingerprint)
    for name, tokens in (("train", train), ("val", val)):
        if len(tokens) != meta[f"{name}_tokens"]:
            raise ShardError(f"{name}.bin holds {len(tokens)} tokens, meta.json says {meta[f'{name}_tokens']}")
    return meta, tok, train, val


def _discard(final: Path) -> None:
    """Move a damaged cache out of the way in one rename (a concurrent reader never sees half of it), then delete."""
    aside = final.with_name(f"{final.name}.damaged-{os.getpid()}")
    os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)


def cache_dir_for(cfg: DataConfig) -> Path:
    """The shard directory of cfg's tokens (it may not be built yet)."""
    kind = "hf" if cfg.tokenizer.startswith("hf:") else cfg.tokenizer  # the directory is in the key, not the name
    return cache_root(cfg) / f"{_source_label(cfg.source)}-{kind}-{cache_key(cfg)}"


def cached_unigram_loss(cfg: DataConfig) -> float | None:
    """The unigram baseline of cfg's training split when its shards are already cached, else None (nothing is
    built: a reader of a finished run should not tokenize a corpus)."""
    try:
        final = cache_dir_for(cfg)
        if not (final / "meta.json").is_file():
            return None
        _, tok, train, _ = _open_cache(final)
    except (CorpusError, ShardError, ValueError, OSError):  # the source is gone here, or the cache is damaged
        return None
    return unigram_entropy(train, tok.vocab_size)


def prepare_data(cfg: DataConfig, run_dir: Path | None = None, log: Callable[[str], None] = print) -> PreparedData:
    """Token shards for cfg, built on the first call and reused while the source and settings are unchanged."""
    cfg.validate()
    final = cache_dir_for(cfg)
    built = not (final / "meta.json").is_file()
    if built:
        _build(cfg, final, log)
    try:
        meta, tok, train, val = _open_cache(final)
    except (ShardError, ValueError, OSError) as e:
        if built:
            raise
        log(f"data: the cache at {_home_relative(final)} is damaged ({e}); rebuilding it")
        _discard(final)
        _build(cfg, final, log)
        built = True
        meta, tok, train, val = _open_cache(final)
    if run_dir is not None:
        tok.save(Path(run_dir))
    log(
        f"data: {_source_label(cfg.source)} {meta['docs']} docs, train {_millions(len(train))} tokens, "
        f"val {_millions(len(val))} tokens ({tok.kind} vocab {tok.vocab_size}, "
        f"{'built' if built else 'cached'} at {_home_relative(final)})"
    )
    return PreparedData(
        tokenizer=tok,
        train=train,
        val=val,
        unigram_loss=unigram_entropy(train, tok.vocab_size),
        cache_dir=final,
    )
