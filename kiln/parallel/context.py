"""Context parallelism: every sequence split over the mesh's cp ranks, attention through torch's context-parallel
style with the keys and values all-gathered (the flex_attention path of torch.distributed.tensor.experimental).

    check_context_parallel(cfg, ...)        what training with parallel.cp > 1 is built for, or one line
    apply_context_parallel(model, cp_mesh)  in place, before FSDP2 shards the model over dp × cp
    SequenceShard                           this rank's positions of a sequence (head-tail load-balanced order), and
                                            of the documents packed in it (SequenceShard.documents)
    ContextAttention                        the attention core each Attention calls: local q against all k, v

A cp rank holds 2 of the 2·cp equal chunks of each sequence, chunk r and chunk 2·cp-1-r (torch's
_HeadTailLoadBalancer: under a causal mask the early chunk's few keys and the late chunk's many even out, so
block-sparse kernels do the same work on every rank). The model sees only this rank's T/cp tokens: a pre-hook on the
root module takes this rank's positions of the batch's x and y, the position tables are read at the global
positions (RoPE's cos/sin rows, or a learned table's lookups), and each block's attention core is replaced, at the
seam kiln.models.parts.Attention.core, by ContextAttention. torch's `_ContextParallel` style (attention type FLEX,
applied by parallelize_module to each core, as torchtitan applies it to its inner attention) puts a pre-hook on it that all-gathers k and v over the cp ranks (cplib::flex_cp_allgather; its backward
reduce-scatters their gradients), and the core computes this rank's queries against every key with the causal mask
written in global positions: query i sees key j when position(i) ≥ position(j).

Packed documents (data.document_mask: a batch's doc (B, T)): the pre-hook leaves doc whole, and the model's
`documents` seam (kiln.models.documents.packed in one process) becomes SequenceShard.documents, which gives this rank's
tokens their positions within their documents (RoPE's whole tables and the learned table are then read at those, not
remapped) and its queries' rows of the mask against the gathered keys: causal in global positions and within one
document, (B, 1, T/cp, T) booleans.

The kernel. torch's own flex_attention refuses a backward on a CPU (torch 2.13: "FlexAttention does not support
backward on CPU", torch.nn.attention.flex_attention._validate_device), and the SDPA path (context_parallel()'s ring
over the flash, efficient or cudnn SDPA ops) has no handler for the CPU's _scaled_dot_product_flash_attention_for_cpu.
So the core is scaled_dot_product_attention with that boolean mask, which every device runs forward and backward,
exact to one process. Its costs: every layer saves the gathered k and v (T tokens, not T/cp) for its backward; the
mask is (T/cp) × T booleans per rank (16 MiB at T = 8192, cp = 4); a masked SDPA cannot use the flash kernel on CUDA. flex_attention with a block mask is the long-context kernel for CUDA;
it is not wired here because no GPU checked it.

The loss. The model returns the SUM of its T/cp tokens' losses; the step divides by the valid count of the whole
batch (every cp rank sees the whole batch's targets, so the count is reduced over dp only) and sums the loss over
dp and cp. FSDP2 shards the parameters over the flattened dp × cp mesh (torchtitan's dp_shard_cp) and averages the
gradients over those dp·cp ranks, so each rank's loss is scaled by dp·cp, as by dp without cp (kiln.train.step).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.parallel.strategy import strategy
from kiln.models.documents import check_doc, positions as document_positions
from kiln.models.parts import Attention


def check_context_parallel(cfg, seq_len: int | None = None, moe: bool = False) -> None:
    """What `kiln train` with parallel.cp > 1 is built and tested for (the `parallel` section, the sequence
    length and whether the model is a mixture of experts); one line otherwise. Nothing to check at cp = 1."""
    cp = cfg.cp
    if cp == 1:
        return
    if not strategy(cfg.strategy).shards_parameters:
        raise KilnError(f"parallel.cp={cp} trains with FSDP2 over the dp × cp ranks only: set "
                        f"--parallel.strategy=fsdp", key="parallel.strategy", value=cfg.strategy,
                        fix="set --parallel.strategy=fsdp")
    if cfg.tp > 1 or cfg.pp > 1:
        raise KilnError(f"parallel.cp={cp} with parallel.tp={cfg.tp} and parallel.pp={cfg.pp} is modelled by kiln "
                        f"memory and kiln plan but not trained: use --parallel.tp=1 --parallel.pp=1 with cp",
                        key="parallel.cp", value=cp, fix="use --parallel.tp=1 --parallel.pp=1 with cp")
    if moe:  # the load-balancing loss pools every token's routing: each cp rank sees only its share of them
        raise KilnError(f"parallel.cp={cp} with a mixture of experts is not built (its load-balancing loss would be "
                        f"computed per sequence shard, not over the batch): use --parallel.cp=1",
                        key="parallel.cp", value=cp, fix="use --parallel.cp=1")
    if seq_len is not None and seq_len % (2 * cp):
        raise KilnError(f"parallel.cp={cp} splits each sequence of data.seq_len={seq_len} tokens into {2 * cp} "
                        f"equal chunks (2 per rank, load-balanced): pick a data.seq_len divisible by {2 * cp}",
                        key="data.seq_len", value=seq_len, fix=f"pick a data.seq_len divisible by {2 * cp}")


class SequenceShard:
    """The positions cp rank `rank` holds of a sequence of T tokens, and the causal mask of its queries against the
    all-gathered keys; recomputed when T changes (a shorter evaluation batch)."""

    def __init__(self, cp: int, rank: int):
        self.cp, self.rank, self.length = cp, rank, None
        self.positions = self.gathered = self.mask = None
        self.packed = False  # this forward carries its documents (doc): positions and mask come from them

    def set_length(self, T: int, device) -> None:
        if T == self.length:
            return
        if T % (2 * self.cp):
            raise KilnError(f"parallel.cp={self.cp}: a batch of {T}-token sequences does not split into "
                            f"{2 * self.cp} equal chunks; use sequences of a multiple of {2 * self.cp} tokens",
                            key="data.seq_len", value=T)
        from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer  # lazy: cp only

        # (T,): the global position at each slot of the gathered sequence, rank 0's T/cp slots first
        order = _HeadTailLoadBalancer(T, self.cp, device)._generate_indices()[0].to(device)
        local = T // self.cp
        self.gathered = order
        self.positions = order[self.rank * local:(self.rank + 1) * local]  # (T/cp,)
        self.mask = self.positions[:, None] >= order[None, :]  # (T/cp, T): causal, in global positions
        self.length = T

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (B, T, ...) tensor."""
        self.set_length(t.shape[1], t.device)
        return t.index_select(1, self.positions)

    def documents(self, doc: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Transformer's `documents` under cp (kiln.models.documents.packed for this rank's tokens): doc (B, T),
        the whole window's, idx (B, T/cp), this rank's tokens -> their positions within their documents (B, T/cp)
        and their queries' mask against the gathered keys (B, 1, T/cp, T): causal in global positions, and within
        one document."""
        self.set_length(doc.shape[1], doc.device)
        mine = doc.index_select(1, self.positions)  # (B, T/cp)
        check_doc(mine, idx)
        same = mine[:, :, None] == doc.index_select(1, self.gathered)[:, None, :]  # (B, T/cp, T)
        return document_positions(doc).index_select(1, self.positions), (same & self.mask).unsqueeze(1)


class ContextAttention(nn.Module):
    """Causal attention of this rank's queries (B, H, T/cp, D) against every rank's keys and values (B, KV, T, D),
    which torch's context-parallel pre-hook has all-gathered before forward runs."""

    def __init__(self, shard: SequenceShard, dropout: float = 0.0):
        super().__init__()
        self.shard, self.dropout = shard, dropout

    def forward(self, q, k, v, mask=None):  # q (B, H, T/cp, D); k, v (B, KV, T, D); mask (B, 1, T/cp, T) documents
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.shard.mask if mask is None else mask,
                                              dropout_p=p, enable_gqa=k.shape[1] != q.shape[1])


