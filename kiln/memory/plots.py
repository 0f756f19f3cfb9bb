"""PNG charts of memory: the breakdown as a stacked bar, and the timeline of a training step."""
from __future__ import annotations

from pathlib import Path

from kiln.memory.estimate import COMPONENTS, GiB

COLORS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "master_weights": "#8172b3", "optimizer_states": "#c44e52",
    "activations": "#55a868", "logits": "#937860", "weight_casts": "#da8bc3", "temporaries": "#8c8c8c",
    "comm_buffers": "#2a9d8f",
    "buffers": "#ccb974", "device_overhead": "#64b5cd",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def breakdown_bar(path: str | Path, predicted: dict[str, int], title: str, measured: dict[str, int] | None = None,
                  capacity: int | None = None, measured_peak: int | None = None,
                  full_sizes: dict[str, int] | None = None) -> Path:
    """Stacked bars in GiB: the predicted components at the peak; with a measurement, the predicted and measured
    full sizes side by side (what a measurement counts) and the measured peak as a dotted line. The capacity is
    drawn when it is on the chart's scale, written in the title otherwise."""
    plt = _pyplot()
    bars = [("predicted\nat peak", predicted)]
    if measured:
        bars += [("predicted\nfull sizes", full_sizes or {}), ("measured\nfull sizes", measured)]
    fig, ax = plt.subplots(figsize=(4 + 2 * len(bars), 5.5))
    for x, (_, comp) in enumerate(bars):
        bottom = 0.0
        for name in COMPONENTS:
            v = comp.get(name, 0) / GiB
            if v <= 0:
                continue
            ax.bar(x, v, bottom=bottom, color=COLORS[name], label=name,
                   width=0.6)
            bottom += v
    if measured_peak:
        ax.hlines(measured_peak / GiB, -0.4, len(bars) - 0.6, colors="black", linestyles="dotted",
                  label="measured peak")
    tallest = max(sum(v for k, v in comp.items() if k in COMPONENTS) for _, comp in bars)
    if capacity and capacity <= 3 * tallest:
        ax.axhline(capacity / GiB, color="red", linestyle="--", label=f"capacity {capacity / GiB:.1f} GiB")
    elif capacity:
        title += f" (capacity {capacity / GiB:.1f} GiB)"
    ax.set_xticks(range(len(bars)), [name for name, _ in bars])
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline(path: str | Path, predicted_first, predicted_steady, measured=None, measured_steps: int = 0,
             title: str = "") -> Path:
    """Left: the predicted components through one step (first step and later steps). Right, when measured:
    live bytes op by op over the measured steps, shaded by phase (forward, backward, optimizer)."""
    plt = _pyplot()
    cols = 3 if measured else 2
    fig, axes = plt.subplots(1, cols, figsize=(5.5 * cols, 4.5), squeeze=False)
    for ax, (name, events) in zip(axes[0], (("predicted: first step", predicted_first),
                                             ("predicted: later steps", predicted_steady))):
        xs = list(range(len(events)))
        bottom = [0.0] * len(events)
        for comp in COMPONENTS:
            ys = [e[1].get(comp, 0) / GiB for e in events]
            if not any(ys):
                continue
            top = [b + y for b, y in zip(bottom, ys)]
            ax.fill_between(xs, bottom, top, step="mid", color=COLORS[comp], label=comp, alpha=0.9)
            bottom = top
        ticks = [i for i, e in enumerate(events) if e[0].startswith(("forward: embeddings", "backward: loss",
                                                                     "optimizer"))]
        ax.set_xticks(ticks, [events[i][0].split(":")[0] for i in ticks], fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("GiB")
    axes[0][0].legend(fontsize=7, loc="upper left")
    if measured:
        ax = axes[0][2]
        t = [s[0] for s in measured]
        y = [s[1] / GiB for s in measured]
        ax.plot(t, y, color="black", linewidth=0.8)
        shade = {"forward": "#55a868", "backward": "#dd8452", "optimizer": "#c44e52"}
        start = 0
        for i in range(1, len(measured) + 1):
            if i == len(measured) or measured[i][2] != measured[start][2]:
                label = measured[start][2]
                if label in shade:
                    ax.axvspan(t[start], t[i - 1], color=shade[label], alpha=0.15, linewidth=0)
                start = i
        for label, color in shade.items():
            ax.fill_between([], [], color=color, alpha=0.3, label=label)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_xlabel("seconds")
        ax.set_title(f"measured: {measured_steps} steps (live tensor bytes)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
