"""AdamW with 8-bit, block-wise quantized moments, in plain PyTorch (CPU and GPU alike).

Each moment of a parameter with at least MIN_8BIT elements is stored as one uint8 code per element plus one fp32
scale per BLOCK elements: 1 + 4/256 bytes per element instead of 4, so AdamW's state drops from 8 to ≈2.03 bytes
per parameter (3.94×). Smaller tensors (norm gains, biases) keep fp32 moments: they are a rounding error of the
total and the most sensitive to quantization.

Codes index a 256-entry dynamic-exponent codebook (the idea of Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"): values normalized by the block's absolute maximum fall in [-1, 1]; each decade below 1
gets half the levels of the decade above it (64, 32, 16 ... for the signed first moment; 128, 64, ... for the
non-negative second moment), so numbers near the block maximum keep ~1% resolution and numbers 10^-7 below it
are still representable instead of rounding to zero — which would turn m / sqrt(v) into a division by ~eps.
Encoding is a bucketize against the midpoints between codebook entries (round to nearest).

The update dequantizes CHUNK elements at a time, so its fp32 temporaries stay bounded (≈16 bytes × CHUNK).

`step(skipped=)` withholds the update on the device, with no host sync: every tensor it writes (parameter, codes,
scales, fp32 moments, the step count, which lives on the device for this) is left bit for bit as it was when the
0-dim flag is non-zero. Codes and scales are selected with torch.where(skip, old, new) written in place, since
re-encoding decoded moments need not give back the same codes; the parameter and the fp32 moments use exact
identities instead (x · 1.0 and x + (-0.0), as kiln.train.optim's MaskedAdam), so no temporary is added.
"""
from __future__ import annotations

import math

import torch

from kiln.errors import KilnError
from kiln.memory.estimate import ADAM8BIT_BLOCK as BLOCK
from kiln.memory.estimate import ADAM8BIT_CHUNK as CHUNK
from kiln.memory.estimate import ADAM8BIT_MIN as MIN_8BIT
from kiln.memory.estimate import adam8bit_state_bytes as state_bytes
from kiln.train.masked import run_closure, skip_flags, steps_to_param_devices


def dynamic_codebook(signed: bool) -> torch.Tensor:
    """Sorted fp32 codebook in [-1, 1] (signed, 255 entries) or [0, 1] (unsigned, 256 entries)."""
    levels = [64, 32, 16, 8, 4, 2, 1] if signed else [128, 64, 32, 16, 8, 4, 2, 1]
    mags = []
    for e, n in enumerate(levels):
        lo, hi = 10.0 ** -(e + 1), 10.0 ** -e
        mags += [lo + (hi - lo) * (j + 1) / n for j in range(n)]
    mags = sorted(mags)
    values = ([-m for m in reversed(mags)] if signed else []) + [0.0] + mags
    return torch.tensor(values, dtype=torch.float32)


