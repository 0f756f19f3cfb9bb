"""`kiln eval SOURCE --task FILE [--task FILE ...]`: multiple-choice and perplexity tasks scored as
lm-evaluation-harness 0.4 scores them (kiln.evaluate; docs/evaluation.md), on a run, one checkpoint or hf:DIR."""
from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kiln.config import ConfigError
from kiln.evaluate import load_tasks, prepare, score_task
from kiln.evaluate.metrics import NA
from kiln.run.source import load_source

HIGHER_IS_BETTER = {"acc": True, "acc_norm": True, "word_perplexity": False, "byte_perplexity": False,
                    "bits_per_byte": False}


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="score multiple-choice and perplexity tasks as lm-evaluation-harness does",
                       description="Score tasks on a model: acc / acc_norm of multiple-choice JSONL rows "
                                   '({"context", "choices", "label"}, HellaSwag or ARC rows), word and byte '
                                   "perplexity and bits per byte of text:FILE, as lm-evaluation-harness 0.4 "
                                   "computes them (docs/evaluation.md).")
    p.add_argument("source", help="RUN_DIR (its newest checkpoint), RUN_DIR/checkpoints/step_NNNNNN, or hf:DIR")
    p.add_argument("--task", action="append", required=True, metavar="FILE",
                   help="a multiple-choice .jsonl file, or text:FILE for perplexity (.jsonl: one document per "
                        "row's --text-field; other files: one document); repeat for several tasks")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="score the first N items of each task (0: all)")
    p.add_argument("--max-length", type=int, default=0, metavar="N",
                   help="tokens the model reads at once (0: the model's max_seq_len); longer contexts lose their "
                        "start, perplexity documents are read in windows of this many tokens")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="rows per forward pass")
    p.add_argument("--text-field", default="text", metavar="NAME", help="the field of a text:FILE.jsonl row that holds its text")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--out", metavar="FILE.json",
                   help="also write the results in lm-evaluation-harness's layout, with the model, checkpoint step "
                        "and item counts")


def run(args, overrides) -> int:
    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    for flag, zero in (("limit", "all items"), ("max_length", "the model's max_seq_len")):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be ≥ 0 (0: {zero})")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size={args.batch_size} must be ≥ 1")
    tasks = load_tasks(args.task, args.text_field)  # a bad row is found before the model loads
    source = load_source(args.source, args.device)
    max_length = args.max_length or source.max_seq_len
    if max_length > source.max_seq_len:
        raise ConfigError(f"--max-length={max_length} is longer than the model's max_seq_len "
                          f"{source.max_seq_len}")
    out = Console(soft_wrap=True, highlight=False)
    err = Console(stderr=True)
    out.print(f"model: {source.description} | window {max_length} tokens", markup=False)
    prepared = [prepare(t, source.tokenizer, max_length, args.limit, source.prefix_id) for t in tasks]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    results = []
    began = time.perf_counter()
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        for p in prepared:
            job = bar.add_task(f"{p.task.name} ({len(p.items)} items)", total=len(p.pairs))
            results.append(score_task(source.model, p, vocab=source.model_cfg.vocab_size, max_length=max_length,
                                      batch_size=args.batch_size, device=source.device,
                                      advance=lambda n, job=job: bar.advance(job, n)))
    seconds = time.perf_counter() - began
    out.print(table(results), markup=False)
    rows = sum(len(p.pairs) for p in prepared)
    out.print(f"{rows:,} rows scored in {seconds:.1f} s ({rows / max(seconds, 1e-9):.1f} rows/s)", markup=False)
    for r in results:
        if r.truncated:
            out.print(f"{r.name}: {r.truncated} context(s) longer than the window of {max_length} tokens lost "
                      f"their start (truncated from the left, as the harness does)", markup=False)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(harness_layout(results, tasks, source, args, max_length), indent=2) + "\n")
        out.print(f"wrote {path}", markup=False)
    return 0


def table(results) -> str:
    """The results as the harness prints them: one line per metric, its value and standard error."""
    lines = [("Task", "Items", "Metric", "Value", "Stderr")]
    for r in results:
        for key, value in r.results.items():
            if key == "alias" or "_stderr," in key:
                continue
            metric = key.split(",")[0]
            stderr = r.results[f"{metric}_stderr,none"]
            lines.append((r.name, f"{r.items}", metric, f"{value:.4f}",
                          stderr if stderr == NA else f"{stderr:.4f}"))
    widths = [max(len(row[i]) for row in lines) for i in range(5)]
    right = (False, True, False, True, True)
    fmt = [(lambda s, w=w: s.rjust(w)) if r else (lambda s, w=w: s.ljust(w)) for w, r in zip(widths, right)]
    shown = ["  ".join(f(c) for f, c in zip(fmt, row)).rstrip() for row in lines]
    shown.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(shown)


def harness_layout(results, tasks, source, args, max_length: int) -> dict:
    """lm-evaluation-harness's results file (results, n-samples, n-shot, higher_is_better, config) plus kiln's
    model, checkpoint step, item and truncation counts."""
    by_name = {t.name: t for t in tasks}
    return {
        "results": {r.name: r.results for r in results},
        "n-samples": {r.name: {"original": len(by_name[r.name].items), "effective": r.items} for r in results},
        "n-shot": {r.name: 0 for r in results},
        "higher_is_better": {r.name: {k.split(",")[0]: HIGHER_IS_BETTER[k.split(",")[0]] for k in r.results
                                      if k != "alias" and "_stderr," not in k} for r in results},
        "config": {"model": "kiln", "model_args": str(args.source), "limit": args.limit or None,
                   "batch_size": args.batch_size, "device": str(source.device), "max_length": max_length},
        "model": source.description,
        "checkpoint_step": source.step,
        "items": {r.name: r.items for r in results},
        "truncated": {r.name: r.truncated for r in results},
        "tasks": {t.name: str(t.path) for t in tasks},
        "date": time.time(),
    }
