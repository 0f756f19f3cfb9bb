"""data.records=chat: chat records read, rendered with the chat template, masked, split and packed into the cache.

    prepare_chat(cfg, root, run_dir, log) -> (tokenizer, train, val, unigram loss, cache dir)

The records are read in file order (files sorted as kiln.data.corpus lists them, rows in order): JSONL (.gz, .zst),
Parquet or a `datasets` Arrow shard, one conversation per line or row. Each becomes (ids, mask) (kiln.data.sft); a
record goes to the validation split by the hash of its JSON (sorted keys), as text records do, so the split does not
depend on the order. Each split is packed into data.seq_len + 1 windows (kiln.data.packing); a sample longer than
that is skipped and counted (not truncated: a cut reply would teach the model to stop mid-answer).

The cache (its key: the files, records, the template's digest, train_on, seq_len, val_fraction, the tokenizer)
holds <split>-tokens.npy, <split>-mask.npy, <split>-doc.npy, the tokenizer and meta.json, written in
<cache>.partial and renamed into place: a failed or killed prepare leaves nothing a later run would read.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from kiln.data import records as _records
from kiln.data.corpus import STDLIB, CorpusError, source_files
from kiln.data.jsonl import JsonlError, jsonl_rows
from kiln.data.packing import PackedWindows, pack
from kiln.data.prepare import _write_json, cache_lock, entropy, file_kind
from kiln.data.sft import ChatRecordError, chat_template_for, conversation, encode_sample
from kiln.data.shards import dtype_for_vocab
from kiln.data.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, load_tokenizer

CHAT_VERSION = 1  # bump when what a chat cache holds changes for the same inputs
SPLITS = ("train", "val")


def chat_tokenizer(cfg):
    return BPETokenizer.from_hf(Path(cfg.tokenizer[3:])) if cfg.tokenizer.startswith("hf:") else ByteTokenizer()


def chat_cache_dir(cfg, root: Path) -> Path:
    """The cache directory of cfg's packed chat windows (it may not be built yet)."""
    if cfg.source == STDLIB:
        raise CorpusError("data.records=chat reads chat records, and data.source is the default Python standard "
                          "library (text); give data.source=FILE.jsonl (or parquet, arrow)",
                          key="data.source", value=cfg.source, fix="give data.source=FILE.jsonl (or parquet, arrow)")
    _, files = source_files(cfg.source, cfg.pattern)
    template = chat_template_for(cfg)
    recipe = {"files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
              "format": cfg.format, "records": cfg.records, "template": template.digest, "train_on": cfg.train_on,
              "seq_len": cfg.seq_len, "val_fraction": cfg.val_fraction, "on_bad_record": cfg.on_bad_record,
              "tokenizer": cfg.tokenizer, "version": CHAT_VERSION}
    if cfg.tokenizer.startswith("hf:"):
        tok_file = Path(cfg.tokenizer[3:]) / TOKENIZER_FILE
        recipe["tokenizer_file"] = [str(tok_file.resolve()), tok_file.stat().st_size, tok_file.stat().st_mtime_ns]
    key = hashlib.blake2b(json.dumps(recipe, sort_keys=True).encode("utf-8"), digest_size=8).hexdigest()
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(cfg.source).expanduser().resolve().name)
    return root / f"{name[:40] or 'data'}-chat-{key}"


def chat_records(cfg):
    """(where, record) of every record of the source in file order; (where, ChatRecordError) for an unreadable one."""
    _, files = source_files(cfg.source, cfg.pattern)
    for path in files:
        kind, compression = file_kind(path, cfg.format)
        if kind == "jsonl":
            yield from _jsonl(path, compression)
        elif kind in ("parquet", "arrow"):
            yield from _table(path, kind)
        else:
            raise CorpusError(f"{path}: data.records=chat reads JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet or "
                              f"Arrow records, not {kind}; convert it, or set data.format",
                              key="data.source", value=str(path), fix="convert it, or set data.format")


