"""The planner: the fastest configuration predicted to fit in a memory budget.

    search(cfg, device, memory, global_batch_tokens) -> Plan
    apply_plan(cfg, device) -> cfg with the best candidate's overrides (the `--plan.memory` hook of kiln train)

It enumerates precision × micro-batch (with accumulation keeping the global batch) × recompute policy × activation
offload × 8-bit AdamW × optimizer-state offload × chunked loss, keeps what kiln.memory.estimate predicts to fit,
predicts each step's time with `step_time` (a roofline per op: FLOPs at the device's peak, bytes at its bandwidth,
whichever is slower; recomputed forward FLOPs, host copies and the host optimizer included) and ranks by it.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

from kiln.memory.estimate import (Breakdown, Job, block_matmul_numel, estimate, fmt_bytes, parameter_numels,
                                  parse_bytes, saved_tensors)
from kiln.memory.recompute import solve_budget

MATMUL_EFFICIENCY = 0.6  # share of peak FLOP/s large matmuls reach (GPU: 55-70% is typical for bf16 GEMMs)
BANDWIDTH_EFFICIENCY = 0.75  # share of peak bandwidth elementwise kernels and copies reach
# Fixed cost per op: a kernel launch on a GPU; on a CPU the dispatcher and Python around each op (measured on the
# shared 2-core machine: micro-batch 1 x 16 costs ~50 ms more per micro-batch than 2 x 8 on the tiny model).
OP_OVERHEAD_S = {"cuda": 5e-6, "cpu": 3e-5}
OPS_PER_BLOCK = 40  # forward; backward ~2x
OPS_HEAD = 40  # embeddings, final norm, loss, forward and backward


@dataclass
class PlanConfig:
    """The `plan` section: let the planner choose the memory levers before training."""

    memory: str = ""  # device memory to plan for, e.g. 24GiB; "" = no planning, train the config as given
    device: str = ""  # device to model: H100, H200, A100-80GB, A100-40GB, V100-32GB, L4, RTX 4090, cpu ("" = this one)
    global_batch_tokens: int = 0  # tokens per optimizer step (0: micro_batch_size × grad_accum_steps × seq_len)

    def validate(self):
        if self.memory:
            parse_bytes(self.memory)
        if self.global_batch_tokens < 0:
            raise ValueError(f"plan.global_batch_tokens must be ≥ 0, got {self.global_batch_tokens}")
        if self.device and self.device.lower() != "cpu":
            from kiln.memory.devices import get_device

            get_device(self.device)


# ---------------------------------------------------------------- step time


def _roofline(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    return max(flops / (peak * MATMUL_EFFICIENCY), nbytes / (bandwidth * BANDWIDTH_EFFICIENCY))


def step_time(job: Job, device) -> dict[str, float]:
    """Predicted seconds of one optimizer step, by part (compute, optimizer, transfers) and in total."""
    cfg, num = job.model, job.num
    B, T, L = job.micro_batch, job.seq_len, cfg.n_layer
    N, d, F, hd, V = B * T, cfg.d_model, cfg.d_ff, cfg.head_dim, cfg.padded_vocab
    H, KV, c, r = cfg.n_head, cfg.n_kv_head, num.compute, num.residual
    peak, bw = device.flops(job.precision), device.bandwidth
    fc = F if cfg.arch == "gpt2" else 2 * F
    mms = [(d, (H + 2 * KV) * hd), (H * hd, d), (d, fc), (F, d)]
    mm = sum(_roofline(2 * N * k * n, (N * k + k * n + N * n) * c, peak, bw) for k, n in mms)
    fused = job.backend != "math"
    attn_flops = 4 * B * H * T * T * hd * (0.5 if fused else 1.0)
    attn_bytes = N * (H + 2 * KV) * hd * c + N * H * hd * c + (0 if fused else 4 * B * H * T * T * 4)
    attn = _roofline(attn_flops, attn_bytes, peak, bw)
    elem_bytes = N * d * r * 14 + N * F * c * (3 if cfg.arch == "llama" else 2)
    if num.autocast:
        elem_bytes += block_matmul_numel(cfg) * 6  # fp32 weights read, half copies written, every micro-batch
    elem = elem_bytes / (bw * BANDWIDTH_EFFICIENCY)
    op_s = OP_OVERHEAD_S.get(device.kind, 0.0)
    launch = op_s * OPS_PER_BLOCK
    fwd_block = mm + attn + elem + launch
    bwd_block = 2 * mm + 2.5 * attn + 2 * elem + 2 * launch
    recompute = 0.0
    for first, stop, policy in job.segments():
        n = stop - first
        recompute += n * (fwd_block if policy == "full" else (attn + elem + launch) if policy == "selective" else 0)
    head_mm = _roofline(2 * N * d * V, (N * d + V * d + N * V) * c, peak, bw)
    head = 3 * head_mm + (head_mm if job.chunked_loss else 0) + N * V * (c + 20) / (bw * BANDWIDTH_EFFICIENCY)
    head += op_s * (OPS_HEAD + (12 * math.ceil(N / job.chunked_loss) if job.chunked_loss else 0))
    micro = L * (fwd_block + bwd_block) + recompute + head
    compute = job.grad_accum * micro

    n_params = sum(n for _, n in parameter_numels(cfg))
    # Bytes moved per parameter by the update: fused AdamW reads p, g, m, v and writes p, m, v (28); the unfused
    # PyTorch 8-bit AdamW makes ~75 elementwise passes over fp32 temporaries (decode, update, re-encode): ~600.
    per_param = {"adamw": 28, "adam": 28, "sgd": 16, "adamw8bit": 600}[job.optimizer]
    transfers = 0.0
    if job.offload and device.kind == "cuda":
        off = sum(sum(b.values()) for i, b in enumerate(saved_tensors(job)[1]) if i in job.offload)
        transfers = 2 * off * job.grad_accum / device.host_link  # out in forward, back in backward
    compute = max(compute, transfers)  # copies run on their own stream, beside the compute
    clip = 2 * n_params * num.grad / (bw * BANDWIDTH_EFFICIENCY)
    if job.optimizer_offload != "none":
        pcie = n_params * (num.grad + num.param) / device.host_link
        host = n_params * per_param / (device.host_bandwidth * BANDWIDTH_EFFICIENCY)
        optimizer = pcie + host if job.optimizer_offload == "host" else max(0.0, pcie + host - compute)
    else:
        masters = n_params * 12 if num.master else 0
        optimizer = n_params * per_param / (bw * BANDWIDTH_EFFICIENCY) + masters / (bw * BANDWIDTH_EFFICIENCY)
    total = compute + clip + optimizer
    return {"compute": compute, "recompute": job.grad_accum * recompute, "optimizer": optimizer + clip,
            "transfers": transfers, "total": total}


# ---------------------------------------------------------------- search


@dataclass
class Candidate:
    overrides: dict  # "section.key" -> value, applied on top of the given config
    breakdown: Breakdown
    times: dict[str, float]
    fits: bool

    @property
    def total_bytes(self) -> int:
        return self.breakdown.total_bytes

    @property
    def step_s(self) -> float:
        return self.times["total"]

    def to_json(self) -> dict:
        return {"overrides": dict(self.overrides), "total_bytes": self.total_bytes, "predicted_step_s": self.step_s,
                "fits": self.fits, "components": dict(self.breakdown.components),
                "host": dict(self.breakdown.host), "time": dict(self.times)}


@dataclass
class Plan:
    device: object
    memory: int
    global_sequences: int
    seq_len: int
    candidates: list[Candidate]  # those that fit, fastest first
    smallest: Candidate  # the smallest footprint found (fits or not)
    considered: int
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def shortfall(self) -> str:
        """What is missing and by how much, when nothing fits."""
        s = self.smallest
        comp = s.breakdown.components
        state = sum(comp[k] for k in ("parameters", "gradients", "master_weights", "optimizer_states"))
        over = s.total_bytes - self.memory
        return (f"nothing fits in {fmt_bytes(self.memory)} on {self.device.name}: the smallest configuration found "
                f"({_describe(s.overrides)}) needs {fmt_bytes(s.total_bytes)}, {fmt_bytes(over)} more than "
                f"available; of it, model state on the device is {fmt_bytes(state)}, activations and logits "
                f"{fmt_bytes(comp['activations'] + comp['logits'])}, device overhead "
                f"{fmt_bytes(comp['device_overhead'])}")

    def to_json(self) -> dict:
        return {"device": self.device.name, "memory_bytes": self.memory,
                "global_batch_tokens": self.global_sequences * self.seq_len, "considered": self.considered,
                "best": self.best.to_json() if self.best else None,
                "candidates": [c.to_json() for c in self.candidates],
                "shortfall": None if self.best else self.shortfall()}


def _describe(o: dict) -> str:
    parts = [o["precision.mode"], f"mb {o['train.micro_batch_size']}×{o['train.grad_accum_steps']}",
             f"recompute {o['memory.recompute']}"]
    if o["memory.offload_blocks"] != "none":
        parts.append(f"offload {o['memory.offload_blocks']}")
    if o["optim.name"] != "adamw":
        parts.append(o["optim.name"])
    if o["optim.offload"] != "none":
        parts.append(f"optimizer on {o['optim.offload']}")
    if o["memory.chunked_loss"]:
        parts.append(f"chunked loss {o['memory.chunked_loss']}")
    return ", ".join(parts)


def chunk_for(vocab: int, tokens: int = 0) -> int:
    """Chunk of the chunked loss: ~64 Mi logits (256 MiB fp32) per chunk, a power of two in [256, 8192], and no
    more than the micro-batch's tokens (when given)."""
    chunk = max(256, min(8192, 2 ** int(math.log2(max(1, (64 * 2**20) // vocab)))))
    if tokens:
        chunk = min(chunk, 2 ** math.ceil(math.log2(tokens)))
    return chunk


def _precisions(device) -> list[str]:
    if device.kind == "cpu":
        modes = ["bf16", "bf16-master", "fp32"] if "bf16" in device.peak_flops else ["fp32"]
    elif device.capability >= 8.0:
        modes = ["bf16", "bf16-master", "tf32"]
    else:
        modes = ["fp16", "fp32"]  # no bf16 before Ampere
    return modes


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def search(cfg, device, memory: int | None = None, global_batch_tokens: int = 0) -> Plan:
    from kiln.memory.levers import job_for

    memory = memory or device.memory
    T = cfg.data.seq_len
    tokens = global_batch_tokens or cfg.train.micro_batch_size * cfg.train.grad_accum_steps * T
    if tokens % T:
        raise ValueError(f"--global-batch-tokens={tokens} is not a multiple of data.seq_len={T}")
    G = tokens // T
    base = job_for(cfg, device, recompute_plan=("none",) * cfg.model.resolve().n_layer)
    L = base.model.n_layer
    optimizers = [cfg.optim.name] + (["adamw8bit"] if cfg.optim.name in ("adamw", "adam") else [])
    opt_offloads = ["none", "host"] if device.kind == "cuda" else ["none"]
    fitting, everything = [], []
    considered = 0
    for precision in _precisions(device):
        for mb in _divisors(G):
            for policy in ("none", "selective", "every_k", "full", "budget"):
                for offload in (["none", "all"] if device.kind == "cuda" and policy == "none" else ["none"]):
                    for optimizer in optimizers:
                        for opt_off in opt_offloads:
                            for ch in (0, chunk_for(base.model.padded_vocab, mb * T)):
                                o = {"precision.mode": precision, "train.micro_batch_size": mb,
                                     "train.grad_accum_steps": G // mb, "memory.recompute": policy,
                                     "memory.recompute_every": 2, "memory.recompute_budget": "",
                                     "memory.offload_blocks": offload, "optim.name": optimizer,
                                     "optim.offload": opt_off, "memory.chunked_loss": ch}
                                cand = _evaluate(cfg, device, o, memory, L)
                                considered += 1
                                if cand is None:
                                    continue
                                everything.append(cand)
                                if cand.fits:
                                    fitting.append(cand)
    fitting.sort(key=lambda c: (c.step_s, c.total_bytes))
    # Identical predictions (e.g. a budget plan that came out as 'none') are listed once.
    unique, seen = [], set()
    for c in fitting:
        key = (round(c.step_s, 9), c.total_bytes)
        if key not in seen:
            seen.add(key)
            unique.append(c)
    smallest = min(everything, key=lambda c: c.total_bytes)
    return Plan(device=device, memory=memory, global_sequences=G, seq_len=T, candidates=unique,
                smallest=smallest, considered=considered)


def with_overrides(cfg, overrides: dict):
    """A copy of cfg with {'section.key': value} set."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def _evaluate(cfg, device, o: dict, memory: int, L: int) -> Candidate | None:
    from kiln.memory.levers import job_for

    trial = with_overrides(cfg, {k: v for k, v in o.items() if k != "memory.recompute"} | {"memory.recompute": "none"})
    job = job_for(trial, device, recompute_plan=("none",) * L)
    policy = o["memory.recompute"]
    if policy == "budget":
        plan = _fill_budget(job, device, memory)
        if plan is None:
            return None
        plan, budget = plan
        o = {**o, "memory.recompute_budget": str(budget)}
    else:
        from kiln.memory.estimate import recompute_plan

        plan = recompute_plan(policy, L, o["memory.recompute_every"])
    job = replace(job, recompute=plan)
    b = estimate(job)
    return Candidate(o, b, step_time(job, device), b.total_bytes <= memory)


def _fill_budget(job: Job, device, memory: int):
    """The recompute plan that spends what memory is left on saved activations; None when it equals a uniform
    policy (already a candidate) or nothing is left."""
    L = job.model.n_layer
    full = estimate(replace(job, recompute=("full",) * L))
    kept_full = sum(sum(b.values()) for b in full.per_block)
    budget = kept_full + (memory - full.total_bytes)
    for _ in range(4):
        if budget < kept_full:
            return None
        plan = solve_budget(job, budget)
        b = estimate(replace(job, recompute=plan))
        if b.total_bytes <= memory:
            break
        budget -= b.total_bytes - memory
    else:
        return None
    if len(set(plan)) == 1:
        return None
    return plan, int(budget)


def apply_plan(cfg, torch_device, log=print):
    """kiln train's `--plan.memory` hook: cfg with the planner's best overrides, or an error saying what is
    missing. The plan is made for plan.device, or the device training runs on."""
    from kiln.memory.devices import get_device, local_device

    device = get_device(cfg.plan.device) if cfg.plan.device else local_device(torch_device)
    plan = search(cfg, device, parse_bytes(cfg.plan.memory), cfg.plan.global_batch_tokens)
    if plan.best is None:
        raise ValueError(plan.shortfall())
    best = plan.best
    log(f"plan: {_describe(best.overrides)} | predicted peak {fmt_bytes(best.total_bytes)} of "
        f"{fmt_bytes(plan.memory)} on {device.name}, {best.step_s:.3g} s/step ({plan.considered} configurations "
        f"considered, {len(plan.candidates)} fit)")
    overrides = dict(best.overrides)
    return with_overrides(cfg, overrides)
