"""`kiln data prepare [CONFIG.toml] [overrides]`: tokenize the configured data into the cache once, with a progress
bar and a summary per source.
`kiln data show [CONFIG.toml] [overrides] [--batches N] [--rows R] [--positions P]`: the training batches the model
will see, decoded, inputs over targets, with the data's statistics."""
from __future__ import annotations

import sys

from kiln.cli.common import add_config_arguments, config_from
from kiln.config import ConfigError
from kiln.data import prepare_data, progress_line
from kiln.run.data_show import show


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="the data: `kiln data prepare` tokenizes it into the cache, `kiln data show` "
                                    "prints decoded training batches")
    actions = p.add_subparsers(dest="action", required=True)
    prep = actions.add_parser("prepare", help="tokenize data.source (or each [[data.mix]] source) into cached shards "
                                              "with data.workers processes; resumes an interrupted prepare")
    add_config_arguments(prep)
    s = actions.add_parser("show", help="decoded batches, inputs over targets column by column, and statistics")
    add_config_arguments(s)
    s.add_argument("--batches", type=int, default=1, help="training batches to show")
    s.add_argument("--rows", type=int, default=2, help="rows of each batch to show")
    s.add_argument("--positions", type=int, default=48, help="positions of each row to show")


def _bar():
    """A one-line progress bar on a terminal (MB, MB/s, tokens/s, ETA), else a line every 10 s."""
    if not sys.stderr.isatty():
        last = [0.0]

        def lines(done, total, tokens, elapsed):
            if elapsed - last[0] >= 10 or done == total:
                last[0] = elapsed
                print("data: " + progress_line(done, total, tokens, elapsed), file=sys.stderr, flush=True)
        return lines

    def draw(done, total, tokens, elapsed):
        width = 30
        filled = int(width * done / max(total, 1))
        end = "\n" if done >= total else ""
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] " + progress_line(done, total, tokens, elapsed),
              end=end, file=sys.stderr, flush=True)
    return draw


def run(args, overrides) -> int:
    if args.action == "prepare":
        cfg = config_from(args, overrides)
        prepare_data(cfg.data, None, log=print, progress=_bar())
        return 0
    for name in ("batches", "rows", "positions"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    cfg = config_from(args, overrides)
    print("\n".join(show(cfg, args.batches, args.rows, args.positions)))
    return 0
