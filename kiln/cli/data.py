"""`kiln data show [CONFIG.toml] [overrides] [--batches N] [--rows R] [--positions P]`: the training batches the model
will see, decoded, inputs over targets, with the data's statistics."""
from __future__ import annotations

from kiln.cli.common import add_config_arguments, config_from
from kiln.config import ConfigError
from kiln.run.data_show import show


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="look at the data: `kiln data show` prints decoded training batches")
    actions = p.add_subparsers(dest="action", required=True)
    s = actions.add_parser("show", help="decoded batches, inputs over targets column by column, and statistics")
    add_config_arguments(s)
    s.add_argument("--batches", type=int, default=1, help="training batches to show")
    s.add_argument("--rows", type=int, default=2, help="rows of each batch to show")
    s.add_argument("--positions", type=int, default=48, help="positions of each row to show")


def run(args, overrides) -> int:
    for name in ("batches", "rows", "positions"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    cfg = config_from(args, overrides)
    print("\n".join(show(cfg, args.batches, args.rows, args.positions)))
    return 0
