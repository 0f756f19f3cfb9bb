"""Batches from a user's data, resumable: a torch Dataset shuffled by kiln, or any re-iterable of batches.

    BatchLoader(dataset, batch_size, seed, device)   map-style Dataset: kiln shuffles and collates
    BatchLoader(iterable, None, seed, device)        ready batches (a DataLoader, a list, a generator function's
                                                     re-iterable): served in their own order

Both have the interface the training loop uses (next, batches_served, skip, state_dict, load_state_dict, close).

A Dataset is exact to resume: batch i is a pure function of (seed, i), as kiln's token loader's is. Epoch e is the
permutation np.random.default_rng([seed, e]) of the indices, cut into batches of batch_size (the last one of an
epoch may be smaller; the step's per-sample normalisation makes that exact). An iterable resumes by iterating
again from its start and skipping the batches already served: exact when it yields the same batches in the same
order every time (a DataLoader with shuffle=True and no seeded generator does not).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from kiln.errors import KilnError


def map_tensors(batch, fn):
    """`fn` applied to every tensor of a batch (nested tuples, lists, dicts); other values as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch, device: torch.device):
    """Tensors of a batch moved to `device`."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def is_dataset(data) -> bool:
    """Map-style: indexable with a length (torch Datasets, TensorDataset, lists of samples are not: see below)."""
    return isinstance(data, Dataset) and hasattr(data, "__len__") and hasattr(data, "__getitem__")


class BatchLoader:
    def __init__(self, data, batch_size: int | None, seed: int, device: torch.device | str = "cpu", rank: int = 0,
                 world: int = 1):
        """rank, world: data parallelism; this rank's n-th batch is batch n·world + rank of the one stream."""
        self.data, self.seed, self.device = data, seed, torch.device(device)
        self.rank, self.world = rank, world
        self.dataset = is_dataset(data)
        if self.dataset:
            if not batch_size or batch_size < 1:
                raise KilnError(f"a Dataset is batched by kiln: batch_size must be ≥ 1, got {batch_size}",
                                key="batch_size", value=batch_size)
            self.n = len(data)
            if self.n == 0:
                raise KilnError("the Dataset is empty: nothing to train on", key="train_data", value=0)
            self.batch_size = batch_size
            self.per_epoch = math.ceil(self.n / batch_size)
        elif not isinstance(data, Iterable):
            raise TypeError(f"training data must be a torch Dataset (indexable, with a length) or an iterable of "
                            f"batches; got {type(data).__name__}")
        self.batches_served = 0
        self._it = None  # iterable: the live iterator
        self._order: tuple[int, np.ndarray] | None = None  # dataset: (epoch, its permutation)

    def _dataset_batch(self, index: int):
        epoch, i = divmod(index, self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n))
        rows = self._order[1][i * self.batch_size:(i + 1) * self.batch_size]
        return default_collate([self.data[int(r)] for r in rows])

    def _iterable_batch(self):
        if self._it is None:
            self._it = iter(self.data)
        try:
            return next(self._it)
        except StopIteration:
            if self._it is self.data or self.batches_served == 0:  # a one-shot iterator, or an empty iterable
                raise KilnError(f"the training data ran out after {self.batches_served} batches and cannot be "
                                f"iterated again; pass a torch Dataset or a re-iterable (a DataLoader, a list), "
                                f"or lower train.max_steps", key="train_data",
                                fix="pass a torch Dataset or a re-iterable (a DataLoader, a list), or lower "
                                    "train.max_steps") from None
            self._it = iter(self.data)  # the next epoch
            return next(self._it)

    def next(self):
        if self.dataset:
            batch = self._dataset_batch(self.batches_served * self.world + self.rank)
        else:
            for _ in range(self.rank):  # the other ranks' batches of this round
                self._iterable_batch()
            batch = self._iterable_batch()
            for _ in range(self.world - 1 - self.rank):
                self._iterable_batch()
        self.batches_served += 1
        return to_device(batch, self.device)

    def skip(self, n: int) -> None:
        if self.dataset:
            self.batches_served += n
        else:
            for _ in range(n * self.world):
                self._iterable_batch()
            self.batches_served += n

    def state_dict(self) -> dict:
        return {"batches_served": self.batches_served, "seed": self.seed, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise KilnError(f"the checkpoint's data order has seed {state['seed']}, this run {self.seed}; "
                            f"resume with the same train.seed", key="train.seed", value=self.seed,
                            fix="resume with the same train.seed")
        served = int(state["batches_served"]) * int(state.get("world", 1))  # batches of the stream, all ranks
        if served % self.world:
            raise KilnError(f"the checkpoint was taken {served} batches into the data, which {self.world} ranks "
                            f"cannot share evenly; resume with a world size that divides it", key="world",
                            value=self.world, fix="resume with a world size that divides it")
        if self.dataset:
            self.batches_served = served // self.world
            return
        if iter(self.data) is self.data:
            raise KilnError("resuming replays the training data from its start, but it is a one-shot "
                            "iterator; pass a torch Dataset or a re-iterable (a DataLoader, a list)", key="train_data",
                            fix="pass a torch Dataset or a re-iterable (a DataLoader, a list)")
        self._it, self.batches_served = None, 0
        self.skip(served // self.world)

    def close(self) -> None:
        self._it = None


def eval_batches(data, batch_size: int):
    """Evaluation batches in order: a Dataset cut into batches, or the iterable's own batches."""
    if is_dataset(data):
        for start in range(0, len(data), batch_size):
            yield default_collate([data[i] for i in range(start, min(start + batch_size, len(data)))])
    else:
        yield from data
