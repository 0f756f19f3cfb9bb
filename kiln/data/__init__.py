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
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kiln.data.corpus import STDLIB, CorpusError, by_extension, source_files, sources
from kiln.data.loader import TokenLoader, val_batches
from kiln.data.chat_data import prepare_chat
from kiln.data.mix import Mixture, check_mix, mix_sources
from kiln.data.packing import PackedMixture, PackedWindows
from kiln.data import prepare as _prepare
from kiln.data.prepare import (
    Progress,
    _write_json,
    cache_lock,
    encode_all,
    entropy,
    extremes,
    file_kind,
    plan_pieces,
    summarize,
    tokenizer_sample,
    worker_count,
)
from kiln.data.pretokenized import check_ids, join, read_tokens, token_files
from kiln.data.sft import check_chat
from kiln.data.shards import VERSION as SHARD_VERSION
from kiln.data.shards import ShardError, dtype_for_vocab, open_shards
from kiln.data.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    IdsTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
)
from kiln.errors import KilnError

__all__ = [
    "DataConfig", "PreparedData", "prepare_data", "Tokenizer", "ByteTokenizer", "BPETokenizer", "load_tokenizer",
    "TokenLoader", "val_batches", "ShardError", "CorpusError", "unigram_entropy", "cache_root", "cache_dir_for",
    "cached_unigram_loss", "Mixture", "progress_line", "summary_line",
]

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow", "tokens")
ON_BAD_RECORD = ("error", "skip")
TOKENIZERS = ("bytes", "bpe")
# Bump when the split rule, separator or anything else that changes the tokens (but not the shard layout)
# changes, so old caches are not reused.
# 2: streamed pieces into shards of data.shard_tokens (train-00000.bin, ...), strict UTF-8, BPE on a sample.
# 3: bytes-tokenizer shards hold uint8 (dtype code 1), which a kiln of version 2 cannot read; the split hash is
#    SHA-1's first 8 bytes (was blake2b's).
PIPELINE_VERSION = 3


