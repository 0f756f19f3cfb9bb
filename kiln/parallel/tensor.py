"""Tensor parallelism (and sequence parallelism) of kiln's Transformer over the mesh's tp dim, through torch's DTensor
`parallelize_module`: Megatron's split of each block, driven by the family's own description of its linears.

    apply_tensor_parallel(model, tp_mesh, sequence_parallel)   in place; the model pipeline's first parallel step
    (fused_rows, canonical, from_canonical: the fused weights' row orders, in kiln.parallel.fused, which imports no
    DTensor: every run's checkpoints use them)
    vocab_parallel_log_likelihood(h, weight, targets, vocab)   log p(target) per row on the split head (scoring)

Each block linear's role comes from `Family.linears(cfg)`: "column" linears (attn.qkv, mlp.fc) are ColwiseParallel
(output features split, this rank's heads or MLP width), "row" linears (attn.proj, mlp.proj) RowwiseParallel (input
split, outputs summed over the tp ranks). The norms and a learned position table are replicated: every rank holds
them whole and computes them on the same activations. All parameters become DTensors on the tp mesh, the
replicated ones too, so that FSDP2 afterwards sees one 2-D (dp, tp) mesh and the optimizer, the global norm and
DCP see one kind of tensor.

The vocabulary is split too (always with tp > 1: the embedding, the head and the logits are 1/tp per rank, the
largest tensors of a small model). The token embedding (VocabParallelEmbedding, in place of the nn.Embedding,
under its name) holds rows [r·V/tp, (r+1)·V/tp) of the padded vocabulary on rank r (Shard(0) of [V, C]), looks up
the ids that fall in them (zeros for the others) and the lookups are summed over the tp ranks: torch's
RowwiseParallel on nn.Embedding, but with the gradient of this rank's rows only. The head weight (its own
nn.Linear, ColwiseParallel, or GPT-2's tied embedding, the same parameter) is split the same way, so the logits
come out sharded on the vocabulary (Shard(-1)): each rank computes its V/tp columns of every token's logits. The
tied weight's gradient is the sum of the lookup's and the head's, both on this rank's rows. The loss
(VocabParallelLoss, in place of the model's LMLoss) is F.cross_entropy's own ops (log_softmax, nll_loss) on those
DTensor logits under torch's `loss_parallel()`: the max, the sum of exponentials and the target's logit are
all-reduced over tp (three [N] vectors), never the [N, V] logits; its backward, run under the same context, gives
each rank its rows of the head's gradient. The sum over valid targets (ignore_index) is LMLoss's contract, so the
step's normalisation by the global batch's count is unchanged. kiln's LM loss has no label smoothing to carry
over. The chunked loss and the fused Triton loss compute the whole vocabulary's logits per chunk:
memory.chunked_loss is refused with tp > 1 (kiln.config), and train.kernels=triton keeps the plain loss's place
for this one (kiln.run.lm). Evaluation runs the same loss (task scoring, kiln.evaluate.forward, puts
vocab_parallel_log_likelihood in its place: the same ops, each target's log-probability instead of the sum); sampling and exports read the consolidated weights
(kiln.train.checkpoint gathers the shards, one whole tensor at a time).

Sequence parallel (parallel.sequence_parallel): between the TP regions the residual stream is split along the
sequence (dim 1) instead of replicated, so the norms, dropout and residual adds run on 1/tp of the tokens; each
region all-gathers its input and its row linear reduce-scatters its output (the same bytes moved as the all-reduce
they replace). The first block splits its input (the embedding's lookups are summed whole: a learned position table
is added to them before the split); the final norm gathers the sequence back for the head and loss.

The fused weights. attn.qkv holds the rows [q; k; v] and a SwiGLU's mlp.fc [gate; up]; a plain Shard(0) would give
rank 0 all of q and part of k, not its heads of each. The family describes the parts (`Linear.parts`), and applying
TP reorders the rows once, in memory, so that each rank's contiguous block is [q_r; k_r; v_r] (its heads of q, of k
and of v; gate_r and up_r of the same MLP columns). The attention reads its local head counts off the width of the
qkv output and SwiGLU chunks the local output in two, so the model code is the same with and without TP. The
reordering never leaves the process: checkpoints (DCP, model and optimizer state), the consolidated safetensors and
Hugging Face exports hold the model's own order, through `canonical` on the way out and `from_canonical` on the way
in (kiln.train.checkpoint), so a checkpoint resumes under any layout, and a checkpoint written without TP resumes
with it. Each conversion gathers one fused tensor at a time (a save or a load, not a step).

A mixture of experts: the router and the stacked experts ("replicate", "expert" roles) are held whole on every tp
rank (Held: replicated DTensors; kiln.models.moe runs the experts on their local copies), and every tp rank routes
and computes the same tokens — all of the sequence, gathered first under sequence parallelism and split again after
(its gradient all-gathered back, so every copy's gradient is the same). Attention is split as for any family. Expert
parallelism (parallel.ep), not tp, divides the experts.

Not built: dropout identical to one process (each tp rank draws its own masks on its heads; with dropout 0 TP is
exact to one process).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)
from torch.nn._reduction import get_enum

from kiln.errors import KilnError
from kiln.models.parts import IGNORE_INDEX, LMLoss, at_least_fp32
from kiln.models.registry import family
from kiln.parallel.fused import fused_rows, tp_order

_SUM, _NONE = get_enum("sum"), get_enum("none")  # nll_loss's reduction argument


class Held(ParallelStyle):
    """A module that is not split: its parameters replicated over the tp ranks (DTensors), its tensor inputs taken
    as DTensors placed `inputs` (Replicate: the same on every tp rank; Shard(d): this rank's part of them), its
    output redistributed to `output` (None: left as it is) and handed on as this rank's local tensor.

    A replicated weight that meets this rank's part of the activations (Shard inputs) gets this rank's part of the
    gradient: DTensor sums it over the tp ranks."""

    def __init__(self, inputs=Replicate(), output=None):
        super().__init__()
        self.inputs, self.output = inputs, output

    def _in(self, module, args, mesh):
        place = self.inputs
        out = []
        for x in args:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                p = Shard(place.dim % x.ndim) if isinstance(place, Shard) else place
                x = DTensor.from_local(x, mesh, [p], run_check=False)
            out.append(x)
        return tuple(out)

    def _out(self, module, y, mesh):
        if isinstance(y, DTensor):
            if self.output is not None and tuple(y.placements) != (self.output,):
                y = y.redistribute(placements=[self.output])
            return y.to_local()
        return y

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, self._in, self._out)


class VocabParallelEmbedding(nn.Embedding):
    """An nn.Embedding's table split by rows (the padded vocabulary) over the tp ranks: `weight` is a DTensor,
    Shard(0), under the embedding's own name, and it is still an nn.Embedding to whoever asks (the optimizer does
    not decay embeddings). Each rank looks up the ids that fall in its rows (zeros for the others) and the lookups
    are summed over tp (DTensor's Partial to Replicate: an all-reduce), as torch's RowwiseParallel does for
    nn.Embedding. Its backward differs: DTensor has no row-sharded rule for the lookup's backward, so under
    RowwiseParallel every rank computes the whole [V, C] gradient from the replicated ids (Replicate, V·C floats
    per rank); here the lookup runs on this rank's rows, and so does its gradient (Shard(0))."""

    def __init__(self, embedding: nn.Embedding, mesh):
        table = distribute_tensor(embedding.weight.detach(), mesh, [Shard(0)])
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, _weight=table)

    def forward(self, ids):  # (B, T), the same on every tp rank
        table = self.weight.to_local()  # (V/tp, C): rows [r·V/tp, (r+1)·V/tp)
        rows = table.shape[0]
        local = ids - self.weight.device_mesh.get_local_rank() * rows
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.masked_fill(outside, 0), table).masked_fill(outside[..., None], 0.0)  # (B, T, C)
        x = DTensor.from_local(x, self.weight.device_mesh, [Partial()], run_check=False)
        return x.redistribute(placements=[Replicate()]).to_local()