def _jsonl(path: Path, compression):
    try:
        stream = _records._open_lines(str(path), compression, 0, None)
    except _records.BadRecord as e:
        raise CorpusError(str(e), key="data.source", value=str(path)) from None
    with io.BufferedReader(stream, 1 << 20) if not compression else stream as f:
        for n, record in jsonl_rows(f, path, skip_bad=True):  # a binary file breaks at b"\n" only
            if isinstance(record, JsonlError):
                record = ChatRecordError(f"{path}:{n}: not a JSON object ({record.reason}); each line must be one "
                                         f"record, or set data.on_bad_record=skip")
            yield f"{path}:{n}", record


def _table(path: Path, kind: str):
    try:
        import pyarrow as pa  # lazy: only Parquet and `datasets` sources need it
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path} is {kind}; reading it needs pyarrow (pip install pyarrow)") from None
    try:
        batches = pq.ParquetFile(path).iter_batches() if kind == "parquet" else pa.ipc.open_stream(path)
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                row += 1  # a table has every column in every row: a record's own keys are its non-null ones
                yield f"{path}:row {row}", {k: v for k, v in record.items() if v is not None}
    except (pa.ArrowInvalid, OSError) as e:
        raise CorpusError(f"{path} does not read as {kind} ({e}); check the file, or remove it from the source",
                          key="data.source", value=str(path)) from None


def prepare_chat(cfg, root: Path, run_dir: Path | None, log):
    """(tokenizer, train, val, unigram loss, cache dir) of cfg's chat records: built once, then read back."""
    final = chat_cache_dir(cfg, root)
    built = not (final / "meta.json").is_file()
    if built:
        with cache_lock(final, log):
            if not (final / "meta.json").is_file():
                scratch = final.with_name(f"{final.name}.partial")
                shutil.rmtree(scratch, ignore_errors=True)
                scratch.mkdir(parents=True)
                try:
                    _build(cfg, scratch, log)
                except BaseException:
                    shutil.rmtree(scratch, ignore_errors=True)
                    raise
                os.rename(scratch, final)
    meta = json.loads((final / "meta.json").read_text())
    tok = load_tokenizer(final)
    masked = cfg.masks_documents
    train, val = (PackedWindows(*(np.load(final / f"{s}-{a}.npy", mmap_mode="r") for a in ("tokens", "mask", "doc")),
                                document_mask=masked) for s in SPLITS)
    if run_dir is not None:
        tok.save(Path(run_dir))
    if built:
        log(summary(meta))
        for example in meta["skipped_examples"]:
            log(f"data: skipped: {example}")
    log(f"data: chat {meta['docs']} conversations, train {meta['train_windows']} windows ({meta['train_counted']:,} "
        f"counted targets), val {meta['val_windows']} windows ({meta['template']}, train_on={cfg.train_on}, "
        f"document mask {'on' if masked else 'off'}; {'built' if built else 'cached'} at {_shown(final)})")
    return tok, train, val, meta["unigram_loss"], final


def _shown(path: Path) -> str:
    """~/... under the home directory (as the text cache's lines show it)."""
    try:
        return "~/" + str(path.resolve().relative_to(Path.home().resolve()))
    except ValueError:
        return str(path)


def summary(meta: dict) -> str:
    return (f"data: chat summary: {meta['docs']:,} conversations (train {meta['train_docs']:,}, val "
            f"{meta['val_docs']:,}) packed into {meta['train_windows'] + meta['val_windows']:,} windows of "
            f"{meta['seq_len'] + 1} tokens ({meta['fill']:.0%} filled) | {meta['too_long']:,} longer than a window "
            f"skipped (raise data.seq_len to keep them) | {meta['skipped_records']:,} bad records skipped | "
            f"{meta['train_counted']:,} of {meta['train_tokens']:,} train tokens counted by the loss "
            f"(train_on={meta['train_on']})")


