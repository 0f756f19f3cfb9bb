"""Optimizer state on the host for a single device: fp32 master weights, gradients and Adam state in (pinned)
CPU memory, the update computed by the CPU, so a model whose Adam state does not fit on the device still trains.

The device keeps only the parameters and their gradients (4 + 4 bytes per parameter in fp32/autocast modes,
2 + 2 in bf16-master) instead of 16. Each step copies the gradients device→host, runs the inner optimizer
(fused CPU AdamW, or AdamW8bit) on the fp32 masters and copies the masters back into the parameters.

mode "host": the step waits for the update; numerics equal the inner optimizer run on the device.
mode "host-async": the update of step t runs on a host thread while step t+1's forward and backward run on the
device, and is copied into the parameters at the start of step t+2's update (ZeRO-Offload's one-step delayed
parameter update): parameters are one update stale, in exchange the host update costs no device time. Call
`flush()` (state_dict does) to apply the pending update.

A withheld step (`step(skipped=)`, inf/NaN gradient or a held-back spike) is decided on the host without reading
the device: the 0-dim flag is copied into pinned host memory right after the gradients, in the same stream order,
so it is there when they are, and the inner optimizer skips on it (found_inf or its own `skipped`). The masters
stay as they were, so copying them back leaves the parameters as they were too.
"""
from __future__ import annotations

import threading

import torch

from kiln.errors import KilnError
from kiln.train.masked import optimizer_step


class HostOptimizer(torch.optim.Optimizer):
    """Looks like an optimizer over the device parameters; holds the real one (`inner`) over host masters."""

    takes_skipped = True  # kiln.train.optim.optimizer_step passes the skip flag to step()

    def __init__(self, groups: list[dict], lr: float, mode: str = "host", make_inner=None):
        """make_inner(host_groups) builds the real optimizer over the host masters (kiln.train.optim does, from the
        same `optim` section); the default is torch's AdamW."""
        if mode not in ("host", "host-async"):
            raise ValueError(f"optimizer offload mode {mode!r}; use 'host' or 'host-async'")
        groups = [g for g in groups if g["params"]]
        super().__init__(groups, dict(lr=lr))
        self.mode = mode
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        host_groups = []
        for g in self.param_groups:
            masters = []
            for p in g["params"]:
                pin = p.device.type == "cuda"
                m = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
                m.copy_(p.detach())
                m.grad = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
                masters.append(m)
                self.pairs.append((p, m))
            host_groups.append({k: v for k, v in g.items() if k != "params"} | {"params": masters})
        self.inner = (make_inner or (lambda g: torch.optim.AdamW(g, lr=lr)))(host_groups)
        # this step's skip flag on the host: written behind the gradients, read by the host update
        self._skipped = torch.zeros((), dtype=torch.float32,
                                    pin_memory=any(p.device.type == "cuda" for p, _ in self.pairs))
        self._thread: threading.Thread | None = None
        self._pending = False  # an update finished on the host and not yet copied to the device
        self._error: BaseException | None = None

    # ------------------------------------------------------------ the step

    def _sync_hyperparameters(self):
        for mine, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in mine.items():
                if key != "params" and key in inner:
                    inner[key] = value

    def _grads_to_host(self, skipped):
        for p, m in self.pairs:
            if p.grad is None:
                m.grad.zero_()
            else:
                m.grad.copy_(p.grad, non_blocking=True)
        if skipped is None:
            self._skipped.zero_()
        else:
            self._skipped.copy_(skipped, non_blocking=True)  # pinned: no wait, and ready with the gradients
        done = None
        if any(p.device.type == "cuda" for p, _ in self.pairs):
            done = torch.cuda.Event()
            done.record()
        return done

    @torch.no_grad()
    def _masters_to_device(self):
        for p, m in self.pairs:
            p.copy_(m, non_blocking=True)
        if any(p.device.type == "cuda" for p, _ in self.pairs):
            copied = torch.cuda.Event()
            copied.record()
            return copied
        return None

    def _host_update(self, wait_for):
        try:
            for event in wait_for:
                if event is not None:
                    event.synchronize()
            optimizer_step(self.inner, self._skipped)
        except BaseException as e:  # re-raised on the training thread
            self._error = e

    def _join(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @torch.no_grad()
    def step(self, closure=None, skipped: torch.Tensor | None = None):
        """One update of the masters; withheld when the 0-dim `skipped` is non-zero, decided on the host after the
        flag arrives with the gradients (the training thread never reads it)."""
        if closure is not None:
            raise KilnError("HostOptimizer.step does not take a closure",
                            key="closure", fix="HostOptimizer.step does not take a closure")
        self._sync_hyperparameters()
        if self.mode == "host":
            grads_ready = self._grads_to_host(skipped)
            if grads_ready is not None:
                grads_ready.synchronize()  # mode "host" waits for the gradients by design; host-async does not
            optimizer_step(self.inner, self._skipped)
            self._masters_to_device()
            return None
        # host-async: publish the previous update, then start this one on a host thread.
        self._join()
        copied = self._masters_to_device() if self._pending else None
        grads_ready = self._grads_to_host(skipped)
        self._thread = threading.Thread(target=self._host_update, args=([copied, grads_ready],), daemon=True)
        self._thread.start()
        self._pending = True
        return None

    def flush(self) -> None:
        """Apply a pending host update to the device parameters (host-async)."""
        self._join()
        if self._pending:
            self._masters_to_device()
            self._pending = False
            if any(p.device.type == "cuda" for p, _ in self.pairs):
                torch.cuda.synchronize()

    def close(self) -> None:
        self.flush()

    def zero_grad(self, set_to_none: bool = True):
        for p, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ------------------------------------------------------------ checkpoints

    def state_dict(self):
        self.flush()
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for _, m in self.pairs],
                "mode": self.mode}

    @torch.no_grad()
    def load_state_dict(self, state):
        self.flush()
        self.inner.load_state_dict(state["inner"])
        for (p, m), saved in zip(self.pairs, state["masters"]):
            m.copy_(saved)
            p.copy_(m)