class _ShardedCrossEntropy(torch.autograd.Function):
    """Sum over valid targets of the cross-entropy of logits sharded on the vocabulary: F.cross_entropy's own ops
    (log_softmax, then nll_loss), forward and backward, under torch's loss_parallel(). Its backward must run inside
    the context too (outside it, DTensor all-gathers the logits' gradient and replicates the head's), and the
    step's backward (or a pipeline schedule's) is not ours to wrap: so the two ops' backward is called here. Saved:
    the log-probabilities (N, V/tp), as F.cross_entropy saves them."""

    @staticmethod
    def forward(ctx, logits, targets):  # logits DTensor (N, V) Shard(-1), targets DTensor (N,) Replicate
        with loss_parallel():
            logp = torch.log_softmax(logits, dim=-1)
            loss, total_weight = torch.ops.aten.nll_loss_forward(logp, targets, None, _SUM, IGNORE_INDEX)
        ctx.save_for_backward(logp, targets, total_weight)
        return loss

    @staticmethod
    def backward(ctx, grad):
        logp, targets, total_weight = ctx.saved_tensors
        with loss_parallel():
            grad = torch.ops.aten.nll_loss_backward(grad, logp, targets, None, _SUM, IGNORE_INDEX, total_weight)
            grad = torch.ops.aten._log_softmax_backward_data(grad, logp, -1, logp.dtype)
        return grad, None


