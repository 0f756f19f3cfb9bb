"""`kiln doctor [CONFIG.toml] [--section.key=value ...] [--json]`: the pre-flight checklist."""
from __future__ import annotations

import argparse
import json
import sys

from kiln.cli.common import add_config_arguments, config_from
from kiln.run.doctor import CHECKS, FAIL, PASS, run_checks


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor", help="check a configuration before training (loss at init, overfitting, gradients, data ...)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the sanity checklist on the configured model and data. Exit code 1 when a check fails.",
        epilog="checks:\n" + "\n".join(f"  {n:2d} {name:18s} {what}" for n, name, what in CHECKS),
    )
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help='print {"checks": [{"number", "name", "status", "value", '
                                                        '"fix"}]} on stdout (progress goes to stderr)')


def run(args, overrides) -> int:
    cfg = config_from(args, overrides)
    out = sys.stderr if args.json else sys.stdout
    checks = run_checks(cfg, log=lambda msg: print(msg, file=out))
    if args.json:
        print(json.dumps({"checks": [c.to_dict() for c in checks]}, indent=2, ensure_ascii=False))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.number:2d} {c.status.upper():4s}  {c.name:{width}s}  {c.value}")
            if c.status != PASS:
                print(f"   {'':4s}  {'':{width}s}  fix: {c.fix}")
        counts = {s: sum(c.status == s for c in checks) for s in ("pass", "warn", "fail")}
        print(f"{counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail")
    return 1 if any(c.status == FAIL for c in checks) else 0
