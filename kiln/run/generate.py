"""Text generation: prompts (token ids) in, completions (text) out, through kiln.models.generate's KV cache and
sampling; what `kiln sample` and the sample at the end of `kiln train` both run.

    done = complete(model, tokenizer, prompts, max_new_tokens, sampling, stops=("\\n\\n",), stop_ids=(eot,))
    done.texts, done.count, done.seconds, done.window_line()

A stop string ends its row once the completion's text contains it; the text is cut before it. A stop id (the
end-of-text id; an hf: model's eos ids) ends its row and is not decoded. Prompts run in batches of `batch_size`,
left-padded (each row's tokens are those it gets alone).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kiln.models.generate import WINDOW, Generated, Sampling, generate


@dataclass
class Completions:
    texts: list[str]  # each prompt's completion, cut before its first stop string
    generated: list[Generated]  # one per batch
    seconds: float  # generation time, prefill included (model loading not)
    max_seq_len: int

    @property
    def count(self) -> int:
        """New tokens over all prompts."""
        return sum(g.count for g in self.generated)

    def rate_line(self) -> str:
        """`N tokens in S s (T tokens/s)`."""
        rate = self.count / self.seconds if self.seconds > 0 else 0.0
        return f"{self.count} tokens in {self.seconds:.2f} s ({rate:,.1f} tokens/s)"

    def window_line(self) -> str | None:
        """One line when a row stopped because the KV cache was full, else None."""
        rows = sum(r == WINDOW for g in self.generated for r in g.reasons)
        if not rows:
            return None
        which = "the completion" if len(self.texts) == 1 else f"{rows} of {len(self.texts)} completions"
        return (f"{which} stopped at model.max_seq_len={self.max_seq_len} positions, all the KV cache holds; "
                f"--no-kv-cache slides the context window past it instead")


def cut_at_stop(text: str, stops) -> str:
    """text up to (not including) the earliest stop string in it."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(ends)] if ends else text


def complete(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
             stops=(), stop_ids=(), seed: int = 0, use_cache: bool = True, batch_size: int = 8,
             autocast=None) -> Completions:
    """Completions of `prompts` by `model` (kiln's Transformer, whole on one device). autocast: a context manager
    factory for the forward (the run's precision), else none."""
    device = model.head_weight.device
    # Its own generator: sampling never disturbs the training RNG streams (exact resume).
    generator = torch.Generator(device=device).manual_seed(seed)
    stops = tuple(s for s in stops if s)
    stop = (lambda tokens: any(s in tokenizer.decode(tokens) for s in stops)) if stops else None
    batches, start = [], time.perf_counter()
    with (autocast or nullcontext)():
        for i in range(0, len(prompts), batch_size):
            batches.append(generate(model, prompts[i:i + batch_size], max_new_tokens, sampling, stop_ids=stop_ids,
                                    stop=stop, vocab_limit=tokenizer.vocab_size, generator=generator,
                                    use_cache=use_cache))
    seconds = time.perf_counter() - start
    texts = [cut_at_stop(tokenizer.decode(tokens), stops) for g in batches for tokens in g.tokens]
    return Completions(texts, batches, seconds, model.cfg.max_seq_len)
