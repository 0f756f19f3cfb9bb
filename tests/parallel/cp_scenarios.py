"""Context parallelism in tests/parallel/worker.py's 2-rank launch (tests/parallel/test_context_parallel.py reads
what it writes): a cp2 run of lm_config's GPT, and one fp64 forward + backward of a Qwen3-shaped model (RoPE,
QK-norm, grouped-query heads) split over the 2 ranks against the whole model on each rank."""
import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.models import build_model
from kiln.models.config import ModelConfig
from kiln.models.parts import IGNORE_INDEX
from kiln.parallel.world import _mesh
from kiln.parallel.context import apply_context_parallel
from kiln.parallel.layout import ParallelPlan
from tests.parallel.scenarios import lm_config


def cp_config(source: str, steps: int = 10, recompute: str = "none"):
    """lm_config's fp32 steps on 2 ranks with parallel.cp=2: dp = 1, so each rank reads the one process's 2
    micro-batches of 4 sequences and computes 16 of their 32 positions; FSDP2 shards over both ranks. recompute:
    memory.recompute (full: each block's forward, its k/v all-gather included, runs again in the backward)."""
    cfg = lm_config(source, "fsdp", steps=steps)
    cfg.parallel.cp, cfg.memory.recompute = 2, recompute
    return cfg


def model_parity(out: Path) -> None:
    """Every rank: the whole model's summed loss and gradients, then a copy laid over the cp ranks (the run's
    mesh: pp1 dp1 cp2 tp1) on the same batch; writes OUT/cp_model_rank{r}.json."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = ModelConfig(preset="qwen3-0.6b", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, head_dim=16,
                      vocab_size=256, max_seq_len=64)
    whole = build_model(cfg).double()
    x = torch.randint(0, 256, (2, 32))
    y = torch.roll(x, -1, dims=1)
    y[0, :5] = IGNORE_INDEX  # ignored targets, all in rank 0's first chunk: the ranks count different tokens
    split = copy.deepcopy(whole)
    loss = whole(x, y, reduction="sum")
    loss.backward()
    shard = apply_context_parallel(split, _mesh(ParallelPlan(2, strategy="fsdp", cp=2), "cpu")["cp"])
    seen = []
    split.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(list(args[0].shape)))
    part = split(x, y, reduction="sum")
    part.backward()
    total = part.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for (name, p), q in zip(whole.named_parameters(), split.parameters()):
        grad = q.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, ((grad - p.grad).abs().max() / p.grad.abs().max()).item())
    (out / f"cp_model_rank{rank}.json").write_text(json.dumps({
        "whole": loss.item(), "part": part.item(), "total": total.item(), "grad_rel": worst,
        "block_input": seen[0], "positions": shard.positions.tolist()}))