@dataclass
class DataConfig:
    """The `data` section: where text comes from, how it is split and tokenized, and how batches are drawn."""

    source: str = field(default=STDLIB, metadata={"help": sources()})  # help: what kiln.data.corpus reads
    format: str = field(default="auto", metadata={"help": (  # auto's rule from the table file_kind reads
        f"auto (by extension: {by_extension()}) | text | jsonl | parquet | arrow (a `datasets` shard; its directory "
        f"works) | tokens (pre-tokenized nanoGPT train.bin/val.bin or llm.c shards; the model's vocabulary is then "
        f"data.vocab_size)")})
    text_field: str = "text"  # the JSONL field, or the Parquet / `datasets` column, holding each record's text
    pattern: str = "**/*.txt"  # glob of files to read when source is a directory (ignored otherwise)
    tokenizer: str = "bytes"  # "bytes" (256 ids) | "bpe" (byte-level BPE trained on the train split; one for all [[data.mix]] sources) | hf:DIR (its tokenizer.json)
    vocab_size: int = 4096  # the vocabulary: BPE's size including <|endoftext|> (bpe), the token files' (format=tokens, e.g. 50257 for GPT-2); ignored for bytes (256) and hf:DIR (its own)
    val_fraction: float = 0.05  # share of documents held out for validation, chosen by a hash of each document
    seq_len: int = 256  # tokens per training sequence; targets are the inputs shifted by one
    cache_dir: str = ""  # where token shards are cached; "" = $KILN_CACHE, else ~/.cache/kiln
    seed: int = 1337  # seed of the batch sampling order (independent of the model's seed)
    prefetch: int = 2  # batches prepared ahead by a background thread on an accelerator (CPU: on demand); 0 = off
    workers: int = 0  # tokenizer processes of a prepare; 0 = one per CPU core. The shards are the same bytes for any count
    shard_tokens: int = 100_000_000  # tokens per shard file (uint8 for the bytes tokenizer, uint16 when the vocabulary fits, else uint32)
    tokenizer_sample_bytes: int = 100_000_000  # characters of train text, drawn from seeded pieces, that BPE trains on (bounds its memory); a [[data.mix]] shares them among its sources by weight
    on_bad_record: str = "error"  # error: stop at the first unreadable record, naming file and line | skip: skip it and count it in the summary
    mix: tuple = ()  # [[data.mix]] tables {source, weight, name, format, text_field, pattern}: a weighted mixture instead of data.source
    cache_per_node: bool = False  # multi-node: cache_dir is node-local, so each node's local rank 0 prepares it
    records: str = "text"  # text: each record is plain text (pretraining) | chat: `messages` [{role, content}] (system/user/assistant) or prompt/completion pairs, rendered with the chat template and packed whole into seq_len + 1 windows, a longer one skipped and counted (fine-tuning; kiln.data.sft, chat_data, packing)
    chat_template: str = ""  # records=chat: "" = the tokenizer's own (data.tokenizer=hf:DIR, or implied by model.init=hf:DIR) | chatml | PATH.jinja
    train_on: str = "assistant"  # records=chat: assistant (the loss counts every assistant turn's content and its end-of-turn token, not the role header; a completion) | all (every token); metrics.jsonl's loss_tokens counts them
    document_mask: bool | None = None  # attention and positions (RoPE, GPT-2's table) restart at every document in a window and a document's last target is not counted (text: documents end at the end-of-text id); None = true for records=chat, false for text. Not with parallel.pp > 1 or train.kernels=triton

    def validate(self) -> None:
        """Raise ValueError naming the field and the fix for the first bad value."""
        if not self.source:
            raise KilnError(f"data.source is empty; give {sources()}",
                            key="data.source", value=self.source, fix=f"give {sources()}")
        if self.format not in FORMATS:
            raise KilnError(f"data.format={self.format!r} is unknown; use one of {FORMATS}",
                            key="data.format", value=self.format, fix=f"use one of {FORMATS}")
        if not self.text_field:
            raise KilnError("data.text_field is empty; name the JSONL field holding the text, e.g. 'text'",
                            key="data.text_field", value=self.text_field,
                            fix="name the JSONL field holding the text, e.g. 'text'")
        if not self.pattern:
            raise KilnError("data.pattern is empty; give a glob such as '**/*.txt'",
                            key="data.pattern", value=self.pattern, fix="give a glob such as '**/*.txt'")
        if self.tokenizer.startswith("hf:"):
            if not (Path(self.tokenizer[3:]) / TOKENIZER_FILE).is_file():
                raise KilnError(f"data.tokenizer={self.tokenizer!r}: {Path(self.tokenizer[3:]) / TOKENIZER_FILE} "
                                f"does not exist; give a Hugging Face model directory that holds one",
                                key="data.tokenizer", value=self.tokenizer,
                                fix="give a Hugging Face model directory that holds one")
        elif self.tokenizer not in TOKENIZERS:
            raise KilnError(f"data.tokenizer={self.tokenizer!r} is unknown; use one of {TOKENIZERS} or hf:DIR",
                            key="data.tokenizer", value=self.tokenizer, fix=f"use one of {TOKENIZERS} or hf:DIR")
        if self.tokenizer == "bpe" and not 257 <= self.vocab_size <= 2**32:
            raise KilnError(
                f"data.vocab_size={self.vocab_size} is out of range for bpe; it needs 256 byte tokens + "
                f"<|endoftext|>, so use at least 257 (4096-50304 is typical)",
                key="data.vocab_size", value=self.vocab_size, fix="use at least 257 (4096-50304 is typical)"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise KilnError(
                f"data.val_fraction={self.val_fraction} must be strictly between 0 and 1 (e.g. 0.05); "
                f"both splits need text",
                key="data.val_fraction", value=self.val_fraction, fix="give a fraction strictly between 0 and 1 (e.g. 0.05)"
            )
        if self.seq_len < 1:
            raise KilnError(f"data.seq_len={self.seq_len} must be >= 1 (e.g. 256)",
                            key="data.seq_len", value=self.seq_len, fix="give a length ≥ 1 (e.g. 256)")
        if self.seed < 0:
            raise KilnError(f"data.seed={self.seed} must be >= 0 (numpy seeds are non-negative)",
                            key="data.seed", value=self.seed, fix="give a seed ≥ 0")
        if self.prefetch < 0:
            raise KilnError(f"data.prefetch={self.prefetch} must be >= 0 (0 turns prefetching off)",
                            key="data.prefetch", value=self.prefetch, fix="give a count ≥ 0 (0 turns prefetching off)")
        if self.workers < 0:
            raise KilnError(f"data.workers={self.workers} must be >= 0 (0 = one per CPU core)",
                            key="data.workers", value=self.workers, fix="give a count ≥ 0 (0 = one per CPU core)")
        if self.shard_tokens < 1:
            raise KilnError(f"data.shard_tokens={self.shard_tokens} must be >= 1 (e.g. 100_000_000)",
                            key="data.shard_tokens", value=self.shard_tokens,
                            fix="give a count ≥ 1 (e.g. 100_000_000)")
        if self.tokenizer_sample_bytes < 1:
            raise KilnError(f"data.tokenizer_sample_bytes={self.tokenizer_sample_bytes} must be >= 1 (e.g. "
                            f"100_000_000)",
                            key="data.tokenizer_sample_bytes", value=self.tokenizer_sample_bytes,
                            fix="give a count ≥ 1 (e.g. 100_000_000)")
        if self.on_bad_record not in ON_BAD_RECORD:
            raise KilnError(f"data.on_bad_record={self.on_bad_record!r} is unknown; use one of {ON_BAD_RECORD}",
                            key="data.on_bad_record", value=self.on_bad_record, fix=f"use one of {ON_BAD_RECORD}")
        if self.format == "tokens" and not 2 <= self.vocab_size <= 2**32:
            raise KilnError(f"data.vocab_size={self.vocab_size}: with data.format=tokens it is the token files' "
                            f"vocabulary (e.g. 50257 for GPT-2)",
                            key="data.vocab_size", value=self.vocab_size,
                            fix="give the token files' vocabulary (e.g. 50257 for GPT-2)")
        if self.masks_documents and self.records == "text" and self.format == "tokens" \
                and not self.tokenizer.startswith("hf:"):
            raise KilnError("data.document_mask=true finds documents by their end-of-text id, which "
                            "data.format=tokens does not know without the files' tokenizer; give "
                            "--data.tokenizer=hf:DIR or set --data.document_mask=false",
                            key="data.document_mask", value=self.document_mask,
                            fix="give --data.tokenizer=hf:DIR or set --data.document_mask=false")
        if self.mix:
            check_mix(self)
        for one in [o for _, _, o in mix_sources(self)] if self.mix else [self]:
            check_chat(one)  # data.records, chat_template, train_on, document_mask (kiln.data.sft)

    @property
    def masks_documents(self) -> bool:
        """Whether windows carry their documents (kiln.data.documents): data.document_mask, or by records."""
        return self.records == "chat" if self.document_mask is None else bool(self.document_mask)


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train: np.ndarray  # 1-D read-only memory map of token ids (uint16 or uint32)
    val: np.ndarray
    unigram_loss: float  # entropy of the train-split token frequencies, nats/token: the loss of a unigram model
    cache_dir: Path | None = None  # the shard directory in use (a mixture's: its first source's)
    sources: list | None = None  # a [[data.mix]]: (name, weight, PreparedData) per source; None for one source


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


def cache_key(cfg: DataConfig, shared: Tokenizer | None = None) -> str:
    """Hash of everything that decides the tokens: source files (path, size, mtime), split, tokenizer, versions.

    Settings that do not apply are left out (pattern for a file, vocab_size for bytes), so changing them does
    not force a rebuild. The worker count is not in it: every count writes the same bytes. `shared`: the BPE
    tokenizer of a [[data.mix]], trained across its sources; its fingerprint (vocabulary and merges) stands in for
    the settings that trained it.
    """
    if cfg.format == "tokens":
        files = token_files(cfg.source)
        recipe = {"tokens": {k: [_stat(p) for p in v] for k, v in files.items()}, "vocab_size": cfg.vocab_size,
                  "tokenizer": cfg.tokenizer, "pipeline_version": PIPELINE_VERSION}
        if cfg.tokenizer.startswith("hf:"):
            recipe["tokenizer_file"] = _stat(Path(cfg.tokenizer[3:]) / TOKENIZER_FILE)
        return hashlib.blake2b(json.dumps(recipe, sort_keys=True).encode(), digest_size=8).hexdigest()
    recipe = _recipe(cfg)
    if shared is not None:
        recipe.update(vocab_size=None, tokenizer_sample_bytes=None, tokenizer_fingerprint=shared.fingerprint)
    blob = json.dumps(recipe, sort_keys=True).encode("utf-8")
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def _recipe(cfg: DataConfig) -> dict:
    """What decides a text source's tokens (cache_key's input)."""
    _, files = source_files(cfg.source, cfg.pattern)
    listing = []
    for path in files:
        st = path.stat()
        listing.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    is_dir = cfg.source != STDLIB and Path(cfg.source).expanduser().is_dir()
    reads_records = cfg.source != STDLIB and any(file_kind(p, cfg.format)[0] != "text" for p in files)
    recipe = {
        "files": listing,
        "format": cfg.format if cfg.source != STDLIB else None,
        "text_field": cfg.text_field if reads_records else None,
        "pattern": cfg.pattern if is_dir else None,
        "tokenizer": cfg.tokenizer,
        "vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else None,
        "tokenizer_sample_bytes": cfg.tokenizer_sample_bytes if cfg.tokenizer == "bpe" else None,
        "val_fraction": cfg.val_fraction,
        "shard_tokens": cfg.shard_tokens,
        "on_bad_record": cfg.on_bad_record,
        "piece_bytes": _prepare.PIECE_BYTES,
        "shard_version": SHARD_VERSION,
        "pipeline_version": PIPELINE_VERSION,
    }
    if cfg.tokenizer.startswith("hf:"):  # only then: the caches of every other recipe keep their keys
        recipe["tokenizer_file"] = _stat(Path(cfg.tokenizer[3:]) / TOKENIZER_FILE)
    return recipe


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


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n / 1e3:.1f}k"


