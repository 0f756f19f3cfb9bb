"""Log-likelihoods of token continuations, as lm-evaluation-harness 0.4 computes them for a causal model.

    pair = encode_pair(encode, context, continuation, prefix_id)      its (context, continuation) tokens
    windows = rolling_windows(tokens, prefix_id, max_length)           a document as disjoint (context, target) pairs
    lls, truncated = loglikelihoods(model, pairs, vocab, max_length)   summed log p(continuation | context), float64
    doc_lls = rolling_loglikelihoods(model, docs, prefix_id, ...)      a whole document each (perplexity, val loss)

A pair is scored as the harness's HFLM._loglikelihood_tokens scores it: the row (context + continuation) keeps its
last max_length + 1 tokens (a longer context loses its start: counted as truncated), the model reads all but the
last, and the log-softmax over the true vocabulary (kiln's padding rows excluded) is summed at the continuation's
positions. `model` is anything that maps ids (B, T) to logits (B, T, V ≥ vocab): kiln's Transformer, or one
wrapped for data parallelism.

Under data parallelism (`world`, kiln.parallel's World) each copy scores every dp_size-th row, padded so that all
run the same number of forwards (FSDP needs every rank in each one), and the log-likelihoods are summed over the
copies: every rank returns all of them.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kiln.errors import KilnError


@dataclass(frozen=True)
class Pair:
    context: tuple[int, ...]  # never empty (an empty context is the prefix id)
    continuation: tuple[int, ...]  # never empty


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str, prefix_id: int) -> Pair:
    """The harness's tokenization of one request: trailing whitespace of the context moves to the continuation,
    the continuation's tokens are those of encode(context + continuation) after the first len(encode(context)) —
    so a merge across the boundary is scored as the model would see the whole text. An empty context is
    `prefix_id` (the end-of-text id), unless the continuation already starts with it."""
    if not context:
        tokens = tuple(encode(continuation))
        if tokens and tokens[0] == prefix_id:
            return Pair(tokens[:1], tokens[1:])
        return Pair((prefix_id,), tokens)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(context + continuation)
    head = encode(context)
    return Pair(tuple(head), tuple(whole[len(head):]))


def rolling_windows(tokens: list[int], prefix_id: int, max_length: int) -> list[Pair]:
    """A document as the harness's get_rolling_token_windows(context_len=1) + make_disjoint_window make it: every
    token is predicted exactly once; the first window reads prefix_id then up to max_length - 1 tokens; each
    later one predicts up to max_length tokens after the one token before them, and the last (shorter) one reads
    as many earlier tokens as fill its window."""
    if max_length < 1:
        raise KilnError(f"max_length={max_length} must be ≥ 1", key="max_length", value=max_length,
                        fix="give a window of at least one token")
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    out = [Pair((prefix_id,), tuple(tokens[:first]))]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)  # tokens predicted by this window
        end = done + n
        read = tokens[end - max_length - 1:end - 1]  # the window the model reads: max_length tokens before `end`
        out.append(Pair(tuple(read[:len(read) - (n - 1)]), tuple(tokens[end - n:end])))
        done = end
    return out


def _row(pair: Pair, max_length: int) -> tuple[list[int], int, bool]:
    """(tokens of the row, how many at its end are scored, whether the context lost its start)."""
    if len(pair.continuation) > max_length:
        raise KilnError(f"a continuation of {len(pair.continuation)} tokens does not fit the model's window of "
                        f"{max_length}", key="model.max_seq_len", value=max_length,
                        fix="score it with a model of a longer window, or shorten the task's answers")
    whole = list(pair.context) + list(pair.continuation)
    return whole[-(max_length + 1):], len(pair.continuation), len(whole) > max_length + 1


def loglikelihoods(model, pairs: list[Pair], vocab: int, max_length: int, batch_size: int = 16,
                   device: torch.device | str = "cpu", autocast=None, world=None,
                   advance: Callable[[int], None] | None = None) -> tuple[torch.Tensor, int]:
    """(summed log-likelihood of each pair's continuation, float64 on the CPU; how many contexts were truncated
    from the left). autocast: a context manager factory for the forward (training's precision); advance(n): called
    after each batch with the rows this rank finished (a progress bar)."""
    rows = [_row(p, max_length) for p in pairs]
    truncated = sum(t for _, _, t in rows)
    rank, size = (world.dp_rank, world.dp_size) if world is not None else (0, 1)
    mine = list(range(rank, len(rows), size))
    per_rank = math.ceil(len(rows) / size) if rows else 0
    mine += [-1] * (per_rank - len(mine))  # a dummy row (row 0, result dropped): the same forwards on every rank
    mine.sort(key=lambda i: -len(rows[max(i, 0)][0]))  # longest first: a batch pads little, the peak comes first
    out = torch.zeros(len(rows), dtype=torch.float64, device=device)
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(mine), batch_size):
                batch = mine[start:start + batch_size]
                scored = _score_batch(model, [rows[max(i, 0)] for i in batch], vocab, device, autocast)
                for i, ll in zip(batch, scored):
                    if i >= 0:
                        out[i] = ll
                if advance is not None:
                    advance(sum(i >= 0 for i in batch))
    finally:
        model.train(was_training)
    if world is not None and size > 1:
        world.all_reduce(out, dim="dp")  # each row was scored by one copy, zeros elsewhere
    return out.cpu(), truncated


def _score_batch(model, rows, vocab: int, device, autocast) -> torch.Tensor:
    width = max(len(tokens) for tokens, _, _ in rows) - 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # right padding: a causal model never reads it
    for b, (tokens, _, _) in enumerate(rows):
        ids[b, :len(tokens) - 1] = torch.tensor(tokens[:-1])
    with autocast() if autocast is not None else contextlib.nullcontext():
        logits = model(ids.to(device))  # (B, T, V)
    sums = torch.empty(len(rows), dtype=torch.float64, device=logits.device)
    for b, (tokens, n, _) in enumerate(rows):
        end = len(tokens) - 1  # positions end - n .. end - 1 predict the last n tokens
        row = logits[b, end - n:end, :vocab]
        # at least fp32 (a bf16 / fp16 forward's logits are widened); an fp64 model keeps its fp64
        logp = F.log_softmax(row.float() if row.element_size() < 4 else row, dim=-1)  # (n, vocab)
        target = torch.tensor(tokens[-n:], device=logp.device)
        sums[b] = logp.gather(1, target[:, None]).sum().double()
    return sums


def rolling_loglikelihoods(model, documents: list[list[int]], prefix_id: int, vocab: int, max_length: int,
                           batch_size: int = 16, device: torch.device | str = "cpu", autocast=None, world=None,
                           advance: Callable[[int], None] | None = None) -> torch.Tensor:
    """The log-likelihood of each whole document (the harness's loglikelihood_rolling): the sum over its
    rolling_windows, every token predicted once. float64 on the CPU, one per document."""
    windows = [rolling_windows(doc, prefix_id, max_length) for doc in documents]
    flat = [w for ws in windows for w in ws]
    lls, _ = loglikelihoods(model, flat, vocab, max_length, batch_size, device, autocast, world, advance)
    out, at = torch.zeros(len(documents), dtype=torch.float64), 0
    for d, ws in enumerate(windows):
        out[d] = lls[at:at + len(ws)].sum()
        at += len(ws)
    return out
