"""Generation: a model's continuations of token prompts, one token per step, with a KV cache (kiln.models.cache)
or, for comparison, by running the whole context again at every step.

    Sampling(temperature, top_k, top_p)     how a token is drawn from the logits (temperature 0: greedy)
    warp(logits, sampling)                  transformers' order: temperature, then top-k, then top-p
    top_p_removed(logits, p)                the tokens outside the nucleus: TopPLogitsWarper's set, ties included
    generate(model, prompts, n, ...)        -> Generated: each prompt's new tokens and why it stopped

A batch of prompts of different lengths is left-padded into one (B, T) prefill; the cache masks the padding and
counts each row's positions from its first real token, so a row's tokens are those it gets alone. With the
cache a row can grow to model.max_seq_len positions and stops there ("window"); without it the context slides
(the last max_seq_len tokens, as the model saw in training) and each row runs alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.models.cache import KVCache
from kiln.models.parts import soft_cap

# Why a row stopped.
LENGTH = "length"  # max_new_tokens reached
END = "end"  # a stop id (end of text, an hf: model's eos ids) was drawn; it is not part of the output
STOP = "stop"  # the caller's stop test (e.g. a stop string) said so
WINDOW = "window"  # the KV cache is full: model.max_seq_len positions


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax); else logits / temperature before the filters
    top_k: int = 0  # keep the k likeliest tokens (0: all)
    top_p: float = 1.0  # keep the nucleus: the likeliest tokens whose probabilities reach p (1: all)

    def __post_init__(self):
        if not self.temperature >= 0 or self.top_k < 0 or not 0 <= self.top_p <= 1:
            key = ("temperature" if not self.temperature >= 0 else "top_k" if self.top_k < 0 else "top_p")
            raise KilnError(f"sampling needs temperature ≥ 0, top_k ≥ 0 and 0 ≤ top_p ≤ 1; got {self}", key=key,
                            value=getattr(self, key), fix="give temperature ≥ 0, top_k ≥ 0 and 0 ≤ top_p ≤ 1")


@dataclass
class Generated:
    tokens: list[list[int]]  # each prompt's new tokens (a stop id is not included)
    reasons: list[str]  # why each row stopped: LENGTH | END | STOP | WINDOW
    logits: list[torch.Tensor] = field(default_factory=list)  # keep_logits: per row (steps, V), fp32

    @property
    def count(self) -> int:
        """New tokens generated over all rows."""
        return sum(len(t) for t in self.tokens)


def top_p_removed(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean mask (..., V) of the tokens outside the top-p nucleus. From the least likely up, a token is removed
    while the probability of it and of every less likely token sums to at most 1 - p; the likeliest always stays.
    This is transformers' TopPLogitsWarper, computed in the same order with the same (unstable) sort, so that on
    ties the kept set is theirs on every device."""
    ascending, order = torch.sort(logits, descending=False)
    removed = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - p  # (..., V) in ascending order
    removed[..., -1] = False
    return removed.scatter(-1, order, removed)


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The logits (B, V) to sample from, in transformers' order: / temperature, top-k, top-p (-inf: removed)."""
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if s.top_p < 1:
        logits = logits.masked_fill(top_p_removed(logits, s.top_p), -float("inf"))
    return logits


