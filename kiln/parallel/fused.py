"""The row order of fused weights under tensor parallelism, without importing DTensor (kiln.util.is_dtensor).

    fused_rows(model)                 {parameter name: rows of each part} of every fused column linear
    tp_order(parts, tp)               the model-order row of each tensor-parallel-order row
    canonical(t, parts, tp)           a fused tensor in TP order, in the model's order (checkpoints keep this one)
    from_canonical(t, parts, tp)      back

kiln.parallel.tensor splits attn.qkv and a SwiGLU's mlp.fc rank by rank ([q_0; k_0; v_0; q_1; ...]); a checkpoint
holds them in the model's order so that any tp degree loads it. Apart from kiln.parallel.tensor so that checkpoints
and pipeline stages, which every run imports, need no torch.distributed.tensor.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kiln.models.registry import family
from kiln.util import is_dtensor


def fused_rows(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{parameter name: rows of each part} of every fused column linear of kiln's Transformer (attn.qkv, a SwiGLU's
    mlp.fc), or of the blocks a pipeline rank holds; {} for any other model."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not isinstance(getattr(model, "blocks", None), (nn.ModuleList, nn.ModuleDict)):
        return {}  # (a ModuleDict: a pipeline rank's blocks, under their model indices)
    out = {}
    for lin in family(cfg.arch).linears(cfg):
        if lin.parts:
            for i, _ in model.blocks.named_children():
                for kind in ("weight", "bias"):
                    out[f"blocks.{i}.{lin.name}.{kind}"] = lin.parts
    return {k: v for k, v in out.items() if _has(model, k)}


def _has(model, name):
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr, None) is not None


def tp_order(parts: tuple[int, ...], tp: int) -> torch.Tensor:
    """Row indices that put rank r's share of every part next to each other: tp_order[i] is the model-order row of
    the tensor-parallel order's row i ([q_0; k_0; v_0; q_1; k_1; v_1; ...] for parts (q, k, v))."""
    starts = torch.tensor([0, *parts]).cumsum(0)[:-1].tolist()
    rows = []
    for r in range(tp):
        for start, n in zip(starts, parts):
            rows.append(torch.arange(start + r * n // tp, start + (r + 1) * n // tp))
    return torch.cat(rows)


@torch.no_grad()
def _reorder(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not is_dtensor(t):
        return t[index.to(t.device)]
    from torch.distributed.tensor import distribute_tensor  # lazy: DTensor only where a tensor is one

    full = t.full_tensor()[index.to(t.device)]
    return distribute_tensor(full, t.device_mesh, t.placements)  # FSDP × TP's _StridedShard included


def canonical(t: torch.Tensor, parts: tuple[int, ...], tp: int) -> torch.Tensor:
    """A fused tensor in tensor-parallel row order (a parameter or its optimizer state) in the model's order."""
    return t if tp == 1 else _reorder(t, torch.argsort(tp_order(parts, tp)))


def from_canonical(t: torch.Tensor, parts: tuple[int, ...], tp: int) -> torch.Tensor:
    return t if tp == 1 else _reorder(t, tp_order(parts, tp))