class _Codebook:
    """Encode by arithmetic on the codebook's structure (a bucketize against 255 midpoints is ~10x slower on CPU):
    the decade is floor(-log10|x|), the level inside it the nearest multiple of the decade's step."""

    def __init__(self, signed: bool, device):
        self.signed = signed
        self.values = dynamic_codebook(signed).to(device)
        levels = [64, 32, 16, 8, 4, 2, 1] if signed else [128, 64, 32, 16, 8, 4, 2, 1]
        E = len(levels)
        # offset[e]: how many magnitudes lie below decade e (decades are stored smallest first)
        offsets = [sum(levels[e + 1:]) for e in range(E)]
        self.E = E
        lo = [10.0 ** -(e + 1) for e in range(E)]
        step = [(10.0 ** -e - lo[e]) / n for e, n in enumerate(levels)]
        lo[-1], step[-1] = 0.0, 10.0 ** -(E - 1)  # below the last (single) level comes 0, not 10^-E
        self.lo = torch.tensor(lo, device=device)
        self.step = torch.tensor(step, device=device)
        self.offset = torch.tensor(offsets, dtype=torch.float32, device=device)
        self.zero = (len(self.values) - 1) // 2 if signed else 0  # index of 0.0

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (n_blocks, BLOCK) fp32 -> (codes uint8, scale fp32 per block), rounding to the nearest entry."""
        scale = x.abs().amax(dim=1).clamp_min(1e-30)
        a = (x / scale[:, None]).abs_()
        e = torch.floor(-torch.log10(a.clamp_min(1e-30))).clamp_(0, self.E - 1).long()
        # magnitude index: -1 is zero, then the levels from smallest to largest
        j = torch.round((a - self.lo[e]) / self.step[e]).clamp_(min=0) - 1 + self.offset[e]
        j = j.clamp_(min=-1)
        codes = (j + 1) * torch.sign(x) if self.signed else j + 1
        return (codes + self.zero).to(torch.uint8), scale

    def decode(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.values[codes.long()] * scale[:, None]


class AdamW8bit(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam whose moments are stored in 8 bits (see the module docstring)."""

    takes_skipped = True  # kiln.train.optim.optimizer_step passes the skip flag to step()

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise KilnError("AdamW8bit: lr > 0, eps > 0, weight_decay ≥ 0 and betas in [0, 1) are required",
                            key="AdamW8bit", value=dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                            fix="lr > 0, eps > 0, weight_decay ≥ 0 and betas in [0, 1) are required")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._codebooks: dict = {}

    def _books(self, device):
        if device not in self._codebooks:
            self._codebooks[device] = (_Codebook(True, device), _Codebook(False, device))
        return self._codebooks[device]

    def _init_state(self, p):
        n = p.numel()
        step = torch.zeros((), dtype=torch.float32, device=p.device)
        if n < MIN_8BIT:
            return {"step": step, "exp_avg": torch.zeros(n, dtype=torch.float32, device=p.device),
                    "exp_avg_sq": torch.zeros(n, dtype=torch.float32, device=p.device)}
        blocks = math.ceil(n / BLOCK)
        signed, _ = self._books(p.device)
        codes = torch.full((blocks * BLOCK,), signed.zero, dtype=torch.uint8, device=p.device)  # the code of 0.0
        return {"step": step, "m_codes": codes, "m_scale": torch.zeros(blocks, device=p.device),
                "v_codes": torch.zeros_like(codes), "v_scale": torch.zeros(blocks, device=p.device)}

    @torch.no_grad()
    def step(self, closure=None, skipped: torch.Tensor | None = None):
        """One update; withheld, exactly and on the device, when the 0-dim `skipped` is non-zero."""
        loss = run_closure(closure)
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            flags = {}  # device -> (skip, keep, β1 gate, β2 gate, decay gate), made once per group and device
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                if p.device not in flags:
                    skip, keep = skip_flags(skipped, p.device)
                    flags[p.device] = (skip, keep, *(torch.where(skip, 1.0, x) for x in (b1, b2, 1 - lr * wd)))
                skip, keep, b1_gate, b2_gate, decay = flags[p.device]
                t = state["step"].add_(keep)
                bc1, bc2 = 1 - b1**t, 1 - b2**t  # 0 on a withheld first step: its NaN update is masked below
                flat_p, flat_g = p.view(-1), p.grad.reshape(-1)
                if "exp_avg" in state:
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    g = flat_g.float().masked_fill(skip, -0.0)  # withheld: m·1 + (-0.0), v·1 + (+0.0), v ≥ +0
                    m.mul_(b1_gate).add_(g, alpha=1 - b1)
                    v.mul_(b2_gate).addcmul_(g, g, value=1 - b2)
                    update = (m / bc1).div_((v / bc2).sqrt_().add_(eps)).mul_(-lr)
                    update.masked_fill_(skip, -0.0)
                    pf = flat_p.float()
                    pf.mul_(decay).add_(update)
                    flat_p.copy_(pf)
                    continue
                self._update_quantized(flat_p, flat_g, state, skip, decay, lr, b1, b2, eps, bc1, bc2)
        return loss

    def _update_quantized(self, flat_p, flat_g, state, skip, decay, lr, b1, b2, eps, bc1, bc2):
        signed, unsigned = self._books(flat_p.device)
        n = flat_p.numel()
        for start in range(0, n, CHUNK):
            stop = min(start + CHUNK, n)
            b0, b_end = start // BLOCK, math.ceil(stop / BLOCK)
            padded = (b_end - b0) * BLOCK
            g = torch.zeros(padded, dtype=torch.float32, device=flat_p.device)
            g[: stop - start] = flat_g[start:stop]
            # A withheld step's gradient may be inf/NaN; encoding a NaN moment would index outside the codebook.
            g = g.masked_fill_(skip, 0.0).view(-1, BLOCK)
            codes_at = slice(b0 * BLOCK, b_end * BLOCK)
            m = signed.decode(state["m_codes"][codes_at].view(-1, BLOCK), state["m_scale"][b0:b_end])
            v = unsigned.decode(state["v_codes"][codes_at].view(-1, BLOCK), state["v_scale"][b0:b_end])
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            update = (m / bc1).div_((v / bc2).sqrt_().add_(eps)).view(-1)[: stop - start].mul_(-lr)
            update.masked_fill_(skip, -0.0)
            pf = flat_p[start:stop].float()
            pf.mul_(decay).add_(update)
            flat_p[start:stop].copy_(pf)
            # where(skip, old, new) written over old: the state keeps its exact bits on a withheld step
            for book, moment, key in ((signed, m, "m"), (unsigned, v, "v")):
                codes, scale = book.encode(moment)
                old_codes, old_scale = state[f"{key}_codes"][codes_at], state[f"{key}_scale"][b0:b_end]
                torch.where(skip, old_codes, codes.view(-1), out=old_codes)
                torch.where(skip, old_scale, scale, out=old_scale)

    def load_state_dict(self, state_dict):
        """As torch's, except that the state keeps its dtypes: torch casts every state tensor of a floating-point
        parameter to the parameter's dtype, which turned the uint8 codes into fp32 (4x the state after a resume).
        Tensors move to their parameter's device; a Python-float `step` (older checkpoints) becomes a tensor."""
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        by_index = {i: p for saved_group, group in zip(state_dict["param_groups"], self.param_groups)
                    for i, p in zip(saved_group["params"], group["params"])}
        for i, state in saved.items():
            p = by_index[i]
            self.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        steps_to_param_devices(self)
