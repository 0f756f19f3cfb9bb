"""Documents packed into one window: the positions within each, and the mask that keeps attention inside it.

A batch with a document mask carries doc (B, T), int: the index within its window of the document each position
belongs to, non-decreasing along T from 0 (kiln.data builds it from the separator token, or from the packed
samples of a chat set). From doc alone, with no host sync:

    positions(doc)             (B, T) long: t minus the first position of its document (RoPE's and GPT-2's table row)
    document_mask(doc)         (B, 1, T, T) bool: key j is seen by query i when j ≤ i and both are in one document
    packed(doc, idx)           (positions, document_mask) of token ids idx: Transformer.documents, the seam where
                               context parallelism puts its sequence shard's (kiln.parallel.context)
    same_document(doc)         the rule as flex_attention's mask_mod
    document_block_mask(doc)   the same rule as flex_attention's BlockMask (CUDA)

Attention with the boolean mask goes through SDPA, measured on CPU against flex_attention and a per-document split
(benchmarks/document_mask.py, docs/benchmarks.md): flex_attention has no backward on CPU (torch 2.13:
"FlexAttention does not support backward on CPU"), and a per-document split needs the boundaries on the host.
"""
from __future__ import annotations

import torch

from kiln.errors import KilnError


def positions(doc: torch.Tensor) -> torch.Tensor:
    """(B, T) long: each position's offset from the first position of its document."""
    T = doc.shape[-1]
    t = torch.arange(T, device=doc.device).expand_as(doc)  # (B, T)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]  # a document begins where the index changes
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=-1).values  # (B, T): its document's first t
    return t - first


def document_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where attention is allowed: causal and within one document (SDPA's attn_mask; the
    diagonal is always allowed, so no row of the softmax is empty)."""
    T = doc.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()  # (T, T)
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def packed(doc: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (B, T), document_mask (B, 1, T, T)) of the documents doc (B, T) of token ids idx (B, T): what the
    Transformer reads of them (its `documents`, replaced under context parallelism by the shard's own)."""
    check_doc(doc, idx)
    return positions(doc), document_mask(doc)


def same_document(doc: torch.Tensor):
    """flex_attention's mask_mod of the rule: (b, h, q, kv) -> q ≥ kv and one document (q, kv: positions of doc's
    windows)."""

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    return mask_mod


def document_block_mask(doc: torch.Tensor, block_size: int = 128):
    """flex_attention's BlockMask for causal attention within each document of doc (B, T); its blocks without any
    allowed pair are skipped, which is where flex gains over a dense mask on a GPU. Not used on a CPU, where
    flex_attention has no backward (and building it took 24 s for T = 22 on the shared 2-core CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask  # lazy: flex pulls in torch's compile stack

    B, T = doc.shape
    return create_block_mask(same_document(doc), B, None, T, T, device=doc.device, BLOCK_SIZE=block_size)


def check_doc(doc: torch.Tensor, idx: torch.Tensor) -> None:
    """Shape and dtype of doc against the token ids (cheap: no values are read, so no host sync)."""
    if doc.shape != idx.shape:
        raise KilnError(f"doc must have the token ids' shape {tuple(idx.shape)}, got {tuple(doc.shape)}",
                        key="doc", value=tuple(doc.shape), fix=f"give doc of shape {tuple(idx.shape)}")
    if doc.is_floating_point() or doc.dtype == torch.bool:
        raise KilnError(f"doc must hold integer document indices, got {doc.dtype}", key="doc", value=doc.dtype,
                        fix="give doc as an integer tensor (torch.long)")
