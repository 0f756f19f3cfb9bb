"""The charts as PNG bytes (matplotlib, Agg): the metric charts of figures.py, a run's memory breakdown (the chart
`kiln memory` draws) and a profiled run's step-time breakdown."""
from __future__ import annotations

import io
import math
import tempfile
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.memory.devices import get_device, local_device
from kiln.memory.estimate import estimate, fmt_bytes
from kiln.memory.levers import JobSections, job_for
from kiln.memory.plots import breakdown_bar
from kiln.report.figures import Chart

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f")
# marker, colour and legend label of each event kind on the loss curve (and of loss-scale changes)
EVENT_STYLE = {
    "loss_spike": ("^", "#ff7f0e", "loss spike"),
    "nonfinite": ("X", "#d62728", "non-finite step (skipped)"),
    "nonfinite_trace": ("*", "#000000", "NaN trace"),
    "rollback": ("<", "#9467bd", "rollback"),
    "rollback_unavailable": ("x", "#9467bd", "rollback unavailable"),
    "stop": ("|", "#000000", "stop"),
    "overflow": ("v", "#d62728", "overflow: scale backed off, step skipped"),
    "growth": ("^", "#2ca02c", "scale grown"),
}
FIGSIZE = (6.4, 3.6)  # inches at DPI: 640×360 px, two charts side by side on a laptop screen
DPI = 100


def _pyplot():
    import matplotlib  # lazy: matplotlib loads in ~0.5 s and only `kiln report` and `kiln memory` draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    _pyplot().close(fig)
    return buf.getvalue()


def draw(chart: Chart) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for line in chart.lines:
        dashes = {"solid": "-", "dashed": "--", "dotted": ":", "points": "--"}[line.style]
        ax.plot(line.x, line.y, dashes, color=COLORS[line.run % len(COLORS)], linewidth=1.3, label=line.label,
                marker="o" if line.style == "points" else None, markersize=3)
    for y, label in chart.hlines:
        ax.axhline(y, color="#555555", linestyle=":", linewidth=1.2, label=label)
    finite = [v for line in chart.lines for v in line.y if math.isfinite(v)]
    shown = set()
    for m in chart.marks:
        marker, color, label = EVENT_STYLE.get(m.event, ("o", "#000000", m.event))
        legend = label if m.event not in shown else None
        shown.add(m.event)
        if m.y is None and not m.clip:
            ax.axvline(m.x, color=color, linestyle="-.", linewidth=1.0, label=legend)
            continue
        # a non-finite loss has no height: at the top of the axes (x in data, y in axes coordinates)
        where = {"transform": ax.get_xaxis_transform()} if m.clip else {}
        y = 0.95 if m.clip else m.y
        ax.plot([m.x], [y], linestyle="none", marker=marker, markersize=9 if m.event == "nonfinite_trace" else 7,
                color=color, markeredgecolor=COLORS[m.run % len(COLORS)], label=legend, zorder=5, **where)
        if m.event == "nonfinite_trace" and m.text:
            ax.annotate(m.text, (m.x, y), xycoords=where.get("transform", "data"), textcoords="offset points",
                        xytext=(7, -3), fontsize=7, va="top")
    if chart.logy and finite and min(finite) > 0:
        ax.set_yscale("log")
    ax.set_title(chart.title, fontsize=10)
    ax.set_xlabel(chart.xlabel, fontsize=8)
    ax.set_ylabel(chart.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if any(line.label for line in chart.lines) or chart.marks or chart.hlines:
        ax.legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    return _png(fig)


def memory_chart(config_path: Path, device: str = "") -> tuple[bytes, str]:
    """The `kiln memory` stacked bar of a run's config.toml, and a one-line caption (predicted peak, device)."""
    cfg = load_config(config_path)
    dev = get_device(device) if device else local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    job = job_for(JobSections.of(cfg), dev)
    b = estimate(job)
    title = (f"{cfg.model.preset} ({job.model.arch}), {job.precision}, micro-batch {job.micro_batch}×{job.seq_len}, "
             f"recompute {cfg.memory.recompute}, {dev.name}")
    with tempfile.TemporaryDirectory() as tmp:
        path = breakdown_bar(Path(tmp) / "memory.png", b.components, title, capacity=dev.memory,
                             full_sizes=b.held())
        png = path.read_bytes()
    caption = (f"predicted peak {fmt_bytes(b.total_bytes)} on {dev.name} ({b.param_count:,} parameters; peak at "
               f"{b.peak_phase}) — the estimate `kiln memory` prints for this config")
    return png, caption


def profile_chart(summary: dict) -> bytes:
    """Horizontal bars: seconds per phase of one step (profile/summary.json's breakdown), with their share."""
    plt = _pyplot()
    parts = {k: float(v) for k, v in (summary.get("breakdown") or {}).items() if isinstance(v, (int, float))}
    step = summary.get("step_s")
    step = float(step) if isinstance(step, (int, float)) else sum(parts.values())
    rest = step - sum(parts.values())
    if rest > 1e-3 * step:
        parts["unaccounted"] = rest
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 0.9 + 0.32 * max(len(parts), 1)))
    names = list(parts)[::-1]
    values = [parts[n] * 1e3 for n in names]
    ax.barh(names, values, color=[COLORS[i % len(COLORS)] for i in range(len(names))][::-1])
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.1f} ms ({100 * v / (step * 1e3):.0f}%)" if step else f" {v:.1f} ms", va="center",
                fontsize=7)
    ax.set_xlabel("ms per step", fontsize=8)
    ax.set_xlim(0, max(values, default=1) * 1.3 or 1)
    ax.tick_params(labelsize=7)
    verdict = summary.get("verdict")
    ax.set_title(f"step time {step * 1e3:.1f} ms" + (f": {verdict}" if verdict else ""), fontsize=10)
    fig.tight_layout()
    return _png(fig)
