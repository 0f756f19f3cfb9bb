"""What a step minimises: how one micro-batch becomes a summed loss, and what that sum is normalised by.

    objective.count(batch)   0-d device tensor: tokens (language model) or samples this micro-batch adds
    objective(model, batch)  0-d tensor: the SUM of their losses
    objective.size(batch)    host int from shapes alone: units for throughput (no device sync)

The step divides every micro-batch's sum by the count of the whole global batch, so k micro-batches, even of
uneven sizes or valid-token counts, give the gradient of one batch k times larger.

    LanguageModeling()   kiln's Transformer: batch (x, y) of token ids, or (x, y, doc) with each position's
                         document (packed chat windows); per valid target token
    Supervised(loss)     any model: batch (inputs, targets); loss(model(inputs), targets); per sample
    Contrastive(loss)    any encoder: batch (view_a, view_b); loss(model(view_a), model(view_b)) (NT-Xent)
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kiln.data.batches import map_tensors
from kiln.errors import KilnError
from kiln.models.transformer import IGNORE_INDEX
from kiln.train.losses import NTXent, as_loss


def _pair(batch, what: str):
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise KilnError(f"{what} expects each batch to be a pair {what.split('(')[1].rstrip(')')}; got "
                        f"{type(batch).__name__}" + (f" of length {len(batch)}" if hasattr(batch, '__len__') else ""),
                        key="batch", value=type(batch).__name__, fix="expects each batch to be a pair")
    return batch


def _like_model(x, model: nn.Module):
    """Floating inputs in the model's parameter dtype (bf16-master and fp64 runs keep their weights in it; autocast
    runs keep fp32 weights and leave the inputs alone)."""
    dtype = next(model.parameters()).dtype
    return map_tensors(x, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _first_dim(x) -> int:
    while isinstance(x, (tuple, list)):
        x = x[0]
    if isinstance(x, dict):
        return _first_dim(next(iter(x.values())))
    return x.shape[0]


class LanguageModeling:
    """kiln's Transformer: model(x, y, reduction="sum") is the summed loss over targets != IGNORE_INDEX. A third
    tensor, doc (B, T), is the document of each position in packed windows (data.document_mask): the model's
    attention and positions restart at each document (kiln.models.documents)."""

    unit = "tokens"

    def count(self, batch) -> torch.Tensor:
        return (batch[1] != IGNORE_INDEX).sum()

    def size(self, batch) -> int:
        return batch[0].numel()

    def __call__(self, model, batch) -> torch.Tensor:
        if len(batch) == 3:  # packed documents (kiln.data.packing): the model restarts attention where doc changes
            x, y, doc = batch
            return model(x, y, reduction="sum", doc=doc)
        x, y = batch
        return model(x, y, reduction="sum")

    def __repr__(self) -> str:
        return "LanguageModeling()"


class Supervised:
    """Batches (inputs, targets); `loss` as kiln.train.losses.as_loss accepts it (a name, a Loss, a callable)."""

    unit = "samples"

    def __init__(self, loss):
        self.loss = as_loss(loss)

    def count(self, batch) -> torch.Tensor:
        return self.loss.count(_pair(batch, "Supervised (inputs, targets)")[1])

    def size(self, batch) -> int:
        return _first_dim(batch[1])

    def __call__(self, model, batch) -> torch.Tensor:
        inputs, targets = _pair(batch, "Supervised (inputs, targets)")
        return self.loss(model(_like_model(inputs, model)), targets)

    def __repr__(self) -> str:
        return f"Supervised({self.loss!r})"


class Contrastive:
    """Batches (view_a, view_b) of the same samples; the model embeds each view, the loss pairs row i with row i.

    Negatives come from the same micro-batch only: accumulating k micro-batches is not one batch k× larger here
    (each anchor sees fewer negatives), though the normalisation is still per anchor.
    """

    unit = "samples"

    def __init__(self, loss=None):
        self.loss = as_loss(loss) if loss is not None else NTXent()

    def count(self, batch) -> torch.Tensor:
        return self.loss.count(_pair(batch, "Contrastive (view_a, view_b)")[1])

    def size(self, batch) -> int:
        return _first_dim(batch[0])

    def __call__(self, model, batch) -> torch.Tensor:
        a, b = _pair(batch, "Contrastive (view_a, view_b)")
        return self.loss(model(_like_model(a, model)), model(_like_model(b, model)))

    def __repr__(self) -> str:
        return f"Contrastive({self.loss!r})"
