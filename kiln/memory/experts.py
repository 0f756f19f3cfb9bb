"""Expert parallelism in the estimator and the planner (issue #41): what one of `ep` ranks holds and sends.

    expert_parallel(job)     per-rank numbers of an MoE under parallel.ep: experts, routed pairs (balanced and
                             worst case), the all-to-all buffers and bytes
    all_to_all_seconds(job, link, efficiency)   the step's all-to-all time on this rank

ep is carved out of the data-parallel ranks (torchtitan's dp_shard_mod_ep × ep): the world stays pp × dp × cp × tp,
ep divides dp (kiln.parallel.layout.check_degrees refuses the rest). Each rank holds n_experts / ep whole experts
of every MoE block (kiln.memory.estimate.local_parameter_shapes drops the others); an expert's gradients and
optimizer state are data-parallel over the dp·cp / ep ranks that hold it, everything else over dp·cp.

Routing: each token's K (token, slot) pairs travel to their experts' ranks and back — two all-to-alls per MoE block
in forward (dispatch, combine) and two in backward (their gradients), d_model elements a pair in the compute dtype.
The estimate assumes balanced routing: a rank receives as many pairs as it sends, N·K, so its routed activations
(an MoE's S-proportional saved tensors, kiln.models.costs.MoEMLP.saved) are one process's. Worst case: a token
sends at most min(K, E/ep) of its pairs to one rank, so a rank can receive ep·N·min(K, E/ep) pairs — its routed
activations and receive buffers times ep·min(K, E/ep)/K (`imbalance`). Dropless, as kiln's MoE is: nothing caps it.
"""
from __future__ import annotations

from dataclasses import replace

from kiln.models.registry import family
from kiln.errors import KilnError
from kiln.parallel.layout import ParallelPlan, check_degrees


def _moe_blocks(cfg) -> int:
    """Blocks with experts: every block of an MoE family, none of a dense one."""
    return cfg.n_layer if any(x.tp == "expert" for x in family(cfg.arch).linears(cfg)) else 0


