"""`kiln sample RUN_DIR --prompt TEXT --max-new-tokens N --temperature T --top-k K`."""
from __future__ import annotations

import math
from pathlib import Path

from kiln.config import ConfigError
from kiln.run.sample import sample_from_run


def add_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a trained run")
    p.add_argument("run_dir", help="a run directory written by `kiln train`")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def run(args, overrides) -> int:
    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    if args.max_new_tokens < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens and --top-k must be ≥ 0")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature} must be a finite number ≥ 0 (0: greedy)")
    print(sample_from_run(Path(args.run_dir), args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                          args.seed, args.device))
    return 0
