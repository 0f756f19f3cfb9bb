"""The layout of a run across processes: how many ways the model is split (tensor, pipeline) and how many copies of
it see different data (data parallel), decided once from the `parallel` section, the world size and the model.

    plan = ParallelPlan.build(cfg.parallel, world_size, model_cfg, family)   degrees checked, or a one-line error
    plan.mesh_shape                    {"pp": P, "dp": D, "tp": T}: tp innermost (neighbouring ranks, one node);
                                       with cp > 1 {"pp", "dp", "cp", "tp"}
    plan.device_mesh(device_type)      torch's DeviceMesh with those named dims (init_device_mesh)
    plan.stage_layers()                the blocks each pipeline stage holds (even split, the remainder first)
    plan.rank_blocks(n_layer, stage)   the blocks one pipeline rank holds (interleaved: its v chunks)
    plan.ranks_of(dim, rank)           the ranks of `rank`'s group along one mesh dim (its tp peers, its dp copies)
    plan.holds(rank, n_layer)          what one rank holds: its coordinates, pipeline stage and blocks, tp shard
    plan.ep_rank(rank), plan.ep_ranks(rank)   its index among its expert-parallel group, and that group's ranks

One plan per run, built by the run builder (kiln.run.builder) once the model is known and asked by everything
else: World (kiln.parallel) keeps the process group and its collectives and reads its degrees from world.plan;
the estimator's Job and the planner's Choice hold one (kiln.memory).

Expert parallelism (parallel.ep) is carved out of the data-parallel ranks, as torchtitan's dp_shard_mod_ep × ep:
the world stays pp × dp × cp × tp, ep divides dp, and the dp index of a rank is dp_mod_ep · ep + its ep index (the
ep ranks of a group are neighbours along dp). Each ep rank holds n_experts/ep whole experts (kiln.parallel.expert);
everything else is data-parallel over all dp ranks, each expert over the dp/ep ranks that hold it. The mesh then
has dims pp, dp_mod_ep, ep, tp, with dp_mod_ep × ep flattened into dp (so mesh["dp"] means the same).

Context parallelism (parallel.cp, each sequence split over cp ranks: kiln.parallel.context) adds a mesh dim "cp"
between dp and tp when cp > 1 (FSDP2 shards over dp × cp flattened); at cp = 1 the mesh is as before.

Everything that branches on a layout asks this object: the model pipeline (apply TP, split into stages, wrap for
data parallelism), the loop (which ranks hold the loss, which reduce what), the checkpointer, the estimator and
the planner. Pure arithmetic except device_mesh, so the estimator and planner use it without a process group.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.models.config import ModelConfig
from kiln.parallel.strategy import Strategy, strategy

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
MESH_DIMS = ("pp", "dp", "tp")  # outermost to innermost
EP_MESH_DIMS = ("pp", "dp_mod_ep", "ep", "tp")  # the mesh under ep > 1: dp split in two, flattened back into "dp"


@dataclass(frozen=True)
class ParallelPlan:
    world_size: int
    tp: int = 1  # tensor-parallel degree: each block's linears split column/row-wise over tp ranks
    pp: int = 1  # pipeline stages
    strategy: str = "none"  # data parallelism over dp = world / (tp·pp) ranks: none | ddp | zero1 | fsdp
    sequence_parallel: bool = False  # tp: norms and dropout on a sequence shard between the TP regions
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0 = max(pp, grad_accum_steps), resolved by build() when the batch is known
    virtual_stages: int = 1  # stages per pipeline rank (interleaved_1f1b: 2)
    cp: int = 1  # context parallel: each sequence split over cp ranks (kiln.parallel.context)
    ep: int = 1  # expert parallel: experts split over ep of the dp ranks (ep divides dp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @staticmethod
    def data_copies(cfg, world_size: int) -> int:
        """The dp degree the `parallel` section gives `world_size` ranks, before the plan is built: the builder
        splits the batch over it (train.global_batch_size) first, and the plan checks the pipeline's share of it."""
        return world_size // (cfg.tp * cfg.pp * getattr(cfg, "cp", 1))

    @property
    def mesh_shape(self) -> dict[str, int]:
        """{"pp", "dp", "tp"} degrees, outermost first; with cp > 1 also "cp", between dp and tp."""
        if self.cp > 1:
            return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    @property
    def mesh_record(self) -> dict[str, int]:
        """mesh_shape as the layout record and `kiln memory` write it: cp and ep added when they split (> 1); ep
        is a part of dp, not a further factor of the world."""
        return self.mesh_shape | ({"cp": self.cp} if self.cp > 1 else {}) | ({"ep": self.ep} if self.ep > 1 else {})

    @property
    def dp_strategy(self) -> Strategy:
        """What parallel.strategy does over the dp dim (kiln.parallel.strategy)."""
        return strategy(self.strategy)

    @property
    def model_parallel(self) -> bool:
        """The model itself is split (tp or pp > 1): each rank holds part of every step's model."""
        return self.tp > 1 or self.pp > 1

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dim (row-major over mesh_shape's dims, tp fastest)."""
        out, rest = {}, rank
        for dim in reversed(self.mesh_shape):
            out[dim], rest = rest % self.mesh_shape[dim], rest // self.mesh_shape[dim]
        return out

    def ranks_of(self, dim: str, rank: int = 0) -> list[int]:
        """The ranks of `rank`'s group along mesh dim `dim`: those whose other coordinates are rank's (its tp peers,
        the dp copies it averages gradients with, the stages of its pipeline), in order along the dim."""
        mine = self.coords(rank)
        return [r for r in range(self.world_size)
                if all(c == mine[d] for d, c in self.coords(r).items() if d != dim)]

    def ep_rank(self, rank: int) -> int:
        """rank's index in its expert-parallel group: which n_experts/ep experts it holds."""
        return self.coords(rank)["dp"] % self.ep

    def ep_ranks(self, rank: int = 0) -> list[int]:
        """The ranks of `rank`'s expert-parallel group (the ep neighbours along dp that exchange tokens), in ep
        order."""
        group = self.coords(rank)["dp"] // self.ep
        return [r for r in self.ranks_of("dp", rank) if self.coords(r)["dp"] // self.ep == group]

    def holds(self, rank: int, n_layer: int) -> dict:
        """What `rank` holds of a model of n_layer blocks: its mesh coordinates, its pipeline stage and blocks, and
        which 1/tp shard of every split linear (tp_shard of tp)."""
        at = self.coords(rank)
        return {"coords": at, "stage": at["pp"], "blocks": self.rank_blocks(n_layer, at["pp"]),
                "tp_shard": at["tp"], "tp": self.tp, "dp_copy": at["dp"], "ep_shard": at["dp"] % self.ep}

    def stage_layers(self, n_layer: int) -> list[range]:
        """The blocks of each of the pp × virtual_stages stages, in model order: an even split, the first
        stages taking one more block when n_layer does not divide."""
        stages = self.pp * self.virtual_stages
        base, extra = divmod(n_layer, stages)
        out, start = [], 0
        for s in range(stages):
            n = base + (s < extra)
            out.append(range(start, start + n))
            start += n
        return out

    def rank_blocks(self, n_layer: int, stage: int) -> list[int]:
        """The blocks pipeline rank `stage` holds: stage_layers()[stage], and under interleaving its later chunks
        stage + pp, stage + 2·pp, ... (torch's interleaved schedules place virtual stage s on rank s mod pp)."""
        layers = self.stage_layers(n_layer)
        return [i for s in range(stage, len(layers), self.pp) for i in layers[s]]

    def device_mesh(self, device_type: str):
        """The run's DeviceMesh over every rank, dims named as mesh_shape (a dim of degree 1 is kept, so code can
        always ask mesh["tp"]; "cp" only when cp > 1). Under ep > 1 (never with cp > 1: MoE is refused under cp) its dims are EP_MESH_DIMS, with dp_mod_ep × ep flattened into "dp":
        the same ranks in the same order, so mesh["dp"] is the same group as without ep."""
        from torch.distributed.device_mesh import init_device_mesh  # lazy: only a multi-process run builds one

        if self.ep == 1:
            return init_device_mesh(device_type, tuple(self.mesh_shape.values()),
                                    mesh_dim_names=tuple(self.mesh_shape))
        shape = (self.pp, self.dp // self.ep, self.ep, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=EP_MESH_DIMS)
        return ExpertMesh(mesh, mesh["dp_mod_ep", "ep"]._flatten("dp"))

    @classmethod
    def build(cls, cfg, world_size: int, model: ModelConfig | None = None, family=None,
              batch_sequences: int | None = None, grad_accum_steps: int = 1) -> "ParallelPlan":
        """Check the `parallel` section (a ParallelConfig) against the world and the model (a resolved
        ModelConfig and its Family, when known); every refusal is one line naming the fix.

        batch_sequences: sequences one data-parallel rank computes per step (micro_batch_size ×
        grad_accum_steps), which the pipeline's micro-batches must divide."""
        check_degrees(cfg, world_size, model, family)
        tp, pp, cp = cfg.tp, cfg.pp, getattr(cfg, "cp", 1)
        if cfg.pp_schedule not in PP_SCHEDULES:
            raise KilnError(f"parallel.pp_schedule={cfg.pp_schedule!r} is unknown; use one of {PP_SCHEDULES}",
                            key="parallel.pp_schedule", value=cfg.pp_schedule, fix=f"use one of {PP_SCHEDULES}")
        virtual = 2 if cfg.pp_schedule == "interleaved_1f1b" and pp > 1 else 1
        if model is not None:
            _check_model(tp, pp * virtual, model, family, cfg.pp_schedule)
        micro = cfg.pp_microbatches
        if pp > 1 and batch_sequences is not None:
            micro = micro or max(pp, grad_accum_steps)
            if micro < 1 or batch_sequences % micro:
                raise KilnError(f"parallel.pp_microbatches={micro} must divide each rank's batch of "
                                f"{batch_sequences} sequences (train.micro_batch_size × train.grad_accum_steps): "
                                f"pick a divisor of {batch_sequences}",
                                key="parallel.pp_microbatches", value=micro,
                                fix=f"pick a divisor of {batch_sequences}")
            if cfg.pp_schedule != "gpipe" and micro < pp:
                raise KilnError(f"parallel.pp_schedule={cfg.pp_schedule} with {pp} stages needs at least {pp} "
                                f"pipeline micro-batches (parallel.pp_microbatches={micro}); raise it or use gpipe",
                                key="parallel.pp_microbatches", value=micro, fix="raise it or use gpipe")
        return cls(world_size, tp, pp, cfg.strategy, cfg.sequence_parallel, cfg.pp_schedule, micro, virtual, cp,
                   getattr(cfg, "ep", 1))


class ExpertMesh:
    """The ep layout's DeviceMesh (dims EP_MESH_DIMS) with its flattened dp kept beside it, asked as the plain mesh
    is: mesh["dp"], mesh["tp"], mesh.get_group("dp"). (torch deprecates slicing a flattened dim out of the root
    mesh: the flattened one is to be kept, as here.)"""

    def __init__(self, root, dp):
        self.root, self.dp = root, dp

    def __getitem__(self, dims):
        return self.dp if dims == "dp" else self.root[dims]

    def get_group(self, dim: str):
        return self[dim].get_group()


def check_degrees(cfg, world_size: int, model: ModelConfig | None = None, family=None) -> None:
    """The `parallel` section's degrees and strategy against `world_size` ranks, and the experts of `model` (a
    resolved ModelConfig, when known): what a launch can be refused for before any rank reads data (init_world,
    without the model), and the first part of ParallelPlan.build (`kiln train`, `kiln memory`, `kiln plan`)."""
    tp, pp, cp, ep = cfg.tp, cfg.pp, getattr(cfg, "cp", 1), getattr(cfg, "ep", 1)
    if tp < 1 or pp < 1 or cp < 1 or ep < 1:
        raise KilnError(f"parallel.tp={tp}, parallel.pp={pp}, parallel.cp={cp} and parallel.ep={ep} must be ≥ 1 "
                        f"(1 = not split)", key="parallel.tp", fix="give each a whole number ≥ 1")
    if model is not None:
        check_experts(ep, model, family)
    if world_size % (tp * pp * cp):
        what = f"parallel.tp={tp} × parallel.pp={pp}" + (f" × parallel.cp={cp}" if cp > 1 else "")
        raise KilnError(f"{world_size} processes do not divide into {what} = {tp * pp * cp} ranks per model "
                        f"copy: launch a multiple of {tp * pp * cp} processes (torchrun --nproc_per_node) or "
                        f"change tp/pp" + ("/cp" if cp > 1 else ""), key="parallel.tp", value=tp)
    dp = world_size // (tp * pp * cp)
    data = strategy(cfg.strategy)
    if dp > 1 and not data.reduces:
        raise KilnError(f"{world_size} processes with tp={tp} × pp={pp} leave {dp} data-parallel copies, but "
                        f"parallel.strategy=none would train them independently: set "
                        f"--parallel.strategy=ddp, zero1 or fsdp",
                        key="parallel.strategy", value=cfg.strategy,
                        fix="set --parallel.strategy=ddp, zero1 or fsdp")
    if cp > 1 and not data.reduces:
        raise KilnError(f"parallel.cp={cp} ranks hold the same weights and must reduce their gradients: set "
                        f"--parallel.strategy=fsdp (or ddp, zero1); the state is sharded over dp × cp ranks",
                        key="parallel.strategy", value=cfg.strategy)
    if cfg.sequence_parallel and tp == 1:
        raise KilnError("parallel.sequence_parallel splits the sequence among tensor-parallel ranks: it needs "
                        "--parallel.tp > 1",
                        key="parallel.sequence_parallel", value=True, fix="it needs --parallel.tp > 1")
    if tp > 1 and data.refuses_tp:
        raise KilnError(f"parallel.strategy={data.name} {data.refuses_tp} with parallel.tp={tp}: use "
                        f"--parallel.strategy=fsdp or ddp",
                        key="parallel.strategy", value=data.name, fix="use --parallel.strategy=fsdp or ddp")
    if pp > 1 and data.zero_optimizer:
        raise KilnError(f"parallel.pp with parallel.strategy={data.name} is not built (ZeroRedundancyOptimizer's "
                        f"state would need one consolidated checkpoint per stage): use --parallel.strategy=fsdp "
                        f"or ddp", key="parallel.strategy", value=data.name)
    _check_ep(cfg, ep, data, world_size)


def check_experts(ep: int, model: ModelConfig, family=None) -> None:
    """parallel.ep against the model: a mixture of experts whose n_experts it divides (each ep rank holds
    n_experts/ep whole experts)."""
    if ep <= 1:
        return
    # the family description says which linears are experts (Linear.tp == "expert"), not its MLP kind's name
    dense = not model.n_experts or (family is not None and not any(x.tp == "expert" for x in family.linears(model)))
    if dense:
        raise KilnError(f"parallel.ep={ep} splits the experts of a mixture of experts, but model.arch={model.arch} "
                        f"is dense (one MLP per block): use --parallel.ep=1 or a mixture-of-experts model "
                        f"(--model.preset=qwen3-moe-nano)", key="parallel.ep", value=ep,
                        fix="use --parallel.ep=1 or a mixture-of-experts model (--model.preset=qwen3-moe-nano)")
    if model.n_experts % ep:
        raise KilnError(f"parallel.ep={ep} does not divide model.n_experts = {model.n_experts}: pick an ep that "
                        f"divides it (each ep rank holds n_experts/ep whole experts)", key="parallel.ep", value=ep,
                        fix="pick an ep that divides it (each ep rank holds n_experts/ep whole experts)")


def check_ep_ranks(cfg, world_size: int) -> None:
    """parallel.ep against the data-parallel ranks of `world_size` processes: ep is carved out of them, so it must
    divide dp = world / (tp·pp·cp). `kiln plan` asks it of the --gpus it is given, check_degrees of the launch."""
    ep = getattr(cfg, "ep", 1)
    dp = world_size // (cfg.tp * cfg.pp * getattr(cfg, "cp", 1))
    if ep > 1 and dp % ep:
        split = " × ".join(f"{k}={v}" for k, v in (("tp", cfg.tp), ("pp", cfg.pp), ("cp", getattr(cfg, "cp", 1))))
        raise KilnError(f"parallel.ep={ep} does not divide the {dp} data-parallel ranks ({world_size} "
                        f"process{'es' if world_size > 1 else ''} / "
                        f"({split})): expert parallelism is carved out of them; pick an ep that divides {dp} or "
                        f"launch {ep}× more processes", key="parallel.ep", value=ep,
                        fix=f"pick an ep that divides {dp} or launch {ep}× more processes")


def _check_ep(cfg, ep: int, data: Strategy, world_size: int) -> None:
    if ep == 1:
        return
    check_ep_ranks(cfg, world_size)
    if data.zero_optimizer:
        raise KilnError(f"parallel.ep with parallel.strategy={data.name} is not built (ZeroRedundancyOptimizer "
                        f"would treat each rank's own experts as copies of one another): use "
                        f"--parallel.strategy=fsdp or ddp", key="parallel.strategy", value=data.name,
                        fix="use --parallel.strategy=fsdp or ddp")


def _check_model(tp: int, stages: int, model: ModelConfig, family, schedule: str) -> None:
    if stages > model.n_layer:
        what = f"{stages} stages ({schedule}: 2 per rank)" if schedule == "interleaved_1f1b" else f"{stages} stages"
        raise KilnError(f"parallel.pp splits {model.n_layer} blocks into {what}: use at most {model.n_layer} "
                        f"stages (a stage holds ≥ 1 block)",
                        key="parallel.pp", value=stages,
                        fix=f"use at most {model.n_layer} stages (a stage holds ≥ 1 block)")
    if tp == 1:
        return
    sizes = {"model.n_head": model.n_head, "model.n_kv_head": model.n_kv_head}
    if family is not None:
        for lin in family.linears(model):
            if lin.tp == "column":  # (an MoE's router and experts are whole on every tp rank: nothing to divide)
                sizes[f"the output width of {lin.name}"] = lin.n_out
                for i, rows in enumerate(lin.parts):  # a fused linear: each rank takes 1/tp of every part
                    sizes[f"part {i + 1} of {lin.name} ({lin.parts})"] = rows
            elif lin.tp == "row":
                sizes[f"the input width of {lin.name}"] = lin.n_in
    if model.vocab_size:  # the embedding and head split by vocabulary rows (kiln.parallel.tensor)
        sizes["the padded vocabulary model.padded_vocab (model.vocab_size rounded up to a multiple of 64)"] = \
            model.padded_vocab
    for name, size in sizes.items():
        if size % tp:
            raise KilnError(f"parallel.tp={tp} does not divide {name} = {size}: pick a tp that divides it "
                            f"(each rank holds 1/tp of it)",
                            key="parallel.tp", value=tp, fix="pick a tp that divides it (each rank holds 1/tp of it)")