def apply_context_parallel(model: nn.Module, cp_mesh) -> SequenceShard:
    """Lay kiln's Transformer over the cp ranks of `cp_mesh`, in place (before FSDP2 wraps it): its inputs are cut
    to this rank's positions, its position tables read at them, its attention cores swapped for ContextAttention
    under torch's context-parallel style. Returns the shard (its positions, for tests)."""
    from torch.distributed.tensor.parallel import parallelize_module  # lazy: cp only
    from torch.distributed.tensor.experimental._context_parallel import _ContextParallel

    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    if not attentions or not hasattr(model, "hidden"):
        raise KilnError(f"parallel.cp splits kiln's Transformer (its Attention cores); {type(model).__name__} has "
                        f"none: use --parallel.cp=1 for this model", key="parallel.cp", value=cp_mesh.size())
    shard = SequenceShard(cp_mesh.size(), cp_mesh.get_local_rank())
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
    for attn in attentions:
        attn.core = parallelize_module(ContextAttention(shard, attn.core.dropout), cp_mesh, style)
    model.register_forward_pre_hook(_shard_inputs(shard), with_kwargs=True)  # first: it sets the positions
    if getattr(model, "rope_cos", None) is not None:
        _read_rope_at(model, shard)
    if getattr(model, "pos_embed", None) is not None:  # the model looks up arange(T/cp): this rank's positions
        model.pos_embed.register_forward_pre_hook(lambda module, args: None if shard.packed else
                                                  (shard.positions[args[0]],))  # (packed: the documents' already)
    model.documents = shard.documents  # packed documents: this rank's positions in them, its rows of their mask
    return shard


def _read_rope_at(model: nn.Module, shard: SequenceShard) -> None:
    """The model takes RoPE's first T/cp rows; give it the rows of this rank's positions instead (torchtitan
    shards its freqs_cis buffer the same way), from the whole tables kept here."""
    tables = (model.rope_cos, model.rope_sin)

    def rows(module, args, kwargs):  # packed documents: the model reads the whole tables at their positions
        module.rope_cos, module.rope_sin = tables if shard.packed else (t[shard.positions] for t in tables)

    model.register_forward_pre_hook(rows, with_kwargs=True)


def _shard_inputs(shard: SequenceShard):
    def hook(module, args, kwargs):  # model(idx, targets=None, ...): both (B, T)
        if kwargs.get("cache") is not None:
            raise KilnError("a context-parallel model does not generate with a KV cache: sample from a plain copy",
                            key="cache", fix="sample from a plain copy")
        args = tuple(shard.take(a) if i < 2 and a is not None else a for i, a in enumerate(args))
        shard.packed = kwargs.get("doc") is not None  # doc stays whole: SequenceShard.documents reads every key's
        if kwargs.get("targets") is not None:
            kwargs = kwargs | {"targets": shard.take(kwargs["targets"])}
        return args, kwargs

    return hook
