"""The planner: the fastest configuration predicted to fit in a memory budget.

    search(sections, device, memory, global_batch_tokens) -> Plan (candidates: a typed Choice each, best first)

It reads the config sections a Job is built from (kiln.memory.levers.JobSections), never the whole Config; `kiln
train --plan.memory` applies the best Choice's sections through the config's checks (kiln.run.lm.plan_memory).

It enumerates precision × micro-batch (with accumulation keeping the global batch) × recompute policy × activation
offload × 8-bit AdamW × optimizer-state offload × chunked loss, keeps what kiln.memory.estimate predicts to fit,
predicts each step's time with `step_time` (a roofline per op: FLOPs at the device's peak, bytes at its bandwidth,
whichever is slower; recomputed forward FLOPs, host copies, the host optimizer and Muon's Newton-Schulz products
(kiln.memory.muon_cost) included) and ranks by it.

With several GPUs it also searches the layout (`layouts`: tensor × pipeline × context parallel, the rest data
parallel under ddp, zero1 or fsdp), each layout's rank estimated through kiln.memory.levers.rank_jobs and timed
with its collectives (`model_parallel_comm`) and the pipeline bubble (`bubble_fraction`); docs/parallel.md.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from kiln.memory.devices import get_device
from kiln.memory.experts import all_to_all_seconds, ep_degrees, with_ep
from kiln.memory.adapters import adapter_flops
from kiln.memory.estimate import (Breakdown, Job, block_matmul_numel, estimate, fmt_bytes, local_parameter_shapes,
                                  parse_bytes, recompute_plan, saved_tensors, trainable)
from kiln.memory.estimate import _memo, _shapes_key  # noqa: E402  (the estimator's caches, shared)
from kiln.memory.levers import JobSections, job_for, rank_jobs
from kiln.memory.muon_cost import muon_cost
from kiln.memory.recompute import solve_budget
from kiln.models.attention_costs import ATTENTION
from kiln.models.registry import family
from kiln.parallel.layout import ParallelPlan
from kiln.parallel.strategy import STRATEGIES, strategy
from kiln.errors import KilnError

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
            parse_bytes(self.memory, "plan.memory")
        if self.global_batch_tokens < 0:
            raise KilnError(f"plan.global_batch_tokens must be ≥ 0, got {self.global_batch_tokens}",
                            key="plan.global_batch_tokens", value=self.global_batch_tokens,
                            fix="give a count of tokens ≥ 0 (0: the config's batch)")
        if self.device and self.device.lower() != "cpu":
            get_device(self.device)


# ---------------------------------------------------------------- communication

# Per-GPU bandwidth one direction of a link gives a ring collective, bytes/s (sources: NVIDIA H100 datasheet,
# NVLink 4: 900 GB/s bidirectional per GPU; PCI-SIG: PCIe 4.0/5.0 x16 at 16/32 GT/s per lane ≈ 32/64 GB/s per
# direction; InfiniBand NDR: 400 Gb/s = 50 GB/s per port, one port per GPU as in DGX H100).
INTERCONNECTS = {"nvlink4": 450e9, "pcie4": 32e9, "pcie5": 64e9, "ib-ndr": 50e9}
COMM_EFFICIENCY = 0.7  # share of that a ring all-reduce / all-gather reaches on large messages (NCCL bus bandwidth)


def communication(job: Job, link: float, compute_s: float) -> dict[str, float]:
    """Bytes and seconds of one optimizer step's collectives for job.parallel on job.world ranks, with a ring over
    `link` bytes/s per GPU: all-reduce moves 2(N-1)/N of the buffer per GPU, all-gather and reduce-scatter
    (N-1)/N. What overlaps with compute (DDP's bucketed all-reduce with the last backward, FSDP2's prefetched
    all-gathers with the whole step) is hidden up to the compute it overlaps; `exposed` is what remains."""
    N = job.world
    data = job.dp_strategy
    if not data.reduces or N == 1:
        return {"bytes": 0.0, "seconds": 0.0, "exposed": 0.0}
    f = (N - 1) / N
    n_params = _local_params(job)
    # gradients are reduced in fp32 (FSDP2: reduce_dtype fp32); FSDP2 gathers bf16 under MixedPrecisionPolicy
    P, G = n_params * (job.num.gathered or job.num.param), _local_params(job, trained=True) * 4
    bw = link * COMM_EFFICIENCY
    backward = compute_s / job.grad_accum * 2 / 3  # the last micro-batch's backward: ~2/3 of its FLOPs
    if data.ddp_reducer:
        moved = 2 * f * G
        exposed = max(0.0, moved / bw - backward)
        if data.zero_optimizer:  # each rank broadcasts its updated shard after the step: nothing to hide behind
            moved += f * P
            exposed += f * P / bw
        return {"bytes": moved, "seconds": moved / bw, "exposed": exposed}
    gathers = job.grad_accum * f * P * 2  # every micro-batch: forward, and backward again (reshard after forward)
    moved = gathers + f * G  # one reduce-scatter on the last micro-batch
    return {"bytes": moved, "seconds": moved / bw, "exposed": max(0.0, moved / bw - compute_s)}


# ---------------------------------------------------------------- step time


def _roofline(flops: float, nbytes: float, peak: float, bandwidth: float, me: float, be: float) -> float:
    return max(flops / (peak * me), nbytes / (bandwidth * be))


def time_constants(device) -> tuple[float, float, float, str]:
    """(matmul efficiency, bandwidth efficiency, seconds per op, where they come from) for `device`: measured by
    `kiln plan --calibrate` when it was run on this device, else the defaults above."""
    tm = device.time_model
    if tm:
        return tm["matmul_efficiency"], tm["bandwidth_efficiency"], tm["op_overhead_s"], f"calibrated {tm['measured']}"
    return MATMUL_EFFICIENCY, BANDWIDTH_EFFICIENCY, OP_OVERHEAD_S.get(device.kind, 0.0), "defaults"


def fit_time_model(device, observations: list[tuple[Job, float]], bandwidth_efficiency: float) -> dict:
    """The matmul efficiency and seconds per op that make step_time match measured steps, by least squares.

    step_time is, to first order, A/e + C·o + E for a job (e the matmul efficiency, o the seconds per op, A, C, E
    read off step_time itself at three settings); the measured seconds of jobs of different sizes (how much is
    matmul, how much per-op cost) pin e and o down."""
    rows = []
    for job, seconds in observations:
        def total(e, o):
            tm = {"matmul_efficiency": e, "bandwidth_efficiency": bandwidth_efficiency, "op_overhead_s": o,
                  "measured": ""}
            return step_time(job, replace(device, time_model=tm))["total"]
        t0 = total(1.0, 0.0)
        a, c = total(0.5, 0.0) - t0, (total(1.0, 1e-6) - t0) / 1e-6
        rows.append((a, c, seconds - (t0 - a)))
    saa, scc = sum(a * a for a, _, _ in rows), sum(c * c for _, c, _ in rows)
    sac, say, scy = sum(a * c for a, c, _ in rows), sum(a * y for a, _, y in rows), sum(c * y for _, c, y in rows)
    det = saa * scc - sac * sac
    if not det or abs(det) < 1e-9 * saa * scc:
        raise KilnError(f"the {len(observations)} calibration steps cannot tell matmul time from per-op time apart",
                        key="observations", value=len(observations), fix="measure jobs of more different sizes")
    u, o = (say * scc - scy * sac) / det, (saa * scy - sac * say) / det
    return {"matmul_efficiency": min(1.0, 1 / u) if u > 0 else 1.0, "op_overhead_s": max(o, 0.0)}


def _local_params(job: Job, trained: bool = False) -> int:
    """Parameters this rank's model part holds before data-parallel sharding (its stage, its tensor shard); trained:
    only those that get gradients (LoRA: the adapters)."""
    return _memo(_PARAMS, (_shapes_key(job), trained), lambda: sum(
        math.prod(shape) for name, shape in local_parameter_shapes(job) if not trained or trainable(job, name)))


_PARAMS: dict = {}
_MUON: dict = {}  # muon_cost by the shapes it reads: the search times one layout for every lever


def model_parallel_comm(job: Job, tp_link: float, cp_link: float, pp_link: float, attention_s: float
                        ) -> dict[str, float]:
    """Seconds of one step's tensor-, context- and pipeline-parallel communication on this rank, all of it on the
    critical path except what ring attention hides behind the attention it feeds (docs/parallel.md):

    tp  per block and micro-batch, 2 all-reduces of the (N, d) activations in forward (after attention's and the
        MLP's row-parallel linear) and 2 in backward (of the column-parallel inputs' gradients), each moving
        2(t-1)/t of the buffer per GPU on a ring; sequence parallelism swaps each for an all-gather plus a
        reduce-scatter, (t-1)/t each: the same bytes (Korthikanti et al. 2022, §4.2.2). A fully recomputed block
        runs its forward's 2 again. The vocabulary-parallel embedding adds one (N, d) all-reduce in forward (the
        first stage), the head one in backward (its input's gradient, the last stage); the loss' three (N,)
        vectors are left out.
    cp  ring attention: each rank receives the other cp - 1 ranks' K and V chunks in forward, K, V and their
        gradients in backward (3 passes); hidden up to the attention's own time.
    pp  each stage boundary sends a micro-batch's activations forward and their gradient back; in the steady
        state they overlap compute, the fill and drain put 2(p - 1) sends per model chunk on the critical path
        (Narayanan et al. 2021, §2.2: interleaving multiplies the sends by v)."""
    cfg, num = job.model, job.num
    N, d, c = job.tokens, cfg.d_model, num.compute
    out = {"tp": 0.0, "cp": 0.0, "cp_exposed": 0.0, "pp": 0.0}
    eff = COMM_EFFICIENCY
    if job.tp > 1:
        t = job.tp
        recomputed = sum(1 for i in range(cfg.n_layer) if job.policy(i) in ("full", "seg"))
        collectives = 4 * cfg.n_layer + 2 * recomputed + (job.first_stage + job.last_stage if job.vocab_parallel
                                                          else 0)
        out["tp"] = job.grad_accum * collectives * 2 * (t - 1) / t * N * d * c / (tp_link * eff)
    if job.cp > 1:
        C = job.cp
        kv = (C - 1) * 2 * N * cfg.n_kv_head * cfg.head_dim * c / max(1, min(job.tp, cfg.n_kv_head))
        out["cp"] = job.grad_accum * cfg.n_layer * 3 * kv / (cp_link * eff)
        out["cp_exposed"] = max(0.0, out["cp"] - attention_s)
    if job.pp > 1:
        send = N * d * num.residual / (job.tp if job.sequence_parallel else 1)
        out["pp"] = 2 * (job.pp - 1) * job.virtual_stages * send / (pp_link * eff)
    return out


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The pipeline's idle share of a step: (p - 1)/(m + p - 1) for GPipe and 1F1B, (p - 1)/(v·m + p - 1) with v
    model chunks per rank (Narayanan et al. 2021, §2.2)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1) if pp > 1 else 0.0


def _elementwise_width(cfg) -> int:
    """Elements per token the MLP's elementwise ops read and write (GELU 2F, SwiGLU 3F, an MoE 3F per routed
    pair plus its routing and weighting)."""
    return family(cfg.arch).mlp_of(cfg).elementwise_width(cfg)


def step_time(job: Job, device, link: float | None = None, tp_link: float | None = None,
              cp_link: float | None = None, pp_link: float | None = None, ep_link: float | None = None
              ) -> dict[str, float]:
    """Predicted seconds of one optimizer step on this rank, by part (compute, optimizer, transfers,
    communication) and in total. link: per-GPU interconnect bytes/s for job.parallel on job.world ranks (default
    NVLink 4); tp_link, cp_link, pp_link: the links the model-parallel groups use (default NVLink 4).

    A tensor-parallel rank runs 1/tp of each split linear and of attention (by heads), a context-parallel rank
    1/cp of the tokens (its queries against the whole causal context); a pipeline stage runs its blocks (the
    head on the last stage) for each of its m micro-batches and waits out the bubble (bubble_fraction). An
    expert-parallel rank (job.ep > 1) reads n_experts/ep experts' weights, runs its share of the routed pairs
    (balanced: N·K, whatever tp) and waits for the all-to-alls over ep_link (kiln.memory.experts). With
    optim.name=muon the optimizer part holds Muon's orthogonalisation of this rank's hidden matrices, also given
    alone as "muon" (kiln.memory.muon_cost)."""
    cfg, num = job.model, job.num
    T, L, tp = job.seq_len, cfg.n_layer, job.tp
    N, d, V = job.tokens, cfg.d_model, cfg.padded_vocab
    c, r = num.compute, num.residual
    peak, bw = device.flops(job.precision), device.bandwidth
    me, be, op_s, _ = time_constants(device)
    nvlink = INTERCONNECTS["nvlink4"]
    # every matmul of the block from its family's description; an MoE's experts as one roofline over the routed
    # rows that reads every expert's weights (expert parallelism would divide `copies` among the ranks); tensor
    # parallelism divides the split linears
    mm = sum(_roofline(2 * N * x.active * x.n_in * x.n_out / s,
                       (N * x.active * x.n_in + x.copies // w * x.n_in * x.n_out + N * x.active * x.n_out) * c / s,
                       peak, bw, me, be)
             for x in family(cfg.arch).linears(cfg)
             for s, w in [(1, job.ep) if x.tp == "expert" and job.ep > 1 else (tp if x.tp != "replicate" else 1, 1)])
    fused = job.backend != "math"
    attn_flops = ATTENTION.flops(cfg, N, T, fused) / tp  # this rank's queries against the context
    attn_bytes = ATTENTION.io_bytes(cfg, N, T, c, fused) / tp
    attn = _roofline(attn_flops, attn_bytes, peak, bw, me, be)
    elem_bytes = N * d * r * 14 / (tp if job.sequence_parallel else 1) + N * _elementwise_width(cfg) * c / tp
    if num.autocast and num.casts:
        elem_bytes += block_matmul_numel(cfg) * 6 / tp  # fp32 weights read, half copies written, every micro-batch
    elem = elem_bytes / (bw * be)
    launch = op_s * OPS_PER_BLOCK
    if job.lora:  # LoRA: the frozen base's backward makes input gradients only; the adapters' matmuls, 3x forward
        adapters = adapter_flops(job.lora, N) / (peak * me)
        fwd_block = mm + adapters + attn + elem + launch
        bwd_block = mm + 2 * adapters + 2.5 * attn + 2 * elem + 2 * launch
    else:
        fwd_block = mm + attn + elem + launch
        bwd_block = 2 * mm + 2.5 * attn + 2 * elem + 2 * launch
    recompute = 0.0
    for first, stop, policy in job.segments():
        n = stop - first
        recompute += n * (fwd_block if policy == "full" else (attn + elem + launch) if policy == "selective" else 0)
    Vr = V / (tp if job.vocab_parallel else 1)
    head_mm = _roofline(2 * N * d * Vr, (N * d + Vr * d + N * Vr) * c, peak, bw, me, be)
    head = (2 if job.lora else 3) * head_mm + (head_mm if job.chunked_loss else 0) + N * Vr * (c + 20) / (bw * be)
    head += op_s * (OPS_HEAD + (12 * math.ceil(N / job.chunked_loss) if job.chunked_loss else 0))
    micro = L * (fwd_block + bwd_block) + recompute + (head if job.last_stage else 0)
    compute = job.grad_accum * micro
    mp = model_parallel_comm(job, tp_link or nvlink, cp_link or nvlink, pp_link or nvlink,
                             job.grad_accum * L * 3.5 * attn)
    # the pipeline: m micro-batches of this stage, plus the bubble while the others fill and drain
    bubble = micro * (job.pp - 1) / job.virtual_stages if job.pp > 1 else 0.0
    compute += bubble + mp["tp"] + mp["cp_exposed"] + mp["pp"]
    a2a = all_to_all_seconds(job, ep_link or nvlink, COMM_EFFICIENCY)  # on the critical path
    compute += a2a

    n_params = _local_params(job, trained=True)
    # Bytes moved per parameter by the update: fused AdamW reads p, g, m, v and writes p, m, v (28); the unfused
    # PyTorch 8-bit AdamW makes ~75 elementwise passes over fp32 temporaries (decode, update, re-encode): ~600.
    # muon: AdamW's pass over the parameters Muon does not take, and Muon's own cost (kiln.memory.muon_cost: its
    # bf16 Newton-Schulz products, 95 GFLOP a step on the tiny model, and its elementwise passes) added below
    per_param = {"adamw": 28, "adam": 28, "sgd": 16, "adamw8bit": 600, "muon": 28}[job.optimizer]
    muon = _memo(_MUON, (_shapes_key(job), job.muon_ns_steps),
                 lambda: muon_cost(local_parameter_shapes(job), job.muon_ns_steps)) \
        if job.optimizer == "muon" else None
    transfers = 0.0
    if job.offload and device.kind == "cuda":
        off = sum(sum(b.values()) for i, b in enumerate(saved_tensors(job)[1]) if i in job.offload)
        transfers = 2 * off * job.grad_accum / device.host_link  # out in forward, back in backward
    compute = max(compute, transfers)  # copies run on their own stream, beside the compute
    clip = 2 * n_params * num.grad / (bw * be)
    if job.optimizer_offload != "none":
        pcie = n_params * (num.grad + num.param) / device.host_link
        host = n_params * per_param / (device.host_bandwidth * be)
        optimizer = pcie + host if job.optimizer_offload == "host" else max(0.0, pcie + host - compute)
    else:
        masters = n_params * 12 if num.master else 0
        optimizer = (n_params - (muon.params if muon else 0)) * per_param / (bw * be) + masters / (bw * be)
    if job.world > 1 and job.dp_strategy.zero_optimizer:
        optimizer /= job.world  # each rank updates its shard
    elif job.world > 1 and job.dp_strategy.shards_parameters:
        optimizer, clip = optimizer / job.world, clip / job.world
    # every DDP rank orthogonalises every matrix of its stage (ZeRO-1, FSDP2 and tp refuse Muon): not divided
    muon_s = muon.seconds(device.flops("bf16"), bw, me, be, op_s) if muon else 0.0
    optimizer += muon_s
    comm = communication(job, link or INTERCONNECTS["nvlink4"], compute)
    total = compute + clip + optimizer + comm["exposed"]
    return {"compute": compute, "recompute": job.grad_accum * recompute, "optimizer": optimizer + clip,
            "transfers": transfers, "communication": comm["seconds"], "exposed_communication": comm["exposed"],
            "bubble": bubble, "tp_communication": mp["tp"], "cp_communication": mp["cp"],
            "pp_communication": mp["pp"], "total": total} | ({"ep_communication": a2a} if job.ep > 1 else {}) \
        | ({"muon": muon_s} if muon else {})


# ---------------------------------------------------------------- search


@dataclass(frozen=True)
class Choice:
    """One point of the search: the levers the planner sets, typed. `on(sections)` applies them to the sections
    a Job is built from (what the estimator sees; their `levers()` are what `--plan.memory` trains, through
    kiln.config.checked); `overrides()` spells them as the command-line flags a user types."""

    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    recompute: str = "none"
    recompute_every: int = 2
    recompute_budget: str = ""
    offload_blocks: str = "none"
    optimizer: str = "adamw"
    optim_offload: str = "none"
    chunked_loss: int = 0
    # the layout over `kiln plan --gpus N` (tp × pp × cp searched, the rest data parallel under ddp, zero1 or
    # fsdp): the one layout object (kiln.parallel.layout), asked below, never copied into fields of its own
    plan: ParallelPlan = field(default_factory=lambda: ParallelPlan(1))

    @property
    def parallel(self) -> str:  # parallel.strategy
        return self.plan.strategy

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def pp(self) -> int:
        return self.plan.pp

    @property
    def cp(self) -> int:
        return self.plan.cp

    @property
    def ep(self) -> int:  # expert parallel: carved out of dp (kiln.memory.experts)
        return getattr(self.plan, "ep", 1)

    @property
    def sequence_parallel(self) -> bool:
        return self.plan.sequence_parallel

    @property
    def pp_schedule(self) -> str:
        return self.plan.pp_schedule

    @property
    def pp_microbatches(self) -> int:
        return self.plan.pp_microbatches

    def overrides(self) -> dict[str, object]:
        """The choice as command-line flags (section.key: value), for the user to read and type."""
        out = {"parallel.strategy": self.parallel, "precision.mode": self.precision, "train.micro_batch_size": self.micro_batch_size,
               "train.grad_accum_steps": self.grad_accum_steps, "memory.recompute": self.recompute,
               "memory.recompute_every": self.recompute_every, "memory.recompute_budget": self.recompute_budget,
               "memory.offload_blocks": self.offload_blocks, "optim.name": self.optimizer,
               "optim.offload": self.optim_offload, "memory.chunked_loss": self.chunked_loss}
        if self.tp > 1:
            out |= {"parallel.tp": self.tp, "parallel.sequence_parallel": self.sequence_parallel}
        if self.pp > 1:
            out |= {"parallel.pp": self.pp, "parallel.pp_schedule": self.pp_schedule,
                    "parallel.pp_microbatches": self.pp_microbatches}
        if self.cp > 1:
            out["parallel.cp"] = self.cp
        if self.ep > 1:
            out["parallel.ep"] = self.ep
        return out

    def layout(self, gpus: int) -> str:
        """tp8·pp4·dp32: the split of `gpus`, outermost first as on the mesh; sp, the schedule and its micro-batches
        after it."""
        dp = gpus // (self.tp * self.pp * self.cp)
        dims = [f"{k}{v}" + (f"(ep{self.ep})" if k == "dp" and self.ep > 1 else "")
                for k, v in (("pp", self.pp), ("dp", dp), ("cp", self.cp), ("tp", self.tp)) if v > 1]
        extra = (["sp"] if self.sequence_parallel else []) + (
            [f"{'i1f1b' if self.pp_schedule == 'interleaved_1f1b' else self.pp_schedule}/m{self.pp_microbatches}"]
            if self.pp > 1 else [])
        return " ".join(["·".join(dims or ["1"]), *extra])

    def on(self, sections: JobSections) -> JobSections:
        """The sections with this choice in them: for the estimator, and (their levers()) for training."""
        s = sections
        return replace(s, precision=replace(s.precision, mode=self.precision),
                       train=replace(s.train, micro_batch_size=self.micro_batch_size,
                                     grad_accum_steps=self.grad_accum_steps),
                       memory=replace(s.memory, recompute=self.recompute, recompute_every=self.recompute_every,
                                      recompute_budget=self.recompute_budget, offload_blocks=self.offload_blocks,
                                      chunked_loss=self.chunked_loss),
                       optim=replace(s.optim, name=self.optimizer, offload=self.optim_offload),
                       parallel=replace(s.parallel, strategy=self.parallel, tp=self.tp, pp=self.pp, cp=self.cp,
                                        sequence_parallel=self.sequence_parallel, pp_schedule=self.pp_schedule,
                                        pp_microbatches=self.pp_microbatches, ep=self.ep))

    def describe(self) -> str:
        parts = [self.precision, f"mb {self.micro_batch_size}×{self.grad_accum_steps}", f"recompute {self.recompute}"]
        if strategy(self.parallel).reduces:
            parts.insert(0, self.parallel)
        if self.tp * self.pp * self.cp > 1:
            parts.insert(0, self.layout(self.tp * self.pp * self.cp).replace("dp", ""))
        if self.ep > 1:
            parts.insert(0, f"ep{self.ep}")
        if self.offload_blocks != "none":
            parts.append(f"offload {self.offload_blocks}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.optim_offload != "none":
            parts.append(f"optimizer on {self.optim_offload}")
        if self.chunked_loss:
            parts.append(f"chunked loss {self.chunked_loss}")
        return ", ".join(parts)


@dataclass
class Candidate:
    choice: Choice
    breakdown: Breakdown
    times: dict[str, float]
    fits: bool

    @property
    def total_bytes(self) -> int:
        return self.breakdown.total_bytes

    @property
    def step_s(self) -> float:
        return self.times["total"]

    @property
    def overrides(self) -> dict[str, object]:
        """The choice as command-line flags (section.key: value), for the user to read and type."""
        return self.choice.overrides()

    def to_json(self) -> dict:
        return {"overrides": self.overrides, "total_bytes": self.total_bytes, "predicted_step_s": self.step_s,
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
                f"({s.choice.describe()}) needs {fmt_bytes(s.total_bytes)}, {fmt_bytes(over)} more than "
                f"available; of it, model state on the device is {fmt_bytes(state)}, activations and logits "
                f"{fmt_bytes(comp['activations'] + comp['logits'])}, device overhead "
                f"{fmt_bytes(comp['device_overhead'])}")

    def to_json(self) -> dict:
        return {"device": self.device.name, "memory_bytes": self.memory,
                "global_batch_tokens": self.global_sequences * self.seq_len, "considered": self.considered,
                "best": self.best.to_json() if self.best else None,
                "candidates": [c.to_json() for c in self.candidates],
                "shortfall": None if self.best else self.shortfall()}


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
        if device.supports("fp8"):  # ranked at bf16's rate (its speed-up is measured, not assumed): bf16 wins ties
            modes.append("fp8")
    else:
        modes = ["fp16", "fp32"]  # no bf16 before Ampere
    return modes


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _valid(choice: Choice, optim=None) -> bool:
    """Combinations kiln.config refuses: the strategy table's rule (with tp beside it: Muon refuses tp), and,
    given the user's `optim` section, the optimizer's own (OptimConfig.validate: Muon refuses optim.offload)."""
    if strategy(choice.parallel).refusal(optim_offload=choice.optim_offload, precision=choice.precision,
                                         optimizer=choice.optimizer, tp=choice.tp) is not None:
        return False
    if optim is None:
        return True
    try:
        replace(optim, name=choice.optimizer, offload=choice.optim_offload).validate()
    except KilnError:
        return False
    return True


GPUS_PER_NODE = 8  # tensor parallelism stays inside a node (its collectives run on every block)
# The strategies searched, in kiln.parallel.strategy's order: with data-parallel copies every one that reduces
# gradients, and for a model-parallel layout (a smaller search, docs/parallel.md) those that shard the optimizer state
DATA_PARALLEL = tuple(name for name, s in STRATEGIES.items() if s.reduces)
SHARDING = tuple(name for name, s in STRATEGIES.items() if s.shards_optimizer)
NO_DATA_PARALLEL = next(name for name, s in STRATEGIES.items() if not s.reduces)
SHARDED = next(name for name, s in STRATEGIES.items() if s.shards_parameters)  # the layout ep's degrees are checked in


def layouts(sections: JobSections, gpus: int, global_sequences: int, gpus_per_node: int = GPUS_PER_NODE,
            context: bool = True) -> list[tuple[int, int, int]]:
    """(tp, pp, cp) splits of `gpus` the planner tries: tp within a node dividing the heads, kv-heads and the
    split linears (ParallelPlan.build refuses the rest, so they are skipped), pp at most n_layer, cp up to 8
    dividing data.seq_len (modelled only), and a data-parallel rest that divides the global batch."""
    model = sections.model.resolve()
    T = sections.seq_len
    out = []
    for tp in _divisors(gpus):
        if tp > gpus_per_node:
            continue
        for pp in _divisors(gpus // tp):
            if pp > model.n_layer:
                continue
            for cp in (_divisors(gpus // (tp * pp)) if context else [1]):
                dp = gpus // (tp * pp * cp)
                if cp > 8 or T % cp or global_sequences % dp or (cp > 1 and tp * cp > gpus_per_node):
                    continue
                out.append((tp, pp, cp))
    return out


def search(sections: JobSections, device, memory: int | None = None, global_batch_tokens: int = 0, gpus: int = 1,
           interconnect: str = "nvlink4", model_parallel: bool = True, gpus_per_node: int = GPUS_PER_NODE,
           inter_node: str = "ib-ndr", quick: bool = False, context: bool = True, expert: bool = True) -> Plan:
    """gpus > 1: every rank has `memory`; the strategies ddp, zero1 and fsdp are searched too, their step time
    including the collectives over `interconnect` inside a node and `inter_node` between nodes of
    `gpus_per_node`. model_parallel: also search tensor × pipeline × context-parallel layouts (`layouts`), each
    with sequence parallelism on, 1F1B and interleaved 1F1B with one pipeline micro-batch per micro-batch, and a
    smaller set of levers (recompute none / selective / full, chunked loss, the two fastest precisions). quick: that
    smaller set for the data-parallel-only layout too, and the fastest precision only
    (benchmarks/parallel_table.py). context: also the (modelled-only) context-parallel layouts. expert: for a
    mixture of experts, also every expert-parallel degree ep > 1 that divides the data-parallel ranks and the
    experts (kiln.memory.experts.ep_degrees), each layout's smaller set of levers; a layout the runtime refuses
    (kiln.parallel.layout.check_degrees: ep with ZeRO-1) is skipped."""
    for name in (interconnect, inter_node):
        if name not in INTERCONNECTS:
            raise KilnError(f"interconnect {name!r} is unknown; use one of {', '.join(INTERCONNECTS)}",
                            key="interconnect" if name == interconnect else "inter_node", value=name,
                            fix=f"use one of {', '.join(INTERCONNECTS)}")
    s = sections
    memory = memory or device.memory
    T = s.seq_len
    tokens = global_batch_tokens or s.train.micro_batch_size * s.train.grad_accum_steps * T * gpus
    if tokens % T:
        raise KilnError(f"--global-batch-tokens={tokens} is not a multiple of data.seq_len={T}",
                        key="--global-batch-tokens", value=tokens, fix=f"give a multiple of data.seq_len={T}")
    G = tokens // T
    splits = layouts(s, gpus, G, gpus_per_node, context) if model_parallel and gpus > 1 else [(1, 1, 1)]
    if G % gpus and not any(G % (gpus // (tp * pp * cp)) == 0 for tp, pp, cp in splits):
        raise KilnError(f"the global batch of {G} sequences (--global-batch-tokens={tokens}) cannot be shared "
                        f"by {gpus} GPUs; make it a multiple",
                        key="--global-batch-tokens", value=tokens, fix="make it a multiple")
    base = job_for(s, device, recompute_plan=("none",) * s.model.resolve().n_layer)
    L = base.model.n_layer
    # the user's optimizer; adamw also as its 8-bit form (the same update on block-quantized moments, named in the
    # table and the flags). adam is not offered it: AdamW8bit decouples the weight decay that adam adds to the gradient
    optimizers = [s.optim.name] + (["adamw8bit"] if s.optim.name == "adamw" else [])
    opt_offloads = ["none", "host"] if device.kind == "cuda" else ["none"]
    links = {"intra": INTERCONNECTS[interconnect], "inter": INTERCONNECTS[inter_node]}
    choices, model_parallel_choices, considered = [], [], 0
    model = s.model.resolve()
    for tp, pp, cp in splits:
        dp = gpus // (tp * pp * cp)
        if G % dp:
            continue
        per_rank = G // dp
        strategies = DATA_PARALLEL if dp * cp > 1 else (NO_DATA_PARALLEL,)
        if expert and model_parallel:
            split = replace(s.parallel, tp=tp, pp=pp, cp=cp, strategy=SHARDED, sequence_parallel=tp > 1)
            model_parallel_choices += [(tp, pp, cp, dp, per_rank, strategies, ep)
                                       for ep in ep_degrees(split, gpus, model)]
        if tp * pp * cp == 1 and not quick:  # data parallel only: every lever
            choices += [
                c for c in (
                    Choice(precision, mb, per_rank // mb, policy, offload_blocks=offload, optimizer=optimizer,
                           optim_offload=opt_off, chunked_loss=chunk, plan=ParallelPlan(gpus, strategy=name))
                    for name, precision, mb, policy, optimizer, opt_off in itertools.product(
                        strategies, _precisions(device), _divisors(per_rank), ("none", "selective", "every_k",
                                                                                "full", "budget"), optimizers,
                        opt_offloads)
                    for offload in (["none", "all"] if device.kind == "cuda" and policy == "none" else ["none"])
                    for chunk in (0, chunk_for(base.model.padded_vocab, mb * T)))
                if _valid(c, s.optim)]
            continue
        model_parallel_choices.append((tp, pp, cp, dp, per_rank, strategies, 1))
    everything = [c for c in (_evaluate(s, device, choice, memory, L, gpus, links, gpus_per_node)
                              for choice in choices) if c is not None]
    for tp, pp, cp, dp, per_rank, strategies, ep in model_parallel_choices:
        found, tried = _search_layout(s, device, memory, L, gpus, links, gpus_per_node, tp, pp, cp, dp, per_rank,
                                      strategies, base.model.padded_vocab, 1 if quick else 2, ep)
        everything += found
        considered += tried
    fitting = sorted((c for c in everything if c.fits), key=lambda c: (c.step_s, c.total_bytes))
    # Identical predictions (e.g. a budget plan that came out as 'none') are listed once.
    unique, seen = [], set()
    for c in fitting:
        key = (round(c.step_s, 9), c.total_bytes)
        if key not in seen:
            seen.add(key)
            unique.append(c)
    smallest = min(everything, key=lambda c: c.total_bytes)
    return Plan(device=device, memory=memory, global_sequences=G, seq_len=T, candidates=unique,
                smallest=smallest, considered=len(choices) + considered)


def _search_layout(sections: JobSections, device, memory, L, gpus, links, gpus_per_node, tp, pp, cp, dp, per_rank,
                   strategies, vocab, precisions: int = 2, ep: int = 1) -> tuple[list[Candidate], int]:
    """One model-parallel layout's candidates: for each strategy, precision, micro-batch and schedule, the least
    recompute (none, then selective, then full; each without, then with the chunked loss) that fits — more
    recompute only costs time — and nothing more once a micro-batch of 1 fits with none of them. With tp > 1 the
    logits are split over the vocabulary instead (the chunked loss is refused there). The optimizer is the user's
    (sections.optim.name); with data-parallel copies the strategies that shard its state are searched, or, when the
    table refuses them all with it (Muon needs whole matrices), those that reduce gradients and take it (ddp)."""
    T = sections.seq_len
    found, tried = [], 0
    schedules = ("1f1b", "interleaved_1f1b") if pp > 1 else ("1f1b",)
    modes = _precisions(device)[:precisions]
    def takes(name):  # the strategy holds the user's optimizer in at least one precision searched
        return any(strategy(name).refusal(optim_offload="none", precision=mode, optimizer=sections.optim.name)
                   is None for mode in modes)
    names = strategies if dp * cp == 1 else (tuple(n for n in SHARDING if takes(n))
                                             or tuple(n for n in DATA_PARALLEL if takes(n)))
    for name in names:
        for precision in modes:
            for schedule in schedules:
                for mb in _divisors(per_rank):
                    m = per_rank // mb
                    if pp > 1 and m < pp:
                        continue
                    fitted, refused = False, False
                    chunks = (0,) if tp > 1 else (0, chunk_for(vocab, mb * T // cp))
                    for policy, chunk in itertools.product(("none", "selective", "full"), chunks):
                        layout = with_ep(ParallelPlan(gpus, tp, pp, name, tp > 1, schedule, m if pp > 1 else 0,
                                                      2 if schedule == "interleaved_1f1b" and pp > 1 else 1, cp), ep)
                        c = Choice(precision, mb, m, policy, optimizer=sections.optim.name, chunked_loss=chunk,
                                   plan=layout)
                        if not _valid(c, sections.optim):
                            refused = True
                            break
                        tried += 1
                        cand = _evaluate(sections, device, c, memory, L, gpus, links, gpus_per_node)
                        if cand is None:  # the runtime refuses this layout
                            refused = True
                            break
                        found.append(cand)
                        if cand.fits:
                            fitted = True
                            break
                    if refused or not fitted:  # a larger micro-batch holds more: it will not fit either
                        break
    return found, tried


def _links(choice: Choice, gpus: int, links: dict, gpus_per_node: int) -> dict[str, float]:
    """The link each group's collectives cross, on the mesh (pp, dp, cp, tp), tp innermost: a group whose ranks lie
    within one node of gpus_per_node talks over the node's link, one that spans nodes over the slower one."""
    dp = gpus // (choice.tp * choice.pp * choice.cp)
    def over(span):
        return links["intra"] if span <= gpus_per_node else links["inter"]
    return {"link": over(choice.tp * choice.cp * dp), "tp_link": over(choice.tp), "cp_link": over(choice.tp * choice.cp),
            "pp_link": over(gpus)} | ({"ep_link": over(choice.tp * choice.cp * choice.ep)} if choice.ep > 1 else {})


