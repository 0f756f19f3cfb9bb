"""`kiln profile [CONFIG.toml] [overrides] [--steps N] [--warmup W] [--json] [--run-dir DIR]`: where a step's time
goes, the operations that take it, and a verdict with the lever to pull."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kiln.cli.common import add_config_arguments, config_from
from kiln.config import ConfigError
from kiln.run.profile import profile_run, report_lines


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="time a step part by part, trace it, and say what bounds it",
                       description="Warm up, time --steps steps part by part (data, forward, backward, optimizer, "
                                   "logging), trace a few more with torch.profiler, and judge: data-, host-overhead-, "
                                   "memory-bandwidth-, compute- or communication-bound, with advice.")
    add_config_arguments(p)
    p.add_argument("--steps", type=int, default=10, help="steps timed part by part")
    p.add_argument("--warmup", type=int, default=3, help="steps run first, untimed")
    p.add_argument("--run-dir", help="where profile/ (trace.json, memory-timeline.html, summary.json) goes "
                                     "(default runs/profile-TIME)")
    p.add_argument("--json", action="store_true", help="print RUN_DIR/profile/summary.json")


def run(args, overrides) -> int:
    if args.steps < 1:
        raise ConfigError(f"--steps must be ≥ 1, got {args.steps}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be ≥ 0, got {args.warmup}")
    cfg = config_from(args, overrides)
    run_dir = Path(args.run_dir or f"runs/profile-{time.strftime('%Y%m%d-%H%M%S')}")
    out = sys.stderr if args.json else sys.stdout
    result = profile_run(cfg, run_dir, args.steps, args.warmup, log=lambda m: print(m, file=out))
    if args.json:
        print(json.dumps(result.summary(), indent=2))
    else:
        print("\n".join(report_lines(result)))
    return 0
