"""One self-contained HTML page for one or more runs: charts as inline PNGs, plain HTML and CSS, no script and
nothing fetched at view time.

    report = collect([run_dir, ...])     what the page shows, as data (runs, summaries, chart specs, config diff)
    html = page(report)                  draws the charts and writes the page
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.config import ConfigError, load_config
from kiln.data import cached_unigram_loss
from kiln.models.lora import parameter_counts
from kiln.report.figures import Chart, build_charts, event_rows
from kiln.report.render import COLORS, draw, memory_chart, profile_chart
from kiln.report.runs import Run, Summary, differing_keys, flat_config, fmt_duration, read_run, summarize, utc


@dataclass
class Report:
    runs: list[Run]
    summaries: list[Summary]
    charts: list[Chart]
    differing: list[str]  # config keys whose values differ between the runs
    notes: list[str] = field(default_factory=list)  # per-run problems that left something out (one line each)
    device: str = ""  # --device for the memory chart ("" = this machine's)


def _names(paths: list[Path]) -> list[str]:
    """Each run's directory name; parent/name where two runs share a name, then an index if still equal."""
    names = [p.resolve().name for p in paths]
    for i, p in enumerate(paths):
        if names.count(names[i]) > 1:
            names[i] = f"{p.resolve().parent.name}/{p.resolve().name}"
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        seen[n] = seen.get(n, 0) + 1
        if seen[n] > 1 or names.count(n) > 1:
            names[i] = f"{n} ({i + 1})"
    return names


def _clip_threshold(run: Run) -> float | None:
    """The global-norm clipping threshold of the run (None when it clips by value or not at all)."""
    optim = run.config.get("optim", {})
    clip = optim.get("grad_clip")
    if optim.get("clip_mode", "norm") != "norm" or not isinstance(clip, (int, float)) or clip <= 0:
        return None
    return float(clip)


def _unigram(run: Run) -> tuple[float | None, str | None]:
    """The unigram baseline of a language-model run's training split (from the token cache; nothing is built)."""
    if not run.is_lm or not (run.path / "config.toml").is_file():
        return None, None
    try:
        cfg = load_config(run.path / "config.toml")
    except (ConfigError, ValueError) as e:
        return None, f"{run.name}: config.toml does not load with this kiln ({e}); no unigram baseline or memory chart"
    value = cached_unigram_loss(cfg.data)
    return value, None if value is not None else (
        f"{run.name}: unigram baseline n/a: the token cache of its data is not on this machine")


def _trainable(run: Run) -> str:
    """A language-model run's trainable parameters of all of them (LoRA: its adapters), from its config.toml."""
    if not run.is_lm:
        return "n/a (not a language-model run)"
    try:
        cfg = load_config(run.path / "config.toml")
        n, total = parameter_counts(cfg.model.resolve(), cfg.lora)
    except (ConfigError, ValueError, OSError):
        return "n/a (config.toml does not load with this kiln)"
    return f"all {total:,}" if n == total else f"{n:,} of {total:,} ({100 * n / total:.2f}%)"


def collect(run_dirs: list[str | Path], device: str = "") -> Report:
    paths = [Path(p) for p in run_dirs]
    runs = [read_run(p, name) for p, name in zip(paths, _names(paths))]
    notes, summaries = [], []
    for run in runs:
        unigram, note = _unigram(run)
        summaries.append(summarize(run, unigram))
        if note:
            notes.append(note)
        if run.unreadable_lines:
            notes.append(f"{run.name}: {run.unreadable_lines} metrics line(s) not JSON were skipped (a run still "
                         f"writing leaves its last line half written)")
    charts = build_charts(runs, [_clip_threshold(r) for r in runs])
    return Report(runs, summaries, charts, differing_keys(runs), notes, device)


# ------------------------------------------------------------------------------------------------- the page

