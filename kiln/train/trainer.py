"""The training loop: one visible train step, evaluation, checkpoints, exact resume."""
from __future__ import annotations

import math
import random
import resource
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from kiln.config import Config, to_toml
from kiln.data import TokenLoader, prepare_data, val_batches
from kiln.memory.levers import apply_memory_config
from kiln.memory.planner import apply_plan
from kiln.models import IGNORE_INDEX, Transformer, build_model
from kiln.numerics.monitor import Numerics
from kiln.numerics.spikes import StepGuard
from kiln.perf import device_peak_flops, flops_per_token, mfu
from kiln.train.checkpoint import Checkpointer, rng_state, set_rng_state
from kiln.train.logging import MetricsLogger
from kiln.train.masked import optimizer_step
from kiln.train.optim import build_optimizer, clip_gradients, param_groups
from kiln.perf.hardware import precision_notice, resolve_mode
from kiln.train.precision import LossScaler, MasterWeights, Precision
from kiln.train.schedule import lr_factor


@dataclass
class TrainConfig:
    max_steps: int = 0  # optimizer steps (each micro_batch_size·grad_accum_steps sequences); 0: fit time_budget
    time_budget: float = 120.0  # max_steps=0: seconds of training steps, sized by the time of steps 3-10 (to 30)
    micro_batch_size: int = 8  # sequences per forward/backward pass
    grad_accum_steps: int = 1  # micro-batches accumulated into one optimizer step
    eval_interval: int = 0  # steps between validation passes (0: only at the end)
    eval_batches: int = 20  # validation micro-batches per evaluation
    early_stop_patience: int = 0  # stop after this many evaluations without a better val loss (0: never)
    early_stop_min_delta: float = 0.0  # a val loss must beat the best by more than this to count as better
    seed: int = 1337  # seed of model init and every training RNG stream
    device: str = "auto"  # "auto" (cuda when available, else cpu) | "cpu" | "cuda" | "cuda:N"
    compile: bool = False  # wrap the model in torch.compile
    sample_tokens: int = 200  # tokens generated after training (0: no sample)
    sample_prompt: str = "def "  # prompt of the sample printed after training

    def validate(self):
        for key in ("micro_batch_size", "grad_accum_steps", "eval_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be ≥ 1, got {getattr(self, key)}")
        for key in ("max_steps", "time_budget", "eval_interval", "early_stop_patience", "sample_tokens",
                    "early_stop_min_delta"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be ≥ 0, got {getattr(self, key)}")
        if self.max_steps == 0 and self.time_budget == 0:
            raise ValueError("train.max_steps=0 sizes the run by train.time_budget, which is 0 too; set "
                             "--train.max_steps=N or --train.time_budget=SECONDS")
        if self.device != "auto" and not self.device.split(":")[0] in ("cpu", "cuda", "mps"):
            raise ValueError(f"train.device={self.device!r}; use auto, cpu, cuda or cuda:N")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device asks for CUDA but torch sees no GPU; use --train.device=cpu")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the global batch's valid tokens (device scalar)
    grad_norm: torch.Tensor  # global gradient norm before clipping
    skipped: torch.Tensor  # 1.0 when the update was not applied (inf/NaN gradient)
    tokens: torch.Tensor  # valid target tokens in the global batch


def accumulate_gradients(model, batches, precision: Precision, scaler: LossScaler):
    """Forward and backward over every micro-batch; returns (mean loss, valid target count) as device tensors.

    Each micro-batch's summed loss is divided by the valid targets of the whole global batch, so k micro-batches
    give the gradient of one batch k× larger even when they hold different numbers of valid tokens.
    """
    n_valid = sum((y != IGNORE_INDEX).sum() for _, y in batches).clamp(min=1)
    total_loss = torch.zeros((), device=n_valid.device, dtype=torch.float64)  # as wide as any precision's loss
    for x, y in batches:
        with precision.autocast():
            loss = model(x, y, reduction="sum") / n_valid
        scaler.scale_loss(loss).backward()
        total_loss += loss.detach()
    return total_loss, n_valid


def train_step(model, batches, optimizer, precision: Precision, scaler: LossScaler, optim_cfg,
               masters: MasterWeights | None = None, guard: StepGuard | None = None) -> StepResult:
    """One optimizer step over a global batch of micro-batches; no host-device sync with any kiln optimizer."""
    total_loss, n_valid = accumulate_gradients(model, batches, precision, scaler)
    if masters is not None:
        masters.grads_to_masters()
    params = masters.masters if masters is not None else [p for p in model.parameters() if p.requires_grad]
    if guard is not None:
        guard.inspect_scaled_grads(params)  # fp16 underflow/overflow per tensor, every fp16_telemetry_interval
    found_inf = scaler.unscale_(params)  # unscale before clipping: the threshold is in true-gradient units
    grad_norm = clip_gradients(params, optim_cfg)
    # A non-finite gradient is never applied, whatever the precision.
    nonfinite = torch.maximum(found_inf, (~torch.isfinite(grad_norm)).float())
    skipped = nonfinite
    if guard is not None:  # records the step on the device; withholds a spike (spike_policy skip|rollback|stop)
        skipped = guard.check(total_loss, grad_norm, nonfinite, scaler.scale)
    optimizer_step(optimizer, skipped)  # applied or withheld on the device: no host sync on any kiln optimizer
    scaler.update(nonfinite)  # only an overflow backs the loss scale off, not a withheld spike
    if masters is not None:
        masters.masters_to_model()
    # Every trainable parameter's gradient is cleared here: plain optimizers hold the model's parameters,
    # MasterWeights already moved them to the masters, and the host optimizer clears the device copies.
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total_loss, grad_norm, skipped, n_valid)


