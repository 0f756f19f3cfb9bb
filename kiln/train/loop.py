"""The training loop over a TrainState: schedule, steps, sync points, logging, evaluation, checkpoints.

    trainer = Trainer(state, run_dir, console, **sections, record=..., evaluate=...)
    trainer.advance(until)     train up to a step; returns why the run ended, or None
    trainer.run()              advance to the end, save the final checkpoint, close: the TrainResult
    trainer.close()            closes the monitor, the logger and the loader (run() does it)

The loop composes the parts of a run: the time budget and train.max_time (kiln.train.budget), the logged window
and its MFU (kiln.train.metrics), the evaluations' gap and early stopping (kiln.train.gap), when to save
(kiln.train.saves). It receives its config sections (train, schedule, optim, log, checkpoint, numerics, faults,
parallel: kiln.run.builder.trainer_sections), never the whole Config, and hands each part its own. What it decides
while running (a budgeted run's train.max_steps) goes to `record.decide`, the run builder's record of the run,
whose `record.toml()` is saved as config.toml and in every checkpoint.

`kiln train` (kiln.run.lm) and `fit()` (kiln.run.fit) both run this loop, built by kiln.run.builder; a benchmark
advances it in blocks that alternate with another loop's. Time outside `advance` is not counted in throughput.
"""
from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

from kiln.errors import KilnError
from kiln.parallel import layout_event
from kiln.parallel.stragglers import StragglerWatch
from kiln.parallel.watchdog import collective_errors
from kiln.numerics.monitor import Handles, Numerics
from kiln.numerics.outcome import LossWatch
from kiln.train.callbacks import Callbacks
from kiln.train.budget import TimeBudget
from kiln.train.checkpoint import Checkpointer
from kiln.train.gap import GapMonitor
from kiln.train.logging import MetricsLogger
from kiln.train.metrics import StepMetrics
from kiln.train.muon import group_lrs
from kiln.train.saves import Saves
from kiln.train.schedule import lr_factor
from kiln.train.settings import KERNELS, TrainConfig  # noqa: F401  (train.kernels' values; the section, re-exported)
from kiln.train.state import TrainState
from kiln.train.target import TargetStop
from kiln.train.step import StepResult, micro_batch_losses, train_step

@dataclass
class TrainResult:
    """What a finished (or stopped) run returns."""

    step: int
    val_loss: float | None  # last evaluation; None when the run stopped before one
    stop_reason: str  # max_steps | early stop: ... | numerics: ...
    checkpoint: Path | None
    state: TrainState
    cfg: object = None  # the configuration trained, as recorded (resolved; a budgeted run's max_steps filled in):
    # set by the run builder, which holds the Config (the loop never does)
    signal: int | None = None  # the stop signal that ended the run (exit status 128 + signal)
    unigram_loss: float | None = None  # language models on byte/BPE data: the loss of predicting token frequencies
    sample: str | None = None  # language models: text generated after training
    failure: str | None = None  # the loss ended non-finite (kiln.numerics.outcome): `kiln train` exits non-zero
    val_metrics: dict | None = None  # fit(metrics=...): the last evaluation's val_<name> values

    def __repr__(self) -> str:  # short: the state holds the model and the optimizer
        shown = [f"step={self.step}", f"stop_reason={self.stop_reason!r}"]
        shown += [f"{k}={v:.4g}" for k, v in ({"val_loss": self.val_loss} | (self.val_metrics or {})).items()
                  if v is not None]
        return f"TrainResult({', '.join(shown)}, checkpoint={str(self.checkpoint) if self.checkpoint else None!r})"


