"""Bytes of one training step, derived tensor by tensor from kiln's own model code.

    estimate(job) -> Breakdown     components alive at the predicted peak, per-block activations, a timeline
    Job                            everything memory depends on (kiln.memory.levers.job_of builds it from the config
                                   sections a Job is built from, kiln.memory.levers.JobSections)

Every saved-for-backward tensor of kiln's model is listed in `_block_tensors` and `_head_tensors` with its size as
a function of micro-batch B, sequence T, width d, heads H, kv-heads KV, head size hd, MLP width F, vocabulary V,
the precision mode and the attention backend. A block's tensors come from the parts its family's description
names (kiln.models.family: norm, positions, qk_norm, mlp), each accounted once; every part states its own saved
tensors, widths and backward peak (the norm, MLP and positions: kiln.models.costs; the attention core and
QK-norm: kiln.models.attention_costs): nothing here knows a family's name or a part's kind.
`docs/memory.md` derives each line; the tests compare the sum with the bytes that
torch.autograd.graph.saved_tensors_hooks sees, storage by storage, for every family.

The step (`estimate`): `_model_state` (parameters, gradients, masters, optimizer state, on the device and the
host), `saved_tensors` (per block, by recompute policy), the transients, then `_simulate` walks a steady step
and the first one event by event; the peak is the largest event.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from kiln.errors import KilnError
from kiln.memory import adapters as lora_
from kiln.memory.experts import expert_comm, is_expert
from kiln.memory.muon_cost import is_muon_matrix
from kiln.models import softcap
from kiln.models.attention_costs import ATTENTION, QK_NORM
from kiln.models.config import ModelConfig
from kiln.models.registry import family
from kiln.parallel.layout import ParallelPlan
from kiln.parallel.strategy import Strategy, strategy
from kiln.precision import PRECISIONS, mode

KiB, MiB, GiB = 1024, 1024**2, 1024**3
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1024**4}

COMPONENTS = ("parameters", "gradients", "master_weights", "optimizer_states", "activations", "logits",
              "weight_casts", "temporaries", "comm_buffers", "buffers", "device_overhead")


def parse_bytes(text: str | int | float, key: str | None = None) -> int:
    """'24GiB' -> 25769803776, '80GB' -> 8e10, '512MiB', '1.5e9' -> bytes. key: the config key or flag the text
    was given as, which an unreadable one's error names."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        fix = "write it like 24GiB, 80GB or 512MiB"
        raise KilnError(f"{key}={text!r}: cannot read it as a size; {fix}" if key else
                        f"cannot read {text!r} as a size; {fix}", key=key, value=text, fix=fix)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------- numerics of the precision modes


# The state layout of kiln.train.adam8bit.AdamW8bit, which takes these constants from here.
ADAM8BIT_BLOCK = 256  # elements sharing one fp32 scale
ADAM8BIT_MIN = 4096  # smaller tensors keep fp32 moments
ADAM8BIT_CHUNK = 1 << 20  # elements dequantized and updated at once (a multiple of ADAM8BIT_BLOCK)


def adam8bit_state_bytes(numel: int) -> int:
    """Bytes of this optimizer's state for one parameter tensor of `numel` elements (4 of them the fp32 step count,
    a device tensor as in torch's fused AdamW)."""
    if numel < ADAM8BIT_MIN:
        return 8 * numel + 4
    blocks = math.ceil(numel / ADAM8BIT_BLOCK)
    return 2 * (blocks * ADAM8BIT_BLOCK + 4 * blocks) + 4  # two moments: codes (padded to whole blocks) + one scale per block


@dataclass(frozen=True)
class Numerics:
    """Bytes per element of each kind of tensor under one precision mode (kiln/train/precision.py)."""

    param: int  # a parameter on the device
    grad: int  # its .grad (same dtype as the parameter)
    master: int  # fp32 master copy held by MasterWeights (bf16-master only)
    residual: int  # the residual stream: block inputs and outputs, norm inputs
    compute: int  # matmul outputs and what attention and the MLP make of them
    autocast: bool  # linears see half-precision copies of their input and weight, made by autocast
    casts: bool = True  # autocast copies the weights (fp32) to half precision; False when they are half already
    gathered: int = 0  # bytes per element of FSDP2's all-gathered parameters (0: the parameter's own)
    frozen: bool = False  # LoRA's frozen base (kiln.memory.adapters.lora_numerics): no gradient, no state
    base: int = 0  # bytes per element of a frozen base parameter (kiln.precision's Mode.frozen_bytes; 0: `param`)

    @property
    def half_weights(self) -> bool:
        """The norms see half-precision weights (bf16 parameters, or FSDP2 gathering them in bf16)."""
        return self.param == 2 or self.gathered == 2 or self.base == 2


# FSDP2 with MixedPrecisionPolicy(param_dtype=bf16), which kiln's bf16 mode uses under parallel.strategy=fsdp
# (kiln.train.state): the fp32 shards are gathered as bf16, so autocast finds the linears' weights in bf16 already
# and makes no copies; the embedding then returns bf16 and each block's inputs are cast to bf16
# (cast_forward_inputs), so the residual stream is bf16 too. The fp32 shards and their fp32 gradients stay.
FSDP_BF16 = Numerics(4, 4, 0, 2, 2, True, casts=False, gathered=2)


# Each mode's bytes from its row (kiln.precision): autocast (bf16, fp16) keeps fp32 parameters and residual and
# multiplies in half precision; bf16-master keeps bf16 parameters and activations with fp32 masters beside them.
# torchao's float8 linears (fp8) save their high-precision (bf16) inputs for backward, as autocast does; their fp8
# weight casts (1 byte) are counted as bf16's autocast cache (2): an over-count, not yet measured on a GPU.
NUMERICS = {m.name: Numerics(m.param_bytes, m.grad_bytes, m.master_bytes, m.residual_bytes, m.compute_bytes,
                             m.autocast is not None) for m in PRECISIONS.values()}


@dataclass(frozen=True)
class Target:
    """What the device changes in the accounting."""

    kind: str = "cpu"  # "cpu" | "cuda"
    capability: float = 9.0  # CUDA compute capability: flash attention needs ≥ 8.0
    context_bytes: int = 0  # outside the allocator: CUDA context and kernels (or the CPU process' baseline)
    fragmentation: float = 0.0  # allowance between allocated and reserved memory, as a share of the peak

    def mask_bytes(self, dtype_bytes: int) -> int:
        # CUDA dropout is the fused native_dropout with a bool mask; CPU multiplies by a mask of the input dtype.
        return 1 if self.kind == "cuda" else dtype_bytes

    def layernorm_stat_bytes(self, dtype_bytes: int) -> int:
        # mean and rstd: fp32 on CUDA whatever the input; the input's dtype on CPU.
        return 4 if self.kind == "cuda" else dtype_bytes


# ---------------------------------------------------------------- the job


def data_parallel(strategy_name: str = "none", ranks: int = 1) -> ParallelPlan:
    """The plan of data parallelism alone: `ranks` copies of the whole model under parallel.strategy."""
    return ParallelPlan(ranks, strategy=strategy_name)


