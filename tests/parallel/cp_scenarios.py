"""Context parallelism in tests/parallel/worker.py's 2-rank launch (tests/parallel/test_context_parallel.py reads
what it writes): a cp2 run of lm_config's GPT, one of tp_config's GPT-2 with its documents masked, and one fp64
forward + backward of a Qwen3-shaped model (RoPE, QK-norm, grouped-query heads) split over the 2 ranks against the
whole model on each rank, then of it and a GPT-2 with documents packed in the windows."""
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
from tests.parallel.scenarios import lm_config, tp_config


def cp_config(source: str, steps: int = 10, recompute: str = "none"):
    """lm_config's fp32 steps on 2 ranks with parallel.cp=2: dp = 1, so each rank reads the one process's 2
    micro-batches of 4 sequences and computes 16 of their 32 positions; FSDP2 shards over both ranks. recompute:
    memory.recompute (full: each block's forward, its k/v all-gather included, runs again in the backward)."""
    cfg = lm_config(source, "fsdp", steps=steps)
    cfg.parallel.cp, cfg.memory.recompute = 2, recompute
    return cfg


def cp_documents_config(source: str):
    """tp_config's GPT-2 with the document mask (6 steps; MaskedLoader's documents end at each newline) on 2 ranks
    with parallel.cp=2: dp = 1, so each rank reads the one process's 4 micro-batches of 2 and computes 16 of their 32
    positions; tp_reference's "gpt2" is the same run in one process."""
    cfg = tp_config(source, "gpt2", "fsdp", tp=1, steps=6)
    cfg.parallel.cp = 2
    return cfg


def _split_against_whole(whole, x, y, doc=None):
    """The whole fp64 model's summed loss and gradients on every rank, then a copy laid over the cp ranks (the run's
    mesh: pp1 dp1 cp2 tp1) on the same batch (doc: its documents): the whole loss, this rank's part, the parts'
    sum, the worst gradient's relative error of the summed parts, the first block's input shape, the shard."""
    split = copy.deepcopy(whole)
    loss = whole(x, y, reduction="sum", doc=doc)
    loss.backward()
    shard = apply_context_parallel(split, _mesh(ParallelPlan(2, strategy="fsdp", cp=2), "cpu")["cp"])
    seen = []
    split.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(list(args[0].shape)))
    part = split(x, y, reduction="sum", doc=doc)
    part.backward()
    total = part.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for (name, p), q in zip(whole.named_parameters(), split.parameters()):
        grad = q.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, ((grad - p.grad).abs().max() / p.grad.abs().max()).item())
    return {"whole": loss.item(), "part": part.item(), "total": total.item(), "grad_rel": worst,
            "block_input": seen[0]}, shard


def model_parity(out: Path) -> None:
    """Every rank: the whole model's summed loss and gradients, then a copy laid over the cp ranks on the same batch
    (_split_against_whole); then with documents packed in the windows (data.document_mask: each shard's positions
    within its documents, its queries' mask rows against the gathered keys), for RoPE and for GPT-2's learned
    positions, beside the loss without them. Writes OUT/cp_model_rank{r}.json."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = ModelConfig(preset="qwen3-0.6b", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, head_dim=16,
                      vocab_size=256, max_seq_len=64)
    whole = build_model(cfg).double()
    x = torch.randint(0, 256, (2, 32))
    y = torch.roll(x, -1, dims=1)
    y[0, :5] = IGNORE_INDEX  # ignored targets, all in rank 0's first chunk: the ranks count different tokens
    result, shard = _split_against_whole(whole, x, y)
    result["positions"] = shard.positions.tolist()
    # row 0: 3 documents, its boundaries inside rank 0's chunk (at 5) and rank 1's (at 19); row 1: 2, between them (8)
    doc = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * 8 + [1] * 24], dtype=torch.int32)
    gpt2 = ModelConfig(preset="tiny", n_layer=2, n_head=2, d_model=64, max_seq_len=64, vocab_size=256)
    result["documents"] = {}
    for name, model_cfg in (("rope", cfg), ("learned", gpt2)):
        torch.manual_seed(0)
        whole = build_model(model_cfg).double()
        result["documents"][name] = _split_against_whole(whole, x, y, doc)[0]
        result["documents"][name]["no_mask"] = whole(x, y, reduction="sum").item()
    (out / f"cp_model_rank{rank}.json").write_text(json.dumps(result))
