"""The documents inside a pretraining window (data.document_mask with records=text): kiln's shards end every
document with the tokenizer's end-of-text id (kiln.data.tokenizer: `eot_id`), and a window is a random offset
into them, so it holds the tail of one document, whole ones, and the head of another.

    with_documents(x, y, separator) -> (x, y, doc)

doc (B, T) int32 is the index within the window of the document each position belongs to (non-decreasing from
0): a separator belongs to the document it ends, the next token starts a new one. y is IGNORE_INDEX where x is
a separator: that target is the next document's first token, which the document mask hides from it. The model
restarts its attention and positions at each new index (kiln.models.documents).
"""
from __future__ import annotations

import torch

from kiln.errors import KilnError

IGNORE_INDEX = -100  # kiln.models.transformer.IGNORE_INDEX: data sits beside models and cannot import it (a test checks)


def with_documents(x: torch.Tensor, y: torch.Tensor, separator: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, doc) of windows x, y (B, T) whose documents end with `separator`."""
    ends = x == separator  # (B, T)
    doc = (ends.cumsum(-1) - ends.long()).to(torch.int32)  # separators before t: this one is still its document's
    return x, y.masked_fill(ends, IGNORE_INDEX), doc


def document_separator(cfg, tokenizer) -> int | None:
    """The id that ends each document when a text corpus's windows carry their documents (cfg: the DataConfig;
    data.document_mask), else None. Chat records are packed with their documents where they are read."""
    if not cfg.masks_documents or cfg.records != "text":
        return None
    if tokenizer.eot_id < 0:  # DataConfig.validate refuses this first; kept for a PreparedData built in code
        raise KilnError("data.document_mask=true needs the tokenizer's end-of-text id, which this pre-tokenized "
                        "corpus does not know; give --data.tokenizer=hf:DIR or set --data.document_mask=false",
                        key="data.document_mask", value=cfg.document_mask,
                        fix="give --data.tokenizer=hf:DIR or set --data.document_mask=false")
    return tokenizer.eot_id


def document_mask_refusal(cfg, kernels: str, pp: int) -> tuple[str, str] | None:
    """(the line, the fix) when the document mask is on (cfg: the DataConfig) with a lever that cannot carry it:
    train.kernels=triton or pipeline parallelism; None otherwise (context parallelism carries it:
    kiln.parallel.context). kiln.config raises it."""
    if not cfg.masks_documents:
        return None
    if kernels == "triton":
        what, lever = "train.kernels=triton runs attention in FlashAttention, which takes no mask", "--train.kernels=torch"
    elif pp > 1:
        what, lever = f"parallel.pp={pp} sends the pipeline stages hidden states, not the documents", "--parallel.pp=1"
    else:
        return None
    fix = f"use {lever}, or set --data.document_mask=false"
    return f"{what}, and data.document_mask is on (records={cfg.records}); {fix}", fix
