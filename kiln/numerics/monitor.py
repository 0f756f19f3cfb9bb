"""What the training loop calls: a per-step guard on the device, and a review at each sync point on the host.

    numerics = Numerics(cfg.numerics, cfg.faults, handles, run_dir, log_interval)
    loop:  lr *= numerics.lr_factor(step)
           batches = numerics.begin_step(step, batches)          # faults; remember the batches for a replay
           train_step(..., guard=numerics.guard)                  # judge + withhold on the device, no sync
           at a sync point: verdict = numerics.review(logger)     # one transfer: events, trace, rollback, stop

The review is the only place the host decides: tracing a non-finite step, rolling back, stopping.
The monitor sees the training state through `Handles` only: the model, the step's parts, the loader position,
and snapshot/restore of the whole state; never the state object or the config. What it keeps across steps (spike
history, an lr cut in force, rollbacks so far) is its state_dict, saved in every checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from kiln.errors import KilnError
from kiln.parallel import World
from kiln.numerics.config import NumericsConfig
from kiln.numerics.faults import FaultInjector, FaultsConfig
from kiln.numerics.fp16 import Fp16Telemetry, ScaleHistory
from kiln.numerics.spikes import (GN_MAD, GN_MED, GN_Z, GRAD_NORM, LOSS, LOSS_MAD, LOSS_MED, LOSS_Z, OVERFLOW,
                                  SCALE, SPIKE, StepGuard)
from kiln.numerics.stats import json_safe
from kiln.numerics.trace import describe, trace_nonfinite, write_report


@dataclass
class Verdict:
    rolled_back: bool = False  # the run was restored to an earlier step: the loop skips the rest of this iteration
    stop: str | None = None  # a reason to end the run (cleanly, with a checkpoint)


def clone_state(obj):
    """Deep copy of a state dict's tensors (on their own device); other values are shared or copied shallowly."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_state(v) for v in obj)
    return obj


@dataclass
class Handles:
    """The parts of the training state the monitor may touch."""

    model: torch.nn.Module  # the eager model: faults and the trace hook its modules
    losses: Callable  # (model, batches) -> (normalised loss, count) per micro-batch, as the step makes them
    scaler: object  # kiln.train.precision.LossScaler
    masters: object  # kiln.train.precision.MasterWeights or None (fp16 telemetry names the masters)
    device: torch.device
    step: Callable[[], int]  # steps done so far
    loader_position: Callable[[], int]  # batches served so far
    skip_batches: Callable[[int], None]  # advance the loader past batches without reading them
    snapshot: Callable[[], dict]  # the whole training state, to roll back to
    restore: Callable[[dict], None]
    load_checkpoint: Callable[[], tuple[dict, str] | None]  # the latest checkpoint's state and its path, or None
    vocab_size: int | None = None  # token ids of the data (language models): the data faults need it
    compiled: bool = False  # the step runs a torch.compile'd model: faults cannot hook it
    world: World = field(default_factory=World)  # data parallelism: the trace gathers every rank's replay