@dataclass(frozen=True)
class Job:
    """Everything the bytes of a training step depend on."""

    model: ModelConfig  # resolved, vocab_size known
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    precision: str = "fp32"  # concrete mode (not "auto")
    target: Target = field(default_factory=Target)
    attention: str = "auto"  # "auto" | "flash" | "efficient" | "math"
    recompute: tuple[str, ...] = ()  # per block: "none" | "selective" | "full" | "seg" (inside a full segment)
    offload: frozenset = frozenset()  # block indices whose saved tensors go to pinned host memory
    chunked_loss: int = 0  # tokens per chunk of the LM head + cross-entropy; 0 = the whole [N x V] at once
    optimizer: str = "adamw"  # "adamw" | "adam" | "sgd" | "adamw8bit"
    sgd_momentum: float = 0.9
    muon_ns_steps: int = 5  # optim.muon_ns_steps: Muon's Newton-Schulz iterations (its step time, not memory)
    optimizer_offload: str = "none"  # "none" | "host" | "host-async"
    reshard_after_forward: bool = True  # fsdp: gathered parameters freed after each block's forward (ZeRO-3)
    # The layout this rank belongs to (kiln.parallel.layout.ParallelPlan, the run's one layout object: Job asks
    # it, never keeps its own degrees; data_parallel(strategy, ranks) for data parallelism alone). With pp > 1,
    # `model` is this rank's stage (levers.for_rank): n_layer is the blocks it holds, micro_batch the pipeline's
    # micro-batch and grad_accum the pipeline micro-batches per step.
    plan: ParallelPlan = field(default_factory=lambda: ParallelPlan(1))
    stage: int = 0  # this rank's pipeline stage (0: holds the embeddings; pp - 1: the final norm, head, loss)
    lora: lora_.Adapters | None = None  # LoRA: the base frozen, these adapters trained (kiln.memory.adapters)

    @property
    def parallel(self) -> str:
        """Data parallelism: none | ddp | zero1 | fsdp (kiln.parallel)."""
        return self.plan.strategy

    @property
    def world(self) -> int:
        """Ranks sharing the model state (dp × cp); the breakdown is one rank's."""
        return self.plan.dp * self.plan.cp

    @property
    def tp(self) -> int:  # column/row linears and their activations split tp ways
        return self.plan.tp

    @property
    def sequence_parallel(self) -> bool:  # tp: norms, dropout and the residual stream on 1/tp of the sequence
        return self.plan.sequence_parallel

    @property
    def vocab_parallel(self) -> bool:  # tp: embedding and head split by vocabulary rows (kiln.parallel.tensor)
        return self.plan.tp > 1

    @property
    def cp(self) -> int:  # context parallel (modelled only): the sequence split cp ways, ring attention
        return self.plan.cp

    @property
    def pp(self) -> int:
        return self.plan.pp

    @property
    def ep(self) -> int:  # expert parallel: n_experts / ep whole experts on this rank, carved out of dp
        return getattr(self.plan, "ep", 1)

    @property
    def pp_schedule(self) -> str:  # gpipe | 1f1b | interleaved_1f1b
        return self.plan.pp_schedule

    @property
    def virtual_stages(self) -> int:  # model chunks per pipeline rank (interleaved_1f1b: 2)
        return self.plan.virtual_stages

    @property
    def dp_strategy(self) -> Strategy:
        """What `parallel` does to the model state of the `world` ranks (kiln.parallel.strategy)."""
        return strategy(self.parallel)

    @property
    def mode_num(self) -> Numerics:
        """The precision mode's bytes, which trained parameters (all of them, or LoRA's adapters) follow."""
        if self.dp_strategy.shards_parameters and mode(self.precision).fsdp_gather is not None:
            return FSDP_BF16
        return NUMERICS[self.precision]

    @property
    def num(self) -> Numerics:
        """... and what the forward sees: under LoRA a frozen bf16 base (kiln.memory.adapters.lora_numerics)."""
        return lora_.lora_numerics(self.mode_num, mode(self.precision).frozen_bytes) if self.lora else self.mode_num

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank: context parallelism splits the sequence."""
        return self.micro_batch * self.seq_len // self.cp

    def in_flight(self) -> float:
        """Micro-batches whose saved activations this pipeline rank holds at once, in units of all its blocks (the
        schedules of torch.distributed.pipelining): GPipe runs every forward before any backward (all m); 1F1B
        runs pp - stage forwards before its first backward (Schedule1F1B's warmup); interleaved 1F1B holds
        (v - 1)·r + 2·(pp - 1 - stage) + 1 chunk forwards of 1/v of its blocks each (r micro-batches per round,
        = pp when m is a multiple of it; _get_warmup_ops), i.e. pp + (pp - 1)/v on stage 0 — Korthikanti et al.
        2022, §4.2.3: the interleaved schedule's first stage stores 1 + (p - 1)/(p·v) times 1F1B's."""
        m = self.grad_accum
        if self.pp == 1:
            return 1
        if self.pp_schedule == "gpipe":
            return m
        if self.pp_schedule == "1f1b":
            return min(m, self.pp - self.stage)
        v = self.virtual_stages
        per_round = m // max(1, m // self.pp)
        chunks = min((v - 1) * per_round + 2 * (self.pp - 1 - self.stage) + 1, m * v)
        return chunks / v

    def in_flight_later(self) -> float:
        """... while a later micro-batch's backward runs (the gradients then exist): the k-th backward (k ≥ 1) has
        at most m - k micro-batches forwarded and not yet backwarded, so at most m - 1. Measured on 2 gloo ranks
        (pp2, m = 2, tests/memory/test_rank_peak.py): the first stage holds one micro-batch's bf16 weight copies
        at its peak, not two."""
        return min(self.in_flight(), max(1, self.grad_accum - 1))

    @property
    def backend(self) -> str:
        return ATTENTION.backend(self.model, self.num, self.target) if self.attention == "auto" else self.attention

    def policy(self, i: int) -> str:
        return self.recompute[i] if self.recompute else "none"

    def segments(self) -> list[tuple[int, int, str]]:
        """Blocks grouped as recompute sees them: (first, last+1, policy); a "full" segment may span blocks."""
        out, i, L = [], 0, self.model.n_layer
        while i < L:
            p = self.policy(i)
            j = i + 1
            if p == "full":
                while j < L and self.policy(j) == "seg":
                    j += 1
            out.append((i, j, p))
            i = j
        return out


def recompute_plan(policy: str, n_layer: int, every: int = 2) -> tuple[str, ...]:
    """Per-block policies for the uniform policies (budget is solved in kiln.memory.recompute)."""
    if policy in ("none", "full", "selective"):
        return (policy,) * n_layer
    if policy == "every_k":
        if every < 1:
            raise KilnError(f"memory.recompute_every must be ≥ 1, got {every}", key="memory.recompute_every",
                            value=every, fix="give a whole number ≥ 1")
        return tuple("full" if i % every == 0 else "seg" for i in range(n_layer))
    raise KilnError(f"memory.recompute={policy!r} has no uniform plan", key="memory.recompute", value=policy,
                    fix="use none, full, selective or every_k (budget is solved by kiln.memory.recompute.solve_budget)")


# ---------------------------------------------------------------- parameters


def parameter_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter tensor of Transformer(cfg), tied weights once, in model order."""
    return family(cfg.arch).parameter_shapes(cfg)


def parameter_numels(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(name, numel) of every parameter tensor of Transformer(cfg), tied weights once, in model order."""
    return [(name, math.prod(shape)) for name, shape in parameter_shapes(cfg)]


def tp_shard_shape(name: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int, vocab_parallel: bool = False
                   ) -> tuple[int, ...] | None:
    """The local shape of one parameter on a tensor-parallel rank, by its linear's role in the family's description
    (kiln.models.family.Linear.tp): column = output rows split (Shard(0), as torch's ColwiseParallel: the weight
    and its bias), row = input columns split (Shard(1), RowwiseParallel; its bias is replicated), expert = an MoE's
    stacked experts, whole on every tp rank as its router (expert parallelism divides them), replicate and everything
    outside the linears (norms, positions) whole; the embedding and an untied head split by vocabulary rows
    only with vocab_parallel."""
    if tp == 1:
        return shape
    parts = name.split(".")
    if parts[0] in ("embed", "head"):
        return (shape[0] // tp, *shape[1:]) if vocab_parallel else shape
    if parts[0] != "blocks":
        return shape
    module, kind = ".".join(parts[2:-1]), parts[-1]
    if module.startswith("mlp.experts."):  # stacked experts (E, out, in), whole on every tp rank (kiln.parallel.tensor)
        return shape
    role = family(cfg.arch).tp_layout(cfg).get(module, "replicate")
    if role == "column":
        return (shape[0] // tp, *shape[1:])
    if role == "row" and kind == "weight":
        return (shape[0], shape[1] // tp)
    return shape


def local_parameter_shapes(job: "Job") -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the parameters this rank's model part holds before data-parallel sharding: its pipeline
    stage's (job.model is the stage: its blocks; the embeddings on the first stage, the final norm and head on the
    last, a tied embedding on both as two copies whose gradients the runtime sums) split by tensor parallelism
    (tp_shard_shape). A later test compares their bytes with the sum of the local DTensor shards."""
    key = _shapes_key(job)
    if key not in _SHAPES:
        if len(_SHAPES) > 64:  # the planner's search asks a few layouts' shapes many times each
            _SHAPES.clear()
        _SHAPES[key] = tuple(_local_parameter_shapes(job))
    return _SHAPES[key]


_SHAPES: dict = {}  # local_parameter_shapes by what they depend on: an MoE of 128 experts × 48 blocks lists 12,000
_NUMELS: dict = {}
_BLOCKS: dict = {}


def _shapes_key(job: "Job") -> tuple:
    return repr(job.model), job.pp, job.stage, job.tp, job.vocab_parallel, job.ep, job.lora


def _local_parameter_shapes(job: "Job") -> list[tuple[str, tuple[int, ...]]]:
    cfg = job.model
    shapes = parameter_shapes(cfg)
    if job.pp > 1:
        def kept(name):
            top = name.split(".")[0]
            return (top not in ("embed", "pos_embed") or job.first_stage) and (top not in ("norm", "head")
                                                                               or job.last_stage)
        shapes = [(n, s) for n, s in shapes if kept(n)]
        if cfg.tie_embeddings and job.last_stage and not job.first_stage:
            shapes.append(("head.weight", (cfg.padded_vocab, cfg.d_model)))
    out = []
    for name, shape in shapes + lora_.adapter_shapes(job.lora, cfg):
        if job.ep > 1 and is_expert(name):
            # expert parallelism (kiln.memory.experts): this rank's n_experts / ep whole experts, not split by tp
            local = _ep_shard(name, shape, cfg, job.ep)
        else:
            local = tp_shard_shape(name, shape, cfg, job.tp, job.vocab_parallel)
        if local is not None:
            out.append((name, local))
    return out


def _ep_shard(name: str, shape: tuple[int, ...], cfg: ModelConfig, ep: int) -> tuple[int, ...] | None:
    """The expert-parallel rank's part of an expert parameter: an expert of its own whole (the first n_experts/ep
    are rank 0's), a stacked tensor's n_experts/ep rows of its first dimension."""
    part = name.split(".")[4]
    if part.isdigit():
        return shape if int(part) < cfg.n_experts // ep else None
    return (shape[0] // ep, *shape[1:])


def trainable(job: "Job", name: str) -> bool:
    """Whether a parameter is trained: all of them, or under LoRA the adapters only."""
    return job.lora is None or lora_.is_adapter(name)


def _dp_ranks(job: "Job", name: str) -> int:
    """Ranks a parameter's state is data-parallel over: an expert's over dp·cp / ep (its expert-parallel peers
    hold other experts), everything else over dp·cp."""
    return job.world // job.ep if job.ep > 1 and is_expert(name) else job.world


def rank_state(job: "Job") -> dict[str, int]:
    key = (_shapes_key(job), job.parallel, job.world, job.precision, job.optimizer, job.sgd_momentum)
    return dict(_memo(_STATES, key, lambda: _rank_state(job)))


_STATES: dict = {}


def _memo(table: dict, key, make):
    """table[key], made once: the planner's search asks the same layout's model state for every lever."""
    if key not in table:
        if len(table) > 64:
            table.clear()
        table[key] = make()
    return table[key]


def _rank_state(job: "Job") -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes one rank holds under data parallelism (job.parallel on
    job.world ranks), as kiln builds them:

    ddp    everything replicated (DDP's own gradient buckets are not counted here: see docs/memory.md).
    zero1  ZeroRedundancyOptimizer's partition: parameters largest first, each to the rank holding the fewest
           elements so far (torch's greedy rule, over kiln's two groups: decayed matrices, then the rest); this
           returns rank 0's share.
    fsdp   FSDP2 shards every parameter on its first dimension into ceil(dim0 / world) rows; the parameter keeps
           a padded shard, the gradient lives in its group's flat padded reduce-scatter buffer, the optimizer
           state is the shard's real rows (rank 0's, the largest).
    """
    num, W = job.mode_num, job.world
    every = local_parameter_shapes(job)
    shapes = [(name, shape) for name, shape in every if trainable(job, name)]
    frozen = [(name, shape) for name, shape in every if not trainable(job, name)]  # LoRA's base
    base = job.num.base or num.param
    numels = [math.prod(shape) for _, shape in shapes]
    n = sum(numels)
    state = {"parameters": n * num.param + sum(math.prod(s) for _, s in frozen) * base, "gradients": n * num.grad,
             "optimizer_states": optimizer_state_bytes(numels, job.optimizer, job.sgd_momentum)
             if job.optimizer != "muon" else muon_state_bytes(shapes)}
    data = job.dp_strategy
    if W == 1 or not data.shards_optimizer:
        return state
    if data.zero_optimizer:
        decayed = [i for i, (name, shape) in enumerate(shapes) if len(shape) >= 2 and "embed" not in name]
        rest = [i for i in range(len(shapes)) if i not in set(decayed)]
        sizes, mine = [0] * W, []
        for group in (decayed, rest):
            for i in sorted(group, key=lambda i: numels[i], reverse=True):  # stable: model order among equals
                rank = sizes.index(min(sizes))
                sizes[rank] += numels[i]
                if rank == 0:
                    mine.append(numels[i])
        state["optimizer_states"] = optimizer_state_bytes(mine, job.optimizer, job.sgd_momentum)
        return state
    def padded(shapes):
        return [math.ceil(shape[0] / _dp_ranks(job, name)) * math.prod(shape[1:]) for name, shape in shapes]
    local = [min(shape[0], math.ceil(shape[0] / _dp_ranks(job, name))) * math.prod(shape[1:])
             for name, shape in shapes]
    return {"parameters": sum(padded(shapes)) * num.param + sum(padded(frozen)) * base,
            "gradients": sum(padded(shapes)) * num.grad,
            "optimizer_states": optimizer_state_bytes(local, job.optimizer, job.sgd_momentum)}


def block_matmul_numel(cfg: ModelConfig) -> int:
    """Weights one block multiplies by (what autocast copies to half precision): every expert of an MoE."""
    return family(cfg.arch).block_matmul_numel(cfg)


def buffer_bytes(cfg: ModelConfig, num: Numerics) -> int:
    """Non-parameter model state, as the positions part states it (RoPE: its cos/sin tables)."""
    return family(cfg.arch).positions_part.buffer_bytes(cfg, num)


def optimizer_state_bytes(numels: list[int], optimizer: str, momentum: float = 0.9) -> int:
    """Optimizer state for parameter tensors of these sizes (fp32 masters or parameters)."""
    if optimizer in ("adamw", "adam"):
        return sum(8 * n + 4 for n in numels)  # exp_avg, exp_avg_sq and a 4-byte `step` tensor each
    if optimizer == "sgd":
        return sum(4 * n for n in numels) if momentum > 0 else 0
    if optimizer == "adamw8bit":
        return sum(adam8bit_state_bytes(n) for n in numels)
    raise KilnError(f"optim.name={optimizer!r} has no optimizer-state size here", key="optim.name", value=optimizer,
                    fix="use adamw, adam, sgd or adamw8bit (muon: muon_state_bytes)")


def muon_state_bytes(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """optim.name=muon (kiln.train.muon's split): one fp32 momentum per hidden matrix (Muon), AdamW's state for the
    embeddings, head, norms, biases and MoE routers. ZeRO-1, FSDP2 and offload refuse Muon, so this is whole."""
    return sum(4 * math.prod(shape) if is_muon_matrix(name, shape)
               else optimizer_state_bytes([math.prod(shape)], "adamw") for name, shape in shapes)


# ---------------------------------------------------------------- saved-for-backward tensors


def _norm_tensors(cfg, N, num, target, name) -> dict[str, int]:
    """What the family's norm saves for backward (kiln.models.costs); the input is the residual stream."""
    fam = family(cfg.arch)
    return fam.norm_part.saved(cfg, N, num, target, name, bool(cfg.bias) and fam.biases)


def _block_tensors(cfg: ModelConfig, B: int, T: int, num: Numerics, target: Target, backend: str) -> dict[str, int]:
    """Every tensor one block saves for backward without recomputation: {kind: bytes}, from the parts its family
    names, each stated by the part (kiln.models.costs: norm, positions, mlp; kiln.models.attention_costs: the
    attention core, QK-norm)."""
    fam = family(cfg.arch)
    mlp, positions = fam.mlp_of(cfg), fam.positions_part
    N, d, c = B * T, cfg.d_model, num.compute
    rotary = positions.rotary
    t = {}
    t.update(_norm_tensors(cfg, N, num, target, "norm1"))
    t["attn.qkv_input"] = N * d * c  # fp32: the norm output; autocast: its half copy; bf16-master: the output
    t.update(positions.block_saved(cfg, T, num))
    if fam.qk_norm_of(cfg):
        t.update(QK_NORM.saved(cfg, N, num, backend))
    t.update(ATTENTION.saved(cfg, B, T, num, target, backend, rotary=rotary, normed_qk=fam.qk_norm_of(cfg)))
    if cfg.dropout > 0:  # on the attention and MLP outputs: an MoE's sums its experts in the residual dtype
        t["resid.dropout_masks"] = N * d * (target.mask_bytes(c) + target.mask_bytes(mlp.output_bytes(num)))
    t.update(_norm_tensors(cfg, N, num, target, "norm2"))
    t["mlp.fc_input"] = N * d * c  # (an MoE: the router's input)
    t.update(mlp.saved(cfg, N, num))
    if num.autocast and num.casts:
        t["weight_casts"] = 2 * block_matmul_numel(cfg)
    # RMSNorm's fp32 copies of a bf16 weight (the norms', QK-norm's) are weight copies too
    w = sum(t.pop(name) for name in [k for k in t if k.endswith(".weight_fp32")])
    if w:
        t["weight_casts"] = t.get("weight_casts", 0) + w
    return {k: v for k, v in t.items() if v}


def _moe_loss_tensors(cfg: ModelConfig) -> dict[str, int]:
    """What the MLP's auxiliary losses over all blocks save (an MoE's load-balancing loss)."""
    return family(cfg.arch).mlp_of(cfg).loss_saved(cfg)


def _selective_tensors(cfg: ModelConfig, B: int, T: int, num: Numerics) -> dict[str, int]:
    """Selective recompute keeps the block input and every matmul output; the rest is recomputed."""
    N, d, c = B * T, cfg.d_model, num.compute
    out = {"block_input": N * d * num.residual}
    names = {"attn.qkv": "attn.qkv", "attn.proj": "attn.proj_out", "mlp.fc": "mlp.fc_out", "mlp.proj": "mlp.proj_out",
             "mlp.router": "mlp.router_out", "mlp.experts.fc": "mlp.experts.fc_out",
             "mlp.experts.proj": "mlp.experts.proj_out"}
    for lin in family(cfg.arch).linears(cfg):
        out[names[lin.name]] = N * lin.active * lin.n_out * c
    return out


def _embed_tensors(cfg: ModelConfig, B: int, T: int, num: Numerics, target: Target) -> dict[str, int]:
    N = B * T
    t = {"embed.token_ids": N * 8}
    t.update(family(cfg.arch).positions_part.embed_saved(T))
    if cfg.dropout > 0:
        t["embed.dropout_mask"] = N * cfg.d_model * target.mask_bytes(num.residual)
    return t


def _head_tensors(cfg: ModelConfig, B: int, T: int, num: Numerics, target: Target, chunk: int) -> dict[str, int]:
    """Final norm and the loss. 'logits' is the [N x V] fp32 log-softmax output cross-entropy keeps."""
    N, d, V, c = B * T, cfg.d_model, cfg.padded_vocab, num.compute
    t = _norm_tensors(cfg, N, num, target, "norm")
    w = t.pop("norm.weight_fp32", 0)
    t["loss.input"] = N * d * c
    t["loss.targets"] = N * 8
    t.update(_moe_loss_tensors(cfg))
    if chunk:
        t["loss.logsumexp"] = N * 4
    else:
        t["logits"] = N * V * 4
        t["loss.total_weight"] = 4
        t.update(softcap.saved(cfg, N))  # model.logit_softcap (the plain loss only: the others refuse it)
        if num.autocast and num.casts:
            w += 2 * V * d
    if w:
        t["weight_casts"] = w
    return t


# ---------------------------------------------------------------- transients (not saved, alive for a moment)


def _loss_transients(cfg: ModelConfig, N: int, num: Numerics, chunk: int, vocab_parallel: bool = False
                     ) -> tuple[int, int]:
    """(forward, backward) peak bytes of the loss' temporaries, beyond what it saves, for the whole vocabulary (a
    vocabulary-parallel rank holds 1/tp of them: the caller divides)."""
    V, d, c = cfg.padded_vocab, cfg.d_model, num.compute
    if vocab_parallel:
        # torch's loss_parallel (kiln.parallel.tensor) runs log_softmax op by op: the fp32 logits, the shifted
        # logits and their exp() alive together, before the log-probs are saved; its backward builds the logits'
        # gradient as (zeros with -1 at the targets + exp(log-probs)) × grad: three [N x V] fp32 beside the saved
        # log-probs (2 x N x V x 4 at each point under-counted by 16% of a tp2 rank's peak when the vocabulary
        # dominates, tests/memory/test_rank_peak.py "tp2 vocabulary")
        return 2 * N * V * 4, 3 * N * V * 4
    if chunk:
        n = min(chunk, N)
        cast = V * d * c if c != num.param else 0  # the head weight in the compute dtype
        fwd = n * V * (c + 4 + 4) + cast  # chunk logits, their fp32 copy, exp() inside logsumexp
        # beside fp32 grad_W, the weight's half copy and grad_h: either a chunk's logits (half, then fp32) or the
        # chunk's half softmax gradient with its (V, d) product, whichever is larger
        bwd = max(n * V * (c + 4), n * V * c + V * d * c) + V * d * 4 + cast + N * d * c
        return fwd, bwd
    fwd = N * V * c + (N * V * 4 if c == 2 else 0)  # matmul output and its fp32 copy (log-probs are saved)
    bwd = 2 * N * V * 4  # grad of log-probs and grad of logits, beside the saved log-probs
    return softcap.transients(cfg, N, fwd, bwd)


def _block_grad_transient(cfg: ModelConfig, N: int, num: Numerics, tp: int = 1, frozen: bool = False) -> int:
    """Bytes beyond the saved tensors when a block's backward peaks, at the MLP output projection: the gradient
    of the block output (and its half copy under autocast), the gradient of the projection's input (SwiGLU: with
    the (N, 2F) gate/up gradient that follows it) and the projection's weight gradient (half, then fp32). An MoE:
    the same for one expert's share of the routed pairs, beside the gradients of all pairs' outputs. frozen (LoRA):
    the projection's weight has no gradient."""
    d, c, r = cfg.d_model, num.compute, num.residual
    F, rows, wide, extra = family(cfg.arch).mlp_of(cfg).projection_backward(cfg, N, num)
    # the projection's weight gradient: in the compute dtype, then an fp32 copy for an fp32 weight under autocast;
    # in the weight's dtype without autocast (FSDP2's gathered bf16 weight: bf16)
    grad_w = 0 if frozen else F * d * ((c + 4) if num.autocast and num.casts else c if num.autocast else num.grad)
    return N * d * (r + (c if num.autocast and c != r else 0)) + (rows * wide * c + grad_w) // tp + extra


def _forward_width(cfg: ModelConfig) -> int:
    """Elements per token of the widest MLP tensors alive together in a block's forward (SwiGLU: gate/up, silu,
    product; an MoE: those of every routed pair)."""
    return family(cfg.arch).mlp_of(cfg).forward_width(cfg)


# ---------------------------------------------------------------- the step


@dataclass
class Breakdown:
    job: Job
    param_count: int
    components: dict[str, int]  # bytes alive on the device at the predicted peak
    total_bytes: int
    peak_phase: str
    host: dict[str, int]  # pinned host memory (offloaded activations, host optimizer)
    activations_saved: dict[str, int]  # every saved-for-backward kind summed over the model (device and host)
    per_block: list[dict[str, int]]  # saved bytes per block as kept during forward
    model_state: dict[str, int]  # parameters, gradients, master_weights, optimizer_states (+ buffers) after a step
    timeline: list[tuple[str, dict[str, int]]]  # (event, live bytes per component): a later step
    first_timeline: list[tuple[str, dict[str, int]]]  # the first step (no optimizer state until its update)
    first_step_peak: int
    backend: str
    recompute_flops: float  # extra forward FLOPs per micro-batch spent recomputing

    def held(self) -> dict[str, int]:
        """Each component at its full size over the step (model state after an update, everything saved by the
        forward), i.e. what a measurement counts; temporaries and overhead have no such size."""
        out = dict(self.model_state)
        out.update(_split(self.activations_saved))
        return out

    def to_json(self) -> dict:
        return {"param_count": self.param_count, "components": dict(self.components), "total_bytes": self.total_bytes,
                "peak_phase": self.peak_phase, "host": dict(self.host), "attention_backend": self.backend,
                "first_step_peak_bytes": self.first_step_peak}


def saved_tensors(job: Job) -> tuple[dict[str, int], list[dict[str, int]], dict[str, int]]:
    """(embedding, per block, head) saved-for-backward bytes by kind, as held between forward and backward by one
    micro-batch on this rank: its pipeline stage's parts, its tensor-parallel share (`_tp_share`), its context-
    parallel share of the sequence."""
    cfg, B, T, num, tgt = job.model, job.micro_batch, job.seq_len // job.cp, job.num, job.target
    full_block = _rank_block(job)
    blocks = []
    for i in range(cfg.n_layer):
        p = job.policy(i)
        if p == "none":
            blocks.append(_rank_block(job, first=True) if i == 0 and job.lora and job.first_stage
                          else dict(full_block))
        elif p == "selective":
            blocks.append(_tp_share(_selective_tensors(cfg, B, T, num), job))
        elif p == "full":
            blocks.append(_tp_share({"block_input": B * T * cfg.d_model * num.residual}, job))
        else:  # inside a full segment: nothing kept
            blocks.append({})
    # a frozen embedding records nothing (LoRA); a frozen head keeps no input
    embed = _tp_share(_embed_tensors(cfg, B, T, num, tgt), job) if job.first_stage and not job.lora else {}
    head = _head_tensors(cfg, B, T, num, tgt, job.chunked_loss) if job.last_stage else {}
    head = _tp_share(lora_.frozen_head(head) if job.lora and head else head, job)
    return embed, blocks, head


def _rank_block(job: Job, first: bool = False) -> dict[str, int]:
    """One block's saved tensors on this rank without recomputation (first: the model's block 0, which under LoRA
    saves nothing before its first adapter)."""
    T = job.seq_len // job.cp
    kinds = _block_tensors(job.model, job.micro_batch, T, job.num, job.target, job.backend)
    if job.lora:
        kinds = lora_.lora_block(kinds, job.lora, job.model, job.micro_batch * T, job.num, job.target, first)
    return _tp_share(kinds, job)


# Saved kinds that stay whole on every tensor-parallel rank: the inputs of the column-parallel linears (torch's
# ColwiseParallel all-gathers a sequence-parallel input and the matmul saves the gathered tensor, unlike Megatron's
# which saves the shard and gathers again in backward), token ids and targets, the RoPE tables, an MoE's routing
# and expert tensors (expert parallelism is not modelled: replicated, an over-count).
_TP_WHOLE = ("attn.qkv_input", "mlp.fc_input", "loss.input", "embed.", "loss.targets", "loss.total_weight",
             "attn.rope_tables", "moe.")
# ... and those split only by sequence parallelism: the norms, the residual stream (block inputs, the row-parallel
# linears' outputs) and dropout on it (Korthikanti et al. 2022, §4.2.2).
_TP_SEQUENCE = ("norm1.", "norm2.", "norm.", "resid.", "block_input", "attn.proj_out", "mlp.proj_out",
                "embed.dropout_mask")
_TP_VOCAB = ("logits", "loss.logsumexp")  # split only with a vocabulary-parallel head


def _tp_share(kinds: dict[str, int], job: Job) -> dict[str, int]:
    """One tensor-parallel rank's bytes of saved kinds: attention by heads and the MLP by width (q, k, v, scores,
    the attention output, the MLP's inner tensors, autocast's copies of the local weight shards) over tp; what
    sequence parallelism splits over tp only with it; the rest whole."""
    tp = job.tp
    if tp == 1:
        return kinds
    out = {}
    for k, v in kinds.items():
        if k.startswith(_TP_SEQUENCE):
            split = job.sequence_parallel
        elif k.startswith(_TP_VOCAB):
            split = job.vocab_parallel
        elif k.startswith(_TP_WHOLE):
            split = False
        else:
            split = True
        out[k] = v // tp if split else v
    return out


def _split(kinds: dict[str, int]) -> dict[str, int]:
    """Saved kinds -> breakdown components."""
    out = {"activations": 0, "logits": 0, "weight_casts": 0}
    for k, v in kinds.items():
        out["logits" if k.split(".")[0] == "logits" else "weight_casts" if k == "weight_casts" else "activations"] += v
    return out


def block_flops(cfg: ModelConfig, B: int, T: int, causal_kernel: bool) -> tuple[float, float]:
    """(matmul, attention-core) forward FLOPs of one block (an MoE: its active experts only)."""
    N = B * T
    matmul = 2 * N * family(cfg.arch).active_matmul_numel(cfg)
    return matmul, ATTENTION.flops(cfg, N, T, causal_kernel)


def grad_shares(job: Job) -> dict:
    """Gradient elements one rank keeps per part of the model (block index, "embed", "pos_embed", "norm", "head"):
    everything under DDP and ZeRO-1; under FSDP2 each parameter's padded shard, ceil(dim0 / world) rows; under
    pipeline parallelism with FSDP2 everything while the step runs (unsharded_gradients)."""
    fsdp = unsharded_gradients(job) is None and job.dp_strategy.shards_parameters and job.world > 1
    key = (_shapes_key(job), fsdp, job.world)
    if key not in _GRADS:
        if len(_GRADS) > 64:
            _GRADS.clear()
        _GRADS[key] = _grad_shares(job, fsdp)
    return dict(_GRADS[key])


_GRADS: dict = {}


def _grad_shares(job: Job, fsdp: bool) -> dict:
    out: dict = {"embed": 0, "pos_embed": 0, "norm": 0, "head": 0}
    for name, shape in local_parameter_shapes(job):
        if not trainable(job, name):
            continue
        key = int(name.split(".")[1]) if name.startswith("blocks.") else name.split(".")[0]
        rows = math.ceil(shape[0] / _dp_ranks(job, name)) if fsdp else shape[0]
        out[key] = out.get(key, 0) + rows * math.prod(shape[1:])
    return out


def unsharded_gradients(job: Job) -> int | None:
    """Gradient bytes a pipeline rank under FSDP2 holds while its step runs: its stage's whole gradients, accumulated
    unsharded in fp32 until the last backward (CommBuffers); None for every other layout. Under bf16 gathering
    (MixedPrecisionPolicy) 2 bytes a parameter more, as measured on 2 gloo stages × 2 copies (tests/parallel/
    test_pipeline.py: without them stage 0 is 10% and stage 1 13% under): the bf16 gradients FSDP2 upcasts into
    its fp32 accumulators are not all released before the step's end (not traced further)."""
    if job.pp == 1 or job.world == 1 or not job.dp_strategy.shards_parameters:
        return None
    n = sum(math.prod(shape) for name, shape in local_parameter_shapes(job) if trainable(job, name))
    return n * (job.num.grad + (job.num.gathered or 0))


@dataclass
class CommBuffers:
    """Bytes the collectives hold on one rank (kiln.parallel's strategies, docs/memory.md):

    ddp, zero1  DDP's gradient buckets: a second copy of every gradient, made when DDP wraps the model
                (gradient_as_bucket_view=False, torch's default), alive for the whole run.
    fsdp        FSDP2's all-gathered parameters: the root's (embeddings, final norm, head) from the start of the
                forward to the end of the backward, and each block's while it runs, plus the next block's
                prefetch; with reshard_after_forward=false a block's stay from its forward to its backward.
                Gathered in the compute dtype under bf16 autocast (MixedPrecisionPolicy), else the parameter's.
                Backward also holds each block's unsharded fp32 gradient as the reduce-scatter input.
                On CPU, gloo stages each all-gather's output through a copy of its size (_allgather_base_) and
                clones each reduce-scatter's input (_reduce_scatter_base_): one more block's bytes while they run
                (measured, tests/memory/test_rank_peak.py); NCCL writes in place.
                Under pipeline parallelism torch's PipelineStage turns FSDP2's per-block reduction off until the
                step's last backward (set_requires_gradient_sync, set_reshard_after_backward: False): every
                block's gradients accumulate unsharded, and a block stays gathered from its first backward to the
                step's end (a later forward reshards it again after running it); no reduce-scatter per block.
    ep > 1      each block's experts are a group of their own (kiln.memory.experts.expert_comm says what each holds).
    """

    persistent: int = 0  # held all step
    staging_forward: int = 0  # gloo's copy of a block's all-gather while a forward runs (CPU)
    staging_backward: int = 0  # ... of an all-gather or reduce-scatter while a backward runs (CPU)
    gathered: dict = field(default_factory=dict)  # block index -> its all-gathered parameter bytes (fsdp)
    reduce_scatter: dict = field(default_factory=dict)  # block index -> the reduce-scatter input of its backward
    keep_gathered: bool = False  # reshard_after_forward=false: gathered blocks stay until their backward
    pipelined: bool = False  # pp: gathered blocks stay after their backward, until the step's reduction
    all_to_all: int = 0  # ep: one all-to-all's send and receive buffers, while an MoE block's forward or backward runs
    # ep (kiln.memory.experts.expert_comm): each block's experts are their own FSDP2 (or replicate) group
    experts: dict = field(default_factory=dict)  # block index -> its gathered experts' bytes
    experts_reduce: dict = field(default_factory=dict)  # block index -> its experts' reduction transient
    experts_backward: dict = field(default_factory=dict)  # block index -> its experts' gradients in their backward
    experts_staging: int = 0  # gloo's copy of a block's experts' all-gather (dp / ep > 1, CPU)
    keep_experts: bool = False  # gathered experts stay from their forward to their backward
    final_reduce: int = 0  # the root group's reduction at the backward's end (replicate: every non-expert)
    released_for_step: bool = False  # the persistent (root) gathers are freed before the optimizer step

    def experts_forward(self, i: int) -> range:
        return range(i + 1) if self.keep_experts else range(i, i + 1)

    def forward(self, i: int) -> range:
        """Blocks whose gathered parameters are alive while block i's forward runs."""
        if not self.gathered:
            return range(0)
        upto = len(self.gathered) if self.pipelined else min(i + 2, len(self.gathered))  # ... and the next one
        return range(upto) if self.keep_gathered else range(i, upto)

    def backward(self, i: int) -> range:
        if not self.gathered:
            return range(0)
        if self.pipelined:
            return range(len(self.gathered))
        return range(i + 1) if self.keep_gathered else range(max(i - 1, 0), i + 1)


def _comm_buffers(job: Job, block_params: dict, trained: dict | None = None) -> CommBuffers:
    """block_params: parameter elements per part of the model (_block_parameters); trained: those that get
    gradients (LoRA's adapters; default all), which DDP's buckets and the reduce-scatters hold."""
    W, num = job.world, job.num
    trained = block_params if trained is None else trained
    element = num.gathered or num.param
    data = job.dp_strategy
    if not data.reduces or (W == 1 and (not data.shards_parameters or element == num.param)):
        return CommBuffers()
    if data.ddp_reducer:
        return CommBuffers(persistent=sum(trained.values()) * num.grad)
    blocks = range(job.model.n_layer)
    # The reduce-scatter input is fp32 (reduce_dtype), 4 bytes an element, beside one more fp32 copy of the block's
    # gradients: the unsharded fp32 gradients being copied in, or a bf16 gradient's fp32 cast (the bf16 one is
    # released first), or on CPU gloo's clone of the input (measured: 8 bytes an element in every case)
    rs = 8
    gathered = {i: block_params[i] * element for i in blocks}
    pipelined = job.pp > 1
    # gloo's staging copy of a block's all-gather: in the forward's prefetch, and under pp also when a later
    # micro-batch's backward gathers a block its forward resharded, the gradients already there
    staging = (max(gathered.values()),) * (1 + pipelined) + (0,) * (1 - pipelined) \
        if job.target.kind == "cpu" and gathered else (0, 0)
    return CommBuffers(persistent=sum(v for k, v in block_params.items() if not isinstance(k, int)) * element,
                       gathered=gathered,
                       reduce_scatter={} if pipelined else {i: trained.get(i, 0) * rs for i in blocks},
                       keep_gathered=not job.reshard_after_forward, staging_forward=staging[0],
                       staging_backward=staging[1], pipelined=pipelined)


@dataclass
class _Step:
    """What walking one micro-batch needs, computed once per estimate."""

    job: Job
    state: dict[str, int]  # model state on the device after an update: parameters, buffers, masters, optimizer
    step_gradients: int  # gradient bytes during the optimizer step (bf16-master: fp32, on the masters)
    embed: dict[str, int]  # saved-for-backward bytes by kind
    head: dict[str, int]
    blocks: list[dict[str, int]]  # per block, {} where offloaded to the host
    held: dict  # gradient elements one rank keeps per part of the model (grad_shares)
    comm: CommBuffers
    casts: int  # autocast's half copies of one block's weights
    loss_fwd: int
    loss_bwd: int
    grad_tmp: int  # a block backward's transient bytes
    fwd_tmp: int  # a recomputed block forward's transient bytes
    work_full: int  # bytes a fully recomputed block brings back
    selective_kept: int  # bytes selective recompute keeps per block
    tied_head: int  # elements of a head tied to the embedding (0 if untied)
    step_tmp: int  # the optimizer step's transient bytes
    offloaded: set
    pipeline: dict = field(default_factory=dict)  # other micro-batches' saved bytes held meanwhile (pp), by component
    unsharded_gradients: int | None = None  # pp × FSDP2: the gradients while the step runs (unsharded_gradients)


def _model_state(job: Job, numels: list[tuple[str, int]]) -> tuple[dict[str, int], int, dict[str, int]]:
    """(model state on the device after an update, gradient bytes during the optimizer step, host bytes)."""
    if job.lora:  # masters and offloaded state: the trained parameters only
        numels = [(name, n) for name, n in numels if trainable(job, name)]
    num, n_params = job.num, sum(n for _, n in numels)
    host_opt = job.optimizer_offload != "none"
    per_rank = rank_state(job)
    state = {"parameters": per_rank["parameters"], "buffers": buffer_bytes(job.model, num),
             "master_weights": 0 if host_opt else n_params * num.master,
             "optimizer_states": 0 if host_opt else per_rank["optimizer_states"],
             "gradients": per_rank["gradients"]}
    step_gradients = 0 if host_opt else (n_params * 4 if num.master else 0)  # fp32 gradients on the masters
    host = {}
    if host_opt:
        host = {"master_weights": n_params * 4, "gradients": n_params * 4,
                "optimizer_states": optimizer_state_bytes([n for _, n in numels], job.optimizer, job.sgd_momentum)}
    return state, step_gradients, host


def _block_parameters(numels: list[tuple[str, int]]) -> dict:
    """Parameter elements per part of the model: block index, "embed", "pos_embed", "norm", "head"."""
    out: dict = {}
    for name, n in numels:
        key = int(name.split(".")[1]) if name.startswith("blocks.") else name.split(".")[0]
        out[key] = out.get(key, 0) + n
    return out


def _simulate(p: _Step, first_step: bool, accumulating: bool) -> list[tuple[str, dict[str, int]]]:
    """Walk one micro-batch and the optimizer step; return [(event, live bytes per component)]."""
    job, num, cfg = p.job, p.job.num, p.job.model
    N, L = job.tokens, cfg.n_layer
    events = []
    whole = p.unsharded_gradients
    grads = (p.state["gradients"] if whole is None else whole) if accumulating else 0
    # a pipeline whose every forward runs before its first backward (GPipe; 1F1B with m ≤ pp - stage): no
    # gradients yet while any forward runs, and no forward reshards a block between two of its backwards
    forwards_first = job.pp > 1 and job.in_flight() >= job.grad_accum
    state = dict(p.state, optimizer_states=0 if first_step else p.state["optimizer_states"],
                 gradients=0 if forwards_first else grads)
    live = {"activations": 0, "logits": 0, "weight_casts": 0, **p.pipeline}
    cache = 0

    def snap(name, temporaries=0, extra_casts=0, gathered=(), staging=0, a2a=False, experts=(), step=False):
        comp = {**state, **live, "temporaries": temporaries}
        comp["weight_casts"] += extra_casts
        comp["comm_buffers"] = (0 if step and p.comm.released_for_step else p.comm.persistent) + staging \
            + sum(p.comm.gathered[i] for i in gathered) + sum(p.comm.experts.get(i, 0) for i in experts) \
            + (p.comm.all_to_all if a2a else 0)
        events.append((name, comp))

    def add(kinds, sign=1):
        for k, v in _split(kinds).items():
            live[k] += sign * v

    add(p.embed)
    snap("forward: embeddings")
    for i in range(L):
        add(p.blocks[i])
        recomputed = job.policy(i) != "none"
        if (recomputed or i in p.offloaded) and num.autocast:
            cache += p.casts  # not saved on the device, but in autocast's cache until forward ends
        if p.comm.experts_staging:  # the block's experts' all-gather, staged by gloo
            snap(f"forward: block {i} experts all-gather", extra_casts=cache, gathered=p.comm.forward(i),
                 staging=p.comm.experts_staging, experts=p.comm.experts_forward(i))
        snap(f"forward: block {i}", temporaries=p.fwd_tmp if recomputed else N * cfg.d_model * 4, extra_casts=cache,
             gathered=p.comm.forward(i), a2a=True, experts=p.comm.experts_forward(i))
        if p.comm.staging_forward and i + 1 < L:  # the next block's all-gather (prefetch), staged by gloo
            snap(f"forward: block {i + 1} all-gather", extra_casts=cache, gathered=p.comm.forward(i),
                 staging=p.comm.staging_forward)
    add(p.head)
    snap("forward: loss", temporaries=p.loss_fwd, extra_casts=cache)
    snap("forward: end", extra_casts=cache)
    state["gradients"] = grads
    cache = 0  # autocast exits before backward
    snap("backward: loss", temporaries=p.loss_bwd)
    add(p.head, sign=-1)
    held = p.held
    if not accumulating:
        state["gradients"] += (held["head"] + held["norm"] + (held["embed"] if p.tied_head else 0)) * num.grad
    if job.last_stage:
        V = cfg.padded_vocab // (job.tp if job.vocab_parallel else 1)
        snap("backward: head", temporaries=N * cfg.d_model * (num.compute + num.residual)
             + V * cfg.d_model * ((num.compute + (4 if num.casts else 0)) if num.autocast and not job.lora else 0))
    for first, stop, policy in reversed(job.segments()):
        # Recomputing a segment brings back what its blocks would have saved (selective: minus what it kept).
        per_block_work = {"none": 0, "full": p.work_full, "selective": p.work_full - p.selective_kept}[policy]
        work = (stop - first) * per_block_work
        for i in reversed(range(first, stop)):
            casts = p.casts if (num.autocast and policy != "none") else 0
            if p.comm.pipelined and p.comm.staging_backward and not (accumulating and forwards_first):
                # the block gathered again (a forward resharded it), through gloo's copy
                snap(f"backward: block {i} all-gather", temporaries=work, gathered=p.comm.backward(i),
                     staging=p.comm.staging_backward)
            snap(f"backward: block {i}", temporaries=work + p.grad_tmp + p.comm.experts_backward.get(i, 0),
                 extra_casts=casts, gathered=p.comm.backward(i), a2a=True, experts=p.comm.experts_forward(i))
            if i in p.comm.experts_reduce:  # the experts' group reduces as soon as their backward is done
                snap(f"backward: block {i} experts reduce", temporaries=work + p.comm.experts_reduce[i],
                     gathered=p.comm.backward(i), experts=p.comm.experts_forward(i - 1) if p.comm.keep_experts else ())
            if p.comm.reduce_scatter:  # after the block's backward: its gradients reduce-scattered
                snap(f"backward: block {i} reduce-scatter", temporaries=work + p.comm.reduce_scatter[i],
                     gathered=p.comm.backward(i), staging=p.comm.staging_backward)
            if not accumulating:
                state["gradients"] += held[i] * num.grad
            add(p.blocks[i], sign=-1)
            work -= per_block_work
    add(p.embed, sign=-1)
    if not accumulating:  # a tied embedding got its grad at the head
        state["gradients"] += (held["pos_embed"] + (0 if p.tied_head else held["embed"])) * num.grad
    # a tied embedding's dense gradient is made, then added to the head's: a second V x d for a moment
    snap("backward: embeddings", temporaries=p.tied_head * num.grad)
    if p.comm.final_reduce:
        snap("backward: root reduce", temporaries=p.comm.final_reduce)
    # optimizer step (after the last micro-batch): bf16-master moves gradients to fp32 masters first
    if num.master and job.optimizer_offload == "none":
        state["gradients"] = p.step_gradients
    if whole is not None:  # reduce-scattered into the shards the optimizer steps
        state["gradients"] = p.state["gradients"]
    state["optimizer_states"] = p.state["optimizer_states"]
    snap("optimizer step", temporaries=p.step_tmp, step=True)
    return events


def _recompute_flops(job: Job) -> float:
    """Forward FLOPs per micro-batch that recomputation runs again."""
    mm_flops, attn_flops = block_flops(job.model, job.micro_batch, job.seq_len, job.backend != "math")
    total = 0.0
    for first, stop, policy in job.segments():
        n = stop - first
        if policy == "full":
            total += n * (mm_flops + attn_flops)
        elif policy == "selective":
            total += n * attn_flops
    return total


def estimate(job: Job) -> Breakdown:
    """The step's bytes: model state, what the forward saves (per block, by kind), the transients, walked event
    by event through a steady step and the first one (no optimizer state yet); the peak is the largest event."""
    cfg, num, tgt = job.model, job.num, job.target
    B, T, L = job.micro_batch, job.seq_len // job.cp, cfg.n_layer
    N, tp = B * T, job.tp
    numels = _memo(_NUMELS, _shapes_key(job),
                   lambda: [(name, math.prod(shape)) for name, shape in local_parameter_shapes(job)])
    n_params = sum(n for _, n in numels)
    state, step_gradients, host = _model_state(job, numels)

    embed, blocks, head = saved_tensors(job)
    full_block = _rank_block(job)
    offloaded = {i for i in job.offload if 0 <= i < L and job.policy(i) == "none"} if tgt.kind == "cuda" else set()
    if offloaded:
        host["activations"] = sum(sum(blocks[i].values()) for i in offloaded)
    all_saved: dict[str, int] = {}
    for part in [embed, head, *blocks]:
        for k, v in part.items():
            all_saved[k] = all_saved.get(k, 0) + v

    comm = _comm_buffers(job, _memo(_BLOCKS, _shapes_key(job), lambda: _block_parameters(numels)),
                         _block_parameters([(k, n) for k, n in numels if trainable(job, k)]) if job.lora else None)
    if job.ep > 1:  # the experts' own data-parallel groups and the all-to-alls' buffers (kiln.memory.experts)
        comm = expert_comm(job, comm, numels, lambda name: trainable(job, name))
    loss_fwd, loss_bwd = (_loss_transients(cfg, N, num, job.chunked_loss, job.vocab_parallel) if job.last_stage
                          else (0, 0))
    if job.vocab_parallel:
        loss_fwd, loss_bwd = loss_fwd // tp, loss_bwd // tp
    # a pipeline rank holds other micro-batches' saved tensors while one walks through (Job.in_flight): the most
    # before its first backward, fewer once gradients exist (Job.in_flight_later)
    split = [_split(part) for part in [embed, head, *blocks]]

    def in_flight(n: float) -> dict:
        others = n - 1
        return {k: int(others * sum(part[k] for part in split)) for k in ("activations", "logits", "weight_casts")
                } if others else {}
    pipeline, pipeline_later = in_flight(job.in_flight()), in_flight(job.in_flight_later())
    host_opt = job.optimizer_offload != "none"
    parts = _Step(
        job=job, state=state, step_gradients=step_gradients, embed=embed, head=head,
        blocks=[({} if i in offloaded else b) for i, b in enumerate(blocks)], held=grad_shares(job), comm=comm,
        casts=2 * block_matmul_numel(cfg) // tp if num.autocast and num.casts else 0, loss_fwd=loss_fwd,
        loss_bwd=loss_bwd, grad_tmp=_block_grad_transient(cfg, N, num, tp, frozen=job.lora is not None),
        # Forward of one block: the residual stream, its half copy and the widest MLP tensors (SwiGLU: gate/up,
        # silu, product) are alive together; a block that keeps nothing frees them as it goes.
        fwd_tmp=N * (cfg.d_model * (num.residual + num.compute) + _forward_width(cfg) * num.compute // tp),
        work_full=sum(full_block.values()) - full_block.get("weight_casts", 0),
        selective_kept=sum(_tp_share(_selective_tensors(cfg, B, T, num), job).values()),
        tied_head=cfg.padded_vocab * cfg.d_model // (tp if job.vocab_parallel else 1)
        if cfg.tie_embeddings and job.first_stage and job.last_stage and not job.lora else 0,
        step_tmp=min(max(n for k, n in numels if not job.lora or trainable(job, k)), ADAM8BIT_CHUNK) * 16 if job.optimizer == "adamw8bit" and not host_opt
        else 0,
        offloaded=offloaded, pipeline=pipeline, unsharded_gradients=unsharded_gradients(job))

    later = replace(parts, pipeline=pipeline_later) if job.grad_accum > 1 else parts
    steady = _simulate(later, first_step=False, accumulating=job.grad_accum > 1)
    first = _simulate(later, first_step=True, accumulating=job.grad_accum > 1)
    if job.grad_accum > 1:  # the first micro-batch of a step has no gradients yet; its peak can differ
        steady = _simulate(parts, first_step=False, accumulating=False)[:-1] + steady
        first = _simulate(parts, first_step=True, accumulating=False)[:-1] + first
    peak_name, peak = max(steady, key=lambda e: sum(e[1].values()))
    allocated = sum(peak.values())
    components = {k: int(peak.get(k, 0)) for k in COMPONENTS if k != "device_overhead"}
    components["device_overhead"] = tgt.context_bytes + int(tgt.fragmentation * allocated)
    model_state = {k: state[k] for k in ("parameters", "gradients", "master_weights", "optimizer_states",
                                         "buffers")}
    if comm.persistent:
        model_state["comm_buffers"] = comm.persistent
    return Breakdown(job=job, param_count=n_params, components=components, total_bytes=sum(components.values()),
                     peak_phase=peak_name, host=host, activations_saved=all_saved,
                     per_block=[dict(b) for b in blocks], model_state=model_state, timeline=steady,
                     first_timeline=first, first_step_peak=max(sum(e[1].values()) for e in first),
                     backend=job.backend, recompute_flops=_recompute_flops(job))


def peak_allocated(b: Breakdown) -> int:
    """Predicted peak of the allocator (what torch.cuda.max_memory_allocated reports): no context, no slack."""
    return b.total_bytes - b.components["device_overhead"]


# ---------------------------------------------------------------- classic cross-checks (docs/memory.md)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> int:
    """Activation bytes per layer of a GPT block with 16-bit activations, 1-byte dropout masks, attention scores
    materialized (Korthikanti et al. 2022, eq. 2): s·b·h·(34 + 5·a·s/h)."""
    return s * b * h * 34 + 5 * a * s * s * b


def textbook_layer_bytes(s: int, b: int, h: int, a: int) -> int:
    """kiln's GPT-2 block under the paper's assumptions, from `_block_tensors`: every activation 16-bit on CUDA
    (mask 1 byte), the math attention path without its fp32 upcast, LayerNorm statistics left out."""
    cfg = ModelConfig(preset="gpt2-124m", n_layer=1, n_head=a, d_model=h, dropout=0.1).resolve()
    num = NUMERICS["bf16-master"]
    t = _block_tensors(cfg, b, s, num, Target("cuda"), "math")
    t = {k: v for k, v in t.items() if not k.endswith(".stats")}
    # The paper's attention core keeps its q, k, v, probabilities and dropped probabilities in 16 bits;
    # torch's math backend upcasts them to fp32, so halve those five.
    for k in ("attn.qk_scaled", "attn.v", "attn.probs", "attn.dropped_probs"):
        t[k] //= 2
    return sum(t.values())


BYTES_PER_PARAM = {
    # Model-state bytes per parameter (weights, gradients, fp32 masters, Adam m and v).
    "fp32": 4 + 4 + 0 + 8,
    "mixed": 2 + 2 + 4 + 8,  # half weights and gradients, fp32 masters and Adam
    "mixed+fp32-grad-accum": 2 + 2 + 4 + 8 + 4,  # plus an fp32 gradient accumulation buffer
}


def model_state_table(sizes=(1e9, 7e9, 70e9)) -> list[tuple[float, int, int, int]]:
    """(parameters, fp32 bytes, mixed bytes, mixed with fp32 grad accumulation bytes) per model size."""
    return [(n, int(n * BYTES_PER_PARAM["fp32"]), int(n * BYTES_PER_PARAM["mixed"]),
             int(n * BYTES_PER_PARAM["mixed+fp32-grad-accum"])) for n in sizes]


def kiln_bytes_per_param(precision: str, optimizer: str = "adamw") -> int:
    """Model-state bytes per parameter kiln holds during backward (Adam state included; step tensors excluded)."""
    num = NUMERICS[precision]
    state = {"adamw": 8, "adam": 8, "sgd": 4}[optimizer]
    return num.param + num.grad + num.master + state
