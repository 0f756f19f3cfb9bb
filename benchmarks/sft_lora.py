"""LoRA fine-tuning end to end on a CPU in minutes: pretrain a tiny base, SFT it with LoRA on a synthetic
instruction set, and score the held-out replies before and after (issue #38; docs/benchmarks.md, "LoRA SFT end
to end"; docs/finetune.md).

    PYTHONPATH=. python benchmarks/sft_lora.py [--workdir DIR] [--pretrain-steps 100] [--sft-steps 150]
                                               [--task sums|reverse] [--rank 8] [--lr 3e-3] [--records 3000]
                                               [--heldout 200] [--generate 100] [--seed 0] [--reuse]

1. pretrain: `kiln train --model.preset=nano` on the default corpus (the Python standard library, bytes), then
   `kiln export RUN --hf BASE` (a GPT-2 directory without a tokenizer: bytes, so the chat template is kiln's chatml);
2. data: two-digit sums, "What is 37+45?" -> "82" (or `--task=reverse`: "Reverse the word: ygje" -> "ejgy"), as
   chat JSONL `messages`; the pairs are distinct and seeded, `--records` for training and `--heldout` others that
   training never sees;
3. SFT: `kiln train --model.init=hf:BASE --data.records=chat --data.chat_template=chatml --lora.rank=R`;
4. score, on the held-out records, the base (hf:BASE) and the run (base + adapters, merged: kiln.run.source):
   - target accuracy: argmax of the next-token logits == the target, over the targets the training loss counts
     (kiln's own chat prepare, masks and packing: the reply's bytes and its `<|im_end|>` marker, document-masked);
   - reply-token accuracy: the same over the targets that are the reply itself, the end-of-turn marker left out
     (its 10 bytes are easy once the format is learnt, so they would flatter the number);
   - exact match: the greedy completion of the prompt (`<|im_start|>assistant\\n` appended, kiln.run.generate),
     cut at `<|im_end|>`, equals the sum; over the first `--generate` held-out records.
Every phase runs kiln's CLI in a subprocess (what a user types) and is timed; the table prints at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kiln.config import load_config  # noqa: E402
from kiln.data import prepare_data  # noqa: E402
from kiln.data.chat import render  # noqa: E402
from kiln.data.packing import IGNORE_INDEX  # noqa: E402
from kiln.data.sft import chat_template_for  # noqa: E402
from kiln.run.generate import complete  # noqa: E402
from kiln.run.source import load_source  # noqa: E402

END = "<|im_end|>"


def kiln(*args: str) -> float:
    """Runs `python -m kiln ARGS` (its output shown); the wall seconds it took."""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "kiln", *args], env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in proc.stdout.splitlines():  # the run's summary lines, not every step's
        if not line.startswith("step ") or "val_loss" in line:
            print(f"  | {line}")
    if proc.returncode != 0:
        sys.exit(f"kiln {' '.join(args)} failed with exit status {proc.returncode}")
    return time.perf_counter() - start


def instructions(task: str, n_train: int, n_heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Distinct (prompt, reply) pairs shuffled by `seed`: the first n_train to train on, the next n_heldout held out.
    reverse: a random 4-letter word and its letters backwards; sums: two two-digit numbers and their sum."""
    rng = random.Random(seed)
    if task == "sums":
        pairs = [(f"What is {a}+{b}?", str(a + b)) for a in range(10, 100) for b in range(10, 100)]
        rng.shuffle(pairs)
    else:
        words = set()
        while len(words) < n_train + n_heldout:  # 26^4 = 456,976 words: room for any sensible count
            words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4)))
        pairs = [(f"Reverse the word: {w}", w[::-1]) for w in sorted(words)]
        rng.shuffle(pairs)
    if n_train + n_heldout > len(pairs):
        sys.exit(f"--records + --heldout must be at most {len(pairs)} for --task={task}")
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
    return records[:n_train], records[n_train:n_train + n_heldout]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def heldout_windows(heldout: Path, base: Path, cache: Path, seq_len: int):
    """The held-out records as training reads them: kiln's chat prepare (template, prompt mask, packing, document
    mask), both of its splits; (x, y, doc) int64/int64/int32 arrays and the tokenizer."""
    cfg = load_config(None, [f"--model.init=hf:{base}", "--data.records=chat", "--data.chat_template=chatml",
                             f"--data.source={heldout}", f"--data.seq_len={seq_len}", f"--data.cache_dir={cache}"])
    data = prepare_data(cfg.data, None, log=lambda msg: None)
    parts = [split.rows(np.arange(split.windows)) for split in (data.train, data.val)]
    return tuple(np.concatenate(a) for a in zip(*parts)), data.tokenizer, chat_template_for(cfg.data)


def reply_targets(y: np.ndarray, n_end: int) -> np.ndarray:
    """Which counted targets are the reply itself: each run of counted targets is one assistant turn, its content
    then the n_end tokens of the end-of-turn marker (the template's rendering up to the turn, less whitespace)."""
    counted = y != IGNORE_INDEX
    reply = np.zeros_like(counted)
    for r, row in enumerate(counted):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(np.int8), [0]])))
        for start, end in zip(edges[::2], edges[1::2]):
            reply[r, start:end - n_end] = True
    return reply