class VocabParallelLoss(nn.Module):
    """LMLoss's contract (the head and the sum of token losses over valid targets, in fp32) on a head weight
    sharded over the vocabulary: the logits stay split (module docstring)."""

    def forward(self, h, weight, targets):  # h (N, C) replicated, weight DTensor (V, C) Shard(0), targets (N,)
        mesh = weight.device_mesh
        h, targets = (DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (h, targets))
        logits = at_least_fp32(F.linear(h, weight))  # (N, V/tp) on this rank: Shard(-1)
        return _ShardedCrossEntropy.apply(logits, targets).to_local()


def vocab_parallel_log_likelihood(h, weight, targets, vocab: int) -> torch.Tensor:
    """log p(target) of each row of h (N, C), replicated over tp, with the softmax over the first `vocab` rows of a
    head weight sharded over the padded vocabulary (Shard(0)): VocabParallelLoss's ops (log_softmax, nll_loss under
    loss_parallel(): three [N] vectors reduced over tp, never the logits) with kiln's padding columns at -inf, as a
    model exported without them has none (kiln.evaluate, task scoring). (N,) fp32 or wider, the same on every rank."""
    mesh = weight.device_mesh
    local = at_least_fp32(F.linear(h, weight.to_local()))  # (N, V/tp): this rank's columns of the logits
    first = mesh.get_local_rank() * local.shape[1]
    padding = torch.arange(first, first + local.shape[1], device=local.device) >= vocab
    logits = DTensor.from_local(local.masked_fill(padding, float("-inf")), mesh, [Shard(-1)], run_check=False)
    targets = DTensor.from_local(targets, mesh, [Replicate()], run_check=False)
    with loss_parallel():
        logp = torch.log_softmax(logits, dim=-1)
        nll, _ = torch.ops.aten.nll_loss_forward(logp, targets, None, _NONE, IGNORE_INDEX)
    return -nll.to_local()


def _gather_sequence(module, args):
    """A TP region's input (attention, MLP) under sequence parallelism: the whole sequence, on every tp rank."""
    x = args[0]
    if isinstance(x, DTensor):
        x = x.redistribute(placements=[Replicate()]).to_local()
    return (x, *args[1:])


def _split_output(mesh):
    def hook(module, args, y):  # (B, T, C), the same on every tp rank -> this rank's sequence shard (B, T/tp, C)
        y = DTensor.from_local(y, mesh, [Replicate()], run_check=False)
        return y.redistribute(placements=[Shard(1)]).to_local()
    return hook


