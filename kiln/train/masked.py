"""Optimizer steps withheld on the device: a 0-dim `skipped` flag decides, and the host never waits for it.

    optimizer_step(optimizer, skipped)   torch's fused optimizers through found_inf, kiln's through step(skipped=)
    MaskedAdam, MaskedSGD                Adam/AdamW and SGD (foreach or per-tensor loop) that honour the flag
    run_closure, skip_flags, steps_to_param_devices   shared by every kiln optimizer (8-bit AdamW, host)
"""
from __future__ import annotations

import torch

from kiln.errors import KilnError


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Fused Adam/AdamW/SGD skip their update on the device when `optimizer.found_inf` is non-zero: no sync."""
    return all(group.get("fused") for group in optimizer.param_groups)


def optimizer_step(optimizer: torch.optim.Optimizer, skipped: torch.Tensor) -> None:
    """Apply this step's update, or withhold it exactly when `skipped` (a 0-dim tensor, 1.0 = withhold) says so.

    The decision is made on the device for every optimizer build_optimizer makes: reading `skipped` on the host
    would wait for the whole forward and backward to finish each step (10-30% of step time on a GPU). A withheld
    step leaves parameters and every state tensor, step counts included, bit for bit as they were.
    """
    if getattr(optimizer, "takes_skipped", False):  # MaskedAdam, MaskedSGD, AdamW8bit, HostOptimizer
        optimizer.step(skipped=skipped)
    elif supports_found_inf(optimizer):
        # torch's fused kernels return early when found_inf is set and take the step count back on the device
        optimizer.found_inf = skipped
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # left set, it would withhold a later plain optimizer.step() too
    elif not skipped.item():  # an optimizer kiln did not build (none of the above): one host sync per step
        optimizer.step()


# ---------------------------------------------------------------- foreach and per-tensor optimizers that skip
#
# torch's foreach and per-tensor Adam/AdamW/SGD take no found_inf, and tensor hyperparameters do not make a skip a
# no-op there: the step count always advances, capturable=True (needed for tensor lr and betas) is refused on CPU,
# and lerp and p + lr·x with lr = 0 still change -0.0 and propagate a NaN gradient. So kiln has its own, written so
# that on a withheld step every write is an exact identity, for any value, at no extra memory:
#   x · 1.0 == x  and  x + (-0.0) == x  bit for bit (±0, inf and NaN included), so
#   - each decay factor (β1, β2, μ, 1 - lr·wd) is torch.where(skip, 1.0, factor), a 0-dim device tensor;
#   - the gradient is replaced by -0.0 (masked_fill: a NaN or inf gradient never reaches the moments);
#   - the parameter increment, -lr·(...) in full, is replaced by -0.0 before it is added;
#   - the step count advances by keep = 1.0 or 0.0 (integers are exact in fp32 up to 2^24 steps);
#   - exp_avg_sq gains (1-β2)·(-0.0)² = +0.0, an identity for it since it is never -0.0 (it is a sum of +0.0
#     and squares).
# The temporaries are one list the size of the parameters at a time (the masked gradient, then the increment; torch's
# foreach Adam has one too, its SGD none) in "foreach" form, one tensor at a time in "loop" form. The cost is two
# more passes over memory and the two masks, which a CPU runs slowly (masked_fill of 1M fp32: 1.6 ms on one core,
# a multiply 0.23 ms): there an AdamW step over 1.05M parameters in 32 tensors takes 13 ms against 6.5 for torch's
# foreach AdamW and 1.4 for its fused one, which "auto" picks on CPU and CUDA alike.


def run_closure(closure):
    """The loss of optimizer.step's optional closure (re-evaluated with gradients on), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def skip_flags(skipped: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(skip, keep) on `device` for a step's 0-dim skip flag: skip a bool, keep 1.0 (apply) or 0.0 (withhold).
    None means apply."""
    if skipped is None:
        skip = torch.zeros((), dtype=torch.bool, device=device)
    else:
        skip = skipped.to(device, non_blocking=True) != 0  # a no-op move on the flag's own device
    return skip, (~skip).float()


def _masked_grads(skip: torch.Tensor, grads: list[torch.Tensor], own: bool) -> list[torch.Tensor]:
    """The gradients, -0.0 everywhere on a withheld step; in place when `own` (a temporary of ours)."""
    if own:
        for g in grads:
            g.masked_fill_(skip, -0.0)
        return grads
    return [torch.where(skip, -0.0, g) for g in grads]  # 1.5 ms per 1M fp32 on a CPU core, masked_fill 2.4


def _by_device_and_dtype(params) -> dict:
    """(device, dtype, DTensor mesh or None) -> the parameters with gradients: a foreach op takes DTensors of one
    mesh at a time (expert parallelism's experts and the other parameters are on two)."""
    out: dict = {}
    for p in params:
        if p.grad is not None:
            out.setdefault((p.device, p.dtype, getattr(p, "device_mesh", None)), []).append(p)
    return out


def steps_to_param_devices(optimizer: torch.optim.Optimizer) -> None:
    """torch's load_state_dict leaves `step` where the checkpoint was mapped; the masked update needs it as an fp32
    tensor on its parameter's device (older AdamW8bit checkpoints hold a Python float)."""
    for p, state in optimizer.state.items():
        if "step" in state:
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)


