"""What each chart of the page shows, as plain data: lines, event marks and threshold lines per run.

Every key of every metrics record lands somewhere: a known key on its chart (below), an unknown numeric train or
eval key on a chart of its own, every numerics event in the events table and, where it concerns the loss, as a
mark on the loss curve at its step. render.py draws these specs; the tests read them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.report.runs import Run, number

# Train keys with a chart of their own (or an axis of one, or a row of the summary: mfu_peak_flops); any other
# numeric key gets a chart named after it.
CHARTED_TRAIN = {"step", "kind", "loss", "lr", "grad_norm", "clip_threshold", "tokens_per_s", "samples_per_s",
                 "step_time_s", "tokens_seen", "samples_seen", "peak_mem_bytes", "mfu", "hfu", "mfu_peak_flops",
                 "utilisation", "skipped_steps", "loss_scale", "loss_tokens"}
# val_ppl is exp(val_loss): the summary gives it; train_loss is the train curve's mean since the last evaluation
CHARTED_EVAL = {"step", "kind", "val_loss", "val_ppl", "train_loss", "gap"}
# Numerics events marked on the loss-vs-step chart (and loss_scale events of an overflow, whose step the scaler
# skipped); each also has a row in the events table, as do all others.
LOSS_EVENTS = ("loss_spike", "nonfinite", "nonfinite_trace", "rollback", "rollback_unavailable", "stop")
GiB = 1024**3


@dataclass
class Line:
    run: int  # index of the run (its colour)
    label: str
    x: list[float]
    y: list[float]
    style: str = "solid"  # solid | dashed (HFU) | dotted (busy) | points (validation: dashed, a dot per evaluation)


@dataclass
class Mark:
    run: int
    event: str  # the numerics event, or "overflow"/"growth" for loss-scale changes
    step: int
    x: float
    y: float | None  # None: a vertical line at x (a stop); the top of the axis for a non-finite loss (see clip)
    text: str = ""
    clip: bool = False  # the value is not finite: drawn at the top of the axis


@dataclass
class Chart:
    key: str
    title: str
    xlabel: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    hlines: list[tuple[float, str]] = field(default_factory=list)  # (y, label): the clipping threshold
    logy: bool = False

    @property
    def empty(self) -> bool:
        return not any(line.x for line in self.lines)


def series(records: list[dict], key: str, x_key: str = "step", scale: float = 1.0) -> tuple[list, list]:
    """(x, y) of the records that carry `key`; a NaN/Inf value stays in (matplotlib leaves a gap)."""
    xs, ys = [], []
    for r in records:
        y, x = number(r.get(key)), number(r.get(x_key))
        if y is not None and x is not None:
            xs.append(x)
            ys.append(y * scale)
    return xs, ys


def loss_at(run: Run, step: float) -> float | None:
    """The train loss at `step`, linear between logged records (finite ones only); None before any record."""
    points = [(r["step"], number(r.get("loss"))) for r in run.train]
    points = [(s, v) for s, v in points if v is not None and math.isfinite(v)]
    if not points:
        return None
    if step <= points[0][0]:
        return points[0][1]
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0) if s1 > s0 else v1
    return points[-1][1]


def tokens_at(run: Run, step: float) -> float | None:
    """Tokens (samples) seen after `step`: linear between train records, the last rate past them."""
    xs, ys = series(run.train, f"{run.unit}_seen")
    if not xs:
        return None
    pairs = sorted(zip(xs, ys))
    if step <= pairs[0][0]:
        return pairs[0][1] * step / pairs[0][0] if pairs[0][0] else pairs[0][1]
    for (s0, v0), (s1, v1) in zip(pairs, pairs[1:]):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0) if s1 > s0 else v1
    s_last, v_last = pairs[-1]
    return v_last * step / s_last if s_last else v_last


def _event_text(e: dict) -> str:
    kind = e.get("event")
    if kind == "nonfinite_trace":
        return f"{e.get('module', '?')} ({e.get('phase', '?')}, {e.get('op', '?')})"
    if kind == "rollback":
        return f"→ step {e.get('to_step')}"
    if kind == "stop":
        return str(e.get("reason", ""))[:60]
    if kind == "loss_spike":
        return e.get("action", "")
    return ""


def loss_marks(run: Run, index: int) -> list[Mark]:
    """Numerics events on the loss-vs-step curve: a spike at its own loss, a non-finite step at the top of the
    axis, a trace there too with its module's name, a rollback and an fp16 overflow (a skipped step) on the curve,
    a stop as a vertical line."""
    marks = []
    for e in run.numerics:
        kind, step = e.get("event"), e.get("step")
        if kind == "loss_scale" and e.get("cause") == "overflow" and isinstance(step, int):
            # an fp16 overflow: the scaler skipped this step's update
            marks.append(Mark(index, "overflow", step, step, loss_at(run, step), "fp16 overflow: step skipped"))
            continue
        if kind not in LOSS_EVENTS or not isinstance(step, int):
            continue
        if kind == "stop":
            marks.append(Mark(index, kind, step, step, None, _event_text(e)))
            continue
        own = number((e.get("stats") or {}).get("loss")) if kind == "loss_spike" else number(e.get("loss"))
        if kind in ("nonfinite", "nonfinite_trace"):
            marks.append(Mark(index, kind, step, step, None, _event_text(e), clip=True))
        else:
            y = own if own is not None and math.isfinite(own) else loss_at(run, step)
            marks.append(Mark(index, kind, step, step, y, _event_text(e)))
    return marks


def scale_marks(run: Run, index: int) -> list[Mark]:
    """fp16 loss-scale changes: a back-off after an overflow (a skipped step) or a growth, at the new scale."""
    return [Mark(index, "overflow" if e.get("cause") == "overflow" else "growth", e["step"], e["step"],
                 number(e.get("loss_scale")))
            for e in run.numerics if e.get("event") == "loss_scale" and isinstance(e.get("step"), int)]


def build_charts(runs: list[Run], clip_thresholds: list[float | None]) -> list[Chart]:
    """The page's charts, in page order; charts no run has data for are left out. clip_thresholds: per run, the
    gradient-norm clipping threshold (None: not clipping by norm)."""
    units = {r.unit for r in runs}
    unit = units.pop() if len(units) == 1 else "tokens or samples"
    multi = len(runs) > 1

    def name(run: Run, what: str) -> str:
        return f"{run.name}: {what}" if multi else what

    loss_step = Chart("loss_step", "loss vs step", "step", "loss (nats per token)" if unit == "tokens" else "loss")
    loss_seen = Chart("loss_seen", f"loss vs {unit} seen", f"{unit} seen", loss_step.ylabel)
    lr = Chart("lr", "learning rate", "step", "lr")
    grad = Chart("grad_norm", "gradient norm (before clipping)", "step", "global L2 norm", logy=True)
    rate = Chart("throughput", f"{unit} per second", "step", f"{unit}/s")
    step_time = Chart("step_time", "step time (mean over each log interval)", "step", "seconds")
    util = Chart("utilization", "MFU (solid), HFU (dashed) and device busy (dotted)", "step", "%")
    scale = Chart("loss_scale", "fp16 loss scale", "step", "scale", logy=True)
    mem = Chart("peak_memory", "peak memory (CUDA allocator; process RSS on CPU)", "step", "GiB")
    skipped = Chart("skipped_steps", "steps skipped so far (update withheld)", "step", "steps")
    counted = Chart("loss_tokens", "tokens the loss counts per step (prompt-masked or packed data)", "step", "tokens")
    gap = Chart("gap", "generalisation gap (val loss − train loss since the previous evaluation)", "step", "gap")
    per_source = Chart("val_loss_sources", "validation loss per data source ([[data.mix]])", "step", loss_step.ylabel)
    tasks = Chart("task_accuracy", "task accuracy (train.eval_tasks): acc (solid), acc_norm (dashed), acc ± its "
                  "standard error (dotted)", "step", "accuracy")
    bpb = Chart("task_bpb", "task bits per byte (train.eval_tasks, text:)", "step", "bits per byte")
    extra: dict[str, Chart] = {}
    for i, run in enumerate(runs):
        x, y = series(run.train, "loss")
        loss_step.lines.append(Line(i, name(run, "train"), x, y))
        x, y = series(run.eval, "val_loss")
        loss_step.lines.append(Line(i, name(run, "validation"), x, y, "points"))
        loss_step.marks += loss_marks(run, i)
        x, y = series(run.train, "loss", x_key=f"{run.unit}_seen")
        loss_seen.lines.append(Line(i, name(run, "train"), x, y))
        vx, vy = series(run.eval, "val_loss")
        seen = [tokens_at(run, s) for s in vx]
        loss_seen.lines.append(Line(i, name(run, "validation"), [s for s in seen if s is not None],
                                    [v for s, v in zip(seen, vy) if s is not None], "points"))
        lr.lines.append(Line(i, run.name, *series(run.train, "lr")))
        grad.lines.append(Line(i, run.name, *series(run.train, "grad_norm")))
        if clip_thresholds[i]:
            grad.hlines.append((clip_thresholds[i], name(run, f"clip at {clip_thresholds[i]:g}")))
        elif len({r.get("clip_threshold") for r in run.train} - {None}) > 1:  # adaptive: a threshold that moves
            grad.lines.append(Line(i, name(run, "clip threshold"), *series(run.train, "clip_threshold"), "dashed"))
        rate.lines.append(Line(i, run.name, *series(run.train, f"{run.unit}_per_s")))
        step_time.lines.append(Line(i, run.name, *series(run.train, "step_time_s")))
        util.lines.append(Line(i, name(run, "MFU"), *series(run.train, "mfu", scale=100)))
        util.lines.append(Line(i, name(run, "HFU"), *series(run.train, "hfu", scale=100), "dashed"))
        util.lines.append(Line(i, name(run, "busy"), *series(run.train, "utilisation", scale=100), "dotted"))
        scale.lines.append(Line(i, run.name, *series(run.train, "loss_scale")))
        scale.marks += scale_marks(run, i)
        mem.lines.append(Line(i, run.name, *series(run.train, "peak_mem_bytes", scale=1 / GiB)))
        x, y = series(run.train, "skipped_steps")
        if any(y):
            skipped.lines.append(Line(i, run.name, x, y))
        x, y = series(run.train, "loss_tokens")
        if len(set(y)) > 1:  # text data counts every target: a flat line says nothing the batch size does not
            counted.lines.append(Line(i, run.name, x, y))
        gap.lines.append(Line(i, run.name, *series(run.eval, "gap"), "points"))
        sources = dict.fromkeys(k for r in run.eval for k in r if k.startswith("val_loss/"))
        for j, key in enumerate(sources):  # one colour per source (per run when comparing runs)
            per_source.lines.append(Line(i if multi else j, name(run, key.removeprefix("val_loss/")),
                                         *series(run.eval, key), "solid" if not multi else ("solid", "dashed",
                                                                                            "dotted")[j % 3]))
        task_lines(run, i, multi, tasks, bpb)
        for records, charted, kind in ((run.train, CHARTED_TRAIN, "train"), (run.eval, CHARTED_EVAL, "eval")):
            for key in dict.fromkeys(k for r in records for k in r if k not in charted
                                     and not k.startswith("val_loss/") and task_name(k) is None):
                x, y = series(records, key)
                if x:
                    chart = extra.setdefault(key, Chart(f"{kind}_{key}", f"{key} ({kind} records)", "step", key))
                    chart.lines.append(Line(i, run.name, x, y))
    charts = [loss_step, loss_seen, per_source, tasks, bpb, gap, lr, grad, rate, step_time, util, scale, mem, skipped,
              counted, *extra.values()]
    for c in charts:
        c.lines = [line for line in c.lines if line.x]
    shown = {"solid": "MFU (solid)", "dashed": "HFU (dashed)", "dotted": "device busy (dotted)"}
    util.title = ", ".join(shown[s] for s in shown if any(line.style == s for line in util.lines)) or util.title
    return [c for c in charts if not c.empty]


TASK_SCORES = ("_acc_norm", "_acc_stderr", "_acc", "_bpb")  # task_<name><suffix>; longest suffixes first


def task_name(key: str) -> str | None:
    """"hellaswag" for task_hellaswag_acc_norm; None for a key that is not a task score."""
    if key.startswith("task_"):
        for suffix in TASK_SCORES:
            if key.endswith(suffix) and len(key) > len("task_") + len(suffix):
                return key[len("task_"):-len(suffix)]
    return None


def task_lines(run: Run, index: int, multi: bool, accuracy: Chart, bpb: Chart) -> None:
    """train.eval_tasks' scores of one run: each task's acc, acc_norm and acc ± stderr, or its bits per byte; one
    colour per task (per run when comparing runs)."""
    names = dict.fromkeys(task_name(k) for r in run.eval for k in r if task_name(k))
    for j, task in enumerate(names):
        colour = index if multi else j
        label = f"{run.name}: {task}" if multi else task
        x, acc = series(run.eval, f"task_{task}_acc")
        if x:
            accuracy.lines.append(Line(colour, f"{label} acc", x, acc, "solid"))
            accuracy.lines.append(Line(colour, f"{label} acc_norm", *series(run.eval, f"task_{task}_acc_norm"),
                                       "dashed"))
            sx, se = series(run.eval, f"task_{task}_acc_stderr")
            at = dict(zip(x, acc))
            for sign, word in ((1, "+"), (-1, "−")):
                accuracy.lines.append(Line(colour, f"{label} acc {word} stderr", sx,
                                           [at[s] + sign * e for s, e in zip(sx, se)], "dotted"))
        x, y = series(run.eval, f"task_{task}_bpb")
        if x:
            bpb.lines.append(Line(colour, label, x, y, "points"))


def _g(value, fmt: str = ".4g") -> str:
    v = number(value)
    return "n/a" if v is None else format(v, fmt)


def event_detail(e: dict) -> str:
    """One line of what a numerics event says."""
    kind = e.get("event")
    if kind == "nonfinite":
        return f"loss {_g(e.get('loss'))}, grad_norm {_g(e.get('grad_norm'))}; {e.get('action', '')}"
    if kind == "nonfinite_trace":
        return (f"first non-finite in the {e.get('phase', '?')} of {e.get('module', '?')}, op {e.get('op', '?')}"
                f" (nonfinite_report.json)")
    if kind == "loss_spike":
        s = e.get("stats") or {}
        return (f"loss {_g(s.get('loss'))} (median {_g(s.get('loss_median'))}, z {_g(s.get('loss_z'), '.1f')}), "
                f"grad_norm {_g(s.get('grad_norm'))} (z {_g(s.get('grad_norm_z'), '.1f')}); policy "
                f"{e.get('policy', '?')}: {e.get('action', '')}")
    if kind == "rollback":
        return (f"rolled back to step {e.get('to_step')} from {e.get('source', '?')}, skipped "
                f"{e.get('skipped_batches', '?')} batches (rollback {e.get('rollbacks', '?')})")
    if kind == "rollback_unavailable":
        return f"no {e.get('source', '?')} state to roll back to; the update was withheld"
    if kind == "loss_scale":
        return f"{e.get('cause', '?')}: {_g(e.get('previous'), 'g')} → {_g(e.get('loss_scale'), 'g')}"
    if kind == "fp16_grads":
        under, over = e.get("underflow") or [], e.get("overflow") or []
        return (f"mean underflow {_g(e.get('mean_underflow'), '.2%')}"
                + (f"; underflowing: {', '.join(under[:5])}" + (" …" if len(under) > 5 else "") if under else "")
                + (f"; overflowing: {', '.join(over[:5])}" if over else ""))
    if kind in ("fp16_advice",):
        return str(e.get("message", ""))
    if kind == "stop":
        return str(e.get("reason", ""))
    return ", ".join(f"{k} {v}" for k, v in e.items() if k not in ("kind", "step", "event"))


def event_rows(run: Run) -> list[tuple[int, str, str]]:
    """(step, event, detail) for every numerics record of the run, and every record of its life (kind "event":
    a restart, a straggler), in step order."""
    lives = [e for e in run.other if e.get("kind") == "event"]
    rows = [(e.get("step", 0), str(e.get("event", "?")), event_detail(e)) for e in run.numerics + lives]
    return sorted(rows, key=lambda r: r[0] if isinstance(r[0], int) else 0)
