"""`kiln sample SOURCE [--prompt TEXT | --prompt-file FILE.jsonl] [--chat] [--stop STR ...] ...`."""
from __future__ import annotations

import json
import math
import sys

from kiln.config import ConfigError
from kiln.models.generate import Sampling
from kiln.run.generate import complete
from kiln.run.sample import encode_prompt, find_chat_template, read_prompt_file
from kiln.run.source import load_source


def add_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a trained model (a run, a checkpoint, or hf:DIR)")
    p.add_argument("source", metavar="SOURCE",
                   help="a run directory (its newest checkpoint), RUN_DIR/checkpoints/step_NNNNNN, or hf:DIR")
    p.add_argument("--prompt", default=None, help="text to continue (default: empty, the start of a document)")
    p.add_argument("--prompt-file", default=None, metavar="FILE.jsonl",
                   help='one JSON object per line, {"prompt": TEXT} or {"messages": [{"role", "content"}, ...]}; '
                        'prints each row back with its "completion", one JSON line each')
    p.add_argument("--chat", action="store_true",
                   help="render prompts as a user message with the model's chat template (rows with messages "
                        "always are); print only the reply")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template to use instead")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample within the nucleus: the likeliest tokens whose probability reaches p (1: off); "
                        "applied after temperature and top-k, as transformers applies them")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop a completion at this text, which is not printed (repeatable); every completion also "
                        "stops at the end-of-text id (and an hf: model's eos ids)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together, left-padded")
    p.add_argument("--no-kv-cache", action="store_true",
                   help="run the whole context at every step (for comparison); the window slides past max_seq_len")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def run(args, overrides) -> int:
    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    if args.max_new_tokens < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens and --top-k must be ≥ 0")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature} must be a finite number ≥ 0 (0: greedy)")
    if not 0 <= args.top_p <= 1:
        raise ConfigError(f"--top-p={args.top_p} must be in [0, 1] (1: off)")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size={args.batch_size} must be ≥ 1")
    if args.prompt is not None and args.prompt_file:
        raise ConfigError("give --prompt or --prompt-file, not both")
    rows = read_prompt_file(args.prompt_file) if args.prompt_file else [{"prompt": args.prompt or ""}]
    source = load_source(args.source, args.device)
    template, tokens, where = None, {}, args.source
    if args.chat or args.chat_template or any("messages" in r for r in rows):
        template, tokens, where = find_chat_template(args.source, args.chat_template)
    prompts = [encode_prompt(source.tokenizer, row, args.chat, template, tokens, where) for row in rows]
    longest = max(len(p) for p in prompts)
    if longest > source.max_seq_len:
        print(f"a prompt of {longest} tokens is longer than model.max_seq_len={source.max_seq_len}: its last "
              f"{source.max_seq_len} are used", file=sys.stderr)
    done = complete(source.model, source.tokenizer, prompts, args.max_new_tokens,
                    Sampling(args.temperature, args.top_k, args.top_p), stops=args.stop, stop_ids=source.eos_ids,
                    seed=args.seed, use_cache=not args.no_kv_cache, batch_size=args.batch_size)
    if args.prompt_file:
        for row, text in zip(rows, done.texts):
            print(json.dumps({**row, "completion": text}, ensure_ascii=False))
    else:
        print(done.texts[0] if args.chat else rows[0]["prompt"] + done.texts[0])
    print(done.rate_line(), file=sys.stderr)
    if done.window_line():
        print(done.window_line(), file=sys.stderr)
    return 0