class Numerics:
    def __init__(self, cfg: NumericsConfig, faults: FaultsConfig, handles: Handles, run_dir: Path,
                 log_interval: int):
        self.cfg, self.h, self.run_dir = cfg, handles, Path(run_dir)
        self.loss_scaling = handles.scaler.enabled
        self.faults = None
        if faults.any:
            if handles.compiled:
                raise KilnError("faults.* hook the eager model; set --train.compile=false to inject faults",
                                key="train.compile", value=True, fix="set --train.compile=false to inject faults")
            self.faults = FaultInjector(faults, handles.model, handles.vocab_size, handles.world.rank)
        telemetry = None
        if self.loss_scaling and cfg.fp16_telemetry_interval:
            names = {id(p): n for n, p in handles.model.named_parameters()}
            if handles.masters is not None:
                names |= {id(m): names[id(p)] for p, m in handles.masters.pairs}
            telemetry = Fp16Telemetry(cfg.fp16_telemetry_interval, names)
        self.scales = ScaleHistory(cfg.fp16_advice_backoffs) if self.loss_scaling else None
        self.guard = None
        if cfg.trace or cfg.spike_policy != "off" or telemetry is not None:
            self.guard = StepGuard(cfg.spike_window, cfg.spike_min_history, cfg.spike_threshold, cfg.spike_rel_floor,
                                   cfg.withholds_spikes, log_interval + 1, handles.device,
                                   detect=cfg.spike_policy != "off", grad_norm_threshold=cfg.spike_grad_norm_threshold)
            self.guard.telemetry = telemetry
        self.reviewed = handles.step()  # steps up to here have been read back and judged
        self._keep_batches = cfg.trace or cfg.spike_policy == "rollback"
        self._batches: dict[int, list] = {}  # step -> its micro-batches, since the last review (trace replay)
        self._positions: dict[int, int] = {}  # step -> loader position after its batches (rollback's data skip)
        self.nonfinite_streak = 0
        self.traced = False
        self.rollbacks = 0
        self._lr_until = -1
        self.snapshot, self.snapshot_history, self.snapshot_step = None, None, None

    def start(self) -> None:
        """Called once the state is built or resumed, before the first step: takes the first memory snapshot."""
        self.reviewed = self.h.step()
        if self.cfg.spike_policy == "rollback" and self.cfg.rollback_from == "memory":
            self._take_snapshot()

    # -- what a checkpoint keeps -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Spike history, the lr cut in force, rollbacks and streaks: resume judges and trains as if never stopped.
        The memory snapshot itself is not saved (a resumed run takes a fresh one at its first step)."""
        state = {"lr_until": self._lr_until, "rollbacks": self.rollbacks, "nonfinite_streak": self.nonfinite_streak,
                 "traced": self.traced, "snapshot_step": self.snapshot_step}
        if self.guard is not None:
            history, pos = self.guard.history_state()
            state["spike_history"], state["spike_history_pos"] = history.cpu(), pos
        if self.scales is not None:
            state["scales"] = self.scales.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self._lr_until, self.rollbacks = state["lr_until"], state["rollbacks"]
        self.nonfinite_streak, self.traced = state["nonfinite_streak"], state["traced"]
        if self.guard is not None and "spike_history" in state:
            self.guard.load_history_state((state["spike_history"].to(self.h.device), state["spike_history_pos"]))
        if self.scales is not None and "scales" in state:
            self.scales.load_state_dict(state["scales"])

    # -- every step (host side, no sync) -----------------------------------------------------------------

    def lr_factor(self, step: int) -> float:
        """Multiplier of the scheduled lr: rollback_lr_factor for rollback_lr_steps after a rollback."""
        return self.cfg.rollback_lr_factor if step < self._lr_until else 1.0

    def begin_step(self, step: int, batches: list) -> list:
        """`step` (1-based) is about to run on `batches`; returns them with any data fault applied."""
        if self.faults is not None:
            self.faults.begin_step(step)
            batches = self.faults.transform(batches)
        if self.guard is not None:
            self.guard.step = step
        if self._keep_batches:
            self._batches[step] = batches
            self._positions[step] = self.h.loader_position()
        return batches

    # -- at sync points ------------------------------------------------------------------------------------

    def review(self, logger) -> Verdict:
        """Read the steps since the last review; log events; trace, roll back or stop when needed."""
        cfg, now = self.cfg, self.h.step()
        if self.guard is None:
            self.reviewed = now
            return Verdict()
        # The one host-device transfer of the review: the step records and the loss scale now in effect.
        flat = torch.cat([self.guard.ring.flatten(), self.h.scaler.scale.double().view(1)]).cpu()
        rows, scale_now = flat[:-1].view(self.guard.ring.shape), flat[-1].item()
        steps = range(self.reviewed + 1, now + 1)
        events, spikes, first_bad, stop = self._scan(steps, rows, logger)
        if self.scales is not None:
            events += self._fp16_events(steps, rows, scale_now, logger)
        for e in sorted(events, key=lambda e: e["step"]):
            logger.log(json_safe(e), kind="numerics")

        if first_bad is not None and cfg.trace and not self.traced and first_bad in self._batches:
            self._trace(first_bad, rows[self.guard.slot(first_bad)].tolist(), logger)
        verdict = Verdict(stop=stop)
        if spikes and stop is None:
            verdict = self._act_on_spikes(spikes, rows, logger)
        if verdict.stop:
            logger.log({"step": now, "event": "stop", "reason": verdict.stop}, kind="numerics")
        if not verdict.rolled_back:
            self.reviewed = now
            clean = not spikes and first_bad is None
            due = self.snapshot_step is None or now - self.snapshot_step >= cfg.snapshot_interval
            if clean and due and cfg.spike_policy == "rollback" and cfg.rollback_from == "memory":
                self._take_snapshot()
        self._batches.clear()
        self._positions.clear()
        return verdict

    def _scan(self, steps, rows, logger):
        """Non-finite steps and spikes among `steps`: (events, spike steps, first non-finite step, stop reason)."""
        cfg = self.cfg
        events, spikes, first_bad, stop = [], [], None, None
        for step in steps:
            r = rows[self.guard.slot(step)].tolist()
            loss_bad = not math.isfinite(r[LOSS])
            grad_bad = bool(r[OVERFLOW]) and not self.loss_scaling  # fp16 overflow is the scaler's business
            if loss_bad or grad_bad:
                self.nonfinite_streak += 1
                first_bad = first_bad or step
                events.append({"step": step, "event": "nonfinite", "loss": r[LOSS], "grad_norm": r[GRAD_NORM],
                               "action": "update not applied"})
                logger.print(f"numerics: step {step} non-finite (loss {r[LOSS]:.4g}, grad_norm "
                             f"{r[GRAD_NORM]:.4g}); update not applied", highlight=False)
            else:
                self.nonfinite_streak = 0
            if cfg.max_nonfinite_steps and self.nonfinite_streak >= cfg.max_nonfinite_steps and stop is None:
                stop = (f"numerics: {self.nonfinite_streak} non-finite steps in a row up to step {step} "
                        f"(numerics.max_nonfinite_steps={cfg.max_nonfinite_steps})")
            if r[SPIKE]:
                spikes.append(step)
                events.append(self._spike_record(step, r))
        return events, spikes, first_bad, stop

    def _fp16_events(self, steps, rows, scale_now: float, logger) -> list[dict]:
        """Loss-scale changes, per-tensor underflow/overflow measurements, and advice when the scale collapses."""
        events = []
        for step in steps:
            r = rows[self.guard.slot(step)].tolist()
            events.append(self.scales.observe(step, r[SCALE], bool(r[OVERFLOW])))
        events.append(self.scales.observe(self.h.step() + 1, scale_now, False))  # the scale the next step gets
        events = [e for e in events if e is not None]
        mean_underflow = None
        telemetry = self.guard.telemetry
        if telemetry is not None and telemetry.pending:
            grads = telemetry.collect({s: rows[self.guard.slot(s)][SCALE].item() for s in steps})
            events += grads
            mean_underflow = grads[-1]["mean_underflow"]
        advice = self.scales.advice(self.h.step(), mean_underflow)
        if advice:
            events.append({"step": self.h.step(), "event": "fp16_advice", "message": advice})
            logger.print(f"numerics: {advice}", highlight=False)
        return events

    def _spike_record(self, step: int, r: list) -> dict:
        policy = self.cfg.spike_policy
        action = {"warn": "update applied", "skip": "update withheld", "rollback": "update withheld; rolling back",
                  "stop": "update withheld; stopping"}[policy]
        stats = {"loss": r[LOSS], "loss_median": r[LOSS_MED], "loss_mad": r[LOSS_MAD], "loss_z": r[LOSS_Z],
                 "grad_norm": r[GRAD_NORM], "grad_norm_median": math.exp(r[GN_MED]) if math.isfinite(r[GN_MED])
                 else r[GN_MED], "log_grad_norm_mad": r[GN_MAD], "grad_norm_z": r[GN_Z],
                 "threshold": self.cfg.spike_threshold, "grad_norm_threshold": self.cfg.spike_grad_norm_threshold}
        return {"step": step, "event": "loss_spike", "policy": policy, "action": action, "stats": stats}

    def _act_on_spikes(self, spikes: list[int], rows, logger) -> Verdict:
        cfg = self.cfg
        for s in spikes:
            r = rows[self.guard.slot(s)].tolist()
            logger.print(f"numerics: spike at step {s}: loss {r[LOSS]:.4f} (median {r[LOSS_MED]:.4f}, z "
                         f"{r[LOSS_Z]:.1f}), grad_norm {r[GRAD_NORM]:.3g} (median {math.exp(r[GN_MED]):.3g}, z "
                         f"{r[GN_Z]:.1f}); policy {cfg.spike_policy}", highlight=False)
        last = spikes[-1]
        if cfg.spike_policy == "stop":
            r = rows[self.guard.slot(spikes[0])].tolist()
            return Verdict(stop=f"numerics: loss spike at step {spikes[0]} (loss {r[LOSS]:.4f} vs median "
                                f"{r[LOSS_MED]:.4f}, grad_norm {r[GRAD_NORM]:.3g} vs median "
                                f"{math.exp(r[GN_MED]):.3g}); "
                                f"numerics.spike_policy=stop withheld the update and ended the run. The checkpoint "
                                f"resumes past the spike's batch (`kiln train --resume RUN_DIR`)")
        if cfg.spike_policy == "rollback":
            if self.rollbacks >= cfg.max_rollbacks:
                return Verdict(stop=f"numerics: spike at step {last} after {self.rollbacks} rollbacks "
                                    f"(numerics.max_rollbacks={cfg.max_rollbacks}); the instability is not one bad "
                                    f"batch: lower --optim.lr or raise --schedule.warmup_steps")
            return Verdict(rolled_back=self._rollback(last, logger))
        return Verdict()

    # -- trace, snapshot, rollback -------------------------------------------------------------------------

    def _trace(self, step: int, r: list, logger) -> None:
        self.traced = True  # one report per run: the first incident is the informative one
        h = self.h
        model, faults = self._replay_model()
        armed = faults.step if faults is not None else None
        if faults is not None:
            faults.step = step
        try:
            # Every rank replays its own micro-batches (a non-finite step is non-finite on all of them: the loss
            # and the gradients are reduced); the first rank whose replay finds the origin is the report.
            # The live model of a multi-process run (not a pipeline's whole copy) may run collectives in its forward
            # and backward (FSDP2, tensor parallelism): the ranks replay in lockstep.
            lockstep = model is h.model and h.world.size > 1
            report = {"reproduced": False} if model is None else trace_nonfinite(
                model, self._batches[step], h.losses, h.scaler, step, {"loss": r[LOSS], "grad_norm": r[GRAD_NORM]},
                None, self._any_rank if lockstep else None)
        finally:
            if faults is not None:
                faults.step = armed
            if faults is not None and faults is not self.faults:
                faults.close()
        if h.world.size > 1:
            reports = h.world.gather_objects(report)
            rank = next((i for i, rep in enumerate(reports) if rep.get("reproduced")), 0)
            report = reports[rank] | {"rank": rank}
        if h.world.main:
            write_report(report, self.run_dir)
        logger.log({"step": step, "event": "nonfinite_trace", "module": report["module"], "op": report["op"],
                    "phase": report["phase"], "report": str(self.run_dir / "nonfinite_report.json")}, kind="numerics")
        logger.print(f"numerics: {describe(report)}\n  report: {self.run_dir / 'nonfinite_report.json'}",
                     highlight=False)

    def _any_rank(self, found: bool) -> bool:
        flag = torch.tensor(float(found))
        self.h.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag)

    def _replay_model(self):
        """The model a step is replayed on, and the faults armed on it. A pipeline's stages cannot be hooked in one
        piece: its weights are gathered into a whole copy on each data-parallel copy's first pipeline rank (None on
        the others, which report nothing), and the configured faults are planted on that copy again, where the
        copy's own rank had them."""
        h = self.h
        whole = getattr(h.model, "whole_model", None)  # kiln.parallel.pipeline.PipelineModel
        if whole is None:
            return h.model, self.faults
        model = whole()  # a collective: every rank gets here, since every rank judged the step the same
        if model is None or self.faults is None:
            return model, None
        cfg, plan = self.faults.cfg, h.world.plan
        ours = cfg.rank >= 0 and plan.coords(cfg.rank)["dp"] == plan.coords(h.world.rank)["dp"]
        return model, FaultInjector(cfg, model, h.vocab_size, cfg.rank if ours else h.world.rank)

    def _take_snapshot(self) -> None:
        # The spike history belongs to the state: after a rollback, steps are judged against the statistics of
        # the restored weights, not of the later ones (early-training grad norms would all look like spikes).
        self.snapshot = clone_state(self.h.snapshot())
        self.snapshot_history = self.guard.history_state() if self.guard is not None else None
        self.snapshot_step = self.h.step()

    def _rollback(self, spike_step: int, logger) -> bool:
        h, cfg = self.h, self.cfg
        if cfg.rollback_from == "memory":
            state, source = (None, "") if self.snapshot is None else (clone_state(self.snapshot), "memory snapshot")
        else:
            loaded = h.load_checkpoint()
            state, source = (None, "") if loaded is None else (loaded[0], f"checkpoint {loaded[1]}")
        if state is None:
            logger.log({"step": spike_step, "event": "rollback_unavailable", "source": cfg.rollback_from},
                       kind="numerics")
            logger.print(f"numerics: no {cfg.rollback_from} state to roll back to; the spike's update was withheld "
                         f"and training goes on", highlight=False)
            return False
        resume_at = self._positions[spike_step]  # loader position just past the spike's batches
        # The restored state carries this monitor's state of back then; the count and the trace are of the run.
        rollbacks, traced = self.rollbacks, self.traced
        h.restore(state)
        self.rollbacks, self.traced = rollbacks + 1, traced
        self.guard.load_history_state(self.snapshot_history if cfg.rollback_from == "memory" else None)
        skipped = resume_at - h.loader_position()
        h.skip_batches(max(skipped, 0))
        if self.scales is not None:
            self.scales.last_scale = None  # the restored scale is not a back-off or a growth
        to_step = h.step()
        self._lr_until = to_step + cfg.rollback_lr_steps
        self.reviewed = to_step
        self.nonfinite_streak = 0
        if cfg.rollback_from == "memory":
            self.snapshot_step = to_step
        record = {"step": spike_step, "event": "rollback", "to_step": to_step, "source": source,
                  "skipped_batches": skipped, "lr_factor": cfg.rollback_lr_factor, "lr_steps": cfg.rollback_lr_steps,
                  "rollbacks": self.rollbacks}
        logger.log(record, kind="numerics")
        logger.print(f"numerics: rolled back from step {spike_step} to step {to_step} ({source}); skipped "
                     f"{skipped} batches of data" + (f"; lr ×{cfg.rollback_lr_factor} for {cfg.rollback_lr_steps} "
                                                     f"steps" if cfg.rollback_lr_steps else ""), highlight=False)
        return True

    def close(self) -> None:
        if self.faults is not None:
            self.faults.close()