CSS = """
:root { --fg: #1b1b1b; --muted: #666; --line: #ddd; --diff: #fff3b0; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg); margin: 0 auto;
       max-width: 1340px; padding: 16px 20px 40px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 3px; }
h3 { font-size: 14px; margin: 14px 0 6px; }
.muted { color: var(--muted); }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.diff td, tr.diff th { background: var(--diff); }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 5px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 14px; }
figure { margin: 0; border: 1px solid var(--line); border-radius: 4px; padding: 6px; break-inside: avoid;
         page-break-inside: avoid; }
figure img { display: block; width: 100%; height: auto; }
figcaption { font-size: 12px; color: var(--muted); margin-top: 4px; }
code { font-size: 12px; }
ul.notes { color: #8a4b00; }
div.config table { width: 100%; table-layout: fixed; margin-bottom: 12px; break-inside: avoid; page-break-inside: avoid; }
div.config td, div.config th { font-size: 12px; padding: 1px 8px 1px 0; overflow-wrap: anywhere; }
div.config th:first-child { width: 45%; }
figure[data-chart="memory"] img { width: auto; max-width: 100%; max-height: 520px; margin: 0 auto; }
@media print {
  body { max-width: none; padding: 0; font-size: 11px; }
  .grid { grid-template-columns: 1fr 1fr; gap: 8px; }
  h2 { break-after: avoid; }
  table { break-inside: auto; }
  tr { break-inside: avoid; }
}
"""


def _e(value) -> str:
    return html.escape(str(value))


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _figure(key: str, png: bytes, alt: str, caption: str = "") -> str:
    cap = f"<figcaption>{_e(caption)}</figcaption>" if caption else ""
    return f'<figure class="chart" data-chart="{_e(key)}">{_img(png, alt)}{cap}</figure>'


