"""fp16 telemetry: loss-scale history, per-tensor gradient underflow/overflow, advice when the scale collapses.

fp16 keeps 10 mantissa bits and 5 exponent bits: normal numbers span 2^-14 (6.1e-5) to 65504. Loss scaling
moves gradients into that range; a gradient element below 2^-14 in magnitude is subnormal (lost precision) or
flushed to zero, one above 65504 overflows to Inf and the scaler skips the step and halves the scale.
"""
from __future__ import annotations

import torch

from kiln.util import is_dtensor

FP16_MIN_NORMAL = 2.0**-14
FP16_MAX = 65504.0
UNDERFLOW_REPORT = 0.25  # a tensor is named as underflowing when this share of its gradient is zero or subnormal


class Fp16Telemetry:
    """Measures the scaled gradients every `interval` steps (and at step 1) on the device; the host reads later."""

    def __init__(self, interval: int, names: dict[int, str]):
        self.interval = interval
        self.names = names  # id(parameter) -> qualified name
        self.pending: list[tuple[int, list[str], torch.Tensor]] = []

    def due(self, step: int) -> bool:
        return self.interval > 0 and (step == 1 or step % self.interval == 0)

    @torch.no_grad()
    def measure(self, params, step: int) -> None:
        named = [(self.names.get(id(p), f"param{i}"), p.grad) for i, p in enumerate(params) if p.grad is not None]
        if not named:
            return
        rows = []
        for _, g in named:
            a = g.detach().abs()
            n = a.numel()
            zero = (a == 0).sum()
            tiny = (a < FP16_MIN_NORMAL).sum() - zero
            big = (~(a <= FP16_MAX)).sum()  # NaN and Inf count as overflow too
            counts = [c.full_tensor() if is_dtensor(c) else c for c in (zero, tiny, big)]  # FSDP2: all shards
            rows.append(torch.stack(counts).float() / n)
        self.pending.append((step, [n for n, _ in named], torch.stack(rows)))  # (tensors, 3): zero, subnormal, over

    def collect(self, scales: dict[int, float]) -> list[dict]:
        """Records for metrics.jsonl: per measured step, the tensors that underflow or overflow."""
        records = []
        for step, names, fractions in self.pending:
            f = fractions.cpu().tolist()
            per_tensor = {n: {"zero": round(z, 4), "subnormal": round(s, 4), "overflow": round(o, 4)}
                          for n, (z, s, o) in zip(names, f) if z + s > 0.01 or o > 0}
            underflow = sorted((n for n, (z, s, _) in zip(names, f) if z + s >= UNDERFLOW_REPORT),
                               key=lambda n: -(per_tensor[n]["zero"] + per_tensor[n]["subnormal"]))
            overflow = [n for n, (_, _, o) in zip(names, f) if o > 0]
            total = sum(z + s for z, s, _ in f) / len(f)
            records.append({"step": step, "event": "fp16_grads", "loss_scale": scales.get(step),
                            "mean_underflow": round(total, 4), "underflow": underflow, "overflow": overflow,
                            "tensors": per_tensor})
        self.pending = []
        return records


class ScaleHistory:
    """Loss-scale changes read from the per-step records; advice when back-offs keep coming."""

    def __init__(self, advice_backoffs: int, horizon: int = 100):
        self.advice_backoffs, self.horizon = advice_backoffs, horizon
        self.last_scale: float | None = None
        self.backoff_steps: list[int] = []
        self.changes: list[tuple[int, float]] = []  # (step, scale in effect from that step on)
        self.advised = False

    def observe(self, step: int, scale: float, overflow: bool) -> dict | None:
        """One step's scale (the one it ran with) and whether it overflowed; returns a record when it differs
        from the previous step's."""
        record = None
        if self.last_scale is not None and scale != self.last_scale:
            # Dated to the step whose outcome changed the scale: the overflow, or the last of a clean streak.
            cause = "overflow" if scale < self.last_scale else "growth"
            record = {"step": step - 1, "event": "loss_scale", "loss_scale": scale, "previous": self.last_scale,
                      "cause": cause}
            self.changes.append((step, scale))
        elif self.last_scale is None:
            self.changes.append((step, scale))
        self.last_scale = scale
        if overflow:
            self.backoff_steps.append(step)
        self.backoff_steps = [s for s in self.backoff_steps if s > step - self.horizon]
        return record

    def state_dict(self) -> dict:
        return {"last_scale": self.last_scale, "backoff_steps": list(self.backoff_steps),
                "changes": [list(c) for c in self.changes], "advised": self.advised}

    def load_state_dict(self, state: dict) -> None:
        self.last_scale, self.backoff_steps = state["last_scale"], list(state["backoff_steps"])
        self.changes, self.advised = [tuple(c) for c in state["changes"]], state["advised"]

    def advice(self, step: int, mean_underflow: float | None = None) -> str | None:
        """Once per run: the scale keeps collapsing, so say what to change."""
        if self.advised or len(self.backoff_steps) < self.advice_backoffs:
            return None
        self.advised = True
        msg = (f"fp16 loss scale collapsing: {len(self.backoff_steps)} overflow back-offs in the last {self.horizon} "
               f"steps (scale now {self.last_scale:g}). Switch to --precision.mode=bf16 (fp32's exponent range, no "
               f"scaling needed), lower --optim.lr, or clip gradients (--optim.grad_clip=1.0)")
        if mean_underflow is not None and mean_underflow > UNDERFLOW_REPORT:
            msg += f"; {100 * mean_underflow:.0f}% of gradient elements already underflow at this scale"
        return msg
