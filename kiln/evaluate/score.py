"""One task scored on one model: its items encoded, their log-likelihoods computed (batched, split over
data-parallel ranks), and the harness's metrics aggregated.

    result = score_task(model, tokenizer, task, vocab=..., max_length=...)
    result.results   {"acc,none": ..., "acc_stderr,none": ..., ...}   lm-evaluation-harness's results[task] entry
    result.scalars   {"acc": ..., "acc_norm": ..., "acc_stderr": ...} or {"bpb": ...}: what training logs
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from kiln.errors import KilnError
from kiln.evaluate.encoding import HarnessEncoding
from kiln.evaluate.forward import width_multiple
from kiln.evaluate.loglik import encode_pair, loglikelihoods, rolling_windows
from kiln.evaluate.metrics import NA, choice_scores, multiple_choice_results, perplexity_results
from kiln.evaluate.tasks import Task, TaskError, load_tasks


@dataclass
class TaskResult:
    name: str
    kind: str  # "multiple_choice" | "perplexity"
    items: int  # items scored (after the limit)
    truncated: int  # rows whose context lost its start to fit max_length (perplexity windows never do)
    results: dict  # the harness's results[task] entry

    @property
    def scalars(self) -> dict[str, float]:
        """The numbers training logs as task_<name>_<key>."""
        r = self.results
        if self.kind == "perplexity":
            return {"bpb": r["bits_per_byte,none"]}
        out = {"acc": r["acc,none"], "acc_norm": r["acc_norm,none"]}
        if r["acc_stderr,none"] != NA:
            out["acc_stderr"] = r["acc_stderr,none"]
        return out


@dataclass
class Prepared:
    """A task encoded for one tokenizer and window: the items scored and the pairs that score them."""
    task: Task
    items: list  # the first `limit` items (0: all)
    pairs: list  # every item's pairs, in item order
    sizes: list[int]  # pairs per item
    max_length: int

    @property
    def truncated(self) -> int:
        """Pairs whose context loses its start to fit max_length + 1 tokens (kiln.evaluate.loglik)."""
        return sum(len(p.context) + len(p.continuation) > self.max_length + 1 for p in self.pairs)


def prepare(task: Task, tokenizer, max_length: int, limit: int = 0, prefix_id: int | None = None) -> Prepared:
    """`task`'s first `limit` items (0: all) as the pairs whose log-likelihoods score them, tokenized as the harness
    tokenizes them (kiln.evaluate.encoding; prefix_id: its prefix token, default the end-of-text id)."""
    items = list(task.items[:limit] if limit else task.items)
    harness = HarnessEncoding(tokenizer, prefix_id)
    encode = functools.lru_cache(maxsize=1024)(harness)  # a context, once per choice
    pairs, sizes = [], []
    for item in items:
        if task.kind == "perplexity":
            windows = rolling_windows(encode(item.text), harness.prefix_id, max_length)
            pairs += windows
            sizes.append(len(windows))
            continue
        for i, choice in enumerate(item.choices):
            pair = encode_pair(encode, item.context, " " + choice, harness.prefix_id,
                               bare=functools.partial(harness, special=False))
            if not pair.continuation or len(pair.continuation) > max_length:
                raise TaskError(f"{item.where}: choice {i} is {len(pair.continuation)} tokens; it must be 1 to "
                                f"{max_length} (the window, --max-length)")
            pairs.append(pair)
        sizes.append(len(item.choices))
    return Prepared(task, items, pairs, sizes, max_length)


def score_task(model, prepared: Prepared, *, vocab: int, max_length: int, batch_size: int = 16,
               device: torch.device | str = "cpu", autocast=None, world=None,
               advance: Callable[[int], None] | None = None) -> TaskResult:
    """A prepared task scored on `model`; every rank of `world` returns the same result (kiln.evaluate.loglik)."""
    task, items = prepared.task, prepared.items
    lls, truncated = loglikelihoods(model, prepared.pairs, vocab, max_length, batch_size, device, autocast, world,
                                    advance)
    per_item, at = [], 0
    for item, n in zip(items, prepared.sizes):
        mine = lls[at:at + n]
        at += n
        per_item.append(float(mine.sum()) if task.kind == "perplexity" else
                        choice_scores(mine.tolist(), item.choices, item.gold))
    if task.kind == "perplexity":
        results = perplexity_results(per_item, [item.text for item in items])
    else:
        results = multiple_choice_results(per_item)
    return TaskResult(task.name, task.kind, len(items), truncated, {"alias": task.name, **results})


def training_tasks(tc, tokenizer, max_seq_len: int, plan, log: Callable[[str], None]) -> list[Prepared]:
    """train.eval_tasks (tc: the train section) read and tokenized before the first step: a bad row stops the run
    before it trains. One line per task says what is scored, and how many contexts lose their start to the model's
    window. plan: the run's ParallelPlan (None: one process); every layout scores through the validation pass's
    forward (kiln.evaluate.forward), whose batches are padded to a multiple of 2·cp (and of tp under sequence
    parallelism) — which the window must be, so that its longest rows still fit."""
    if not tc.eval_tasks:
        return []
    multiple = width_multiple(plan)
    if max_seq_len % multiple:
        raise KilnError(f"train.eval_tasks pads each batch to a multiple of {multiple} tokens (2·parallel.cp, and "
                        f"parallel.tp under sequence parallelism), which model.max_seq_len={max_seq_len} is not: "
                        f"pick a multiple of {multiple}", key="model.max_seq_len", value=max_seq_len,
                        fix=f"pick a model.max_seq_len divisible by {multiple}")
    tasks = [prepare(t, tokenizer, max_seq_len, tc.eval_task_limit) for t in load_tasks(tc.eval_tasks)]
    for p in tasks:
        cut = f"; {p.truncated} context(s) longer than model.max_seq_len={max_seq_len} lose their start " \
              f"(truncated from the left, as the harness does)" if p.truncated else ""
        log(f"eval task {p.task.name}: {len(p.items)} of {len(p.task.items)} items ({p.task.kind}, "
            f"{len(p.pairs)} rows) at every evaluation{cut}")
    return tasks