def next_tokens(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B,) the next token of each row from its logits (B, V)."""
    if s.temperature == 0:
        return logits.argmax(dim=-1)
    probs = F.softmax(warp(logits, s), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _last_logits(model, idx: torch.Tensor, cache: KVCache | None, vocab_limit: int | None) -> torch.Tensor:
    """fp32 logits (B, V) of the last position; tokens at or above vocab_limit (vocabulary padding) at -inf."""
    logits = F.linear(model.hidden(idx, cache)[:, -1], model.head_weight).float()
    logits = soft_cap(logits, getattr(getattr(model, "cfg", None), "logit_softcap", 0.0))  # as the model trained
    if vocab_limit is not None:
        logits[:, vocab_limit:] = -float("inf")
    return logits


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
             stop_ids=(), stop: Callable[[list[int]], bool] | None = None, vocab_limit: int | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True,
             keep_logits: bool = False) -> Generated:
    """Continue each prompt (a non-empty list of token ids) by up to max_new_tokens tokens.

    A row stops at a token of stop_ids (not kept), when stop(its new tokens) is true, after max_new_tokens, or
    (cached) when model.max_seq_len positions are filled. A prompt longer than max_seq_len keeps its last
    max_seq_len tokens. keep_logits: every step's logits over the vocabulary (below vocab_limit), for comparisons."""
    if any(not p for p in prompts):
        raise KilnError("every prompt needs at least one token", key="prompts",
                        fix="give each prompt at least one token")
    window = model.cfg.max_seq_len
    prompts = [list(p[-window:]) for p in prompts]
    was_training = model.training
    model.eval()
    try:
        if use_cache:
            return _cached(model, prompts, max_new_tokens, sampling, set(stop_ids), stop, vocab_limit, generator,
                           keep_logits)
        rows = [_uncached(model, p, max_new_tokens, sampling, set(stop_ids), stop, vocab_limit, generator,
                          keep_logits) for p in prompts]
        return Generated([r.tokens[0] for r in rows], [r.reasons[0] for r in rows],
                         [r.logits[0] for r in rows] if keep_logits else [])
    finally:
        model.train(was_training)


def _cached(model, prompts, max_new_tokens, sampling, stop_ids, stop, vocab_limit, generator, keep_logits):
    B, T = len(prompts), max(len(p) for p in prompts)
    out, reasons, kept = [[] for _ in prompts], [LENGTH] * B, [[] for _ in prompts]
    if max_new_tokens == 0:
        return Generated(out, reasons, [torch.empty(0) for _ in prompts] if keep_logits else [])
    device = model.head_weight.device
    pad = [T - len(p) for p in prompts]
    # the padding's token id is never seen (masked); the first real token of the row is as good as any
    idx = torch.tensor([[p[0]] * n + p for p, n in zip(prompts, pad)], device=device)  # (B, T)
    # the last token drawn is never fed back: n new tokens need T + n - 1 positions
    cache = KVCache(len(model.blocks), min(model.cfg.max_seq_len, T + max_new_tokens - 1),
                    torch.tensor(pad) if any(pad) else None)
    logits = _last_logits(model, idx, cache, vocab_limit)  # (B, V)
    active = list(range(B))
    for step in range(max_new_tokens):
        chosen = next_tokens(logits, sampling, generator)  # (B,)
        for b, token in zip(list(active), chosen.tolist()):
            if keep_logits:
                kept[b].append(logits[b, :vocab_limit])
            if token in stop_ids:
                reasons[b] = END
            else:
                out[b].append(token)
                if stop is None or not stop(out[b]):
                    continue
                reasons[b] = STOP
            active.remove(b)
        if not active or step == max_new_tokens - 1:
            break
        if cache.filled == cache.length:
            for b in active:
                reasons[b] = WINDOW
            break
        logits = _last_logits(model, chosen[:, None], cache, vocab_limit)
    return Generated(out, reasons, [torch.stack(k) if k else torch.empty(0) for k in kept] if keep_logits else [])


def _uncached(model, prompt, max_new_tokens, sampling, stop_ids, stop, vocab_limit, generator, keep_logits):
    """One prompt, the whole context (its last max_seq_len tokens) through the model at every step."""
    device = model.head_weight.device
    ids, out, kept, reason = list(prompt), [], [], LENGTH
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-model.cfg.max_seq_len:]], device=device)
        logits = _last_logits(model, context, None, vocab_limit)
        if keep_logits:
            kept.append(logits[0, :vocab_limit])
        token = next_tokens(logits, sampling, generator).item()
        if token in stop_ids:
            reason = END
            break
        ids.append(token)
        out.append(token)
        if stop is not None and stop(out):
            reason = STOP
            break
    return Generated([out], [reason], [torch.stack(kept) if kept else torch.empty(0)])
