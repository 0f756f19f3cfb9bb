"""prepare_data: token shards for the `data` section, built on the first call (kiln.data.build) and reused while
the source and settings are unchanged (kiln.data.cache); a [[data.mix]] prepares each source and mixes them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kiln.data.build import build, build_tokens, shared_bpe
from kiln.data.cache import cache_dir_for, cache_root, discard, open_cache, source_label
from kiln.data.chat_data import prepare_chat
from kiln.data.config import DataConfig
from kiln.data.corpus import CorpusError
from kiln.data.mix import Mixture, mix_sources
from kiln.data.packing import PackedMixture, PackedWindows
from kiln.data.shards import ShardError
from kiln.data.summary import every, home_relative, millions, summary_line, unigram_entropy
from kiln.data.tokenizer import Tokenizer


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train: np.ndarray  # 1-D read-only memory map of token ids (uint16 or uint32)
    val: np.ndarray
    unigram_loss: float  # entropy of the train-split token frequencies, nats/token: the loss of a unigram model
    cache_dir: Path | None = None  # the shard directory in use (a mixture's: its first source's)
    sources: list | None = None  # a [[data.mix]]: (name, weight, PreparedData) per source; None for one source


def cached_unigram_loss(cfg: DataConfig) -> float | None:
    """The unigram baseline of cfg's training split when its shards are already cached, else None (nothing is
    built: a reader of a finished run should not tokenize a corpus)."""
    try:
        if cfg.mix:
            shared = shared_bpe(cfg, print, train=False) if cfg.tokenizer == "bpe" else None
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
        meta, tok, train, _ = open_cache(final)
    except (CorpusError, ShardError, ValueError, OSError):  # the source is gone here, or the cache is damaged
        return None
    return meta["unigram_loss"] if "unigram_loss" in meta else unigram_entropy(train, tok.vocab_size)


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
    make = build_tokens if cfg.format == "tokens" else \
        lambda c, f, lg: build(c, f, lg, progress or every(30.0, lg), shared)
    if built:
        make(cfg, final, log)
    try:
        meta, tok, train, val = open_cache(final)
    except (ShardError, ValueError, OSError) as e:
        if built:
            raise
        log(f"data: the cache at {home_relative(final)} is damaged ({e}); rebuilding it")
        discard(final)
        make(cfg, final, log)
        built = True
        meta, tok, train, val = open_cache(final)
    if meta.get("format") == "tokens":
        tok.vocab_size = cfg.vocab_size  # the model's vocabulary is the files', whatever decodes them
    if run_dir is not None:
        tok.save(Path(run_dir))
    unigram = meta["unigram_loss"] if "unigram_loss" in meta else unigram_entropy(train, tok.vocab_size)
    if built and meta.get("format") != "tokens":
        log(summary_line(source_label(cfg.source), meta, unigram))
        for example in meta.get("skipped_examples", []):
            log(f"data: skipped: {example}")
    log(
        f"data: {source_label(cfg.source)} {meta['docs']} docs, train {millions(len(train))} tokens, "
        f"val {millions(len(val))} tokens ({tok.kind} vocab {tok.vocab_size}, "
        f"{'built' if built else 'cached'} at {home_relative(final)})"
    )
    return PreparedData(tokenizer=tok, train=train, val=val, unigram_loss=unigram, cache_dir=final)


def _prepare_mix(cfg: DataConfig, run_dir, log, progress) -> PreparedData:
    shared = shared_bpe(cfg, log) if cfg.tokenizer == "bpe" else None
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