@torch.no_grad()
def target_accuracy(model, windows, tokenizer) -> dict:
    """Argmax == target over the counted targets; and over those that are the reply (the marker left out)."""
    x, y, doc = (torch.from_numpy(a) for a in windows)
    reply = torch.from_numpy(reply_targets(windows[1], len(tokenizer.encode_chat(END))))
    hits = total = reply_hits = replies = 0
    for i in range(0, len(x), 16):
        logits = model(x[i:i + 16], doc=doc[i:i + 16])  # (B, T, V)
        target = y[i:i + 16]
        counted = target != IGNORE_INDEX
        right = (logits.argmax(-1) == target) & counted
        hits, total = hits + int(right.sum()), total + int(counted.sum())
        reply_hits, replies = reply_hits + int((right & reply[i:i + 16]).sum()), replies + int(reply[i:i + 16].sum())
    return {"targets": total, "target_acc": hits / total, "replies": replies, "reply_acc": reply_hits / replies}


def exact_match(source, records: list[dict], template) -> dict:
    """Greedy completions of the prompts (the generation prompt appended) against the replies."""
    prompts = [source.tokenizer.encode_chat(render(r["messages"][:1], template.text, template.tokens,
                                                   add_generation_prompt=True)) for r in records]
    out = complete(source.model, source.tokenizer, prompts, max_new_tokens=16, stops=(END,), batch_size=32)
    answers = [r["messages"][1]["content"] for r in records]
    right = sum(text.strip() == answer for text, answer in zip(out.texts, answers))  # the base replies with indentation
    return {"prompts": len(records), "exact": right / len(records),
            "examples": [f"{r['messages'][0]['content']} -> {t.strip()!r}" for r, t in zip(records[:3], out.texts)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="", help="where the runs and data go (default: a new temporary directory)")
    ap.add_argument("--pretrain-steps", type=int, default=100)
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--task", default="sums", choices=("sums", "reverse"))
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3, help="the SFT's peak learning rate")
    ap.add_argument("--records", type=int, default=3000, help="training conversations")
    ap.add_argument("--heldout", type=int, default=200, help="held-out conversations (pairs training never sees)")
    ap.add_argument("--generate", type=int, default=100, help="held-out prompts completed greedily (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="keep the workdir's base and SFT run if there (scores again)")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kiln-sft-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base_run, base, sft = work / "base", work / "base-hf", work / "sft"
    seq_len = 256  # the nano preset's max_seq_len: ~3.5 conversations of ~74 bytes per window
    times = {}
    print(f"workdir {work} | {platform.processor() or platform.machine()} {os.cpu_count()} cores | "
          f"load {os.getloadavg()[0]:.1f} | torch {torch.__version__}")

    if not (args.reuse and (base / "model.safetensors").is_file()):
        print(f"1. pretrain: nano, {args.pretrain_steps} steps on the default corpus; export --hf")
        times["pretrain"] = kiln("train", "--model.preset=nano", f"--train.max_steps={args.pretrain_steps}",
                                 "--train.sample_tokens=0", f"--train.eval_interval={args.pretrain_steps}",
                                 f"--data.seed={args.seed}", "--run-dir", str(base_run))
        times["pretrain"] += kiln("export", str(base_run), "--hf", str(base))

    start = time.perf_counter()
    train, heldout = instructions(args.task, args.records, args.heldout, args.seed)
    write_jsonl(work / "train.jsonl", train)
    write_jsonl(work / "heldout.jsonl", heldout)
    times["data"] = time.perf_counter() - start
    print(f"2. data: {args.task}, {len(train)} train and {len(heldout)} held-out conversations, e.g. "
          f"{train[0]['messages']}")

    if not (args.reuse and (sft / "checkpoints").is_dir()):
        print(f"3. SFT: LoRA rank {args.rank}, {args.sft_steps} steps, lr {args.lr}")
        times["sft"] = kiln("train", f"--model.init=hf:{base}", "--data.records=chat", "--data.chat_template=chatml",
                            f"--data.source={work / 'train.jsonl'}", f"--data.seq_len={seq_len}",
                            f"--data.cache_dir={work / 'cache'}", f"--data.seed={args.seed}",
                            f"--lora.rank={args.rank}", f"--optim.lr={args.lr}",
                            f"--train.max_steps={args.sft_steps}", "--train.sample_tokens=0",
                            f"--train.eval_interval={args.sft_steps}", "--run-dir", str(sft))

    print("4. score the held-out records: the base, then base + adapters")
    start = time.perf_counter()
    windows, tokenizer, template = heldout_windows(work / "heldout.jsonl", base, work / "cache", seq_len)
    scores = {}
    for name, spec in (("base", f"hf:{base}"), ("base + LoRA", str(sft))):
        source = load_source(spec, device="cpu")
        scores[name] = target_accuracy(source.model, windows, tokenizer)
        if args.generate:
            scores[name].update(exact_match(source, heldout[:args.generate], template))
    times["score"] = time.perf_counter() - start

    print()
    print(f"{'':32}{'base':>12}{'base + LoRA':>14}")
    b, a = scores["base"], scores["base + LoRA"]
    print(f"{'target accuracy (%d counted)' % b['targets']:32}{b['target_acc']:>12.1%}{a['target_acc']:>14.1%}")
    print(f"{'reply tokens (%d)' % b['replies']:32}{b['reply_acc']:>12.1%}{a['reply_acc']:>14.1%}")
    if args.generate:
        print(f"{'exact match, greedy (%d)' % b['prompts']:32}{b['exact']:>12.1%}{a['exact']:>14.1%}")
        for name in scores:
            print(f"  {name}: {'; '.join(scores[name]['examples'])}")
    print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
          + f" | total {sum(times.values()):.0f} s | load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