@torch.no_grad()
def evaluate(model, tokens, batch_size: int, seq_len: int, max_batches: int, precision: Precision, device) -> float:
    """Mean validation loss per token."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.int64)
    for x, y in val_batches(tokens, batch_size, seq_len, max_batches):
        x, y = x.to(device), y.to(device)
        with precision.autocast():
            total += model(x, y, reduction="sum").double()
        count += (y != IGNORE_INDEX).sum()
    model.train(was_training)
    return (total / count.clamp(min=1)).item()  # one sync per evaluation


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Run:
    """Everything one training run holds; built from a Config, restorable from a checkpoint."""

    def __init__(self, cfg: Config, run_dir: Path, log=print):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        tc = cfg.train
        self.device = pick_device(tc.device)
        seed_everything(tc.seed)
        self.data = prepare_data(cfg.data, self.run_dir, log=log)
        vocab = self.data.tokenizer.vocab_size
        model_cfg = cfg.model.resolve()
        if model_cfg.vocab_size == 0:
            model_cfg.vocab_size = vocab
        elif model_cfg.vocab_size < vocab:
            raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {vocab}; "
                             f"set --model.vocab_size={vocab} or 0 (take the tokenizer's)")
        if cfg.data.seq_len > model_cfg.max_seq_len:
            raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; "
                             f"lower data.seq_len or raise model.max_seq_len")
        if cfg.plan.memory:  # the planner picks precision, batch split and memory levers for this budget
            cfg = apply_plan(replace(cfg, model=model_cfg), self.device, log)
            tc = cfg.train
        self.cfg = replace(cfg, model=model_cfg)  # the resolved config is what gets saved
        self.precision = Precision(resolve_mode(cfg.precision.mode, self.device), self.device)
        self.model = build_model(model_cfg, self.device).to(self.precision.param_dtype)
        self.memory_levers = apply_memory_config(self.model, cfg, self.device)  # recompute, offload, chunked loss
        self.step_model = torch.compile(self.model) if tc.compile else self.model
        groups = param_groups(self.model, cfg.optim.weight_decay)
        # With optim.offload the host optimizer keeps the fp32 masters itself.
        keep_masters = self.precision.mode == "bf16-master" and cfg.optim.offload == "none"
        self.masters = MasterWeights(self.model) if keep_masters else None
        self.optimizer = build_optimizer(self.masters.groups(groups) if self.masters else groups, cfg.optim)
        self.scaler = LossScaler(cfg.precision, self.device, enabled=self.precision.loss_scaling)
        self.loader = TokenLoader(self.data.train, tc.micro_batch_size, cfg.data.seq_len, cfg.data.seed,
                                  self.device, cfg.data.prefetch)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir)
        self.step = 0
        self.tokens_seen = 0
        self.best_val = math.inf
        self.evals_since_best = 0

    def state_dict(self) -> dict:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "best_val": self.best_val,
            "evals_since_best": self.evals_since_best,
            "data": self.loader.state_dict(),
            "rng": rng_state(),
        }
        if self.masters is not None:
            state["masters"] = self.masters.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self.masters is not None:
            self.masters.load_state_dict(state["masters"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.best_val, self.evals_since_best = state["best_val"], state["evals_since_best"]
        self.loader.load_state_dict(state["data"])
        set_rng_state(state["rng"])

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.state_dict(), to_toml(self.cfg), self.model)

    def evaluate(self) -> float:
        c = self.cfg
        return evaluate(self.model, self.data.val, c.train.micro_batch_size, c.data.seq_len, c.train.eval_batches,
                        self.precision, self.device)

    def sample(self, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 50,
               seed: int = 0) -> str:
        tok = self.data.tokenizer
        return generate_text(self.model, tok, prompt, max_new_tokens, temperature, top_k, seed, self.device,
                             self.precision)


def generate_text(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int, device, precision: Precision | None = None) -> str:
    # Own generator: sampling never disturbs the training RNG streams (exact resume).
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = tokenizer.encode(prompt) or [0]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    ctx = precision.autocast() if precision is not None else torch.autocast(device.type, enabled=False)
    with ctx:
        out = model.generate(idx, max_new_tokens, temperature, top_k, vocab_limit=tokenizer.vocab_size, generator=gen)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())


# train.max_steps=0: the step time is measured from step 3 (1-2 warm the allocator up) to step 10 at least, and up to
# 30 while the warm-up lasts. Early steps still run slower than later ones (default job on a 2-core Xeon: 13,600
# tok/s over steps 3-30, 17,000 after), so a run ends 10-20% under its budget rather than over it.
CALIBRATION_STEPS, CALIBRATION_MAX = 10, 30


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainingLoop:
    """The loop of `kiln train` over a built Run, advanced to a given step at a time.

    `train` runs it to the end in one call; a benchmark runs it in blocks that alternate with another loop's, so
    both see the same machine noise. Time spent outside `advance` is not counted in the logged tokens/s.

    With train.max_steps=0 the run is sized by train.time_budget: steps 3..10 (up to 30) are timed, max_steps is
    set so that the steps take the budget, printed, and saved in the run's config (so `--train.max_steps=N`
    repeats the run bit for bit). Those first steps are inside the linear warm-up, whose lr does not depend on the
    horizon yet.
    """

    def __init__(self, run: Run, console: Console):
        self.run, self.con = run, console
        cfg, tc = run.cfg, run.cfg.train
        self.budgeted = tc.max_steps == 0
        sched = cfg.schedule
        self._first = run.step  # a budgeted run resumed before it was sized measures from where it resumed
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
        self.tokens_per_step = tc.micro_batch_size * tc.grad_accum_steps * cfg.data.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = device_peak_flops(run.device, run.precision.mode)
        self.numerics = Numerics(cfg.numerics, cfg.faults, run, run.run_dir, cfg.log.interval)
        self.logger = MetricsLogger(cfg.log, run.run_dir, tc.max_steps or None, run.step, console=console)
        # While a budgeted run is measured, any horizon past the warm-up gives the same lr.
        self.horizon = sched.total_steps or tc.max_steps or 1 << 30
        self._clock: dict[int, float] = {}  # budgeted run: step -> when it ended (the first one, two after it)
        self.skipped_total = torch.zeros((), device=run.device)
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.stop_reason: str | None = None  # set when the run has ended
        self.val_loss: float | None = None

    def advance(self, until: int) -> str | None:
        """Train up to step `until` (never past train.max_steps); returns why the run ended, or None."""
        run, cfg, tc = self.run, self.run.cfg, self.run.cfg.train
        numerics, logger = self.numerics, self.logger
        self.window_start, self.window_steps = time.perf_counter(), 0
        while self.stop_reason is None and run.step < min(until, self.max_steps):
            if self.budgeted:
                self._measure()
            lr = cfg.optim.lr * lr_factor(cfg.schedule, run.step, self.horizon) * numerics.lr_factor(run.step)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            batches = numerics.begin_step(run.step + 1, [run.loader.next() for _ in range(tc.grad_accum_steps)])
            result = train_step(run.step_model, batches, run.optimizer, run.precision, run.scaler, cfg.optim,
                                run.masters, numerics.guard)
            self.skipped_total += result.skipped
            run.step += 1
            run.tokens_seen += self.tokens_per_step
            self.window_steps += 1
            logger.advance(run.step)
            if self.budgeted and run.step == self._sized_at:
                self._size_run()
            tc = run.cfg.train
            last = run.step == tc.max_steps
            log_due = run.step % cfg.log.interval == 0 or last
            eval_due = (tc.eval_interval and run.step % tc.eval_interval == 0) or last
            checkpoint_due = cfg.checkpoint.interval and run.step % cfg.checkpoint.interval == 0 and not last
            verdict = None
            if log_due or eval_due or checkpoint_due:
                # A sync point: numerics reads back the steps since the last one (spikes, NaN/Inf, loss scale)
                # and, where needed, traces a non-finite step, rolls back to the last good state, or stops.
                verdict = numerics.review(logger)
                if verdict.rolled_back:
                    self.window_start, self.window_steps = time.perf_counter(), 0
                    continue
            if log_due:
                self._log(result, lr)
            if verdict is not None and verdict.stop:
                self.stop_reason = verdict.stop
                break
            if eval_due:
                self._evaluate(last)
            if checkpoint_due:
                run.save_checkpoint()
                self.window_start = time.perf_counter()
        if self.stop_reason is None and run.step >= self.max_steps:
            self.stop_reason = "max_steps"
        return self.stop_reason

    @property
    def max_steps(self) -> int:
        return self.run.cfg.train.max_steps or 1 << 62  # unknown until a budgeted run has measured its steps

    def _measure(self) -> None:
        """Budgeted run, before a step: note when the first step and the two after it ended (device idle)."""
        if self.run.step in (self._first, self._first + 2):
            _synchronize(self.run.device)
            self._clock[self.run.step] = time.perf_counter()

    def _size_run(self) -> None:
        """Budgeted run, at the end of its measured steps: fix max_steps from the measured step time."""
        run, tc = self.run, self.run.cfg.train
        _synchronize(run.device)
        now = time.perf_counter()
        step_time = (now - self._clock[self._first + 2]) / (run.step - self._first - 2)
        left = tc.time_budget - (now - self._clock[self._first])
        floor = max(run.step, run.cfg.schedule.warmup_steps)  # a shorter run would change the warm-up
        steps = max(floor, run.step + int(left / step_time))
        run.cfg = replace(run.cfg, train=replace(tc, max_steps=steps))
        self.budgeted = False
        self.horizon = run.cfg.schedule.total_steps or steps
        self.logger.set_total(steps)
        (run.run_dir / "config.toml").write_text(to_toml(run.cfg))
        self.logger.print(f"max_steps {steps:,}: train.time_budget {tc.time_budget:g} s at {step_time:.3f} s/step "
                          f"(steps {self._first + 3}-{run.step} on this {run.device.type}); --train.max_steps={steps} "
                          f"repeats this run exactly", highlight=False)

    def _log(self, result: StepResult, lr: float) -> None:
        run = self.run
        # The one host-device transfer per log interval.
        loss, grad_norm, skipped, scale = torch.stack([
            result.loss.double(), result.grad_norm.double(), self.skipped_total.double(), run.scaler.scale.double()
        ]).tolist()
        elapsed = time.perf_counter() - self.window_start
        tps = self.window_steps * self.tokens_per_step / elapsed
        self.logger.log({
            "step": run.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tps, "step_time_s": elapsed / self.window_steps, "tokens_seen": run.tokens_seen,
            "peak_mem_bytes": peak_memory_bytes(run.device), "mfu": mfu(self.flops_per_token, tps, self.peak),
            "skipped_steps": int(skipped), "loss_scale": scale if run.scaler.enabled else None,
        })
        self.window_start, self.window_steps = time.perf_counter(), 0

    def _evaluate(self, last: bool) -> None:
        run, tc = self.run, self.run.cfg.train
        self.val_loss = run.evaluate()
        self.logger.log({"step": run.step, "val_loss": self.val_loss, "val_ppl": math.exp(min(self.val_loss, 50))})
        if self.val_loss < run.best_val - tc.early_stop_min_delta:
            run.best_val, run.evals_since_best = self.val_loss, 0
        else:
            run.evals_since_best += 1
        self.window_start = time.perf_counter()  # evaluation time is not training throughput
        if tc.early_stop_patience and run.evals_since_best >= tc.early_stop_patience and not last:
            self.stop_reason = f"early stop: no val improvement in {tc.early_stop_patience} evaluations"

    def close(self) -> None:
        self.numerics.close()
        self.logger.close()
        self.run.loader.close()


def train(cfg: Config, run_dir: Path, resume: bool = False, console=None) -> dict:
    """Train (or resume) a run; returns a summary with the final validation loss."""
    run_dir = Path(run_dir)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir)
    if not resume and checkpointer.latest() is not None:
        raise FileExistsError(f"{run_dir} already holds a run with checkpoints; pass --resume {run_dir} to continue "
                              f"it, or choose another --run-dir")
    con = console or Console(soft_wrap=True)
    run = Run(cfg, run_dir, log=lambda msg: con.print(msg, highlight=False))
    cfg, tc = run.cfg, run.cfg.train
    if resume:
        run.load_state_dict(checkpointer.load(map_location=run.device))
        con.print(f"resumed from {checkpointer.latest()} at step {run.step}", highlight=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))

    n_params = sum(p.numel() for p in dict.fromkeys(run.model.parameters()))
    tokens_per_step = tc.micro_batch_size * tc.grad_accum_steps * cfg.data.seq_len
    con.print(f"model: {cfg.model.preset} ({cfg.model.arch}) {n_params / 1e6:.2f}M parameters | "
              f"device {run.device} | precision {run.precision.mode} | {tokens_per_step:,} tokens/step",
              highlight=False)
    note = precision_notice(cfg.precision.mode, run.device)  # why auto chose it, or that bf16 is emulated here
    if note:
        con.print(note, highlight=False)
    loop = TrainingLoop(run, con)
    try:
        stop_reason = loop.advance(loop.max_steps)
        path = run.save_checkpoint()
    finally:
        loop.close()
    val_loss = loop.val_loss
    shown_val = f"{val_loss:.4f}" if val_loss is not None else "n/a (stopped before an evaluation)"
    con.print(f"done at step {run.step} ({stop_reason}): val_loss {shown_val} | unigram baseline "
              f"{run.data.unigram_loss:.4f} | checkpoint {path}", highlight=False)
    sample = None
    if tc.sample_tokens:
        sample = run.sample(tc.sample_prompt, tc.sample_tokens)
        con.rule("sample")
        con.print(sample, markup=False, highlight=False)
        con.rule()
    return {"step": run.step, "val_loss": val_loss, "unigram_loss": run.data.unigram_loss,
            "checkpoint": str(path), "sample": sample, "stop_reason": stop_reason, "run": run}
