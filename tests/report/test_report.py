"""`kiln report`: the data each chart and table of the page is built from, on fabricated runs and one real run."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from kiln.cli.main import main
from kiln.config import Config, to_toml
from kiln.report import collect, page, read_run
from kiln.report.figures import CHARTED_EVAL, CHARTED_TRAIN, LOSS_EVENTS, build_charts, event_rows, loss_at
from kiln.report.runs import differing_keys, fmt_duration, summarize
from kiln.run.lm import train
from tests.report.fake import GiB, make_run, steps_run, train_record

EVERY_EVENT = [
    {"kind": "numerics", "step": 12, "event": "nonfinite", "loss": "nan", "grad_norm": "nan",
     "action": "update not applied"},
    {"kind": "numerics", "step": 12, "event": "nonfinite_trace", "module": "blocks.1.mlp", "op": "aten.mul.Tensor",
     "phase": "forward", "report": "nonfinite_report.json"},
    {"kind": "numerics", "step": 37, "event": "loss_spike", "policy": "rollback", "action": "update withheld",
     "stats": {"loss": 9.25, "loss_median": 2.0, "loss_mad": 0.1, "loss_z": 40.0, "grad_norm": 30.0,
               "grad_norm_median": 1.0, "log_grad_norm_mad": 0.3, "grad_norm_z": 9.0}},
    {"kind": "numerics", "step": 37, "event": "rollback", "to_step": 30, "source": "memory snapshot",
     "skipped_batches": 7, "lr_factor": 1.0, "lr_steps": 0, "rollbacks": 1},
    {"kind": "numerics", "step": 44, "event": "rollback_unavailable", "source": "checkpoint"},
    {"kind": "numerics", "step": 49, "event": "loss_scale", "loss_scale": 32768.0, "previous": 65536.0,
     "cause": "overflow"},
    {"kind": "numerics", "step": 60, "event": "loss_scale", "loss_scale": 65536.0, "previous": 32768.0,
     "cause": "growth"},
    {"kind": "numerics", "step": 60, "event": "fp16_grads", "loss_scale": 65536.0, "mean_underflow": 0.31,
     "underflow": ["blocks.0.attn.qkv.weight"], "overflow": [], "tensors": {}},
    {"kind": "numerics", "step": 70, "event": "fp16_advice", "message": "fp16 loss scale collapsing: switch to bf16"},
    {"kind": "numerics", "step": 80, "event": "brand_new_event", "detail": 3},
    {"kind": "numerics", "step": 90, "event": "stop", "reason": "numerics: loss spike at step 90"},
]


def _chart(charts, key):
    found = [c for c in charts if c.key == key]
    assert found, f"no chart {key}; charts: {[c.key for c in charts]}"
    return found[0]


def test_every_record_kind_and_key_is_rendered(tmp_path):
    train_records = [train_record(s, 4.0 / s**0.25, hfu=0.6 + s / 1000, loss_scale=65536.0 / (1 + (s >= 50)),
                                  skipped_steps=int(s >= 50), grad_sparsity=0.01 * s)
                     for s in range(10, 101, 10)]
    evals = [{"kind": "eval", "step": s, "val_loss": 3.0 - s / 100, "val_ppl": math.exp(3.0 - s / 100),
              "val_accuracy": s / 200} for s in (50, 100)]
    path = make_run(tmp_path, train=train_records, eval=evals, numerics=EVERY_EVENT)
    run = read_run(path)
    assert (len(run.train), len(run.eval), len(run.numerics)) == (10, 2, len(EVERY_EVENT))
    charts = build_charts([run], [1.0])

    # each train key on its chart, with the logged numbers (scaled where the axis is in % or GiB)
    where = {"loss": ("loss_step", 1), "lr": ("lr", 1), "grad_norm": ("grad_norm", 1), "tokens_per_s": ("throughput", 1),
             "step_time_s": ("step_time", 1), "mfu": ("utilization", 100), "hfu": ("utilization", 100),
             "loss_scale": ("loss_scale", 1), "peak_mem_bytes": ("peak_memory", 1 / GiB),
             "skipped_steps": ("skipped_steps", 1), "grad_sparsity": ("train_grad_sparsity", 1)}
    keys = {k for r in run.train for k in r} - {"kind", "step", "tokens_seen"}  # tokens_seen: the x of loss_seen
    assert keys == set(where), keys ^ set(where)
    for key, (chart_key, scale) in where.items():
        expected = [r[key] * scale for r in run.train]
        lines = _chart(charts, chart_key).lines
        assert any(line.y == pytest.approx(expected) and line.x == [r["step"] for r in run.train] for line in lines), key
    seen = _chart(charts, "loss_seen").lines[0]
    assert seen.x == [r["tokens_seen"] for r in run.train] and seen.y == [r["loss"] for r in run.train]
    assert "grad_sparsity" not in CHARTED_TRAIN and "val_accuracy" not in CHARTED_EVAL  # an unknown key gets a chart
    # eval: val_loss on both loss charts (against tokens interpolated at the eval steps), unknown keys charted
    val = [line for line in _chart(charts, "loss_step").lines if line.style == "points"][0]
    assert val.x == [50, 100] and val.y == pytest.approx([2.5, 2.0])
    val_seen = [line for line in _chart(charts, "loss_seen").lines if line.style == "points"][0]
    assert val_seen.x == [50 * 2048, 100 * 2048]
    assert _chart(charts, "eval_val_accuracy").lines[0].y == [0.25, 0.5]
    # the clipping threshold is drawn on the gradient norm
    assert _chart(charts, "grad_norm").hlines == [(1.0, "clip at 1")]

    # every numerics record has a row at its step; the loss events are marked on the loss curve
    rows = event_rows(run)
    assert sorted((s, k) for s, k, _ in rows) == sorted((e["step"], e["event"]) for e in EVERY_EVENT)
    marks = _chart(charts, "loss_step").marks
    assert sorted((m.step, m.event) for m in marks) == sorted(
        [(e["step"], e["event"]) for e in EVERY_EVENT if e["event"] in LOSS_EVENTS] + [(49, "overflow")])
    scale_marks = _chart(charts, "loss_scale").marks
    assert [(m.step, m.event, m.y) for m in scale_marks] == [(49, "overflow", 32768.0), (60, "growth", 65536.0)]

    # and the page shows all of it: a figure per chart, a row per event with what it says
    html = page(collect([path]))
    assert re.findall(r'<figure class="chart" data-chart="([^"]+)"', html) == [c.key for c in charts] + ["memory"]
    assert html.count("<img ") == len(charts) + 1 and "http://" not in html and "https://" not in html
    assert "<script" not in html
    for needle in ("blocks.1.mlp", "aten.mul.Tensor", "rolled back to step 30 from memory snapshot",
                   "overflow: 65536 → 32768", "blocks.0.attn.qkv.weight", "switch to bf16", "brand_new_event",
                   "numerics: loss spike at step 90", "HFU (mean, 2nd half)"):
        assert needle in html, needle


def test_events_land_at_their_step(tmp_path):
    run = read_run(steps_run(tmp_path, numerics=EVERY_EVENT))
    marks = {(m.event, m.step): m for m in _chart(build_charts([run], [None]), "loss_step").marks}
    spike = marks["loss_spike", 37]
    assert (spike.x, spike.y) == (37, 9.25)  # at the spiking step's own loss, not the logged interval's
    rollback = marks["rollback", 37]
    assert rollback.x == 37 and rollback.y == pytest.approx(loss_at(run, 37))
    # between the records of steps 30 and 40, on the line joining them
    assert loss_at(run, 37) == pytest.approx(4 / 30**0.25 + 0.7 * (4 / 40**0.25 - 4 / 30**0.25))
    nan = marks["nonfinite", 12]
    assert nan.clip and nan.x == 12  # a NaN loss has no height: drawn at the top of the axis
    trace = marks["nonfinite_trace", 12]
    assert trace.clip and trace.text == "blocks.1.mlp (forward, aten.mul.Tensor)"
    stop = marks["stop", 90]
    assert stop.y is None and not stop.clip  # a vertical line
    overflow = marks["overflow", 49]  # the fp16 scaler skipped step 49: on the curve
    assert overflow.y == pytest.approx(loss_at(run, 49)) and ("growth", 60) not in marks
    assert ("fp16_advice", 70) not in marks and ("fp16_grads", 60) not in marks  # not loss events


def test_differing_config_keys_are_found_and_highlighted(tmp_path):
    a = Config()
    b = Config()
    b.optim.lr, b.optim.clip_mode, b.train.micro_batch_size = 6e-3, "value", 16
    run_a = steps_run(tmp_path, "a", config=a)
    # a run written by another kiln version: one key fewer, one more
    toml_c = to_toml(a).replace("keep_last = 3\n", "").replace("[plan]\n", "[plan]\nlegacy = 1\n")
    run_c = steps_run(tmp_path, "c", toml=toml_c)
    run_b = steps_run(tmp_path, "b", config=b)
    runs = [read_run(p) for p in (run_a, run_b, run_c)]
    assert differing_keys(runs) == ["optim.lr", "optim.clip_mode", "train.micro_batch_size", "checkpoint.keep_last",
                                    "plan.legacy"]
    assert differing_keys(runs[:1]) == []
    assert differing_keys([runs[0], read_run(steps_run(tmp_path, "a2", config=Config()))]) == []
    report = collect([run_a, run_b])
    assert report.differing == ["optim.lr", "optim.clip_mode", "train.micro_batch_size"]
    html = page(report)
    highlighted = re.findall(r'<tr class="diff"><th><code>([^<]+)</code></th><td>([^<]*)</td><td>([^<]*)</td>', html)
    assert highlighted == [("optim.lr", "0.002", "0.006"), ("optim.clip_mode", "&quot;norm&quot;", "&quot;value&quot;"),
                           ("train.micro_batch_size", "8", "16")]
    # only a run clipping by global norm has its threshold on the gradient-norm chart
    assert _chart(report.charts, "grad_norm").hlines == [(1.0, "a: clip at 1")]
    # two runs: one line per run on each chart, in its own colour
    assert [(line.run, line.label) for line in _chart(report.charts, "lr").lines] == [(0, "a"), (1, "b")]


def test_summary_numbers(tmp_path):
    path = steps_run(tmp_path, steps=range(10, 61, 10), evals=(20, 40, 60))
    # two attempts (a resume): wall time runs from the first one's start to the newest record
    (path / "tensorboard").mkdir()
    for started in (1_800_000_000, 1_800_000_500):
        (path / "tensorboard" / f"events.out.tfevents.{started}.host.1.0").write_bytes(b"")
    os.utime(path / "metrics.jsonl", (1_800_000_725, 1_800_000_725))
    run = read_run(path)
    run.eval[1]["val_loss"] = 1.2  # the best is not the last
    s = summarize(run, unigram=3.25)
    assert s.steps == 60 and s.seen == 60 * 2048 and s.final_loss == pytest.approx(4 / 60**0.25)
    assert s.train_time_s == pytest.approx(sum(10 * 2048 / (15000.0 + k) for k in range(10, 61, 10)))
    assert (s.best_val, s.best_val_step) == (1.2, 40) and s.final_val_step == 60
    assert s.mean_rate == pytest.approx(15000 + (40 + 50 + 60) / 3)
    assert s.peak_mem_bytes == GiB // 2 + 60 * 1024 * 1024 and s.unigram == 3.25
    assert s.wall_s == 725.0 and fmt_duration(s.wall_s) == "12 min 05 s"


def test_a_run_still_training(tmp_path):
    """Records read up to the half-written last line; the process holding the run lock is named."""
    cfg = Config()
    cfg.train.max_steps = 200
    path = steps_run(tmp_path, config=cfg, steps=range(10, 51, 10), evals=(),
                     tail='{"kind": "train", "step": 60, "lo')
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (path / ".lock").write_text(str(sleeper.pid))
        report = collect([path])
        assert report.summaries[0].status == f"training now (process {sleeper.pid}), at step 50 of 200"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert report.runs[0].unreadable_lines == 1 and any("1 metrics line(s) not JSON" in n for n in report.notes)
    assert [line.x[-1] for line in _chart(report.charts, "loss_step").lines] == [50]  # no validation line yet
    assert collect([path]).summaries[0].status.startswith("stopped at step 50 of 200")  # the process has gone


def test_stopped_early_without_evaluation_and_a_fit_run(tmp_path):
    cfg = Config()
    cfg.train.max_steps = 100
    stopped = steps_run(tmp_path, "stopped", config=cfg, steps=range(10, 31, 10), evals=())
    fit_records = [{"kind": "train", "step": s, "loss": 1.0 / s, "lr": 1e-3, "grad_norm": 0.5,
                    "samples_per_s": 4000.0, "step_time_s": 0.01, "samples_seen": 64 * s, "peak_mem_bytes": GiB,
                    "skipped_steps": 0} for s in (100, 200)]
    fit = make_run(tmp_path, "fit", train=fit_records, lm=False)
    report = collect([stopped, fit])
    s = report.summaries[0]
    assert s.status.startswith("stopped at step 30 of 100") and s.final_val is None and s.best_val is None
    assert report.runs[1].unit == "samples" and not report.runs[1].is_lm
    assert _chart(report.charts, "loss_seen").xlabel == "tokens or samples seen"
    html = page(report)
    assert "n/a (no evaluation yet)" in html and "n/a (not a language-model run)" in html
    assert "fit: no memory chart" in html and html.count('<figure class="chart" data-chart="memory"') == 1


def test_profiled_run_shows_its_step_time_breakdown_and_hfu(tmp_path):
    profile = {"step_s": 0.25, "breakdown": {"data": 0.01, "forward": 0.08, "backward": 0.12, "optimizer": 0.02},
               "verdict": "compute-bound", "advice": ["raise the micro-batch", "try train.compile=true"]}
    records = [train_record(s, 3.0, hfu=0.7) for s in (10, 20)]
    path = make_run(tmp_path, train=records, profile=profile)
    report = collect([path])
    assert report.runs[0].profile == profile
    hfu = [line for line in _chart(report.charts, "utilization").lines if line.style == "dashed"][0]
    assert hfu.y == pytest.approx([70.0, 70.0])
    assert report.summaries[0].mean_hfu == pytest.approx(0.7)
    html = page(report)
    assert html.count('<figure class="chart" data-chart="profile"') == 1
    assert "raise the micro-batch; try train.compile=true" in html and "70.0%" in html


def test_not_a_run_is_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a kiln run directory" in err and err.startswith("kiln report: error:")
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_a_real_run_every_record_rendered(small_config, tmp_path, capsys):
    """A tiny fp16 run with a planted NaN: every key kiln logs is charted or summarised, the trace names the
    module on the loss chart, and `kiln report` writes the page."""
    cfg = small_config(train={"max_steps": 8, "eval_interval": 4}, log={"interval": 2},
                       precision={"mode": "fp16", "init_scale": 2.0**-10, "growth_interval": 2},
                       faults={"nan_forward": "blocks.1.attn@5"})
    result = train(cfg, tmp_path / "run")
    run = read_run(tmp_path / "run")
    charts = build_charts([run], [1.0])
    charted = {k for r in run.train for k in r}
    assert charted <= CHARTED_TRAIN and {k for r in run.eval for k in r} <= CHARTED_EVAL
    assert "loss_scale" in charted and _chart(charts, "loss_scale").lines[0].y
    events = {(e["event"], e["step"]) for e in run.numerics}
    assert {("nonfinite", 5), ("nonfinite_trace", 5)} <= events
    marks = {(m.event, m.step): m for m in _chart(charts, "loss_step").marks}
    assert marks["nonfinite_trace", 5].text.startswith("blocks.1.attn")
    # the numerics events, and the run's life: its layout record at the start (every run writes one)
    assert sorted((s, k) for s, k, _ in event_rows(run)) == sorted([(e["step"], e["event"]) for e in run.numerics]
                                                                  + [(0, "layout")])

    out = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "run"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "run: finished: 8 steps" in printed and f"wrote {out}" in printed
    html = out.read_text()
    summary = summarize(run)
    assert f"{summary.final_val:.4f} at step 8" in html
    # the peak MFU divided by (measured on a CPU) is a row of the summary, not a chart of its own
    assert summary.mfu_peak_flops == run.train[-1]["mfu_peak_flops"] > 0
    assert f"<th>MFU peak used (last record)</th><td>{summary.mfu_peak_flops / 1e9:,.1f} GFLOP/s</td>" in html
    # the baseline the run printed, read back from the test's token cache
    assert f"<th>unigram baseline</th><td>{result.unigram_loss:.4f}</td>" in html and result.unigram_loss > 0


def test_a_run_that_has_just_started_and_the_device_flag(tmp_path, capsys):
    """config.toml written, no record yet: the page says so; --device predicts the memory for another device."""
    path = make_run(tmp_path, "fresh")
    (path / "metrics.jsonl").unlink()
    out = tmp_path / "r.html"
    assert main(["report", str(path), "--out", str(out), "--device", "H100"]) == 0
    html = out.read_text()
    assert "No metrics records yet." in html and "no train records yet" in html
    assert html.count("<figure") == 1 and "on H100 (" in html  # the memory chart only, for an H100
    assert main(["report", str(path), "--out", str(out), "--device", "H1000"]) == 2
    assert "did you mean 'H100'" in capsys.readouterr().err


def test_a_profile_directory_is_called_a_profile(tmp_path, capsys):
    """`kiln profile` sets max_steps one past the steps it runs: the report said "stopped" (a crash?) for it."""
    cfg = Config()
    cfg.train.max_steps = 17  # warm-up 3 + 10 timed + 3 traced, and one more (kiln.run.profile)
    profile = {"step_s": 0.25, "breakdown": {"forward": 0.1, "backward": 0.15}, "verdict": "compute-bound",
               "steps": 10, "advice": []}
    path = make_run(tmp_path, "profile-1", train=[train_record(s, 3.0) for s in range(1, 17)], config=cfg,
                    profile=profile)
    assert collect([path]).summaries[0].status == ("profile (`kiln profile`, not a training run): 10 steps timed "
                                                   "of 16 run, 0.25 s/step, compute-bound")
    assert main(["report", str(path), "--out", str(tmp_path / "r.html")]) == 0
    assert "profile-1: profile (`kiln profile`, not a training run)" in capsys.readouterr().out


def test_task_scores_are_charted_together(tmp_path):
    """train.eval_tasks' task_<name>_* keys: acc, acc_norm and acc ± stderr of each task on one chart, bits per
    byte on another; none gets a chart of its own."""
    evals = [{"kind": "eval", "step": s, "val_loss": 2.0, "task_hella_swag_acc": a, "task_hella_swag_acc_norm": a + 0.1,
              "task_hella_swag_acc_stderr": 0.05, "task_wiki_bpb": 3.0 - a} for s, a in ((50, 0.25), (100, 0.5))]
    run = read_run(make_run(tmp_path, train=[train_record(s, 1.0) for s in (50, 100)], eval=evals))
    charts = build_charts([run], [None])
    accuracy = {line.label: line.y for line in _chart(charts, "task_accuracy").lines}
    assert accuracy == {"hella_swag acc": [0.25, 0.5], "hella_swag acc_norm": [0.35, 0.6],
                        "hella_swag acc + stderr": pytest.approx([0.3, 0.55]),
                        "hella_swag acc − stderr": pytest.approx([0.2, 0.45])}
    assert [(line.label, line.x, line.y) for line in _chart(charts, "task_bpb").lines] == [
        ("wiki", [50, 100], [2.75, 2.5])]
    assert not [c.key for c in charts if c.key.startswith("eval_task")]


def test_counted_tokens_are_charted_only_when_they_vary(tmp_path):
    """loss_tokens: a chat run's counted tokens change with each batch (a chart); a text run counts every target,
    the same number each step (no chart)."""
    def run(name, counts):
        records = [train_record(s, 1.0) | {"loss_tokens": n} for s, n in zip((10, 20, 30), counts)]
        return read_run(make_run(tmp_path / name, train=records))
    chat, text = build_charts([run("chat", (300, 412, 288))], [None]), build_charts([run("text", (2048,) * 3)], [None])
    assert [(line.x, line.y) for line in _chart(chat, "loss_tokens").lines] == [([10, 20, 30], [300, 412, 288])]
    assert "loss_tokens" not in [c.key for c in text] and not [c.key for c in text if c.key.endswith("loss_tokens")]