class MaskedAdam(torch.optim.Optimizer):
    """Adam, or AdamW (decoupled=True), in foreach or per-tensor ("loop") form, whose step takes a skip flag and
    withholds the update on the device (see the comment above). State as torch's Adam keeps it (step, exp_avg,
    exp_avg_sq), `step` on the parameter's device as with fused=True. Agrees with torch's foreach Adam/AdamW in
    fp32 to within 2e-7 of each tensor's largest entry over 8 steps (β1·m + (1-β1)·g where torch lerps, one
    reciprocal and multiply where it divides; tests/memory/test_optimizers.py)."""

    takes_skipped = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | None = None, *, decoupled: bool, foreach: bool = True):
        if weight_decay is None:  # torch's defaults (AdamW 1e-2, Adam 0), so fused and foreach runs decay alike
            weight_decay = 1e-2 if decoupled else 0.0
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise KilnError("MaskedAdam: lr > 0, eps > 0, weight_decay ≥ 0 and betas in [0, 1) are required",
                            key="MaskedAdam", value=dict(lr=lr, betas=tuple(betas), eps=eps,
                                                         weight_decay=weight_decay),
                            fix="lr > 0, eps > 0, weight_decay ≥ 0 and betas in [0, 1) are required")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.decoupled, self.foreach = decoupled, foreach

    @torch.no_grad()
    def step(self, closure=None, skipped: torch.Tensor | None = None):
        loss = run_closure(closure)
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for (device, _, _), params in _by_device_and_dtype(group["params"]).items():
                skip, keep = skip_flags(skipped, device)
                gates = [torch.where(skip, 1.0, x) for x in (b1, b2, 1 - lr * wd)]
                for chunk in [params] if self.foreach else [[p] for p in params]:
                    self._update(chunk, skip, keep, gates, lr, b1, b2, eps, wd)
        return loss

    def _update(self, params, skip, keep, gates, lr, b1, b2, eps, wd):
        b1_gate, b2_gate, decay_gate = gates
        states = [self.state[p] for p in params]
        for p, s in zip(params, states):
            if not s:
                s["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        steps = [s["step"] for s in states]
        ms, vs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        torch._foreach_add_(steps, keep)
        grads = [p.grad for p in params]
        l2 = wd != 0 and not self.decoupled
        if l2:  # Adam's L2 penalty goes into the gradient, and so into the moments
            grads = torch._foreach_add(grads, params, alpha=wd)
        grads = _masked_grads(skip, grads, own=l2)
        torch._foreach_mul_(ms, b1_gate)
        torch._foreach_add_(ms, grads, alpha=1 - b1)
        torch._foreach_mul_(vs, b2_gate)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
        del grads
        # step size -lr / (1 - β1^t) and sqrt(1 - β2^t), per parameter from its device-side step count
        step_size = torch._foreach_pow(b1, steps)
        torch._foreach_sub_(step_size, 1)
        torch._foreach_div_(step_size, lr)
        torch._foreach_reciprocal_(step_size)
        bc2_sqrt = torch._foreach_pow(b2, steps)
        torch._foreach_neg_(bc2_sqrt)
        torch._foreach_add_(bc2_sqrt, 1)
        torch._foreach_sqrt_(bc2_sqrt)
        increment = torch._foreach_sqrt(vs)  # the one parameter-sized temporary
        torch._foreach_div_(increment, bc2_sqrt)
        torch._foreach_add_(increment, eps)
        torch._foreach_reciprocal_(increment)
        torch._foreach_mul_(increment, ms)
        torch._foreach_mul_(increment, step_size)
        _masked_grads(skip, increment, own=True)  # NaN on a withheld first step (0/0 at t = 0): masked here
        if wd != 0 and self.decoupled:
            torch._foreach_mul_(params, decay_gate)
        torch._foreach_add_(params, increment)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        steps_to_param_devices(self)


class MaskedSGD(torch.optim.Optimizer):
    """SGD with optional (Nesterov) momentum and L2 weight decay, dampening 0, in foreach or per-tensor ("loop")
    form, whose step takes a skip flag (see the comment above). The momentum buffer starts at zeros, so the first
    step sets it to the gradient as torch's SGD does (μ·0 + g). Agrees with torch's foreach SGD in fp32 to within
    1.2e-7 of each tensor's largest entry over 8 steps."""

    takes_skipped = True

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, *, foreach: bool = True):
        if lr <= 0 or momentum < 0 or weight_decay < 0:
            raise KilnError("MaskedSGD: lr > 0, momentum ≥ 0 and weight_decay ≥ 0 are required",
                            key="MaskedSGD", value=dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
                            fix="lr > 0, momentum ≥ 0 and weight_decay ≥ 0 are required")
        if nesterov and momentum == 0:
            raise KilnError("MaskedSGD: Nesterov momentum needs momentum > 0",
                            key="MaskedSGD.nesterov", value=nesterov, fix="needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))
        self.foreach = foreach

    @torch.no_grad()
    def step(self, closure=None, skipped: torch.Tensor | None = None):
        loss = run_closure(closure)
        for group in self.param_groups:
            for (device, _, _), params in _by_device_and_dtype(group["params"]).items():
                skip, _ = skip_flags(skipped, device)
                momentum_gate = torch.where(skip, 1.0, group["momentum"])
                for chunk in [params] if self.foreach else [[p] for p in params]:
                    self._update(chunk, skip, momentum_gate, group)
        return loss

    def _update(self, params, skip, momentum_gate, group):
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        grads = [p.grad for p in params]
        if wd != 0:  # L2 in the gradient, as torch's SGD: a list of ours from here on
            grads = torch._foreach_add(grads, params, alpha=wd)
        if momentum == 0 and wd != 0:
            increment = grads
            torch._foreach_mul_(increment, -lr)
        elif momentum == 0:
            increment = torch._foreach_mul(grads, -lr)
        else:
            grads = _masked_grads(skip, grads, own=wd != 0)
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            torch._foreach_mul_(bufs, momentum_gate)
            torch._foreach_add_(bufs, grads)
            if group["nesterov"]:
                increment = grads
                torch._foreach_add_(increment, bufs, alpha=momentum)
                torch._foreach_mul_(increment, -lr)
            else:
                del grads  # freed before the increment is made: one parameter-sized list at a time
                increment = torch._foreach_mul(bufs, -lr)
        _masked_grads(skip, increment, own=True)  # also takes a NaN gradient out of the momentum-free increment
        torch._foreach_add_(params, increment)
