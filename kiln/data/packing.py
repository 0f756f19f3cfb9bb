"""Chat samples packed into windows, and the batches drawn from them.

    windows = pack(samples, seq_len, pad_id)       greedy, in order: (tokens, mask, doc) of shape (N, seq_len + 1)
    packed = PackedWindows(tokens, mask, doc, document_mask)
    packed.train_batch(seed, index, batch_size)    (x, y) or (x, y, doc) of training batch `index`
    packed.rows(indices)                           the same for chosen windows (validation: in order)

A window holds seq_len + 1 tokens: x is its first seq_len, y its last seq_len, as the text loader's windows. Samples
go in whole, greedily in file order: each into the first of the last OPEN windows opened that has room for it,
else into a new one (first fit, bounded so it costs O(OPEN) per sample; within a window the samples keep the
file's order); one longer than seq_len + 1 tokens is skipped and counted by the caller. The rest of a window is padding: the pad id, never counted (mask PAD), its own
document.

The targets: y[t] = window[t + 1] when that token is counted (the mask: assistant tokens, or all) and, under the
document mask, belongs to the same sample as window[t]; else IGNORE_INDEX. So a sample's last position, whose
next token opens the next sample, never counts under the mask. doc[t] is the index of window[t]'s sample within
the window: 0, 0, ..., 1, 1, ..., non-decreasing; the model restarts attention and positions where it changes.

Training batch i is a pure function of (seed, i): window b of batch i is entry (i·B + b) mod N of epoch
(i·B + b) div N's permutation np.random.default_rng([seed, epoch]), so every window is seen once per epoch,
resuming is exact and no global RNG is touched (as kiln.data.loader's random windows).
"""
from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100  # kiln.models.parts.IGNORE_INDEX (kiln.data imports nothing from kiln.models)
PAD = 2  # the mask's value at padding (0: a token the loss does not count, 1: one it counts)
# Windows a sample may still go into: first fit over the last OPEN opened. On a file alternating 130- and 64-token
# conversations (seq_len 160, bytes) next fit (OPEN = 1) filled 64% of the windows, first fit over 64 fills 85%.
OPEN = 64


def pack(samples, seq_len: int, pad_id: int, dtype=np.uint32):
    """(tokens, mask, doc, placed): samples [(ids, mask)] packed into (N, seq_len + 1) windows; `placed` the
    indices of the samples packed (the others were longer than a window)."""
    width = seq_len + 1
    order, placed = [], []  # order: per window, the samples in it
    room = np.zeros(0, dtype=np.int64)  # the free tokens of the last OPEN windows opened, oldest first
    for i, (ids, _) in enumerate(samples):
        n = len(ids)
        if n > width or n == 0:
            continue
        fits = np.flatnonzero(room >= n)
        if len(fits):
            slot = int(fits[0])
        else:  # a new window; the oldest open one closes when there are OPEN
            order.append([])
            room = np.append(room[1:] if len(room) == OPEN else room, width)
            slot = len(room) - 1
        order[len(order) - len(room) + slot].append(i)
        room[slot] -= n
        placed.append(i)
    tokens = np.full((len(order), width), pad_id, dtype=dtype)
    mask = np.zeros((len(order), width), dtype=np.uint8)
    doc = np.zeros((len(order), width), dtype=np.int32)
    for w, members in enumerate(order):
        at = 0
        for d, i in enumerate(members):
            ids, counted = samples[i]
            tokens[w, at:at + len(ids)] = ids
            mask[w, at:at + len(ids)] = counted
            doc[w, at:at + len(ids)] = d
            at += len(ids)
        doc[w, at:] = len(members)  # the padding: a document of its own
        mask[w, at:] = PAD
    return tokens, mask, doc, placed


class PackedWindows:
    """A split's packed windows (memory maps of the cache's arrays), drawn as batches."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, doc: np.ndarray, document_mask: bool = True) -> None:
        self.tokens, self.mask, self.doc = tokens, mask, doc
        self.document_mask = document_mask
        self.windows, width = tokens.shape
        self.seq_len = width - 1
        self.ndim = 1  # the loader's checks read it as a token array's

    def __len__(self) -> int:
        """Tokens held, padding included (what the loader's length checks and resume state read)."""
        return int(self.tokens.size)

    def rows(self, indices) -> tuple[np.ndarray, ...]:
        """(x, y) or, under the document mask, (x, y, doc) of the windows `indices`: int64 x, y and int32 doc,
        each (len(indices), seq_len)."""
        indices = np.asarray(indices)
        w = self.tokens[indices].astype(np.int64)
        counted = self.mask[indices] == 1
        doc = self.doc[indices]
        keep = counted[:, 1:]
        if self.document_mask:
            keep = keep & (doc[:, 1:] == doc[:, :-1])
        x = np.ascontiguousarray(w[:, :-1])
        y = np.where(keep, w[:, 1:], IGNORE_INDEX)
        if not self.document_mask:
            return x, y
        return x, y, np.ascontiguousarray(doc[:, :-1])

    def train_batch(self, seed: int, index: int, batch_size: int) -> tuple[np.ndarray, ...]:
        """Training batch `index`: windows in seeded per-epoch order (the module's docstring)."""
        g = index * batch_size + np.arange(batch_size)
        epochs, place = np.divmod(g, self.windows)
        picked = np.empty(batch_size, dtype=np.int64)
        for e in np.unique(epochs):
            order = np.random.default_rng([seed, int(e)]).permutation(self.windows)
            picked[epochs == e] = order[place[epochs == e]]
        return self.rows(picked)

    def content(self) -> np.ndarray:
        """The samples' tokens, padding left out (statistics)."""
        return np.asarray(self.tokens)[np.asarray(self.mask) != PAD]

    def counted(self) -> int:
        """Targets the loss counts over the whole split (under this document mask)."""
        total = 0
        for start in range(0, self.windows, 4096):
            y = self.rows(np.arange(start, min(start + 4096, self.windows)))[1]
            total += int((y != IGNORE_INDEX).sum())
        return total


class PackedMixture:
    """[[data.mix]] of chat sources: row b of training batch i comes from source s with probability weight_s (as
    kiln.data.mix.Mixture draws text rows), and from a window of it drawn uniformly, both from
    np.random.default_rng([seed, i]): a pure function of (seed, i)."""

    def __init__(self, names: list[str], weights: list[float], parts: list[PackedWindows]) -> None:
        self.names, self.parts = names, parts
        self.weights = np.array(weights, dtype=np.float64) / sum(weights)
        self.seq_len, self.document_mask, self.ndim = parts[0].seq_len, parts[0].document_mask, 1

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def train_batch(self, seed: int, index: int, batch_size: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng([seed, index])
        source = rng.choice(len(self.parts), size=batch_size, p=self.weights)
        u = rng.random(batch_size)
        out = None
        for s in np.unique(source):
            mine = source == s
            part = self.parts[s]
            arrays = part.rows((u[mine] * part.windows).astype(np.int64))
            if out is None:
                out = [np.empty((batch_size, *a.shape[1:]), dtype=a.dtype) for a in arrays]
            for o, a in zip(out, arrays):
                o[mine] = a
        return tuple(out)
