"""Pipeline parallelism on torch.distributed.pipelining: the transformer's blocks split into consecutive stages,
one (or, interleaved, two) per pipeline rank, run by torch's schedules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B). No send/recv of our own: the schedule moves activations and their gradients.

    pipe = PipelineModel(model, plan, rank, device)   this rank's part of a built Transformer, named as in it
    loss = pipe.train_step(x, y, count, scale_loss, autocast)   the schedule's forward and backward of one step
    total, count = pipe.evaluate_batch(x, y, autocast)  forward only (the schedule's eval path)
    pipe.grad_norm(params)                            the global gradient norm over every stage
    pipe.full_state_dict()                            every stage's weights gathered on rank 0 (export, sampling)
    pipe.whole_model()                                a plain Transformer on each copy's first pipeline rank (the
                                                      NaN trace's replay, which hooks the model in one piece)

Stage s holds blocks plan.stage_layers(n_layer)[s]; the first also the embeddings (and the position table), the
last the final norm, the head and the loss. The parts keep their full-model names (blocks.3.attn.qkv.weight on
whichever rank holds block 3), so a checkpoint of any layout loads into any other through DCP.

A mixture of experts: each stage holds whole MoE blocks. The load-balancing loss is the whole model's, E·Σ f_e·P_e
pooled over every block's tokens of the micro-batch (kiln.models.moe), not a sum of per-stage losses: each stage adds
its blocks' routing sums (routed counts, probability and z sums, tokens: kiln.models.moe.routing_sums) to a small
vector that travels with the hidden states (a second stage output), and the last stage computes the loss from the
total, as Transformer.forward adds it. Its backward reaches every stage's routing probabilities through that same
vector's gradient, sent back by the schedule with the hidden states': no collective of its own, and exact to one
process. The record's moe_aux_loss and load shares are over every stage (PipelineModel.moe_metrics). With expert
parallelism (parallel.ep) each stage's experts split over the ep ranks of its dp group (mesh["ep"] stays inside a
stage), wrapped per stage as kiln.parallel.parallelize wraps a whole model; a stage's ep ranks run the same schedule,
so their all-to-alls meet.

Tied embeddings (GPT-2: head weight = embedding weight): the first and the last stage each hold the weight; after
the backward their gradients are summed over a group of those two ranks, so both copies take the same update.

Data parallelism composes over the mesh's dp dim, per stage module: DDP (parallel.strategy=ddp) or FSDP2
(parallel.strategy=fsdp: fully_shard on each of the stage's blocks, then on the stage for its embeddings, norm and
head, as torchtitan composes them). torch's PipelineStage reduces the gradients once, after the last micro-batch's
backward (DDP's reducer readied by hand; FSDP2's reduce-scatter run by the schedule's post-backward). The loss
runs outside the stage's forward (it applies the head, fused or chunked), so the last stage's head weight is the
gathered one: the stage (FSDP2's root of its group) keeps its own parameters gathered from its forward to the end
of the step's backward. ZeRO-1 is refused by ParallelPlan.build. The gradient norm takes the gradients of each
DTensor mesh apart (ep: the experts' and the others').

Tensor parallelism composes inside each stage (tp × pp, and tp × pp × dp): kiln.parallel.tensor splits the
whole model over mesh["tp"] first, then it is split into stages (with dp copies, each stage then takes FSDP2 over
mesh["dp"]: fully_shard under fsdp, replicate under ddp, since DDP cannot reduce DTensors); the stages pass plain tensors (the full hidden
width, replicated over tp, or with sequence parallelism this rank's sequence shard). Each tp rank of the last stage
computes the same loss (from its vocabulary shard of the logits, reduced over tp); the gradient norm is each rank's
DTensor norm (reduced over tp) summed over pp; the tied weight's gradient (each tp rank's vocabulary rows) is summed
between the first and last stage's ranks with the same tp coordinate.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from kiln.errors import KilnError
from kiln.models import build_model
from kiln.models.lora import adapter_layout, add_adapters
from kiln.models.moe import MoE, losses_of, moe_metrics, routing_sums
from kiln.models.transformer import moe_penalty
from kiln.parallel.apply import shard_blocks
from kiln.parallel.expert import shard_experts, wrap_experts
from kiln.parallel.fused import canonical, fused_rows
from kiln.parallel.layout import ParallelPlan
from kiln.util import is_dtensor

# parallel.pp_schedule -> torch.distributed.pipelining's schedule class
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def _pipelining():
    """torch.distributed.pipelining, imported when a pipeline is built: it imports torch._dynamo and with it
    Triton's language (about 2 s), which must not happen before a process decides on TRITON_INTERPRET."""
    import torch.distributed.pipelining as pipelining  # lazy: see the docstring

    return pipelining


