"""The training loop over a TrainState: schedule, steps, sync points, logging, evaluation, checkpoints.

    trainer = Trainer(state, cfg, run_dir, console, evaluate=..., config_toml=...)
    trainer.advance(until)     train up to a step; returns why the run ended, or None
    trainer.finish()           final checkpoint; closes the monitor, the logger and the loader

`kiln train` (a language model, kiln.run.lm) and `fit()` (any nn.Module, kiln.run.fit) both run this loop; a
benchmark advances it in blocks that alternate with another loop's, so both see the same machine noise. Time
spent outside `advance` is not counted in the logged throughput.

`cfg` is read for its train, optim, schedule, log, numerics, faults and checkpoint sections only.
"""
from __future__ import annotations

import contextlib
import math
import re
import resource
import shutil
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

from kiln.parallel import layout_event
from kiln.parallel.stragglers import StragglerWatch
from kiln.parallel.watchdog import collective_errors
from kiln.models import moe_metrics
from kiln.numerics.monitor import Handles, Numerics
from kiln.numerics.outcome import LossWatch
from kiln.perf.compile import compile_setting
from kiln.perf.peak import utilisation
from kiln.train.callbacks import Callbacks
from kiln.train.checkpoint import Checkpointer, CheckpointWriteError
from kiln.train.logging import MetricsLogger
from kiln.train.schedule import lr_factor
from kiln.train.state import TrainState
from kiln.train.step import StepResult, micro_batch_losses, train_step

# train.max_steps=0: the step time is measured from step 3 (1-2 warm the allocator up) to step 10 at least, and up to
# 30 while the warm-up lasts. Early steps still run slower than later ones (default job on a 2-core Xeon: 13,600
# tok/s over steps 3-30, 17,000 after), so a run ends 10-20% under its budget rather than over it.
CALIBRATION_STEPS, CALIBRATION_MAX = 10, 30
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
KERNELS = ("torch", "triton", "auto")


@dataclass
class TrainConfig:
    max_steps: int = 0  # optimizer steps (each micro_batch_size·grad_accum_steps sequences); 0: fit time_budget
    time_budget: float = 120.0  # max_steps=0: seconds of training steps, sized by the time of steps 3-10 (to 30)
    micro_batch_size: int = 8  # sequences per forward/backward pass
    grad_accum_steps: int = 1  # micro-batches accumulated into one optimizer step (per rank)
    global_batch_size: int = 0  # sequences per optimizer step over all ranks; sets grad_accum_steps (0: off)
    eval_interval: int = 0  # steps between validation passes (0: only at the end)
    eval_batches: int = 20  # validation micro-batches per evaluation
    early_stop_patience: int = 0  # stop after this many evaluations without a better val loss (0: never)
    early_stop_min_delta: float = 0.0  # a val loss must beat the best by more than this to count as better
    gap_patience: int = 3  # warn once when val − train loss grew this many evals in a row as train fell (0: off)
    deterministic: bool = False  # deterministic kernels (use_deterministic_algorithms; CUDA: cuBLAS, math SDPA)
    seed: int = 1337  # seed of model init and every training RNG stream
    device: str = "auto"  # "auto" (cuda when available, else cpu) | "cpu" | "cuda" | "cuda:N"
    compile: bool | str = "auto"  # torch.compile: true | false | auto (on when its measured compile time and gain pay off over the run; kiln.perf.compile)
    compile_decided_by: str = ""  # written by kiln train: why train.compile resolved as it did (auto's prediction, or the config)
    kernels: str = "torch"  # "torch" | "triton" | "auto" (Triton on CUDA compute capability ≥ 8.0 when importable)
    max_time: str = ""  # wall-clock limit, e.g. 3h50m or 90s: the run saves and ends at the step that crosses it
    sample_tokens: int = 200  # tokens generated after training (0: no sample)
    sample_prompt: str = "def "  # prompt of the sample printed after training

    def validate(self):
        for key in ("micro_batch_size", "grad_accum_steps", "eval_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be ≥ 1, got {getattr(self, key)}")
        for key in ("max_steps", "time_budget", "eval_interval", "early_stop_patience", "sample_tokens",
                    "early_stop_min_delta", "global_batch_size", "gap_patience"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be ≥ 0, got {getattr(self, key)}")
        if self.max_steps == 0 and self.time_budget == 0:
            raise ValueError("train.max_steps=0 sizes the run by train.time_budget, which is 0 too; set "
                             "--train.max_steps=N or --train.time_budget=SECONDS")
        if self.device != "auto" and not self.device.split(":")[0] in ("cpu", "cuda", "mps"):
            raise ValueError(f"train.device={self.device!r}; use auto, cpu, cuda or cuda:N")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                             f"train.micro_batch_size={self.micro_batch_size}")
        parse_duration(self.max_time)
        compile_setting(self.compile)
        if self.kernels not in KERNELS:
            raise ValueError(f"train.kernels={self.kernels!r} is unknown; use one of {KERNELS}")


