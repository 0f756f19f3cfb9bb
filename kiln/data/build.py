"""Building a cache: tokenize a source into shards in <cache>.partial (resuming one a killed prepare left), check
pre-tokenized files once (data.format=tokens), and train the one BPE tokenizer a [[data.mix]] shares."""
from __future__ import annotations

import json
import os
import resource
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from kiln.data.cache import mix_tokenizer_dir
from kiln.data.config import DataConfig
from kiln.data.corpus import CorpusError
from kiln.data.mix import mix_sources
from kiln.data.prepare import (
    Progress,
    _write_json,
    cache_lock,
    encode_all,
    entropy,
    extremes,
    plan_pieces,
    summarize,
    tokenizer_sample,
    worker_count,
)
from kiln.data.pretokenized import check_ids, read_tokens, token_files
from kiln.data.shards import dtype_for_vocab
from kiln.data.summary import home_relative, millions
from kiln.data.tokenizer import TOKENIZER_FILE, BPETokenizer, IdsTokenizer, Tokenizer, build_tokenizer, load_tokenizer


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


def build(cfg: DataConfig, final: Path, log: Callable[[str], None], progress=None, shared=None) -> None:
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


def build_tokens(cfg: DataConfig, final: Path, log: Callable[[str], None]) -> None:
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


def mix_sample_shares(cfg: DataConfig) -> list[tuple[str, int, DataConfig]]:
    """(name, characters, source config): each source's share of data.tokenizer_sample_bytes, in proportion to its
    weight (the tokenizer sees the text in the proportions training does). A source with less train text than its
    share gives all it has; the rest is not handed to the others."""
    sources = mix_sources(cfg)
    total = sum(w for _, w, _ in sources)
    return [(name, max(1, int(cfg.tokenizer_sample_bytes * w / total)), one) for name, w, one in sources]


def shared_bpe(cfg: DataConfig, log: Callable[[str], None], train: bool = True) -> Tokenizer | None:
    """The BPE tokenizer every source of a [[data.mix]] shares: trained once on a seeded sample drawn from all of
    them (mix_sample_shares), kept in its own cache directory, and loaded from there afterwards. train=False: None
    when it is not built yet."""
    final = mix_tokenizer_dir(cfg)
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
            f"{millions(cfg.tokenizer_sample_bytes)} characters of train documents, shared by weight: "
            + ", ".join(f"{name} {millions(limit)}" for name, limit, _ in shares))
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
        log("data: mixture tokenizer trained on " + ", ".join(f"{n} {millions(taken[n])}" for n, _, _ in shares)
            + f" characters; saved at {home_relative(final)}")
        return tok