def _every(seconds: float, log: Callable[[str], None]):
    """A progress callback that logs one line at most every `seconds`."""
    last = [time.perf_counter()]

    def report(done: int, total: int, tokens: int, elapsed: float) -> None:
        now = time.perf_counter()
        if now - last[0] >= seconds and done < total:
            last[0] = now
            log("data: " + progress_line(done, total, tokens, elapsed))

    return report


def progress_line(done: int, total: int, tokens: int, elapsed: float) -> str:
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (total - done) / rate if rate > 0 else float("nan")
    return (f"{done / 1e6:,.0f} of {total / 1e6:,.0f} MB ({done / max(total, 1):.0%}) | {rate / 1e6:.1f} MB/s | "
            f"{tokens / max(elapsed, 1e-9) / 1e6:.2f}M tokens/s | ETA {eta:.0f} s")


def _tokenizer_for(cfg: DataConfig, scratch: Path, pieces: list[dict], log: Callable[[str], None],
                   shared: Tokenizer | None = None) -> Tokenizer:
    """The cache's tokenizer: `shared` (a mixture's), else the one saved in the scratch directory by an interrupted
    prepare, else built."""
    if shared is not None:
        shared.save(scratch)
        return shared
    if (scratch / TOKENIZER_FILE).is_file():
        try:
            return load_tokenizer(scratch)
        except (ValueError, OSError, KeyError):
            pass  # half-written by a killed prepare: build it again
    if cfg.tokenizer == "bpe":
        log(f"data: training BPE tokenizer (vocab {cfg.vocab_size}) on up to {cfg.tokenizer_sample_bytes / 1e6:,.0f}M "
            f"characters of train documents")
    tok = build_tokenizer(cfg.tokenizer, tokenizer_sample(cfg, pieces, cfg.tokenizer_sample_bytes), cfg.vocab_size)
    tok.save(scratch)
    return tok