def parse_duration(text: str) -> float | None:
    """'3h50m', '90s', '1.5h', '45m' -> seconds; '' -> None."""
    if not text:
        return None
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*", text)
    if not parts or not any(parts.groups()):
        raise ValueError(f"train.max_time={text!r}: write a duration such as 3h50m, 45m or 90s")
    h, m, sec = (float(g) if g else 0.0 for g in parts.groups())
    return 3600 * h + 60 * m + sec


def accumulation_for(tc: TrainConfig, world_size: int) -> int:
    """grad_accum_steps per rank: from train.global_batch_size when it is set, else as configured."""
    if not tc.global_batch_size:
        return tc.grad_accum_steps
    per_step = tc.micro_batch_size * world_size
    if tc.global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size={tc.global_batch_size} sequences cannot be shared by {world_size} "
                         f"ranks of train.micro_batch_size={tc.micro_batch_size}: it must be a multiple of "
                         f"{per_step}; change the world size, the micro-batch or the global batch")
    return tc.global_batch_size // per_step


@dataclass
class TrainResult:
    """What a finished (or stopped) run returns."""

    step: int
    val_loss: float | None  # last evaluation; None when the run stopped before one
    stop_reason: str  # max_steps | early stop: ... | numerics: ...
    checkpoint: Path | None
    state: TrainState
    cfg: object = None  # the configuration trained (resolved; a time-budgeted run's max_steps filled in)
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


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """The loop of one run. With train.max_steps=0 the run is sized by train.time_budget: steps 3..10 (up to 30)
    are timed, max_steps is set so that the steps take the budget, printed, and saved in the run's config (so
    `--train.max_steps=N` repeats the run bit for bit). Those first steps are inside the linear warm-up, whose lr
    does not depend on the horizon yet."""

    def __init__(self, state: TrainState, cfg, run_dir: Path, console: Console | None = None, *,
                 evaluate: Callable[[torch.nn.Module], float] | None = None,
                 config_toml: Callable[[object], str] | None = None, flops_per_unit: float | None = None,
                 peak_flops: float | None = None, vocab_size: int | None = None,
                 hardware_flops_per_unit: float | None = None, peak_lr: float | None = None, callbacks=()):
        """evaluate(model) -> mean validation loss; config_toml(cfg) -> the text saved as config.toml (and in
        every checkpoint); flops_per_unit and peak_flops give MFU (per token or sample), and with
        hardware_flops_per_unit (the same plus what recomputation runs again) HFU; vocab_size arms the data faults
        of language models; peak_lr replaces optim.lr (optim.lr_scaling, kiln.train.optim.scaled_lr); callbacks:
        kiln.train.callbacks (evaluate may then return a dict: val_loss and more keys for the eval record)."""
        self.state, self.cfg, self.run_dir = state, cfg, Path(run_dir)
        self.con = console or Console(soft_wrap=True)
        self._evaluate_fn, self._config_toml = evaluate, config_toml
        self.flops_per_unit, self.peak = flops_per_unit, peak_flops
        self.hardware_flops_per_unit = hardware_flops_per_unit or flops_per_unit  # + recomputation (HFU)
        self.peak_lr = peak_lr or cfg.optim.lr  # optim.lr, or what optim.lr_scaling makes of it (scaled_lr)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir,
                                         warn=lambda msg: self.con.print(msg, highlight=False))
        self.resumed_at: int | None = None  # the step a resume started from: later metrics records are stale
        self.signal: int | None = None  # a stop signal received (SIGTERM, SIGINT, SIGUSR1): the run ends at a step
        self._started = self._last_save = time.monotonic()
        self._max_time = parse_duration(cfg.train.max_time)
        self._first_save = True
        tc, sched = cfg.train, cfg.schedule
        self.budgeted = tc.max_steps == 0
        self._first = state.step  # a budgeted run resumed before it was sized measures from where it resumed
        # Until the run is sized its lr must not depend on its length: true of a constant schedule or an explicit
        # horizon, and of any schedule during its linear warm-up.
        horizon_free = bool(sched.total_steps) or sched.name == "constant"
        self._sized_at = self._first + (CALIBRATION_MAX if horizon_free else
                                        min(CALIBRATION_MAX, max(sched.warmup_steps - self._first, 0)))
        if self.budgeted and self._sized_at < self._first + CALIBRATION_STEPS:
            raise ValueError(f"train.max_steps=0 measures steps {self._first + 1}-{self._first + CALIBRATION_STEPS} "
                             f"before it knows the run's length, so the {sched.name} schedule needs "
                             f"schedule.warmup_steps ≥ {self._first + CALIBRATION_STEPS} (got {sched.warmup_steps}); "
                             f"raise it, or set train.max_steps")
        loader = state.loader
        self.numerics = Numerics(cfg.numerics, cfg.faults, Handles(
            model=state.model, losses=lambda model, batches: micro_batch_losses(model, batches, state.objective,
                                                                                state.precision),  # this rank's
            scaler=state.scaler, masters=state.masters, device=state.device, step=lambda: state.step,
            loader_position=lambda: loader.batches_served, skip_batches=loader.skip,
            snapshot=state.state_dict, restore=state.load_state_dict, load_checkpoint=self._load_latest,
            vocab_size=vocab_size, compiled=hasattr(state.step_model, "_orig_mod"), world=state.world), self.run_dir,
            cfg.log.interval)
        state.numerics = self.numerics
        self.logger: MetricsLogger | None = None
        # While a budgeted run is measured, any horizon past the warm-up gives the same lr.
        self.horizon = sched.total_steps or tc.max_steps or 1 << 30
        self._clock: dict[int, float] = {}  # budgeted run: step -> when it ended (the first one, two after it)
        self.skipped_total = torch.zeros((), device=state.device)
        self.window_start, self.window_steps, self.window_units, self.window_busy = time.perf_counter(), 0, 0, 0.0
        self.stop_reason: str | None = None  # set when the run has ended
        self.val_loss: float | None = None
        self.unit = getattr(state.objective, "unit", "samples")
        self._train_losses: list[float] = []  # logged since the last evaluation
        self._gaps: list[tuple[float, float, float]] = []  # (gap, train loss, val loss) per evaluation
        self._gap_warned = False
        self.losses = LossWatch()  # whether the logged losses ended finite (TrainResult.failure)
        self.callbacks, self.requested_stop, self.val_metrics = Callbacks(callbacks), None, None
        self.events: list[dict] = []  # kind "event" records written when the logger opens (a restart)
        self.stragglers = StragglerWatch(state.world, cfg.parallel, state.model) if hasattr(cfg, "parallel") else None

    def request_stop(self, reason: str) -> None:
        """End the run at the end of this step (a callback's way out); `reason` becomes the stop reason."""
        self.requested_stop = self.requested_stop or str(reason)

    # -- start, resume, save -------------------------------------------------------------------------------

    def resume(self) -> Path:
        """Load the latest checkpoint of the run directory into the state (numerics monitor included)."""
        if self.state.world.sharded:
            path = self.checkpointer.load_sharded(self.state)
            self.resumed_at = self.state.step  # the records an interrupted attempt wrote past it move aside
            return path
        state = self.checkpointer.load(map_location=self.state.device)
        path = self.checkpointer.loaded
        if (path / "sharded").is_dir():
            raise ValueError(f"{path} was written under parallel.strategy by several ranks; resume it with "
                             f"--parallel.strategy=ddp or fsdp (one process works without torchrun)")
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
            self.logger = MetricsLogger(self.cfg.log, self.run_dir, self.cfg.train.max_steps or None,
                                        self.state.step, console=self.con, enabled=main,
                                        resumed_at=self.resumed_at)
            if self.state.world.size > 1:  # every run across processes says how it is laid out (a collective)
                self.events.insert(0, layout_event(self.state.world, self.state.model))
            for record in self.events:
                self.logger.log(record, kind="event")
            self.numerics.start()

    def _write_config(self) -> None:
        if self._config_toml is not None and self.state.world.main:
            (self.run_dir / "config.toml").write_text(self._config_toml(self.cfg))

    def save_checkpoint(self) -> Path | None:
        text = self._config_toml(self.cfg) if self._config_toml is not None else ""
        if self._first_save:
            self._first_save = False
            self._check_free_space()
        try:
            if self.state.world.sharded:
                path = self.checkpointer.save_sharded(self.state.step, self.state, text)
            else:
                path = self.checkpointer.save(self.state.step, self.state.state_dict(), text, self.state.model)
        except CheckpointWriteError as e:
            if self.cfg.checkpoint.on_error != "warn":
                raise
            self.con.print(f"checkpoint: {e}; training on (checkpoint.on_error=warn)", highlight=False)
            return None
        self._last_save = time.monotonic()
        self.callbacks.checkpoint(self, path)
        return path

    def _check_free_space(self) -> None:
        """Before the first save: warn when keep_last checkpoints of this size will not fit on the disk."""
        if not self.state.world.main:
            return
        tensors = [*self.state.model.state_dict().values()]
        tensors += [v for s in self.state.optimizer.state.values() if s  # ZeRO-1 keeps None for others' parameters
                    for v in s.values() if isinstance(v, torch.Tensor)]
        size = sum(t.numel() * t.element_size() for t in tensors)
        size += sum(p.numel() * p.element_size() for p in self.state.model.parameters())  # model.safetensors
        target = self.checkpointer.dir if self.checkpointer.dir.exists() else self.run_dir
        target.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(target).free
        need = size * (self.cfg.checkpoint.keep_last + 1)  # the kept ones and the one being written
        if free < need:
            self.con.print(f"checkpoint: {self.cfg.checkpoint.keep_last} checkpoints of ~{size:,} bytes (and the "
                           f"one being written) need {need:,} bytes, {free:,} are free on {target}; lower "
                           f"checkpoint.keep_last or free space", highlight=False)

    # -- the loop -----------------------------------------------------------------------------------------

    @property
    def max_steps(self) -> int:
        return self.cfg.train.max_steps or 1 << 62  # unknown until a budgeted run has measured its steps

    def advance(self, until: int) -> str | None:
        """Train up to step `until` (never past train.max_steps); returns why the run ended, or None."""
        self._start()
        state, numerics, logger = self.state, self.numerics, self.logger
        self.window_start, self.window_steps, self.window_units, self.window_busy = time.perf_counter(), 0, 0, 0.0
        while self.stop_reason is None and state.step < min(until, self.max_steps):
            cfg = self.cfg
            tc = cfg.train
            if self.budgeted:
                self._measure()
            if self.stragglers is not None:
                self.stragglers.step_began()
            lr = self.peak_lr * lr_factor(cfg.schedule, state.step, self.horizon) * numerics.lr_factor(state.step)
            for group in state.optimizer.param_groups:
                group["lr"] = lr
            batches = numerics.begin_step(state.step + 1, [state.loader.next() for _ in range(tc.grad_accum_steps)])
            units = sum(state.objective.size(b) for b in batches)
            began = time.perf_counter()
            result = train_step(state.step_model, batches, state.objective, state.optimizer, state.precision,
                                state.scaler, cfg.optim, state.masters, numerics.guard,
                                state.world if state.world.sharded else None, state.adaptive_clip)
            self.window_busy += time.perf_counter() - began  # CPU: the step's compute, which runs in the call
            if self.stragglers is not None:
                self.stragglers.step_ended(began)
            self.skipped_total += result.skipped
            state.step += 1
            state.tokens_seen += units
            self.window_steps += 1
            self.window_units += units
            logger.advance(state.step)
            if self.budgeted and state.step == self._sized_at:
                self._size_run()
            tc = self.cfg.train
            last = state.step == tc.max_steps
            log_due = state.step % cfg.log.interval == 0 or last
            eval_due = (tc.eval_interval and state.step % tc.eval_interval == 0) or last
            # The step boundary: the only place a signal or the clock ends the run (the final save follows).
            stop_now, save_due = self._host_decisions(sync=log_due)
            checkpoint_due = not last and not stop_now and (
                (cfg.checkpoint.interval and state.step % cfg.checkpoint.interval == 0) or save_due)
            verdict = None
            if log_due or eval_due or checkpoint_due:
                # A sync point: numerics reads back the steps since the last one (spikes, NaN/Inf, loss scale)
                # and, where needed, traces a non-finite step, rolls back to the last good state, or stops.
                verdict = numerics.review(logger)
                if verdict.rolled_back:
                    self.window_start, self.window_steps, self.window_units = time.perf_counter(), 0, 0
                    self.window_busy = 0.0
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
                self.window_start = time.perf_counter()
            if stop_now and self.stop_reason is None:
                self.stop_reason = stop_now
            if self.requested_stop and self.stop_reason is None:
                self.stop_reason = self.requested_stop
        if self.stop_reason is None and state.step >= self.max_steps:
            self.stop_reason = "max_steps"
        return self.stop_reason

    def _measure(self) -> None:
        """Budgeted run, before a step: note when the first step and the two after it ended (device idle)."""
        if self.state.step in (self._first, self._first + 2):
            _synchronize(self.state.device)
            self._clock[self.state.step] = time.perf_counter()

    def _size_run(self) -> None:
        """Budgeted run, at the end of its measured steps: fix max_steps from the measured step time."""
        state, tc = self.state, self.cfg.train
        _synchronize(state.device)
        now = time.perf_counter()
        step_time = (now - self._clock[self._first + 2]) / (state.step - self._first - 2)
        left = tc.time_budget - (now - self._clock[self._first])
        floor = max(state.step, self.cfg.schedule.warmup_steps)  # a shorter run would change the warm-up
        steps = state.world.broadcast_object(max(floor, state.step + int(left / step_time)))  # rank 0 decides
        self.cfg = replace(self.cfg, train=replace(tc, max_steps=steps))
        self.budgeted = False
        self.horizon = self.cfg.schedule.total_steps or steps
        self.logger.set_total(steps)
        self._write_config()
        self.logger.print(f"max_steps {steps:,}: train.time_budget {tc.time_budget:g} s at {step_time:.3f} s/step "
                          f"(steps {self._first + 3}-{state.step} on this {state.device.type}); "
                          f"--train.max_steps={steps} repeats this run exactly", highlight=False)

    def _log(self, result: StepResult, lr: float) -> dict:
        state = self.state
        # The one host-device transfer per log interval.
        threshold = result.clip_threshold if result.clip_threshold is not None else result.grad_norm.new_tensor(
            self.cfg.optim.grad_clip if self.cfg.optim.clip_mode == "norm" else math.nan)
        loss, grad_norm, skipped, scale, threshold = torch.stack([
            result.loss.double(), result.grad_norm.double(), self.skipped_total.double(), state.scaler.scale.double(),
            threshold.double()]).tolist()
        self._train_losses.append(loss)  # the evaluation's gap compares against these
        self.losses.observe(state.step, loss)
        elapsed = time.perf_counter() - self.window_start
        rate = self.window_units * state.world.dp_size / elapsed  # global: every data-parallel copy served as many
        # per device: the global rate shared by the ranks; a measured peak the model beat is raised to its rate
        mfu, hfu, peak = utilisation(self.flops_per_unit or 0.0, self.hardware_flops_per_unit or 0.0,
                                     rate / state.world.size, self.peak)
        record = {
            "step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            # the global-norm threshold in force (norm: optim.grad_clip; adaptive: this step's percentile)
            "clip_threshold": threshold if math.isfinite(threshold) and threshold > 0 else None,
            f"{self.unit}_per_s": rate, "step_time_s": elapsed / self.window_steps,
            f"{self.unit}_seen": state.tokens_seen * state.world.dp_size,
            "peak_mem_bytes": peak_memory_bytes(state.device),
            "mfu": mfu if self.flops_per_unit else None, "hfu": hfu if self.flops_per_unit else None,
            "mfu_peak_flops": peak if self.flops_per_unit else None,  # the peak this record's MFU divides by
            "skipped_steps": int(skipped), "loss_scale": scale if state.scaler.enabled else None,
            # ddp, zero1: seconds per step the gradient all-reduces were in flight (overlapping the backward)
            "comm_s": state.world.comm.take() / self.window_steps if state.world.comm is not None else None,
            "utilisation": self._utilisation(elapsed),
            **moe_metrics(state.model),  # a mixture of experts: moe_aux_loss, moe_load_max, moe_load_min
        }
        self.logger.log(record, kind="train")
        if self.stragglers is not None:  # every rank's compute time per step, gathered: a slow rank is named
            self.stragglers.observe(state.step, self.logger, self.con)
        self.window_start, self.window_steps, self.window_units, self.window_busy = time.perf_counter(), 0, 0, 0.0
        return {k: v for k, v in record.items() if v is not None}

    def _utilisation(self, elapsed: float) -> float | None:
        """How busy the device was over the log interval: on CUDA NVML's busy share (torch.cuda.utilization,
        when pynvml is installed); on a CPU the share of the interval spent inside the steps (forward, backward,
        optimizer), the rest being data, logging and everything else between them."""
        device = self.state.device
        if device.type == "cuda":
            try:
                return torch.cuda.utilization(device) / 100
            except Exception:  # no NVML here: better no number than the host's launch time, which is not busy time
                return None
        return min(1.0, self.window_busy / elapsed) if elapsed > 0 else None

    def _run_evaluation(self, last: bool) -> None:
        if self._evaluate_fn is None:
            return
        state, tc = self.state, self.cfg.train
        self.val_loss = self._evaluate_fn(state.model)
        if isinstance(self.val_loss, dict):  # fit(metrics=...) or a data mixture: {"val_loss": ..., "val_<name>": ...}
            self.val_metrics = {k: v for k, v in self.val_loss.items() if k != "val_loss"}
            self.val_loss = self.val_loss["val_loss"]
        record = {"step": state.step, **(self.val_metrics or {}), "val_loss": self.val_loss}
        if self._train_losses and all(math.isfinite(x) for x in self._train_losses):
            record["train_loss"] = sum(self._train_losses) / len(self._train_losses)  # logged since the last eval
            record["gap"] = self.val_loss - record["train_loss"]
            self._watch_gap(record)
        self._train_losses = []
        if self.unit == "tokens":
            record["val_ppl"] = math.exp(min(self.val_loss, 50))
        self.logger.log(record, kind="eval")
        self.callbacks.eval(self, record)
        if self.val_loss < state.best_val - tc.early_stop_min_delta:
            state.best_val, state.evals_since_best = self.val_loss, 0
        else:
            state.evals_since_best += 1
        self.window_start = time.perf_counter()  # evaluation time is not training throughput
        if tc.early_stop_patience and state.evals_since_best >= tc.early_stop_patience and not last:
            self.stop_reason = f"early stop: no val improvement in {tc.early_stop_patience} evaluations"

    def _watch_gap(self, record: dict) -> None:
        """Warn once when the generalisation gap grew train.gap_patience evaluations in a row while the training
        loss fell: the model is learning its training data rather than the task."""
        k = self.cfg.train.gap_patience
        self._gaps.append((record["gap"], record["train_loss"], record["val_loss"]))
        if not k or self._gap_warned or len(self._gaps) <= k:
            return
        recent = self._gaps[-(k + 1):]
        if all(b[0] > a[0] and b[1] < a[1] for a, b in zip(recent, recent[1:])):
            self._gap_warned = True
            rise = recent[-1][2] - recent[0][2]
            message = (f"overfitting: the gap val − train grew {recent[0][0]:.3f} → {recent[-1][0]:.3f} over {k} "
                       f"evaluations while train loss fell (val loss {rise:+.3f}); consider more data, dropout "
                       f"(model.dropout), or early stopping (train.early_stop_patience)")
            self.con.print(message, highlight=False)
            self.logger.log({"step": self.state.step, "event": "overfitting", "gap": recent[-1][0],
                             "message": message}, kind="numerics")

    def _host_decisions(self, sync: bool) -> tuple[str | None, bool]:
        """(why to stop after this step, whether to save by the wall clock), from what only the host knows: a stop
        signal, train.max_time, checkpoint.every_minutes. Under data parallelism every rank must decide the same,
        so the three are combined in one all-reduce, made only at sync points (log intervals): no other step
        waits on the host for it."""
        world = self.state.world
        if world.size > 1 and not sync:
            return None, False
        now, every = time.monotonic(), self.cfg.checkpoint.every_minutes
        flags = [float(self.signal or 0), float(self._max_time is not None and now - self._started >= self._max_time),
                 float(bool(every) and now - self._last_save >= 60 * every)]
        if world.size > 1:
            reduced = torch.tensor(flags, device=self.state.device)
            world.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
            flags = reduced.tolist()
        signalled, out_of_time, save_due = flags
        if signalled:
            self.signal = self.signal or int(signalled)
            return f"signal {signal.Signals(self.signal).name}", False
        if out_of_time:
            return f"max_time: train.max_time={self.cfg.train.max_time} reached", False
        return None, bool(save_due)

    @contextlib.contextmanager
    def _stop_signals(self):
        """SIGTERM, SIGINT, SIGUSR1 (what schedulers send before a kill) end the run at the next step boundary
        with a checkpoint; a second SIGINT stops at once."""
        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signal = signum
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only; a loop run elsewhere keeps the handlers it has
            return
        previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def run(self) -> TrainResult:
        """Train to the end (or a stop signal), save the final checkpoint, close everything."""
        try:
            with self._stop_signals(), collective_errors(self.state.world, lambda: self.state.step):
                stop_reason = self.advance(self.max_steps)
                path = self.save_checkpoint()
                self.checkpointer.wait()  # checkpoint.async_save: the last save is on disk before the run ends
        finally:
            self.close()
        return TrainResult(self.state.step, self.val_loss, stop_reason, path, self.state, self.cfg,
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
