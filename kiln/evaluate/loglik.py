"""Log-likelihoods of token continuations, as lm-evaluation-harness 0.4 computes them for a causal model.

    pair = encode_pair(encode, context, continuation, prefix_id)      its (context, continuation) tokens
    windows = rolling_windows(tokens, prefix_id, max_length)           a document as disjoint (context, target) pairs
    lls, truncated = loglikelihoods(model, pairs, vocab, max_length)   summed log p(continuation | context), float64
    doc_lls = rolling_loglikelihoods(model, docs, prefix_id, ...)      a whole document each (perplexity, val loss)

A pair is scored as the harness's HFLM._loglikelihood_tokens scores it: the row (context + continuation) keeps its
last max_length + 1 tokens (a longer context loses its start: counted as truncated), the model reads all but the
last, and the log-softmax over the true vocabulary (kiln's padding rows excluded) is summed at the continuation's
positions. `model` is kiln's Transformer (maybe wrapped for data parallelism, or split by tp or cp) or a
pipeline's PipelineModel: the rows run through the validation pass's forward with a scoring head in the loss's
place (kiln.evaluate.forward).

Under data parallelism (`world`, kiln.parallel's World) each copy scores every dp_size-th row, padded so that all
run the same number of forwards (FSDP needs every rank in each one), and the log-likelihoods are summed over the
copies (and over a row's cp ranks and pipeline stages): every rank returns all of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kiln.evaluate.forward import row_loglikelihoods, scoring_head, width_multiple
from kiln.models.parts import IGNORE_INDEX

from kiln.errors import KilnError


@dataclass(frozen=True)
class Pair:
    context: tuple[int, ...]  # never empty (an empty context is the prefix id)
    continuation: tuple[int, ...]  # never empty


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str, prefix_id: int,
                bare: Callable[[str], list[int]] | None = None) -> Pair:
    """The harness's tokenization of one request: trailing whitespace of the context moves to the continuation,
    the continuation's tokens are those of encode(context + continuation) after the first len(encode(context)) —
    so a merge across the boundary is scored as the model would see the whole text. An empty context is
    `prefix_id`, unless the continuation already starts with it; that continuation is encoded by `bare` (the
    harness's add_special_tokens=False, kiln.evaluate.encoding; default: encode)."""
    if not context:
        tokens = tuple((bare or encode)(continuation))
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
    after each batch with the rows this rank finished (a progress bar); world: kiln.parallel's World of a run under
    torchrun (its layout: kiln.evaluate.forward)."""
    rows = [_row(p, max_length) for p in pairs]
    truncated = sum(t for _, _, t in rows)
    rank, size = (world.dp_rank, world.dp_size) if world is not None else (0, 1)
    plan = world.plan if world is not None else None
    mine = list(range(rank, len(rows), size))
    per_rank = math.ceil(len(rows) / size) if rows else 0
    mine += [-1] * (per_rank - len(mine))  # a dummy row (row 0, result dropped): the same forwards on every rank
    mine.sort(key=lambda i: -len(rows[max(i, 0)][0]))  # longest first: a batch pads little, the peak comes first
    out = torch.zeros(len(rows), dtype=torch.float64, device=device)
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        with torch.no_grad(), scoring_head(model, vocab, model_softcap(model)) as head:
            for start in range(0, len(mine), batch_size):
                batch = mine[start:start + batch_size]
                ids, targets = _batch([rows[max(i, 0)] for i in batch], plan, batch_size, max_length)
                sums = row_loglikelihoods(model, head, ids.to(device), targets.to(device), autocast,
                                          plan.cp if plan is not None else 1)
                for i, ll in zip(batch, sums):
                    if i >= 0:
                        out[i] = ll
                if advance is not None:
                    advance(sum(i >= 0 for i in batch))
    finally:
        model.train(was_training)
    if world is not None and world.size > 1:  # each row scored by one copy (zeros elsewhere), its sum complete on
        for dim in ("dp", "cp", "pp"):  # the last pipeline stage (zeros on the others), over its positions' cp ranks
            world.all_reduce(out, dim=dim)
    return out.cpu(), truncated


def model_softcap(model) -> float:
    """model.logit_softcap of kiln's Transformer (or its pipeline), 0 for another model."""
    cfg = getattr(getattr(model, "module", model), "cfg", None)
    return getattr(cfg, "logit_softcap", 0.0) or 0.0


def _batch(rows, plan, batch_size: int, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, W) and targets (B, W) of a batch of rows, right-padded (a causal model never reads the padding; its
    targets are ignored), each row's scored tokens its only valid targets. W is the longest row's input, rounded up
    to a multiple of 2·cp under context parallelism (each cp rank holds 2 equal chunks) and of tp under sequence
    parallelism; under pipeline parallelism to a power of two and B to batch_size, since the pipeline builds an
    evaluation schedule for each batch shape (a dozen shapes at most, not one per row length)."""
    longest = max(len(tokens) for tokens, _, _ in rows) - 1
    B, multiple = len(rows), width_multiple(plan)
    if plan is not None and plan.pp > 1:
        B, longest = max(B, batch_size), 1 << (longest - 1).bit_length()
    width = min(-(-longest // multiple) * multiple, max_length)  # (kiln.evaluate.score checked max_length divides)
    ids = torch.zeros(B, width, dtype=torch.long)
    targets = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
    for b, (tokens, n, _) in enumerate(rows):
        end = len(tokens) - 1  # positions end - n .. end - 1 predict the last n tokens
        ids[b, :end] = torch.tensor(tokens[:-1])
        targets[b, end - n:end] = torch.tensor(tokens[-n:])
    return ids, targets


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