class Stage(nn.Module):
    """One pipeline stage: a run of consecutive blocks, with the embeddings when it is the first and the final norm
    when it is the last. Its forward is what the schedule calls: token ids (B, T) or hidden states (B, T, C) in,
    hidden states (B, T, C) out (normalised on the last stage, whose loss function applies the head)."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.pos_embed, self.drop = model.embed, model.pos_embed, model.drop
        elif last and model.head is None:  # tied: the head is the embedding matrix; held so DDP reduces its gradient
            self.embed = model.embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.norm, self.head = model.norm, model.head
        if hasattr(model, "rope_cos"):
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.autocast = contextlib.nullcontext  # the run's precision (set by the step)
        self.moe = [m for m in self.blocks.modules() if isinstance(m, MoE)]  # a plain list: not registered twice
        self.routed: list[list[torch.Tensor]] = []  # each training forward's routed counts per block, this step

    def forward(self, x: torch.Tensor, sums: torch.Tensor | None = None):
        """A mixture of experts: (hidden states, routing sums) out, the sums of this micro-batch's routing over the
        stages so far (kiln.models.moe.routing_sums; zeros in evaluation, which routes without recording)."""
        x = self._blocks(x)
        if not self.moe:
            return x
        if self.moe[0].training:  # (the stage itself is not a submodule of the PipelineModel: its blocks are)
            self.routed.append([m.routed for m in self.moe])
            mine = routing_sums(self.moe)
        else:
            mine = torch.zeros(2 * self.moe[0].n_experts + 2, device=x.device)
        return x, mine if sums is None else sums + mine

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            if self.first:
                T = x.shape[1]
                x = self.embed(x)  # (B, T, C)
                if self.pos_embed is not None:
                    x = x + self.pos_embed(torch.arange(T, device=x.device))
                x = self.drop(x)
            rope = (self.rope_cos, self.rope_sin) if hasattr(self, "rope_cos") else None
            for block in self.blocks.values():
                x = block(x, rope)
            return self.norm(x) if self.last else x


class PipelineModel(nn.Module):
    """This rank's part of a Transformer: the parts of its stages under their full-model names (what the optimizer,
    state_dict and DCP see), the stage modules and the schedule that runs them."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, rank: int, device: torch.device, mesh=None,
                 fsdp: dict | None = None):
        """fsdp: FSDP2's options (kiln.parallel.fsdp_options): fully_shard's under parallel.strategy=fsdp,
        replicate's under ddp with tp."""
        super().__init__()
        self.plan, self.coords = plan, plan.coords(rank)
        mesh = mesh if mesh is not None else plan.device_mesh(device.type)
        if plan.tp > 1:  # torchtitan's order: tensor parallel on the whole model, then the split into stages
            from kiln.parallel.tensor import apply_tensor_parallel  # lazy: DTensor's imports, tp > 1 only

            apply_tensor_parallel(model, mesh["tp"], plan.sequence_parallel)
        if plan.ep > 1:  # each stage's experts split over its ep ranks (kiln.parallel.expert), as without pp
            shard_experts(model, mesh["ep"])
        self.cfg = model.cfg  # what kiln.parallel.fused.fused_rows reads (the checkpoint's TP row order)
        self.adapters = adapter_layout(model)  # LoRA's, for whole_model's copy
        self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        n_stages = plan.pp * plan.virtual_stages
        layers = plan.stage_layers(model.cfg.n_layer)
        pp_rank = self.coords["pp"]
        self.stage_ids = list(range(pp_rank, n_stages, plan.pp))  # loop order: stage s on pp rank s % pp
        self.stages = [Stage(model, layers[s], s == 0, s == n_stages - 1) for s in self.stage_ids]
        self.has_first, self.has_last = self.stage_ids[0] == 0, self.stage_ids[-1] == n_stages - 1
        # The parts, registered once under the names the full model gives them.
        if self.has_first or (self.has_last and model.head is None):
            self.embed = model.embed
        if self.has_first:
            self.pos_embed = model.pos_embed
        self.blocks = nn.ModuleDict({k: b for st in self.stages for k, b in st.blocks.items()})
        if self.has_last:
            self.norm, self.head, self.loss = model.norm, model.head, model.loss
        self.tied = model.head is None
        self.moe_aux_loss: torch.Tensor | None = None  # the last stage's last micro-batch's (a mixture of experts)
        self.tie_group = _tie_group(plan, rank) if self.tied else None
        self.dp = plan.dp
        self.dp_mesh, self.mesh = mesh["dp"], mesh
        wrapped = [self._data_parallel(st, device, fsdp or {}) for st in self.stages]
        self.device = device
        pipelining = _pipelining()
        self._stages = [pipelining.PipelineStage(w, s, n_stages, device, group=self.pp_group)
                        for w, s in zip(wrapped, self.stage_ids)]
        cls = getattr(pipelining, SCHEDULES[plan.pp_schedule])
        self.schedule = cls(self._stages if cls is pipelining.ScheduleInterleaved1F1B else self._stages[0],
                            plan.pp_microbatches, loss_fn=self._train_loss, scale_grads=False)
        self._eval: dict = {}  # eval schedules by batch shape
        self._sums: list[torch.Tensor] = []  # the last stage's micro-batch losses (sum over tokens / count)
        self._step_args = None  # (count, scale_loss) of the step being run

    def _data_parallel(self, stage: Stage, device, fsdp: dict) -> nn.Module:
        if self.plan.dp == 1:
            return stage
        ep = self.plan.ep > 1  # the stage's experts first, over mesh["dp_mod_ep"] (kiln.parallel.expert.wrap_experts)
        if self.plan.dp_strategy.shards_parameters:  # the stage itself becomes the FSDP2 module (in place)
            if ep:
                from torch.distributed.fsdp import fully_shard  # lazy: fsdp only

                wrap_experts(stage, self.mesh, fully_shard, fsdp)
            shard_blocks(stage, stage.blocks.values(), self.dp_mesh, fsdp, keep_root=True)
            return stage
        if self.plan.tp > 1 or ep:  # DDP cannot reduce DTensors; FSDP2's replicate can (as kiln.parallel.parallelize)
            from torch.distributed._composable.replicate_with_fsdp import replicate  # lazy: ddp × (tp or ep) × pp

            if ep:
                wrap_experts(stage, self.mesh, replicate, fsdp)
            replicate(stage, mesh=self.dp_mesh, **fsdp)
            return stage
        ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(stage, device_ids=ids, process_group=self.dp_group)
        # PipelineStage readies DDP's reducer itself before the last micro-batch's backward and runs the others
        # under no_sync; a forward must not ready it too (1F1B runs a later micro-batch's forward before an
        # earlier one's backward, which would then count every gradient twice: DDP's bucket rebuild asserts).
        ddp.require_backward_grad_sync = False
        return ddp

    def forward(self, *args, **kwargs):
        raise KilnError("a pipeline-parallel model runs through its schedule (PipelineModel.train_step, "
                        "evaluate_batch), not in one piece: gather it first (PipelineModel.whole_model, or "
                        "full_state_dict into a model built on one rank)", key="model",
                        fix="gather it first (PipelineModel.whole_model, or full_state_dict into a model built on one "
                            "rank)")

    @property
    def duplicate(self) -> nn.Parameter | None:
        """The last stage's copy of a tied embedding, counted once in the gradient norm (the first stage's counts)."""
        return self.embed.weight if self.tied and self.has_last and not self.has_first else None

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.tied else self.head.weight

    # -- one step ----------------------------------------------------------------------------------------------

    def _train_loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch, as the step normalises it: its sum over valid tokens divided by
        the global batch's count, times the dp degree (DDP averages the ranks' gradients), loss-scaled."""
        count, scale_loss = self._step_args
        h, sums = h if isinstance(h, tuple) else (h, None)
        with self.stages[-1].autocast():
            loss = self.loss(h.flatten(0, 1), self.head_weight, y.flatten())
        if sums is not None:  # an MoE: the penalty of every stage's routing, as Transformer.forward adds it
            aux, z = losses_of(sums, self.cfg.n_experts, bool(self.cfg.moe_z_coef))
            loss = loss + moe_penalty(self.cfg, aux, z, self) * (y != -100).sum()
        loss = loss / count
        self._sums.append(loss.detach())
        return scale_loss(loss * self.dp if self.dp > 1 else loss)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, count: torch.Tensor, scale_loss, autocast) -> torch.Tensor:
        """Forward and backward of this rank's per-step batch (x, y: (B, T), B split into plan.pp_microbatches);
        returns this rank's share of the global mean loss (fp64; zero where the loss is not computed), for an
        all-reduce over every rank."""
        for st in self.stages:
            st.autocast = autocast
        self._sums.clear()
        self._step_args = (count, scale_loss)
        for st in self.stages:
            st.routed.clear()
        self.schedule.step(*((x,) if self.has_first else ()), target=y if self.has_last else None)
        for st in self.stages:  # the micro-batches' forwards are the last ones: torch's first step runs one more, on
            for routed in st.routed[-self.plan.pp_microbatches:]:  # the inputs' shapes (uninitialized past stage 0)
                for m, r in zip(st.moe, routed):
                    m.load = r if m.load is None else m.load + r
        self._sync_tied()
        return self._share(self._sums[-self.plan.pp_microbatches:] if self.has_last else [], count.device)

    def _share(self, sums: list[torch.Tensor], device) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for s in sums:  # the same on every tp rank of the last stage (reduced over tp in the loss): over pp, dp
            total = total + s.double()
        return total

    def _sync_tied(self) -> None:
        """Tied embeddings: the first and the last stage's gradients of the shared weight, summed on both."""
        if self.tie_group is None:
            return
        grad = self.embed.weight.grad
        if grad is None:
            grad = self.embed.weight.grad = torch.zeros_like(self.embed.weight)
        dist.all_reduce(_local(grad), group=self.tie_group)  # under TP: each tp rank its rows, with its own pair

    def grad_norm(self, params, masters=None) -> torch.Tensor:
        """The L2 norm of every stage's gradients, the tied copy counted once: this rank's sum of squares summed
        over the pipeline ranks. `params` may be the fp32 masters of bf16-master (masters: its MasterWeights)."""
        skip = set()
        if self.duplicate is not None:
            skip.add(id(self.duplicate))
            if masters is not None:
                skip.add(id(masters.by_model_param[id(self.duplicate)]))
        groups: dict = {}  # by the gradients' DTensor mesh (ep: the experts' differs), each normed over its ranks
        for p in params:
            if p.grad is not None and id(p) not in skip:
                groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for grads in groups.values():  # the same meshes in the same order on the ranks of a stage
            local = torch.nn.utils.get_total_norm(grads, foreach=True)
            if is_dtensor(local):  # TP: split gradients' squares summed over the tp ranks, replicated once
                local = local.full_tensor()
            sq = sq + local.double() ** 2
        dist.all_reduce(sq, group=self.pp_group)
        return sq.sqrt().to(next(iter(groups.values()))[0].dtype if groups else torch.float32)

    def moe_metrics(self) -> dict[str, float]:
        """kiln.models.moe_metrics over every stage's blocks: the load-balancing loss the last stage computed from
        every stage's routing, the largest and smallest load share over the pipeline ranks. A collective over the
        pipeline ranks (every rank logs); {} without experts."""
        mine = moe_metrics(self)  # this rank's blocks (their load read and reset)
        if not mine:
            return {}
        aux = float(self.moe_aux_loss) if self.has_last and self.moe_aux_loss is not None else 0.0
        values = torch.tensor([aux, mine["moe_load_max"], -mine["moe_load_min"]], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.pp_group)  # the loss is ≥ 0, set on one rank
        aux, high, low = values.tolist()
        return {"moe_aux_loss": aux, "moe_load_max": high, "moe_load_min": -low}

    # -- evaluation ------------------------------------------------------------------------------------------

    def _eval_loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = h[0] if isinstance(h, tuple) else h  # (a mixture of experts' routing sums: no penalty in evaluation)
        with self.stages[-1].autocast():
            total = self.loss(h.flatten(0, 1), self.head_weight, y.flatten())
        self._sums.append(total.detach())
        return total

    @torch.no_grad()
    def evaluate_batch(self, x: torch.Tensor, y: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of token losses, valid-token count) of one batch on the rank that speaks for the last stage, zeros
        elsewhere: the sum over every rank is the batch's."""
        for st in self.stages:
            st.autocast = autocast
        schedule, n = self._eval_schedule(tuple(x.shape))
        self._sums.clear()
        schedule.eval(*((x,) if self.has_first else ()), target=y if self.has_last else None)
        total = self._share(self._sums[-n:] if self.has_last else [], x.device)
        count = (y != -100).sum().double() if self.has_last else total.new_zeros(())
        return total, count

    def _eval_schedule(self, shape: tuple):
        """A forward-only schedule over the unwrapped stage modules, one per batch shape (a stage's buffers are
        sized by the first batch it sees). Micro-batches: the largest divisor of the batch ≤ plan.pp_microbatches."""
        if shape not in self._eval:
            n = max(d for d in range(1, shape[0] + 1) if shape[0] % d == 0 and d <= self.plan.pp_microbatches)
            n_stages = self.plan.pp * self.plan.virtual_stages
            pipelining = _pipelining()
            stages = [pipelining.PipelineStage(st, s, n_stages, self.device, group=self.pp_group)
                      for st, s in zip(self.stages, self.stage_ids)]
            schedule = pipelining.schedules.ScheduleLoopedBFS(stages, n, loss_fn=self._eval_loss) if len(stages) > 1 else \
                pipelining.ScheduleGPipe(stages[0], n, loss_fn=self._eval_loss)
            self._eval[shape] = (schedule, n)
        return self._eval[shape]

    # -- export --------------------------------------------------------------------------------------------------

    def full_state_dict(self, every_copy: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights (host copies) on global rank 0, gathered from the pipeline ranks of its
        data-parallel copy; {} on every other rank. every_copy: on the first pipeline rank of every copy (and tp
        coordinate) instead. A collective: every rank calls it."""
        mine = {k: _local(v.full_tensor() if is_dtensor(v) else v).detach().cpu()
                for k, v in self.state_dict().items()}  # TP: each weight gathered from its tp ranks
        for name, parts in fused_rows(self).items():  # ... and its fused rows back in the model's order
            mine[name] = canonical(mine[name], parts, self.plan.tp)
        ranks = dist.get_process_group_ranks(self.pp_group)
        out = [None] * len(ranks) if dist.get_rank() == ranks[0] else None
        dist.gather_object(mine, out, dst=ranks[0], group=self.pp_group)
        if dist.get_rank() != (ranks[0] if every_copy else 0):
            return {}
        full = {}
        for part in out:
            full.update(part)
        return full

    def whole_model(self) -> nn.Module | None:
        """A plain copy of the whole model (kiln's Transformer, in the weights' dtype, on this device) on the first
        pipeline rank of each data-parallel copy (full_state_dict's every_copy), None on the others: where the step
        can be replayed in one piece with hooks on every module (kiln.numerics.trace). A collective: every rank
        calls it."""
        weights = self.full_state_dict(every_copy=True)
        if not weights:
            return None
        model = build_model(self.cfg, self.device)
        add_adapters(model, self.adapters)
        model.load_state_dict(weights)
        return model.to(next(iter(weights.values())).dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _tie_group(plan: ParallelPlan, rank: int):
    """The 2-rank group of this rank's first and last pipeline ranks (same dp and tp coordinates). Every rank
    creates every group (torch's new_group is collective); each keeps its own."""
    mine = None
    for r in range(plan.world_size):
        c = plan.coords(r)
        if c["pp"] != 0:
            continue
        pair = [r, r + (plan.pp - 1) * plan.dp * plan.tp]  # the same (dp, tp) on the last pp rank
        group = dist.new_group(pair)
        if rank in pair:
            mine = group
    return mine