def expert_parallel(job) -> dict[str, float]:
    """One rank's expert-parallel numbers for a Job (kiln.memory.estimate.Job): experts_per_rank, pairs (routed
    (token, slot) pairs per micro-batch, balanced), worst_pairs, imbalance (worst / balanced), exchange_bytes (one
    all-to-all's send and receive buffers alive together), all_to_all_bytes (what this rank sends per micro-batch,
    forward and backward: 4 exchanges a block, (ep - 1)/ep of each leaves the rank)."""
    cfg, ep = job.model, job.ep
    blocks = _moe_blocks(cfg)
    if not blocks:
        return {"experts_per_rank": 0, "pairs": 0, "worst_pairs": 0, "imbalance": 1.0, "exchange_bytes": 0,
                "all_to_all_bytes": 0.0}
    E, K, d, c = cfg.n_experts, cfg.n_experts_active, cfg.d_model, job.num.compute
    pairs = job.tokens * K
    worst = ep * job.tokens * min(K, E // ep)
    exchange = 2 * pairs * d * c if ep > 1 else 0
    recomputed = sum(1 for i in range(cfg.n_layer) if job.policy(i) in ("full", "seg"))  # forward run again
    sent = (4 * blocks + 2 * recomputed) * pairs * d * c * (ep - 1) / ep
    return {"experts_per_rank": E // ep, "pairs": pairs, "worst_pairs": worst, "imbalance": worst / pairs,
            "exchange_bytes": exchange, "all_to_all_bytes": sent}


def is_expert(name: str) -> bool:
    """A parameter of an MoE's experts: blocks.i.mlp.experts.e.* (one per expert) or blocks.i.mlp.experts.*
    (the experts stacked on a first dimension)."""
    return name.split(".")[2:4] == ["mlp", "experts"]


def expert_comm(job, comm, numels: list[tuple[str, int]], trained) -> object:
    """The data-parallel wrapper's buffers under ep (kiln.memory.estimate.CommBuffers, built for one group per
    block): kiln.parallel.expert.wrap_experts makes each block's experts (its `mlp`) a group of their own over
    dp/ep ranks, so they are gathered in their own block's forward and backward only (not prefetched with the
    next block) and reduced as soon as their backward ends, apart from the block's other parameters.
    numels: this rank's (name, elements); trained(name): gets a gradient.

    fsdp        the block groups gather and reduce-scatter the non-expert parameters only (their gloo staging
                too); the experts' group gathers a copy even on one rank (FSDP2 copies the shard into its
                unsharded parameter at world size 1) and stages it through gloo only over more than one.
    ddp         FSDP2's replicate (DDP has no ep): no persistent buckets; replicate(model) holds one copy of every
                non-expert parameter from the forward to the backward's end (reduced there), and each block's
                experts a copy from their forward to their backward (replicate does not reshard after forward).
    Both free their root gathers before the optimizer step (the first step's peak, measured 2026-11-27 on 2
    gloo ranks: +25% with DDP's buckets, +6% with the root's gathers held)."""
    comm.all_to_all = int(expert_parallel(job)["exchange_bytes"])
    data, num = job.dp_strategy, job.num
    if not data.reduces:
        return comm
    element, rs = num.gathered or num.param, 8  # rs: kiln.memory.estimate._comm_buffers's fp32 input and copy
    experts, others, reduced, root = {}, {}, {}, 0
    for name, n in numels:
        if not name.startswith("blocks."):
            root += n
            continue
        i = int(name.split(".")[1])
        part = experts if is_expert(name) else others
        part[i] = part.get(i, 0) + n
        if is_expert(name) and trained(name):
            reduced[i] = reduced.get(i, 0) + n
    # The experts' backward makes their unsharded gradients (in the gathered dtype) beside the block's other
    # transients: the step's peak on 2 gloo ranks is in it (kiln.parallel.expert's _ScaleGrad, measured
    # 2026-11-27, ep2 fsdp fp32: 5.8% under without them). _ScaleGrad's scaled copy of each is not counted: with
    # the largest one's counted too the estimate is +2.4% on 2 ranks but +4.8% (+5.7% in the first step) on 4
    # (dp/ep = 2), without it -2.0% and -1.5% (-2.8%): torch frees more of the unscaled ones than assumed.
    comm.experts_backward = {i: n * element for i, n in reduced.items()}
    comm.experts = {i: n * element for i, n in experts.items()}
    comm.experts_reduce = {i: n * rs for i, n in reduced.items()}
    if job.world // job.ep > 1 and element < 4:
        # over gloo (dp/ep > 1) a half-precision gradient stays beside the fp32 input and gloo's copy of it:
        # 10 bytes an element (measured on 4 ranks, ep2 fsdp bf16: the peak is in the experts' reduction, 5.8%
        # under with 8)
        comm.experts_reduce = {i: n * (rs + element) for i, n in reduced.items()}
    comm.released_for_step = True
    if data.ddp_reducer:
        comm.persistent = (root + sum(others.values())) * element
        comm.keep_experts = True
        # the root group's fp32 reduction input; the unsharded gradients are freed as they are copied in
        comm.final_reduce = sum(n for name, n in numels if not is_expert(name) and trained(name)) * 4
        return comm
    comm.gathered = {i: others.get(i, 0) * element for i in comm.gathered}
    comm.keep_experts = not job.reshard_after_forward
    comm.reduce_scatter = {i: sum(n for name, n in numels if name.startswith(f"blocks.{i}.") and not is_expert(name)
                                  and trained(name)) * rs for i in comm.reduce_scatter}
    if comm.staging_forward:
        comm.staging_forward = max(comm.gathered.values())
        comm.experts_staging = max(comm.experts.values(), default=0) if job.world // job.ep > 1 else 0
    return comm


def all_to_all_seconds(job, link: float, efficiency: float) -> float:
    """Seconds of one step's all-to-alls on this rank (every micro-batch), on the critical path: a block's experts
    wait for their tokens, and the combine for the experts."""
    if job.ep == 1:
        return 0.0
    return job.grad_accum * expert_parallel(job)["all_to_all_bytes"] / (link * efficiency)


def worst_case_note(job) -> str | None:
    """One line for `kiln memory`: the balanced assumption and what the worst routing would add."""
    if job.ep == 1:
        return None
    x = expert_parallel(job)
    if not x["pairs"]:
        return None
    return (f"expert parallel ep{job.ep}: {x['experts_per_rank']:g} experts of {job.model.n_experts} a rank; routed "
            f"activations assume balanced routing ({x['pairs']:,} (token, slot) pairs a rank); worst case "
            f"{x['worst_pairs']:,} pairs ({x['imbalance']:g}× the routed activations and receive buffers; dropless)")


def ep_degrees(parallel, world: int, model) -> list[int]:
    """The expert-parallel degrees > 1 the planner tries for a resolved model on `world` ranks split as `parallel`
    (a ParallelConfig with tp, pp, cp and a strategy): every one the runtime's own check passes
    (kiln.parallel.layout.check_degrees: ep divides dp and the experts, an MoE, no ZeRO-1); none for a dense model."""
    if not _moe_blocks(model) or "ep" not in ParallelPlan.__dataclass_fields__:  # the layout object holds ep (#41)
        return []
    fam, dp = family(model.arch), world // (parallel.tp * parallel.pp * parallel.cp)
    out = []
    for e in range(2, dp + 1):
        try:
            check_degrees(replace(parallel, ep=e), world, model, fam)
        except KilnError:
            continue
        out.append(e)
    return out


def with_ep(plan, ep: int):
    """The layout object with expert-parallel degree ep (kiln.parallel.layout.ParallelPlan.ep)."""
    return plan if ep == 1 else replace(plan, ep=ep)