class Trainer:
    """The loop of one run. With train.max_steps=0 the run is sized by train.time_budget (kiln.train.budget); the
    max_steps decided is printed and saved in the run's config, so `--train.max_steps=N` repeats the run bit for
    bit."""

    def __init__(self, state: TrainState, run_dir: Path, console: Console | None = None, *, train, schedule, optim,
                 log, checkpoint, numerics, faults, parallel=None, record=None,
                 evaluate: Callable[[torch.nn.Module], float] | None = None, flops_per_unit: float | None = None,
                 peak_flops: float | None = None, vocab_size: int | None = None,
                 hardware_flops_per_unit: float | None = None, peak_lr: float | None = None, callbacks=()):
        """train ... parallel: the sections the loop reads; record: the builder's RunRecord (decide(key, value),
        toml(): config.toml's text; None: none written); evaluate(model) -> mean validation loss; flops_per_unit
        and peak_flops give MFU (per token or sample), and with
        hardware_flops_per_unit (the same plus what recomputation runs again) HFU; vocab_size arms the data faults
        of language models; peak_lr replaces optim.lr (optim.lr_scaling, kiln.train.optim.scaled_lr); callbacks:
        kiln.train.callbacks (evaluate may then return a dict: val_loss and more keys for the eval record)."""
        self.state, self.run_dir = state, Path(run_dir)
        self.train, self.schedule, self.optim, self.log = train, schedule, optim, log
        self.con = console or Console(soft_wrap=True)
        self._evaluate_fn, self.record = evaluate, record
        self.peak_lr = peak_lr or optim.lr  # optim.lr, or what optim.lr_scaling makes of it (scaled_lr)
        self.checkpointer = Checkpointer(checkpoint, self.run_dir, warn=self._print)
        self.resumed_at: int | None = None  # the step a resume started from: later metrics records are stale
        # The parts of the run, each given its own config section: the clock, the saves (and the stop signal), the
        # logged window, the evaluations' comparisons.
        self.budget = TimeBudget(train, schedule, first_step=state.step)
        self.saves = Saves(checkpoint, self.checkpointer, warn=self._print)
        self.unit = getattr(state.objective, "unit", "samples")
        self.metrics = StepMetrics(self.unit, state.device, flops_per_unit=flops_per_unit, peak_flops=peak_flops,
                                   hardware_flops_per_unit=hardware_flops_per_unit, optim=optim)
        self.gap = GapMonitor(train)
        self.target = TargetStop(train)  # train.stop_at_val_loss
        loader = state.loader
        self.numerics = Numerics(numerics, faults, Handles(
            model=state.model, losses=lambda model, batches: micro_batch_losses(model, batches, state.objective,
                                                                                state.precision),  # this rank's
            scaler=state.scaler, masters=state.masters, device=state.device, step=lambda: state.step,
            loader_position=lambda: loader.batches_served, skip_batches=loader.skip,
            snapshot=state.state_dict, restore=state.load_state_dict, load_checkpoint=self._load_latest,
            vocab_size=vocab_size, compiled=hasattr(state.step_model, "_orig_mod"), world=state.world), self.run_dir,
            log.interval)
        state.numerics = self.numerics
        self.logger: MetricsLogger | None = None
        self.stop_reason: str | None = None  # set when the run has ended
        self.val_loss: float | None = None
        self.losses = LossWatch()  # whether the logged losses ended finite (TrainResult.failure)
        self.callbacks, self.requested_stop, self.val_metrics = Callbacks(callbacks), None, None
        self.events: list[dict] = []  # kind "event" records written when the logger opens (a restart)
        self.stragglers = StragglerWatch(state.world, parallel, state.model) if parallel is not None else None

    def _print(self, message: str) -> None:
        self.con.print(message, highlight=False)

    @property
    def signal(self) -> int | None:
        """The stop signal received (SIGTERM, SIGINT, SIGUSR1), if any: the run ends at a step boundary."""
        return self.saves.signal

    def request_stop(self, reason: str) -> None:
        """End the run at the end of this step (a callback's way out); `reason` becomes the stop reason."""
        self.requested_stop = self.requested_stop or str(reason)

    # -- start, resume, save -------------------------------------------------------------------------------

    def resume(self) -> Path:
        """Load the latest checkpoint of the run directory into the state (numerics monitor included)."""
        if self.state.world.sharded:
            latest = self.checkpointer.latest()
            if latest is not None:  # the base a LoRA checkpoint refers to, before any weights are loaded
                self.state.check_base(torch.load(latest / "state.pt", map_location="cpu", weights_only=True), latest)
            path = self.checkpointer.load_sharded(self.state)
            self.resumed_at = self.state.step  # the records an interrupted attempt wrote past it move aside
            return path
        state = self.checkpointer.load(map_location=self.state.device)
        path = self.checkpointer.loaded
        if (path / "sharded").is_dir():
            raise KilnError(f"{path} was written under parallel.strategy by several ranks; resume it with "
                            f"--parallel.strategy=ddp or fsdp (one process works without torchrun)",
                            key="parallel.strategy", fix="resume it with --parallel.strategy=ddp or fsdp")
        self.state.check_base(state, path)
        self.state.load_state_dict(state)
        self.resumed_at = self.state.step
        return path

    def _load_latest(self):
        try:
            state = self.checkpointer.load(map_location=self.state.device)
        except FileNotFoundError:
            return None
        return state, self.checkpointer.loaded

    def _start(self) -> None:
        if self.logger is None:
            main = self.state.world.main  # under data parallelism rank 0 writes the run directory, alone
            if main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self.checkpointer.clean_leftovers()
            self._write_config()
            self.logger = MetricsLogger(self.log, self.run_dir, self.train.max_steps or None,
                                        self.state.step, console=self.con, enabled=main,
                                        resumed_at=self.resumed_at)
            # every run, one process too ({"dp": 1}), says its layout at the step it starts from (a collective)
            self.events.insert(0, {"step": self.state.step} | layout_event(self.state.world, self.state.model))
            for record in self.events:
                self.logger.log(record, kind="event")
            self.numerics.start()

    def _write_config(self) -> None:
        if self.record is not None and self.state.world.main:
            (self.run_dir / "config.toml").write_text(self.record.toml())

    def save_checkpoint(self) -> Path | None:
        text = self.record.toml() if self.record is not None else ""
        path = self.saves.save(self.state, text, self.run_dir)
        if path is not None:
            self.callbacks.checkpoint(self, path)
        return path

    # -- the loop -----------------------------------------------------------------------------------------

    @property
    def max_steps(self) -> int:
        return self.train.max_steps or 1 << 62  # unknown until a budgeted run has measured its steps

    def advance(self, until: int) -> str | None:
        """Train up to step `until` (never past train.max_steps); returns why the run ended, or None."""
        self._start()
        state, numerics, logger, metrics, budget = self.state, self.numerics, self.logger, self.metrics, self.budget
        metrics.restart()
        while self.stop_reason is None and state.step < min(until, self.max_steps):
            tc = self.train
            if budget.budgeted:
                budget.measure(state.step, state.device)
            if self.stragglers is not None:
                self.stragglers.step_began()
            lr = self.peak_lr * lr_factor(self.schedule, state.step, budget.horizon) * numerics.lr_factor(state.step)
            for group in state.optimizer.param_groups:  # lr_ratio: a group's own peak over optim.lr (muon)
                group["lr"] = lr * group.get("lr_ratio", 1.0)
            batches = numerics.begin_step(state.step + 1, [state.loader.next() for _ in range(tc.grad_accum_steps)])
            units = sum(state.objective.size(b) for b in batches)
            began = time.perf_counter()
            result = train_step(state.step_model, batches, state.objective, state.optimizer, state.precision,
                                state.scaler, self.optim, state.masters, numerics.guard,
                                state.world if state.world.sharded else None, state.adaptive_clip)
            metrics.step_done(units, time.perf_counter() - began, result.skipped)
            if self.stragglers is not None:
                self.stragglers.step_ended(began)
            state.step += 1
            state.tokens_seen += units * state.world.dp_size  # global: every data-parallel copy saw as many
            logger.advance(state.step)
            if budget.budgeted and state.step == budget.sized_at:
                self._size_run()
            tc = self.train
            last = state.step == tc.max_steps
            log_due = state.step % self.log.interval == 0 or last
            eval_due = (tc.eval_interval and state.step % tc.eval_interval == 0) or last
            # The step boundary: the only place a signal or the clock ends the run (the final save follows).
            stop_now, save_due = self._host_decisions(sync=log_due)
            checkpoint_due = self.saves.due(state.step, last, stop_now, save_due)
            verdict = None
            if log_due or eval_due or checkpoint_due:
                # A sync point: numerics reads back the steps since the last one (spikes, NaN/Inf, loss scale)
                # and, where needed, traces a non-finite step, rolls back to the last good state, or stops.
                verdict = numerics.review(logger)
                if verdict.rolled_back:
                    metrics.restart()
                    continue
            record = self._log(result, lr) if log_due else {"step": state.step, "lr": lr}
            self.callbacks.step_end(self, record)
            if verdict is not None and verdict.stop:
                self.stop_reason = verdict.stop
                break
            if eval_due:
                self._run_evaluation(last)
            if checkpoint_due:
                self.save_checkpoint()
                metrics.restart_clock()
            if stop_now and self.stop_reason is None:
                self.stop_reason = stop_now
            if self.requested_stop and self.stop_reason is None:
                self.stop_reason = self.requested_stop
        if self.stop_reason is None and state.step >= self.max_steps:
            self.stop_reason = "max_steps"
        return self.stop_reason

    def _size_run(self) -> None:
        """Budgeted run, at the end of its measured steps: fix max_steps from the measured step time."""
        steps, message = self.budget.size(self.state)
        self.train = replace(self.train, max_steps=steps)
        if self.record is not None:  # the builder records it in the run's config (config.toml, checkpoints)
            self.record.decide("train.max_steps", steps)
        self.logger.set_total(steps)
        self._write_config()
        self.logger.print(message, highlight=False)

    def _log(self, result: StepResult, lr: float) -> dict:
        """The train record of this log interval, logged; returns its known values (for the callbacks)."""
        record = self.metrics.record(result, lr, self.state) | group_lrs(self.state.optimizer)  # muon: muon_lr
        self.gap.observe(record["loss"])  # the evaluation's gap compares against these
        self.losses.observe(self.state.step, record["loss"])
        self.logger.log(record, kind="train")
        if self.stragglers is not None:  # every rank's compute time per step, gathered: a slow rank is named
            self.stragglers.observe(self.state.step, self.logger, self.con)
        self.metrics.restart()
        return {k: v for k, v in record.items() if v is not None}

    def _run_evaluation(self, last: bool) -> None:
        if self._evaluate_fn is None:
            return
        state = self.state
        self.val_loss = self._evaluate_fn(state.model)
        if isinstance(self.val_loss, dict):  # fit(metrics=...) or a data mixture: {"val_loss": ..., "val_<name>": ...}
            self.val_metrics = {k: v for k, v in self.val_loss.items() if k != "val_loss"}
            self.val_loss = self.val_loss["val_loss"]
        record = {"step": state.step, **(self.val_metrics or {}), "val_loss": self.val_loss}
        warning = self.gap.compare(record)  # train_loss, gap
        if warning is not None:
            self._print(warning)
            self.logger.log({"step": state.step, "event": "overfitting", "gap": record["gap"], "message": warning},
                            kind="numerics")
        if self.unit == "tokens":
            record["val_ppl"] = math.exp(min(self.val_loss, 50))
        self.logger.log(record, kind="eval")
        self.callbacks.eval(self, record)
        stop = self.gap.early_stop(state, self.val_loss, last)
        reached = self.target.check(state.step, self.val_loss)
        if reached is not None:
            stop, event = reached
            self.logger.log(event, kind="event")
        self.metrics.restart_clock()  # evaluation time is not training throughput
        if stop is not None:
            self.stop_reason = stop

    def _host_decisions(self, sync: bool) -> tuple[str | None, bool]:
        """(why to stop after this step, whether to save by the wall clock), from what only the host knows: a stop
        signal, train.max_time, checkpoint.every_minutes. Under data parallelism every rank must decide the same,
        so the three are combined in one all-reduce, made only at sync points (log intervals): no other step
        waits on the host for it."""
        world = self.state.world
        if world.size > 1 and not sync:
            return None, False
        now = time.monotonic()
        flags = [float(self.saves.signal or 0), float(self.budget.out_of_time(now)), float(self.saves.clock_due(now))]
        if world.size > 1:
            reduced = torch.tensor(flags, device=self.state.device)
            world.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
            flags = reduced.tolist()
        signalled, out_of_time, save_due = flags
        if signalled:
            self.saves.signal = self.saves.signal or int(signalled)
            return f"signal {signal.Signals(self.saves.signal).name}", False
        if out_of_time:
            return f"max_time: train.max_time={self.train.max_time} reached", False
        return None, bool(save_due)

    def run(self) -> TrainResult:
        """Train to the end (or a stop signal), save the final checkpoint, close everything."""
        try:
            with self.saves.stop_signals(), collective_errors(self.state.world, lambda: self.state.step):
                stop_reason = self.advance(self.max_steps)
                path = self.save_checkpoint()
                self.checkpointer.wait()  # checkpoint.async_save: the last save is on disk before the run ends
        finally:
            self.close()
        return TrainResult(self.state.step, self.val_loss, stop_reason, path, self.state, None,
                           signal=self.signal, failure=self.losses.failure(self.val_loss, stop_reason),
                           val_metrics=self.val_metrics)

    def close(self) -> None:
        if not self.state.world.broken:  # a save in flight finishes (after a failed collective it never would)
            with contextlib.suppress(Exception):
                self.checkpointer.wait()
        self.numerics.close()
        if self.logger is not None:
            self.logger.close()
        if self.state.loader is not None:
            self.state.loader.close()