def _evaluate(sections: JobSections, device, choice: Choice, memory: int, L: int, gpus: int = 1,
              links: dict | float | None = None, gpus_per_node: int = GPUS_PER_NODE) -> Candidate | None:
    if not isinstance(links, dict):  # one link for everything (a single node)
        link = links or INTERCONNECTS["nvlink4"]
        links = {"intra": link, "inter": link}
    dp_cp = gpus // (choice.tp * choice.pp)
    job = job_for(choice.on(sections), device, recompute_plan=("none",) * L, world=dp_cp)
    if choice.recompute == "budget":
        plan = _fill_budget(job, device, memory)
        if plan is None:
            return None
        plan, budget = plan
        choice = replace(choice, recompute_budget=str(budget))
    else:
        plan = recompute_plan(choice.recompute, L, choice.recompute_every)
    job = replace(job, recompute=plan)
    wired = _links(choice, gpus, links, gpus_per_node)
    if choice.tp * choice.pp * choice.cp * choice.ep == 1:
        b = estimate(job)
        return Candidate(choice, b, step_time(job, device, wired["link"]), b.total_bytes <= memory)
    try:
        # the first stage holds the most blocks and micro-batches in flight, the last the head: every other
        # stage is bounded by these two in memory and time
        _, stages = rank_jobs(choice.on(sections), device, gpus, plan, stages=lambda layout: sorted({0, layout.pp - 1}))
    except ValueError:  # a layout the runtime refuses (tp not dividing the heads, too few blocks)
        return None
    estimates = [estimate(j) for j in stages]
    worst = max(estimates, key=lambda e: e.total_bytes)
    times = max((step_time(j, device, **wired) for j in stages), key=lambda t: t["total"])
    return Candidate(choice, worst, times, worst.total_bytes <= memory)


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
