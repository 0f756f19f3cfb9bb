"""Batches of token windows: a seeded random sampler for training and fixed windows for validation.

Batch i of the training stream is a pure function of (seed, i): its start offsets come from
np.random.default_rng([seed, i]). Resuming is therefore exact after any number of batches, skipping ahead
costs nothing, and no global RNG (torch, numpy, random) is touched, so model init and dropout streams are
the same with or without data loading.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from kiln.data.documents import with_documents
from kiln.data.mix import Mixture
from kiln.data.packing import PackedMixture, PackedWindows
from kiln.errors import KilnError

_POLL_S = 0.1  # how often a blocked producer re-checks its stop flag; bounds how long close() can wait


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if isinstance(tokens, (PackedWindows, PackedMixture)):  # chat windows: packed at data.seq_len already
        if tokens.seq_len != seq_len:
            raise KilnError(f"{what}: the chat windows were packed for seq_len {tokens.seq_len}, not {seq_len}",
                            key="data.seq_len", value=seq_len)
        return
    if isinstance(tokens, Mixture):  # each source must hold a window
        tokens.check_length(seq_len, what)
    if tokens.ndim != 1:
        raise KilnError(f"{what}: token array must be 1-D, got shape {tokens.shape}", key="tokens",
                        value=tuple(tokens.shape))
    if seq_len < 1:
        raise KilnError(f"{what}: seq_len={seq_len} must be >= 1", key="seq_len", value=seq_len)
    if len(tokens) < seq_len + 1:
        raise KilnError(f"{what}: {len(tokens)} tokens are fewer than seq_len + 1 = {seq_len + 1}; "
                        f"lower data.seq_len or use more text", key="data.seq_len", value=seq_len,
                        fix="lower data.seq_len or use more text")


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    rows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)  # (B, T+1)
    # Contiguous copies (B*T*8 bytes each, cheap) so callers can .view(-1) the targets.
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])  # x, y: (B, T); y[:, t] = x[:, t+1]


def batch_starts(seed: int, index: int, batch_size: int, num_tokens: int, seq_len: int) -> np.ndarray:
    """Start offsets of training batch `index`, uniform in [0, num_tokens - seq_len - 1]."""
    rng = np.random.default_rng([seed, index])  # a private generator: global RNG state is untouched
    return rng.integers(0, num_tokens - seq_len, size=batch_size)


def _host_batch(
    tokens: np.ndarray, seed: int, index: int, batch_size: int, seq_len: int, pin: bool, separator: int | None = None
) -> tuple[Tensor, ...]:
    if isinstance(tokens, (PackedWindows, PackedMixture)):  # packed chat windows carry their own documents
        batch = tuple(torch.from_numpy(a) for a in tokens.train_batch(seed, index, batch_size))
        return tuple(t.pin_memory() for t in batch) if pin else batch
    if isinstance(tokens, Mixture):  # rows drawn from the sources by weight
        rows = tokens.windows(seed, index, batch_size, seq_len)
        x, y = torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
    else:
        starts = batch_starts(seed, index, batch_size, len(tokens), seq_len)
        x, y = (torch.from_numpy(a) for a in _windows(tokens, starts, seq_len))
    batch = (x, y) if separator is None else with_documents(x, y, separator)  # (x, y) or (x, y, doc)
    return tuple(t.pin_memory() for t in batch) if pin else batch


def _produce(
    tokens: np.ndarray, seed: int, batch_size: int, seq_len: int, pin: bool, separator: int | None, rank: int,
    world: int, index: int, out: queue.Queue, stop: threading.Event,
) -> None:
    """Background thread body: put (i, batch) for i = index, index+1, ... until stopped; an error ends it."""
    while not stop.is_set():
        try:
            item = _host_batch(tokens, seed, index * world + rank, batch_size, seq_len, pin, separator)
        except BaseException as e:  # handed to next(), which re-raises it on the training thread
            item = e
        while not stop.is_set():
            try:
                out.put((index, item), timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if isinstance(item, BaseException):
            return
        index += 1


class TokenLoader:
    """Random windows of seq_len + 1 tokens, batch_size at a time.

    For an accelerator, `prefetch` batches are prepared ahead on a background thread (pinned for CUDA), so the host
    builds the next batch while the device computes. For a CPU device they are built on demand in the caller's
    thread (about 30 µs for 8x256 tokens): the step's compute threads already take every core, so a producer
    thread can only take a core from them, and there is nothing for it to overlap with. `threaded` overrides it.

    separator: the id that ends a document (data.document_mask): batches are then (x, y, doc), kiln.data.documents.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int,
        device: torch.device | str = "cpu",
        prefetch: int = 2,
        threaded: bool | None = None,
        rank: int = 0,
        world: int = 1,
        what: str = "TokenLoader",  # how errors name the tokens: the user's data.source
        separator: int | None = None,
    ) -> None:
        _check_length(tokens, seq_len, what)
        if batch_size < 1:
            raise KilnError(f"TokenLoader: batch_size={batch_size} must be >= 1", key="batch_size", value=batch_size)
        if prefetch < 0:
            raise KilnError(f"TokenLoader: prefetch={prefetch} must be >= 0 (0 turns the background thread off)",
                            key="prefetch", value=prefetch)
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.separator = separator
        self.threaded = self.device.type != "cpu" if threaded is None else threaded
        # Pinned host memory lets .to(device, non_blocking=True) return at once instead of waiting for the copy.
        self._pin = self.device.type == "cuda"
        # Data parallelism: this rank's n-th batch is batch n·world + rank of the one stream, so the batches of one
        # optimizer step (micro-batches k..k+M of the stream) are the same whatever the world size.
        self.rank, self.world = rank, world
        self.batches_served = 0  # batches returned by next(); prefetched ones do not count
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._start_prefetch()

    def next(self) -> tuple[Tensor, ...]:
        """The next (x, y) batch, int64 of shape (batch_size, seq_len), on the loader's device; with a separator
        (x, y, doc), and so are packed chat windows under the document mask (doc int32, kiln.data.packing)."""
        index = self.batches_served
        if self._queue is None:
            batch = _host_batch(self.tokens, self.seed, index * self.world + self.rank, self.batch_size,
                                self.seq_len, self._pin, self.separator)
        else:
            got, item = self._queue.get()
            if isinstance(item, BaseException):
                self._join()
                raise RuntimeError(f"TokenLoader background thread failed on batch {got}") from item
            assert got == index, f"prefetcher produced batch {got}, expected {index}"
            batch = item
        self.batches_served += 1
        if self.device.type != "cpu":
            # From pinned memory the copy is asynchronous: it is queued on the current stream, ahead of the
            # forward pass that reads it, and the host returns at once to queue that forward pass.
            batch = tuple(t.to(self.device, non_blocking=True) for t in batch)
        return batch

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        while True:
            yield self.next()

    # --- resume -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "batches_served": self.batches_served,
            "world": self.world,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position. The stream's shape must match, or the resume would not be exact."""
        mine = self.state_dict()
        for key in ("seed", "batch_size", "seq_len", "num_tokens"):
            if key in state and state[key] != mine[key]:
                raise KilnError(
                    f"TokenLoader state has {key}={state[key]} but this loader has {key}={mine[key]}; "
                    f"the data stream would differ from the saved run's. Resume with the same data and batch config.",
                    key=key, value=mine[key], fix="Resume with the same data and batch config.")
        served = int(state["batches_served"]) * int(state.get("world", 1))  # batches of the stream, all ranks
        if served % self.world:
            raise KilnError(f"the checkpoint was taken {served} batches into the data stream, which {self.world} "
                            f"ranks cannot share evenly; resume with a world size that divides it", key="world",
                            value=self.world, fix="resume with a world size that divides it")
        self._seek(served // self.world)

    def skip(self, n: int) -> None:
        """Move past n batches without building them (e.g. a data window that produced a loss spike)."""
        if n < 0:
            raise KilnError(f"TokenLoader.skip: n={n} must be >= 0", key="n", value=n)
        self._seek(self.batches_served + n)

    def _seek(self, index: int) -> None:
        self._stop_prefetch()  # batches already queued belong to the old position
        self.batches_served = index
        self._start_prefetch()

    # --- background thread --------------------------------------------------------------------------------

    def _start_prefetch(self) -> None:
        if self.prefetch == 0 or not self.threaded:
            return
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        # The thread gets the array and numbers, not `self`, so a loader dropped without close() is still
        # collected and __del__ stops the thread. daemon: a crashed training loop must still let the process exit.
        args = (self.tokens, self.seed, self.batch_size, self.seq_len, self._pin, self.separator, self.rank,
                self.world)
        self._thread = threading.Thread(
            target=_produce, args=(*args, self.batches_served, self._queue, self._stop),
            name="kiln-token-loader", daemon=True,
        )
        self._thread.start()

    def _stop_prefetch(self) -> None:
        if self._stop is not None:
            self._stop.set()
            # Emptying the queue wakes a producer blocked in put() now rather than at its next poll.
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self._thread = self._queue = self._stop = None

    def close(self) -> None:
        """Stop the background thread. Safe to call more than once."""
        self._stop_prefetch()

    def __enter__(self) -> "TokenLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # interpreter shutdown: the daemon thread dies with the process anyway


def val_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int, device: torch.device | str = "cpu",
    separator: int | None = None,
) -> Iterator[tuple[Tensor, ...]]:
    """Fixed validation batches: non-overlapping windows spread evenly over the whole split; with a separator
    (x, y, doc) as the training batches (kiln.data.documents).

    The same arguments always give the same batches, so validation losses compare across steps and runs.
    At most max_batches * batch_size windows; the last batch is smaller when the split has fewer windows.
    """
    _check_length(tokens, seq_len, "val_batches")
    if batch_size < 1 or max_batches < 1:
        raise KilnError(f"val_batches: batch_size={batch_size} and max_batches={max_batches} must be >= 1",
                        key="batch_size" if batch_size < 1 else "max_batches",
                        value=batch_size if batch_size < 1 else max_batches)
    if isinstance(tokens, PackedWindows):  # chat windows: the first ones, in order
        wanted = min(tokens.windows, batch_size * max_batches)
        for first in range(0, wanted, batch_size):
            yield tuple(torch.from_numpy(a).to(device) for a in tokens.rows(np.arange(first, min(first + batch_size,
                                                                                                   wanted))))
        return
    available = (len(tokens) - 1) // seq_len  # window k reads tokens k*T .. k*T + T (its last is k+1's first)
    wanted = min(available, batch_size * max_batches)
    starts = (np.arange(wanted) * available // wanted) * seq_len  # evenly spaced window indices, no repeats
    for first in range(0, wanted, batch_size):
        x, y = (torch.from_numpy(a) for a in _windows(tokens, starts[first : first + batch_size], seq_len))
        batch = (x, y) if separator is None else with_documents(x, y, separator)
        yield tuple(t.to(device) for t in batch)