def _build(cfg, scratch: Path, log) -> None:
    started = time.perf_counter()
    template, tok = chat_template_for(cfg), chat_tokenizer(cfg)
    threshold = _records.split_threshold(cfg.val_fraction)
    samples = {s: [] for s in SPLITS}
    hashes = {s: [] for s in SPLITS}
    skipped, examples = 0, []
    for where, record in chat_records(cfg):
        try:
            if isinstance(record, ChatRecordError):
                raise record
            messages = conversation(record, where, need_assistant=cfg.train_on == "assistant")
            ids, mask = encode_sample(messages, template, tok, cfg.train_on, where)
        except ChatRecordError as e:
            if cfg.on_bad_record != "skip":
                raise
            skipped += 1
            if len(examples) < _records.MAX_EXAMPLES:
                examples.append(str(e))
            continue
        h = _records.split_hash(json.dumps(record, sort_keys=True, ensure_ascii=False))
        split = "val" if h < threshold else "train"
        samples[split].append((ids, mask))
        hashes[split].append(h)
    _balance(samples, hashes, cfg)
    dtype = dtype_for_vocab(tok.vocab_size)
    pad = max(tok.eot_id, 0)
    meta = {"built_with": asdict(cfg), "records": "chat", "template": template.origin, "train_on": cfg.train_on,
            "seq_len": cfg.seq_len, "skipped_records": skipped,
            "skipped_examples": examples, "too_long": 0}
    counts, filled = np.zeros(tok.vocab_size, dtype=np.int64), 0
    for split in SPLITS:
        tokens, mask, doc, placed = pack(samples[split], cfg.seq_len, pad, dtype)
        meta["too_long"] += len(samples[split]) - len(placed)
        if not len(tokens):
            raise CorpusError(f"data.source={cfg.source!r}: every {split} conversation is longer than data.seq_len + 1 "
                              f"= {cfg.seq_len + 1} tokens; raise data.seq_len",
                              key="data.seq_len", value=cfg.seq_len, fix="raise data.seq_len")
        for name, array in (("tokens", tokens), ("mask", mask), ("doc", doc)):
            np.save(scratch / f"{split}-{name}.npy", array)
        windows = PackedWindows(tokens, mask, doc, cfg.masks_documents)
        used = sum(len(samples[split][i][0]) for i in placed)
        filled += used
        meta.update({f"{split}_docs": len(placed), f"{split}_windows": len(tokens), f"{split}_tokens": used,
                     f"{split}_counted": windows.counted()})
        if split == "train":  # the baseline of what the loss counts: the counted tokens' frequencies
            counted = np.concatenate([samples[split][i][0][samples[split][i][1]] for i in placed])
            counts += np.bincount(counted, minlength=tok.vocab_size)
    meta["docs"] = meta["train_docs"] + meta["val_docs"]  # the conversations packed
    meta["fill"] = filled / ((meta["train_windows"] + meta["val_windows"]) * (cfg.seq_len + 1))
    meta["unigram_loss"] = entropy(counts)
    meta["seconds"] = round(time.perf_counter() - started, 3)
    tok.save(scratch)
    _write_json(scratch / "meta.json", meta)  # its presence marks "complete"


def _balance(samples: dict, hashes: dict, cfg) -> None:
    """A small set whose hashes sent every conversation to one split: the one nearest the threshold moves over."""
    total = len(samples["train"]) + len(samples["val"])
    if total < 2:
        raise CorpusError(f"data.source={cfg.source!r} holds {total} usable conversation(s); kiln needs two to split "
                          f"into train and val: give more", key="data.source", value=cfg.source, fix="give more")
    for empty, full in (("val", "train"), ("train", "val")):
        if not samples[empty]:
            pick = int(np.argmin(hashes[full])) if empty == "val" else int(np.argmax(hashes[full]))
            samples[empty].append(samples[full].pop(pick))
            hashes[empty].append(hashes[full].pop(pick))