def _build(cfg: DataConfig, final: Path, log: Callable[[str], None], progress=None, shared=None) -> None:
    """Tokenize the source into shards in <cache>.partial (resuming one left by a killed prepare), then rename it
    into place. Holds <cache>.lock throughout; returns at once when another prepare finished the cache meanwhile."""
    with cache_lock(final, log):
        if (final / "meta.json").is_file():
            return
        scratch = final.with_name(f"{final.name}.partial")
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            _build_in(cfg, final, scratch, log, progress, shared)
        except CorpusError:  # the input must change, and with it the cache key: nothing here can be resumed
            shutil.rmtree(scratch, ignore_errors=True)
            raise


def _build_in(cfg: DataConfig, final: Path, scratch: Path, log: Callable[[str], None], progress, shared) -> None:
    started, cpu = time.perf_counter(), _cpu_seconds()
    pieces = plan_pieces(cfg)
    tok = _tokenizer_for(cfg, scratch, pieces, log, shared)
    dtype = dtype_for_vocab(tok.vocab_size)
    workers = min(worker_count(cfg.workers), len(pieces))
    flip = _saved_flip(scratch)
    if flip is not None:
        pieces = plan_pieces(cfg, flip)
    while True:
        job = {"tokenizer_file": str(scratch / TOKENIZER_FILE) if tok.kind == "bpe" else None,
               "eot_id": tok.eot_id, "dtype": dtype.str, "text_field": cfg.text_field,
               "on_bad_record": cfg.on_bad_record, "val_fraction": cfg.val_fraction, "flip": flip,
               "fingerprint": tok.fingerprint}
        total = sum(p["bytes"] for p in pieces)
        result = encode_all(cfg, scratch, pieces, job, dtype, tok.fingerprint, workers,
                            Progress(total, progress), log, tok.vocab_size)
        summary = summarize(result["pieces"])
        if summary["tokens_train"] and summary["tokens_val"]:
            break
        # The hash sent every document of a small corpus to one split: move the one nearest the threshold.
        docs = summary["docs_train"] + summary["docs_val"]
        if docs < 2:
            raise CorpusError(f"data.source={cfg.source!r} holds only one document; kiln needs two to split (one "
                              f"text file it cuts in two): give more text")
        if flip is not None:
            raise CorpusError(f"data.source={cfg.source!r}: all {docs} documents land in one split even after moving "
                              f"one across, so they are identical; give distinct documents")
        empty = "val" if not summary["tokens_val"] else "train"
        flip = extremes(result["pieces"])["train" if empty == "val" else "val"][0]
        for shard in scratch.glob("*-*.bin"):
            shard.unlink()
        (scratch / "flip.json").write_text(json.dumps({"flip": flip}))
        pieces = plan_pieces(cfg, flip)
    seconds = time.perf_counter() - started
    meta = {
        "unigram_loss": entropy(result["counts"]),
        "built_with": asdict(cfg),
        "docs": summary["docs_train"] + summary["docs_val"],
        "train_docs": summary["docs_train"],
        "val_docs": summary["docs_val"],
        "train_tokens": summary["tokens_train"],
        "val_tokens": summary["tokens_val"],
        "shards": {s: [f"{s}-{i:05d}.bin" for i in range(result["shards"][s])] for s in ("train", "val")},
        "bytes": summary["bytes"],
        "skipped_records": summary["skipped"],
        "skipped_examples": summary["examples"],
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "fingerprint": tok.fingerprint,
        "workers": workers,
        "seconds": round(seconds, 3),
        "cpu_seconds": round(_cpu_seconds() - cpu, 3),  # this process and its finished workers
        "pieces": len(pieces),
        "resumed": result["resumed"],  # what an interrupted prepare had finished, when this one continued it
    }
    (scratch / "flip.json").unlink(missing_ok=True)
    _write_json(scratch / "meta.json", meta)  # its presence marks "complete"
    os.rename(scratch, final)


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended (the workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _saved_flip(scratch: Path) -> int | None:
    try:
        return json.loads((scratch / "flip.json").read_text())["flip"]
    except (OSError, ValueError, KeyError):
        return None


def _open_cache(final: Path):
    """(meta, tokenizer, train, val) of a complete cache directory; ShardError (or the loader's own error) when a
    file is missing, unreadable, truncated or holds another number of tokens than meta.json says."""
    meta = json.loads((final / "meta.json").read_text())
    if not (final / TOKENIZER_FILE).is_file():
        raise ShardError(f"{final / TOKENIZER_FILE} is missing from the shard cache")
    tok = load_tokenizer(final)
    if meta.get("format") == "tokens":
        return meta, tok, *_open_token_files(meta)
    if "shards" not in meta:
        raise ShardError(f"{final / 'meta.json'} lists no shards (a cache of an older kiln)")
    splits = {}
    for name in ("train", "val"):
        splits[name] = open_shards([final / f for f in meta["shards"][name]], tok.fingerprint)
        if len(splits[name]) != meta[f"{name}_tokens"]:
            raise ShardError(f"the {name} shards hold {len(splits[name])} tokens, meta.json says "
                             f"{meta[f'{name}_tokens']}")
    return meta, tok, splits["train"], splits["val"]


def _open_token_files(meta: dict):
    splits = []
    for name in ("train", "val"):
        arrays = []
        for entry in meta["files"][name]:
            path = Path(entry["path"])
            st = path.stat()
            if [st.st_size, st.st_mtime_ns] != [entry["size"], entry["mtime_ns"]]:
                raise ShardError(f"{path} changed since it was checked")
            arrays.append(read_tokens(path))
        splits.append(join(arrays))
    return splits


def _build_tokens(cfg: DataConfig, final: Path, log: Callable[[str], None]) -> None:
    """data.format=tokens: check the files' ids against data.vocab_size once and record them in meta.json."""
    with cache_lock(final, log):
        if (final / "meta.json").is_file():
            return
        if cfg.tokenizer.startswith("hf:"):
            tok = BPETokenizer.from_hf(Path(cfg.tokenizer[3:]))
        else:
            if cfg.tokenizer == "bpe":
                raise CorpusError("data.format=tokens reads ids as they are: data.tokenizer=bpe would train a new "
                                  "vocabulary; use hf:DIR (the files' tokenizer) or leave the default")
            log("data: data.format=tokens: the bytes tokenizer is ignored; ids are shown as <id> (give "
                "data.tokenizer=hf:DIR to decode them)")
            tok = IdsTokenizer(cfg.vocab_size)
        files, meta_files, counts = token_files(cfg.source), {}, {}
        for name, paths in files.items():
            meta_files[name], counts[name] = [], 0
            for path in paths:
                tokens = read_tokens(path)
                check_ids(path, tokens, cfg.vocab_size)
                st = path.stat()
                meta_files[name].append({"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                         "tokens": len(tokens)})
                counts[name] += len(tokens)
        scratch = final.with_name(f"{final.name}.partial")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        tok.save(scratch)
        _write_json(scratch / "meta.json", {
            "built_with": asdict(cfg), "format": "tokens", "files": meta_files, "docs": 0,
            "train_tokens": counts["train"], "val_tokens": counts["val"], "tokenizer": tok.kind,
            "vocab_size": cfg.vocab_size, "fingerprint": tok.fingerprint})
        os.rename(scratch, final)


def _discard(final: Path) -> None:
    """Move a damaged cache out of the way in one rename (a concurrent reader never sees half of it), then delete."""
    aside = final.with_name(f"{final.name}.damaged-{os.getpid()}")
    os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)


def cache_dir_for(cfg: DataConfig, shared: Tokenizer | None = None) -> Path:
    """The shard directory of cfg's tokens (it may not be built yet); `shared` as in cache_key."""
    kind = "hf" if cfg.tokenizer.startswith("hf:") else cfg.tokenizer  # the directory is in the key, not the name
    if cfg.format == "tokens":
        kind = "tokens"
    return cache_root(cfg) / f"{_source_label(cfg.source)}-{kind}-{cache_key(cfg, shared)}"


def _mix_tokenizer_dir(cfg: DataConfig) -> Path:
    """Where the one BPE tokenizer of a [[data.mix]] is kept: keyed by what trains it (each source's files and
    settings, the weights, vocab_size, tokenizer_sample_bytes, seed), not by shard_tokens."""
    recipe = {"sources": [], "vocab_size": cfg.vocab_size, "tokenizer_sample_bytes": cfg.tokenizer_sample_bytes,
              "seed": cfg.seed, "sample": "weights", "pipeline_version": PIPELINE_VERSION}
    for name, weight, one in mix_sources(cfg):
        source = _recipe(one)
        for unused in ("shard_tokens", "tokenizer", "vocab_size", "tokenizer_sample_bytes"):
            source.pop(unused)
        recipe["sources"].append([name, weight, source])
    key = hashlib.blake2b(json.dumps(recipe, sort_keys=True).encode("utf-8"), digest_size=8).hexdigest()
    return cache_root(cfg) / f"mix-bpe-{key}"


def mix_sample_shares(cfg: DataConfig) -> list[tuple[str, int, DataConfig]]:
    """(name, characters, source config): each source's share of data.tokenizer_sample_bytes, in proportion to its
    weight (the tokenizer sees the text in the proportions training does). A source with less train text than its
    share gives all it has; the rest is not handed to the others."""
    sources = mix_sources(cfg)
    total = sum(w for _, w, _ in sources)
    return [(name, max(1, int(cfg.tokenizer_sample_bytes * w / total)), one) for name, w, one in sources]


def _shared_bpe(cfg: DataConfig, log: Callable[[str], None], train: bool = True) -> Tokenizer | None:
    """The BPE tokenizer every source of a [[data.mix]] shares: trained once on a seeded sample drawn from all of
    them (mix_sample_shares), kept in its own cache directory, and loaded from there afterwards. train=False: None
    when it is not built yet."""
    final = _mix_tokenizer_dir(cfg)
    if (final / "meta.json").is_file():
        return load_tokenizer(final)
    if not train:
        return None
    with cache_lock(final, log):
        if (final / "meta.json").is_file():
            return load_tokenizer(final)
        shares = mix_sample_shares(cfg)
        taken = {name: 0 for name, _, _ in shares}

        def sample():
            for name, limit, one in shares:
                for text in tokenizer_sample(one, plan_pieces(one), limit):
                    taken[name] += len(text)
                    yield text

        log(f"data: training one BPE tokenizer (vocab {cfg.vocab_size}) for the mixture on up to "
            f"{_millions(cfg.tokenizer_sample_bytes)} characters of train documents, shared by weight: "
            + ", ".join(f"{name} {_millions(limit)}" for name, limit, _ in shares))
        started = time.perf_counter()
        tok = build_tokenizer("bpe", sample(), cfg.vocab_size)
        scratch = final.with_name(f"{final.name}.partial")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        tok.save(scratch)
        _write_json(scratch / "meta.json", {"sources": [[n, limit, taken[n]] for n, limit, _ in shares],
                                            "vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint,
                                            "seconds": round(time.perf_counter() - started, 3)})
        os.rename(scratch, final)
        log("data: mixture tokenizer trained on " + ", ".join(f"{n} {_millions(taken[n])}" for n, _, _ in shares)
            + f" characters; saved at {_home_relative(final)}")
        return tok


def cached_unigram_loss(cfg: DataConfig) -> float | None:
    """The unigram baseline of cfg's training split when its shards are already cached, else None (nothing is
    built: a reader of a finished run should not tokenize a corpus)."""
    try:
        if cfg.mix:
            shared = _shared_bpe(cfg, print, train=False) if cfg.tokenizer == "bpe" else None
            if cfg.tokenizer == "bpe" and shared is None:
                return None
            losses = [(w, _cached_unigram_loss(one, shared)) for _, w, one in mix_sources(cfg)]
            if any(loss is None for _, loss in losses):
                return None
            return sum(w * loss for w, loss in losses) / sum(w for w, _ in losses)
        return _cached_unigram_loss(cfg, None)
    except (CorpusError, ShardError, ValueError, OSError):  # the source is gone here, or the cache is damaged
        return None


def _cached_unigram_loss(cfg: DataConfig, shared: Tokenizer | None) -> float | None:
    try:
        final = cache_dir_for(cfg, shared)
        if not (final / "meta.json").is_file():
            return None
        meta, tok, train, _ = _open_cache(final)
    except (CorpusError, ShardError, ValueError, OSError):  # the source is gone here, or the cache is damaged
        return None
    return meta["unigram_loss"] if "unigram_loss" in meta else unigram_entropy(train, tok.vocab_size)


def summary_line(label: str, meta: dict, unigram: float) -> str:
    """One source's summary: documents, tokens, bytes, bad records skipped, unigram loss, speed."""
    seconds = meta.get("seconds")
    workers = f"{meta.get('workers')} worker{'' if meta.get('workers') == 1 else 's'}"
    speed = f" | {meta['bytes'] / seconds / 1e6:.1f} MB/s with {workers}" if seconds else ""
    skipped = f" | {meta.get('skipped_records', 0):,} bad records skipped" if "skipped_records" in meta else ""
    size = f" | {meta['bytes'] / 1e6:,.1f} MB read" if "bytes" in meta else ""
    return (f"data: {label} summary: {meta['docs']:,} documents (train {meta.get('train_docs', 0):,}, val "
            f"{meta.get('val_docs', 0):,}) | {meta['train_tokens'] + meta['val_tokens']:,} tokens{size}{skipped} | "
            f"unigram loss {unigram:.4f} nats/token{speed}")


def prepare_data(cfg: DataConfig, run_dir: Path | None = None, log: Callable[[str], None] = print,
                 progress: Callable[[int, int, int, float], None] | None = None) -> PreparedData:
    """Token shards for cfg, built on the first call and reused while the source and settings are unchanged.

    progress(bytes done, total bytes, tokens, seconds) is called as pieces finish; by default a line is logged
    every 30 s. A [[data.mix]] config prepares each source on its own; the result's train is their Mixture.
    """
    cfg.validate()
    if cfg.mix:
        return _prepare_mix(cfg, run_dir, log, progress)
    return _prepare_one(cfg, run_dir, log, progress)


def _prepare_one(cfg: DataConfig, run_dir: Path | None, log: Callable[[str], None], progress,
                 shared: Tokenizer | None = None) -> PreparedData:
    """One source's prepare_data; `shared`: the tokenizer of the [[data.mix]] it belongs to (BPE)."""
    if cfg.records == "chat":  # packed chat windows (kiln.data.chat_data)
        return PreparedData(*prepare_chat(cfg, cache_root(cfg), run_dir, log))
    final = cache_dir_for(cfg, shared)
    built = not (final / "meta.json").is_file()
    build = _build_tokens if cfg.format == "tokens" else \
        lambda c, f, lg: _build(c, f, lg, progress or _every(30.0, lg), shared)
    if built:
        build(cfg, final, log)
    try:
        meta, tok, train, val = _open_cache(final)
    except (ShardError, ValueError, OSError) as e:
        if built:
            raise
        log(f"data: the cache at {_home_relative(final)} is damaged ({e}); rebuilding it")
        _discard(final)
        build(cfg, final, log)
        built = True
        meta, tok, train, val = _open_cache(final)
    if meta.get("format") == "tokens":
        tok.vocab_size = cfg.vocab_size  # the model's vocabulary is the files', whatever decodes them
    if run_dir is not None:
        tok.save(Path(run_dir))
    unigram = meta["unigram_loss"] if "unigram_loss" in meta else unigram_entropy(train, tok.vocab_size)
    if built and meta.get("format") != "tokens":
        log(summary_line(_source_label(cfg.source), meta, unigram))
        for example in meta.get("skipped_examples", []):
            log(f"data: skipped: {example}")
    log(
        f"data: {_source_label(cfg.source)} {meta['docs']} docs, train {_millions(len(train))} tokens, "
        f"val {_millions(len(val))} tokens ({tok.kind} vocab {tok.vocab_size}, "
        f"{'built' if built else 'cached'} at {_home_relative(final)})"
    )
    return PreparedData(tokenizer=tok, train=train, val=val, unigram_loss=unigram, cache_dir=final)


def _prepare_mix(cfg: DataConfig, run_dir, log, progress) -> PreparedData:
    shared = _shared_bpe(cfg, log) if cfg.tokenizer == "bpe" else None
    parts = []
    for name, weight, one in mix_sources(cfg):
        prepared = _prepare_one(one, None, lambda msg, n=name: log(msg.replace("data: ", f"data[{n}]: ", 1)),
                                progress, shared)
        parts.append((name, weight, prepared))
    fingerprints = {p.tokenizer.fingerprint for _, _, p in parts}
    if len(fingerprints) > 1:
        raise CorpusError("the [[data.mix]] sources were tokenized with different tokenizers; give them one "
                          "data.tokenizer")
    for name, _, prepared in parts:
        for split, tokens in (("train", prepared.train), ("val", prepared.val)):
            if len(tokens) < cfg.seq_len + 1:
                raise CorpusError(f"[[data.mix]] source {name!r}: its {split} split holds {len(tokens)} tokens, fewer "
                                  f"than data.seq_len + 1 = {cfg.seq_len + 1}; give it more text, raise "
                                  f"data.val_fraction or lower data.seq_len")
    tok = parts[0][2].tokenizer
    if run_dir is not None:
        tok.save(Path(run_dir))
    total = sum(w for _, w, _ in parts)
    kind = PackedMixture if isinstance(parts[0][2].train, PackedWindows) else Mixture  # chat: whole windows
    train = kind([n for n, _, _ in parts], [w for _, w, _ in parts], [p.train for _, _, p in parts])
    val = kind([n for n, _, _ in parts], [w for _, w, _ in parts], [p.val for _, _, p in parts])
    log("data: mixture " + ", ".join(f"{n} {w / total:.0%}" for n, w, _ in parts))
    return PreparedData(tokenizer=tok, train=train, val=val,
                        unigram_loss=sum(w * p.unigram_loss for _, w, p in parts) / total,
                        cache_dir=parts[0][2].cache_dir, sources=parts)
