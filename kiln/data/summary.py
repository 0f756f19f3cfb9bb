"""The lines a prepare logs: progress, each source's summary, and the unigram baseline (the loss of a model that
predicts only token frequencies)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from kiln.errors import KilnError


def home_relative(path: Path) -> str:
    """~/... for paths under the home directory: shorter, and the same in every user's logs."""
    try:
        return "~/" + str(Path(path).resolve().relative_to(Path.home().resolve()))
    except ValueError:
        return str(path)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """-sum p log p (nats) of the token frequencies: the loss a model predicting only frequencies would get."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk = 1 << 24  # 16M tokens at a time: bincount widens to int64, so whole-array would cost 8 B/token
    for start in range(0, len(tokens), chunk):
        chunk_counts = np.bincount(tokens[start : start + chunk], minlength=vocab_size)
        if len(chunk_counts) > vocab_size:
            raise KilnError(f"token id {len(chunk_counts) - 1} is outside the vocabulary of {vocab_size}",
                            key="vocab_size", value=vocab_size)
        counts += chunk_counts
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n / 1e3:.1f}k"


def every(seconds: float, log: Callable[[str], None]):
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