def _split_sequence(mesh):
    def hook(module, args):  # the first block: the replicated embedding output, split along the sequence
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return (x.redistribute(placements=[Shard(1)]).to_local(), *args[1:])
    return hook


def apply_tensor_parallel(model: nn.Module, mesh, sequence_parallel: bool = False) -> None:
    """Split kiln's Transformer over `mesh` (the tp dim) in place: block linears by their family roles, the
    embedding, head and loss over the vocabulary, the rest replicated (module docstring)."""
    tp = mesh.size()
    cfg = getattr(model, "cfg", None)
    if cfg is None or not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        raise KilnError(f"parallel.tp={tp} splits kiln's Transformer by its family's description of its linears; "
                        f"{type(model).__name__} has none: use --parallel.tp=1 (data parallelism works on any model)",
                        key="parallel.tp", value=tp, fix="use --parallel.tp=1")
    fam = family(cfg.arch)
    roles = {lin.name: lin for lin in fam.linears(cfg)}
    if not isinstance(model.loss, LMLoss):  # (ParallelPlan.build checked the padded vocabulary divides by tp)
        raise KilnError(f"parallel.tp={tp} computes the loss on vocabulary-sharded logits (1/tp of them per rank); "
                        f"the model's {type(model.loss).__name__} needs the whole head: keep the plain loss "
                        f"(ModelPlan.loss='plain', no --memory.chunked_loss)", key="parallel.tp", value=tp,
                        fix="keep the plain loss")
    if model.loss.softcap:
        raise KilnError(f"parallel.tp={tp} computes the loss on vocabulary-sharded logits without a soft-cap; "
                        f"model.logit_softcap={model.loss.softcap:g} needs --parallel.tp=1 or logit_softcap=0",
                        key="parallel.tp", value=tp, fix="needs --parallel.tp=1 or logit_softcap=0")
    with torch.no_grad():  # the fused rows, once, before the weights are split
        for name, parts in fused_rows(model).items():
            p = model.get_parameter(name)
            p.copy_(p[tp_order(parts, tp).to(p.device)])
    seq = Shard(1)
    for i, block in enumerate(model.blocks):
        split = {}
        for name, lin in roles.items():
            if lin.tp == "column":
                split[name] = ColwiseParallel()
            elif lin.tp == "row":
                split[name] = RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())
            else:  # an MoE's router and stacked experts: whole on every tp rank (module docstring)
                split[name] = Held()
        regions = {name.rpartition(".")[0] for name in roles}  # attn, mlp: where the activations are split
        whole = {r for r in regions if "." not in r and not any(lin.tp == "row" and n.startswith(r + ".")
                                                                  for n, lin in roles.items())}  # an MoE's mlp
        for name, module in block.named_modules():
            if not name or name in roles or name in regions or not any(True for _ in module.parameters(False)):
                continue
            if any(name.startswith(r + ".") for r in regions):  # a norm of this rank's heads (QK-norm)
                split[name] = Held(Shard(-2))
            else:  # the block's norms on the residual stream
                split[name] = SequenceParallel() if sequence_parallel else Held()
        parallelize_module(block, mesh, split)
        if sequence_parallel:
            for r in regions:
                block.get_submodule(r).register_forward_pre_hook(_gather_sequence)
            for r in whole:  # no row linear reduce-scatters its output: this rank's part of the sequence
                block.get_submodule(r).register_forward_hook(_split_output(mesh))
            if i == 0:
                block.register_forward_pre_hook(_split_sequence(mesh))
    top = {name: Held() for name, module in model.named_children()
           if name not in ("blocks", "embed", "head") and any(True for _ in module.parameters())}
    model.embed = VocabParallelEmbedding(model.embed, mesh)
    if model.head is not None:  # untied: split as the embedding (tied: the embedding's own parameter)
        top["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if sequence_parallel:
        top["norm"] = Held(seq, Replicate())  # the final norm's output: the whole sequence for the head and loss
    parallelize_module(model, mesh, top)
    model.loss = VocabParallelLoss()
