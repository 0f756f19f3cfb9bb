"""`kiln report RUN_DIR [RUN_DIR ...] [--out FILE.html] [--device NAME]`."""
from __future__ import annotations

from kiln.config import ConfigError
from kiln.memory.devices import get_device
from kiln.report import write_report


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page of one or more runs (charts, events, config)",
                       description="Writes one HTML file (images inline, nothing fetched when viewed) with the loss "
                                   "curves, learning rate, gradient norm, throughput, MFU, loss scale and memory of "
                                   "each run, numerics events marked on the loss, the memory breakdown of each "
                                   "run's config, the step-time breakdown of profiled runs, a summary per run and "
                                   "the resolved config with the keys that differ between runs highlighted. Works "
                                   "on runs still training.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories written by `kiln train` or fit()")
    p.add_argument("--out", default="report.html", help="the HTML file to write (default: report.html)")
    p.add_argument("--device", default="", help="device the memory breakdown is predicted for (H100, A100-80GB, "
                                                "..., cpu; default: this machine's)")


def run(args, overrides) -> int:
    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    if args.device:
        get_device(args.device)  # a misspelt device is an error before anything is drawn
    path, report = write_report(args.run_dirs, args.out, args.device)
    for note in report.notes:
        print(f"note: {note}")
    for run, summary in zip(report.runs, report.summaries):
        val = f", val_loss {summary.final_val:.4f}" if summary.final_val is not None else ""
        saved = "" if any((run.path / "checkpoints").glob("step_*")) else (
            "; no checkpoint (nothing to resume, sample or export)")
        print(f"{run.name}: {summary.status}{val}{saved}")
    print(f"wrote {path} ({path.stat().st_size / 1024:,.0f} KiB, {len(report.charts)} charts)")
    return 0
