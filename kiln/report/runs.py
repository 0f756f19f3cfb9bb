"""A run directory read back: its metrics records by kind, its resolved config, its profile, and a summary.

Reads only what is there, so a run that is still training (a last line half written), one stopped early, one
resumed (records after a resume point were moved to metrics.stale-N.jsonl and are not read) and one without
evaluation all load. A directory without metrics.jsonl and config.toml is not a run: ValueError, one line.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError

PROFILE_SUMMARY = Path("profile") / "summary.json"  # written by a profiled run: step_s, breakdown, verdict, advice


@dataclass
class Run:
    path: Path
    name: str  # how the page calls it: the directory's name, made unique among the runs of one report
    train: list[dict] = field(default_factory=list)  # kind "train" records, in file order
    eval: list[dict] = field(default_factory=list)
    numerics: list[dict] = field(default_factory=list)
    other: list[dict] = field(default_factory=list)  # records of a kind this reader does not know
    config: dict[str, dict] = field(default_factory=dict)  # config.toml's tables, as written
    profile: dict | None = None
    unreadable_lines: int = 0  # lines that are not JSON (the last one of a run being written, or damage)
    started: float | None = None  # unix time the run (its first attempt) started, when known
    last_write: float | None = None  # unix time of the newest metrics record

    @property
    def unit(self) -> str:
        """"tokens" for language models, "samples" for fit() on other objectives."""
        return "samples" if any("samples_per_s" in r or "samples_seen" in r for r in self.train) else "tokens"

    @property
    def is_lm(self) -> bool:
        """A language-model run of kiln's own transformer (`kiln train`): its config's model and data are real."""
        return self.unit == "tokens" and (self.path / "tokenizer.json").is_file()

    def last_step(self) -> int:
        steps = [r["step"] for r in self.train + self.eval + self.numerics if isinstance(r.get("step"), int)]
        return max(steps, default=0)


def number(value) -> float | None:
    """A metrics value as a float: NaN/Inf are written as strings ("nan", "inf"); None and non-numbers -> None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def read_run(path: str | Path, name: str | None = None) -> Run:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise KilnError(f"{path} is not a kiln run directory (it is a file)", key=str(path),
                        fix="give the run's directory (the one holding metrics.jsonl)")
    metrics, config = path / "metrics.jsonl", path / "config.toml"
    if not metrics.is_file() and not config.is_file():
        raise KilnError(f"{path} is not a kiln run directory: it has neither metrics.jsonl nor config.toml "
                        f"(`kiln train --run-dir DIR` and fit() write both)", key=str(path),
                        fix="give a directory `kiln train --run-dir DIR` or fit() wrote")
    run = Run(path=path, name=name or path.resolve().name)
    if config.is_file():
        try:
            run.config = tomllib.loads(config.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise KilnError(f"{config} is not valid TOML: {e}", key=str(config),
                            fix="repair the file, or remove it to report the metrics alone") from None
    if metrics.is_file():
        for line in metrics.read_text(errors="replace").splitlines():  # damaged bytes: unreadable lines
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                run.unreadable_lines += 1
                continue
            if not isinstance(record, dict):
                run.unreadable_lines += 1
                continue
            getattr(run, record.get("kind") if record.get("kind") in ("train", "eval", "numerics") else "other"
                    ).append(record)
        run.last_write = metrics.stat().st_mtime
    profile = path / PROFILE_SUMMARY
    if profile.is_file():
        try:
            run.profile = json.loads(profile.read_text())
        except json.JSONDecodeError as e:
            raise KilnError(f"{profile} is not valid JSON: {e}", key=str(profile),
                            fix="run `kiln profile` again, or remove the file") from None
    run.started = _started(path)
    return run


def _started(path: Path) -> float | None:
    """When the run first started: TensorBoard names each events file by its creation time (one per attempt);
    without TensorBoard, when the run lock was last written (the start of the latest attempt)."""
    times = []
    for f in (path / "tensorboard").glob("events.out.tfevents.*"):
        m = re.match(r"events\.out\.tfevents\.(\d+)\.", f.name)
        if m:
            times.append(int(m.group(1)))
    if times:
        return float(min(times))
    lock = path / ".lock"
    return lock.stat().st_mtime if lock.is_file() else None


def training_pid(path: Path) -> int | None:
    """The PID of a process training in the run directory now, or None. Read from RUN_DIR/.lock (the run lock
    holds its PID) and checked to be alive; the lock itself is never taken, so a starting run is never refused."""
    lock = path / ".lock"
    try:
        pid = int(lock.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, someone else's
        return pid
    if pid == os.getpid():
        return None
    return pid


def flat_config(config: dict[str, dict]) -> dict[str, object]:
    """{"optim.lr": 0.002, ...} from config.toml's tables."""
    flat = {}
    for section, table in config.items():
        if isinstance(table, dict):
            for key, value in table.items():
                flat[f"{section}.{key}"] = value
        else:
            flat[section] = table
    return flat


MISSING = object()  # a key one run's config does not have (another kiln version)


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys whose values are not the same in every run (a key missing from some runs differs), in the
    order of the first run's config."""
    flats = [flat_config(r.config) for r in runs]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    return [k for k in keys if len({repr(f.get(k, MISSING)) for f in flats}) > 1] if len(runs) > 1 else []


@dataclass
class Summary:
    status: str
    steps: int
    max_steps: int | None
    seen: float | None  # tokens (or samples) seen at the last train record
    train_time_s: float | None  # the sum of logged step times: time in training steps, evaluation left out
    wall_s: float | None  # first start to the last metrics record (includes evaluation, saving, and any pause)
    final_loss: float | None
    final_val: float | None
    final_val_step: int | None
    best_val: float | None
    best_val_step: int | None
    final_val_ppl: float | None
    unigram: float | None
    mean_rate: float | None  # tokens (samples) per second over the second half of the train records
    mean_mfu: float | None
    mean_hfu: float | None
    mfu_peak_flops: float | None  # the peak the last record's MFU divided by (a CPU's is measured)
    peak_mem_bytes: float | None
    skipped: int
    events: dict[str, int]


def summarize(run: Run, unigram: float | None = None) -> Summary:
    train = run.train
    steps = max((r["step"] for r in train), default=0)
    max_steps = run.config.get("train", {}).get("max_steps") or None
    evals = [(r["step"], number(r.get("val_loss"))) for r in run.eval]
    evals = [(s, v) for s, v in evals if v is not None and math.isfinite(v)]
    final_val = evals[-1] if evals else (None, None)
    best_val = min(evals, key=lambda sv: sv[1]) if evals else (None, None)
    train_time, prev = 0.0, 0
    for r in train:
        dt = number(r.get("step_time_s"))
        if dt is not None:
            train_time += dt * max(r["step"] - prev, 0)
        prev = r["step"]
    half = train[len(train) // 2:]

    def mean(key):
        values = [number(r.get(key)) for r in half]
        values = [v for v in values if v is not None and math.isfinite(v)]
        return sum(values) / len(values) if values else None

    pid = training_pid(run.path)
    last = run.last_step()
    stops = [e for e in run.numerics if e.get("event") == "stop"]
    if pid is not None:
        status = f"training now (process {pid}), at step {last:,}" + (f" of {max_steps:,}" if max_steps else "")
    elif stops:
        status = f"stopped at step {last:,}: {stops[-1].get('reason', 'numerics')}"
    elif max_steps and steps >= max_steps:
        status = f"finished: {steps:,} steps"
    elif run.profile is not None:  # `kiln profile` runs one step fewer than its config's max_steps, by design
        status = profile_status(run.profile, steps)
    elif not train:
        status = "no train records yet"
    else:
        status = f"stopped at step {last:,}" + (f" of {max_steps:,}" if max_steps else "") + (
            " (early stop, a signal, train.max_time or a crash)")
    events: dict[str, int] = {}
    for e in run.numerics:
        events[e.get("event", "?")] = events.get(e.get("event", "?"), 0) + 1
    peaks = [number(r.get("peak_mem_bytes")) for r in train]
    peaks = [p for p in peaks if p is not None]
    ppl = number(run.eval[-1].get("val_ppl")) if run.eval else None
    return Summary(
        status=status, steps=steps, max_steps=max_steps,
        seen=number(train[-1].get(f"{run.unit}_seen")) if train else None,
        train_time_s=train_time if train else None,
        wall_s=(run.last_write - run.started) if run.started and run.last_write else None,
        final_loss=number(train[-1].get("loss")) if train else None,
        final_val=final_val[1], final_val_step=final_val[0], best_val=best_val[1], best_val_step=best_val[0],
        final_val_ppl=ppl, unigram=unigram, mean_rate=mean(f"{run.unit}_per_s"), mean_mfu=mean("mfu"),
        mean_hfu=mean("hfu"), mfu_peak_flops=number(train[-1].get("mfu_peak_flops")) if train else None,
        peak_mem_bytes=max(peaks) if peaks else None,
        skipped=int(number(train[-1].get("skipped_steps")) or 0) if train else 0, events=events)


def profile_status(profile: dict, steps: int) -> str:
    """What a directory written by `kiln profile` is: a profile, not a run that stopped."""
    step_s, verdict = number(profile.get("step_s")), profile.get("verdict")
    timed = profile.get("steps")
    what = f"{timed} steps timed of {steps:,} run" if isinstance(timed, int) else f"{steps:,} steps run"
    return (f"profile (`kiln profile`, not a training run): {what}" + (f", {step_s:.3g} s/step" if step_s else "")
            + (f", {verdict}" if verdict else ""))


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))