def _f(value, fmt: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{format(value, fmt)}{suffix}"


def _summary_rows(report: Report) -> list[tuple[str, list[str]]]:
    unit = {r.unit for r in report.runs}
    unit = unit.pop() if len(unit) == 1 else "tokens/samples"
    rows = []
    for label, cell in (
        ("status", lambda r, s: s.status),
        ("steps", lambda r, s: f"{s.steps:,}" + (f" of {s.max_steps:,}" if s.max_steps else "")),
        (f"{unit} seen", lambda r, s: _f(s.seen, ",.0f")),
        ("wall time (training start to last record)", lambda r, s: fmt_duration(s.wall_s)),
        ("time in training steps", lambda r, s: fmt_duration(s.train_time_s)),
        ("final train loss", lambda r, s: _f(s.final_loss, ".4f")),
        ("final val loss", lambda r, s: "n/a (no evaluation yet)" if s.final_val is None else
            f"{s.final_val:.4f} at step {s.final_val_step:,}" + (f" (ppl {s.final_val_ppl:.2f})"
                                                                   if s.final_val_ppl else "")),
        ("best val loss", lambda r, s: "n/a" if s.best_val is None else f"{s.best_val:.4f} at step {s.best_val_step:,}"),
        ("unigram baseline", lambda r, s: _f(s.unigram, ".4f") if r.is_lm else "n/a (not a language-model run)"),
        ("trainable parameters", lambda r, s: _trainable(r)),
        (f"{unit}/s (mean, 2nd half)", lambda r, s: _f(s.mean_rate, ",.0f")),
        ("MFU (mean, 2nd half)", lambda r, s: _f(s.mean_mfu and 100 * s.mean_mfu, ".1f", "%")),
        ("HFU (mean, 2nd half)", lambda r, s: _f(s.mean_hfu and 100 * s.mean_hfu, ".1f", "%")),
        ("MFU peak used (last record)", lambda r, s: _f(s.mfu_peak_flops and s.mfu_peak_flops / 1e9, ",.1f",
                                                     " GFLOP/s")),
        ("peak memory", lambda r, s: _f(s.peak_mem_bytes and s.peak_mem_bytes / 2**30, ".2f", " GiB")),
        ("skipped steps", lambda r, s: f"{s.skipped:,}"),
        ("numerics events", lambda r, s: ", ".join(f"{k} {v}" for k, v in s.events.items()) or "none"),
    ):
        rows.append((label, [cell(r, s) for r, s in zip(report.runs, report.summaries)]))
    return [(label, cells) for label, cells in rows
            if not (label.startswith("HFU") and all(c == "n/a" for c in cells))]


def _config_table(report: Report) -> str:
    """One small table per config section, flowed into columns; the keys that differ between runs highlighted."""
    flats = [flat_config(r.config) for r in report.runs]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    diff = set(report.differing)
    head = "".join(f"<th>{_e(r.name)}</th>" for r in report.runs) if len(report.runs) > 1 else "<th></th>"
    sections: dict[str, list[str]] = {}
    for k in keys:
        cls = ' class="diff"' if k in diff else ""
        cells = "".join(f"<td>{_e(json.dumps(f[k]) if k in f else '—')}</td>" for f in flats)  # TOML's spelling
        sections.setdefault(k.split(".")[0], []).append(f"<tr{cls}><th><code>{_e(k)}</code></th>{cells}</tr>")
    width = 330 if len(report.runs) == 1 else 250 + 160 * len(report.runs)
    tables = "".join(f'<table class="config"><tr><th>[{_e(name)}]</th>{head}</tr>{"".join(rows)}</table>'
                     for name, rows in sections.items())
    return f'<div class="config" style="columns: {width}px; column-gap: 28px">{tables}</div>'


def page(report: Report) -> str:
    runs = report.runs
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>kiln report: {_e(', '.join(r.name for r in runs))}</title><style>{CSS}</style></head><body>"]
    out.append(f"<h1>kiln report: {_e(', '.join(r.name for r in runs))}</h1>")
    out.append(f'<p class="muted">generated {utc(time.time())} from '
               + ", ".join(f"<code>{_e(r.path)}</code>" for r in runs) + "</p>")
    if report.differing:
        out.append("<p>These runs differ in: " + ", ".join(f"<code>{_e(k)}</code>" for k in report.differing)
                   + " (highlighted in the config below).</p>")
    if report.notes:
        out.append('<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in report.notes) + "</ul>")

    # summary
    out.append('<h2 id="summary">Summary</h2><table class="summary"><tr><th></th>')
    for i, r in enumerate(runs):
        out.append(f'<th><span class="swatch" style="background:{_color(i)}"></span>{_e(r.name)}</th>')
    out.append("</tr>")
    for label, cells in _summary_rows(report):
        out.append(f"<tr><th>{_e(label)}</th>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    out.append("</table>")

    # metric charts
    out.append('<h2 id="charts">Training</h2><div class="grid">')
    for chart in report.charts:
        out.append(_figure(chart.key, draw(chart), chart.title))
    out.append("</div>")
    if not report.charts:
        out.append('<p class="muted">No metrics records yet.</p>')

    # numerics events
    out.append('<h2 id="events">Numerics events</h2>')
    for run in runs:
        rows = event_rows(run)
        title = f"<h3>{_e(run.name)}</h3>" if len(runs) > 1 else ""
        if not rows:
            out.append(f'{title}<p class="muted">No numerics events (no spike, non-finite step, rollback or '
                       f"loss-scale change).</p>")
            continue
        out.append(f'{title}<table class="events"><tr><th>step</th><th>event</th><th>what</th></tr>')
        out += [f'<tr><td class="num">{_e(s)}</td><td>{_e(k)}</td><td>{_e(d)}</td></tr>' for s, k, d in rows]
        out.append("</table>")

    # memory and profile
    out.append('<h2 id="memory">Memory breakdown</h2><div class="grid">')
    drawn: dict[str, list[str]] = {}
    figures: dict[str, tuple[bytes, str]] = {}
    for run in runs:
        if not run.is_lm:
            out.append(f'<p class="muted">{_e(run.name)}: no memory chart (the estimator models kiln\'s own '
                       f"transformer; this run trained another model through fit()).</p>")
            continue
        try:
            png, caption = memory_chart(run.path / "config.toml", report.device)
        except (ConfigError, ValueError, OSError) as e:
            out.append(f'<p class="muted">{_e(run.name)}: no memory chart ({_e(e)}).</p>')
            continue
        key = hashlib.sha256(png).hexdigest()
        drawn.setdefault(key, []).append(run.name)
        figures[key] = (png, caption)
    for key, names in drawn.items():
        png, caption = figures[key]
        out.append(_figure("memory", png, "memory breakdown", f"{', '.join(names)}: {caption}"))
    out.append("</div>")
    profiled = [r for r in runs if r.profile]
    if profiled:
        out.append('<h2 id="profile">Step-time breakdown (profiled)</h2><div class="grid">')
        for run in profiled:
            advice = run.profile.get("advice") or []
            caption = f"{run.name}: " + ("; ".join(str(a) for a in advice) if advice else "no advice")
            out.append(_figure("profile", profile_chart(run.profile), "step-time breakdown", caption))
        out.append("</div>")

    # config
    out.append('<h2 id="config">Resolved config</h2>')
    if len(runs) > 1:
        out.append(f'<p class="muted">{len(report.differing)} key(s) differ between the runs (highlighted).</p>')
    out.append(_config_table(report))
    out.append("</body></html>")
    return "\n".join(out)


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def write_report(run_dirs: list[str | Path], out: str | Path, device: str = "") -> tuple[Path, Report]:
    report = collect(run_dirs, device)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(report), encoding="utf-8")
    return out, report
