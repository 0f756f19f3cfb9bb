"""Where a source's token shards are cached and what keys them: the cache directory (data.cache_dir, $KILN_CACHE,
~/.cache/kiln), the hash of everything that decides the tokens, and opening (or discarding) a built cache."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from kiln.data import prepare as _prepare
from kiln.data.config import DataConfig
from kiln.data.corpus import STDLIB, source_files
from kiln.data.mix import mix_sources
from kiln.data.prepare import file_kind
from kiln.data.pretokenized import join, read_tokens, token_files
from kiln.data.shards import VERSION as SHARD_VERSION
from kiln.data.shards import ShardError, open_shards
from kiln.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer

# Bump when the split rule, separator or anything else that changes the tokens (but not the shard layout)
# changes, so old caches are not reused.
# 2: streamed pieces into shards of data.shard_tokens (train-00000.bin, ...), strict UTF-8, BPE on a sample.
# 3: bytes-tokenizer shards hold uint8 (dtype code 1), which a kiln of version 2 cannot read; the split hash is
#    SHA-1's first 8 bytes (was blake2b's).
PIPELINE_VERSION = 3


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


def source_label(source: str) -> str:
    if source == STDLIB:
        return STDLIB
    name = Path(source).expanduser().resolve().name or "data"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]


def open_cache(final: Path):
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


def discard(final: Path) -> None:
    """Move a damaged cache out of the way in one rename (a concurrent reader never sees half of it), then delete."""
    aside = final.with_name(f"{final.name}.damaged-{os.getpid()}")
    os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)


def cache_dir_for(cfg: DataConfig, shared: Tokenizer | None = None) -> Path:
    """The shard directory of cfg's tokens (it may not be built yet); `shared` as in cache_key."""
    kind = "hf" if cfg.tokenizer.startswith("hf:") else cfg.tokenizer  # the directory is in the key, not the name
    if cfg.format == "tokens":
        kind = "tokens"
    return cache_root(cfg) / f"{source_label(cfg.source)}-{kind}-{cache_key(cfg, shared)}"


def mix_tokenizer_dir(cfg: DataConfig) -> Path:
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
