"""The runs the distributed tests compare: built the same way in the test process and in the torchrun workers."""
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from kiln import fit
from kiln.config import make_config
from kiln.data import DataConfig, TokenLoader
from kiln.data.documents import with_documents
from kiln.models import ModelConfig
from kiln.models.parts import IGNORE_INDEX
from kiln.perf.cpu_linear import onednn_available
from kiln.train.losses import CrossEntropy


def lm_config(source: str, strategy: str, steps: int, global_batch_size: int = 8, nan_forward: str = "",
              nan_rank: int = -1, trace: bool = False, model: ModelConfig | None = None):
    """A 2-layer GPT (or `model`) on a small corpus, fp32, global batch 8 sequences of 32 tokens: 2 micro-batches
    of 4 on one process, 1 on each of two."""
    model = model or ModelConfig(preset="tiny", n_layer=2, n_head=2, d_model=64, max_seq_len=64)
    cfg = make_config(model=model, data=DataConfig(source=source, seq_len=32, prefetch=0))
    tc = cfg.train
    tc.max_steps, tc.micro_batch_size, tc.global_batch_size, tc.eval_batches = steps, 4, global_batch_size, 4
    tc.sample_tokens, tc.device = 0, "cpu"
    cfg.precision.mode, cfg.log.interval, cfg.log.tensorboard, cfg.log.progress = "fp32", 1, False, "off"
    cfg.schedule.warmup_steps, cfg.schedule.total_steps = 2, 10
    cfg.optim.implementation = "foreach"  # the same arithmetic for every strategy (zero1 runs kiln's foreach)
    # the same products in every process: auto measures per thread count, and torchrun's ranks run 1 thread each
    tc.cpu_linear = "onednn" if onednn_available() else "torch"
    cfg.parallel.strategy = strategy
    cfg.numerics.trace, cfg.faults.nan_forward, cfg.faults.rank = trace, nan_forward, nan_rank
    return cfg


def moe_config(source: str, strategy: str):
    """Qwen3-MoE's nano preset (2 blocks of 8 SwiGLU experts, 2 per token; its load-balancing loss on) as lm_config
    trains it, for 6 steps."""
    cfg = lm_config(source, strategy, steps=6, model=ModelConfig(preset="qwen3-moe-nano"))
    # torch's products: train.cpu_linear=onednn fails in the backward of an expert that got no token in a
    # micro-batch (oneDNN cannot build an inner product over 0 rows)
    cfg.train.cpu_linear = "torch"
    return cfg


def muon_config(source: str, strategy: str):
    """lm_config's GPT for 6 steps with optim.name=muon: torch's Muon on the 8 hidden matrices (qkv, proj, fc, proj
    of both blocks), AdamW on the tied embedding, norms and biases, each at its own peak (muon_lr 0.05, lr 3e-3)."""
    cfg = lm_config(source, strategy, steps=6)
    cfg.optim.name, cfg.optim.lr, cfg.optim.muon_lr = "muon", 3e-3, 0.05
    return cfg


def lora_config(source: str, strategy: str, mode: str = "fp32"):
    """lm_config's GPT with rank-4 adapters on every block linear (the base frozen), 6 steps at a LoRA-sized lr;
    mode bf16 stores the frozen base in bf16 beside fp32 adapters (FSDP2 shards both)."""
    cfg = lm_config(source, strategy, steps=6)
    cfg.lora.rank, cfg.lora.alpha, cfg.optim.lr = 4, 8.0, 1e-2
    if mode != "fp32":
        cfg.precision.mode, cfg.train.cpu_linear = mode, "torch"  # oneDNN's linears are fp32 ones
    return cfg


def fit_data():
    """Classes with ignored labels spread unevenly: the ranks' micro-batches hold different valid counts."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = (x @ torch.randn(6, 4, generator=g)).argmax(-1)
    y[torch.tensor([1, 3, 5, 6, 7, 9, 13, 17, 20, 21, 22, 23, 40])] = -100
    return TensorDataset(x, y)


def fit_settings(strategy: str, **more) -> dict:
    return {"train.max_steps": 8, "train.micro_batch_size": 4, "train.global_batch_size": 8,
            "schedule.warmup_steps": 2, "optim.lr": 1e-2, "optim.implementation": "foreach", "log.interval": 1,
            "log.tensorboard": False, "log.progress": "off", "train.device": "cpu", "precision.mode": "fp32",
            "parallel.strategy": strategy} | more


def fit_run(strategy: str, run_dir: Path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4))
    return fit(model, fit_data(), loss=CrossEntropy(ignore_index=-100), config=fit_settings(strategy),
               run_dir=run_dir)


def user_mlp() -> nn.Module:
    """A model of the user's own that knows nothing of parallelism: Linear → GELU → Linear, and a LayerNorm that
    the user's plan leaves whole (kiln replicates it over the tp ranks)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 4), nn.LayerNorm(4))


def megatron_mlp(model: nn.Module, tp_mesh) -> None:
    """The user's tensor-parallel plan: the first linear's outputs split over the tp ranks, the second's inputs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def accuracy(outputs, targets):
    valid = targets != IGNORE_INDEX
    return ((outputs.argmax(-1) == targets) & valid).sum(), valid.sum()


def fit_tp_run(strategy: str, tp: int, run_dir: Path, interval: int = 0, resume: bool = False, **more):
    """user_mlp on fit_data for 6 steps of 8 samples (micro-batches of 2: each dp rank of tp2 × dp2 takes 2), with
    evaluation and a metric; tensor_parallel=megatron_mlp where tp > 1. more: other config keys."""
    config = fit_settings(strategy, **{"train.max_steps": 6, "train.micro_batch_size": 2, "parallel.tp": tp,
                                       "checkpoint.interval": interval} | more)
    return fit(user_mlp(), fit_data(), loss=CrossEntropy(ignore_index=IGNORE_INDEX), config=config, run_dir=run_dir,
               eval_data=fit_data(), metrics={"acc": accuracy}, resume=resume,
               tensor_parallel=megatron_mlp if tp > 1 else None)


def measured_state_bytes(state) -> dict[str, int]:
    """One rank's parameter, gradient and optimizer-state bytes (distinct storages), gradients after a backward."""
    from torch.distributed.tensor import DTensor

    from kiln.memory.measure import tensor_bytes

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    x = torch.randint(0, 256, (4, 32))
    state.objective(state.step_model, (x, x)).backward()
    params = [local(p) for p in state.model.parameters()]
    optimizer = getattr(state.optimizer, "optim", state.optimizer)  # ZeroRedundancyOptimizer: this rank's part
    states = [local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {"parameters": tensor_bytes(params), "gradients": tensor_bytes([local(p.grad) for p in state.model.parameters()]),
           "optimizer_states": tensor_bytes(states)}
    state.optimizer.zero_grad(set_to_none=True)
    return out


def tp_config(source: str, arch: str, strategy: str, tp: int, steps: int, sequence_parallel: bool = False,
              interval: int = 0):
    """lm_config's run on a tensor-parallel layout: 2 micro-batches of 2 sequences per data-parallel rank (the
    global batch of 8 on any dp degree up to 4); arch llama has grouped-query attention (4 heads, 2 key/value heads)
    and a SwiGLU MLP, both fused weights that tensor parallelism must split by part; arch qwen3_moe the same attention
    with a mixture of experts. gpt2 runs with the document mask (data.document_mask; MaskedLoader's documents end at each
    newline)."""
    cfg = lm_config(source, strategy, steps)
    cfg.data.document_mask = arch == "gpt2"
    if arch == "llama":
        cfg.model = ModelConfig(preset="llama-125m", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96,
                                max_seq_len=64, vocab_size=256)
    elif arch == "qwen3_moe":  # 4 experts of width 32, 2 per token, whole on each tp rank; a strong balancing loss
        cfg.model = ModelConfig(preset="qwen3-moe-nano", n_layer=2, n_head=4, n_kv_head=2, head_dim=16, d_model=64,
                                n_experts=4, moe_d_ff=32, max_seq_len=64, vocab_size=256, moe_aux_coef=0.1)
    cfg.train.micro_batch_size = 2
    cfg.train.cpu_linear = "torch"  # a tp rank's linears hold DTensors, which take F.linear: the reference too
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, sequence_parallel
    cfg.checkpoint.interval = interval
    return cfg


class MaskedLoader(TokenLoader):
    """Every target 'e' ignored: each micro-batch holds a different count of valid tokens (the data-parallel ranks
    too), so a loss not normalised by the global count, or counted again on each tp rank, is off. With a document
    mask the documents end at each newline (the corpus is one document: its separator never shows)."""

    def next(self):
        x, y, *doc = super().next()
        y = y.masked_fill(y == ord("e"), IGNORE_INDEX)
        return (x, y) if not doc else with_documents(x, y, ord("\n"))


def rewound(run: Path, copy: Path, step: int = 3) -> Path:
    """A copy of a finished run whose latest checkpoint is the one at `step` (the later ones removed): resuming it
    continues from there."""
    shutil.copytree(run, copy)
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (copy / "checkpoints" / "latest").write_text(f"step_{step:06d}\n")
    return copy


def ep_config(source: str, strategy: str, ep: int = 1, tp: int = 1, steps: int = 10, interval: int = 0,
              sequence_parallel: bool = False, pp: int = 1):
    """moe_config's Qwen3-MoE nano for `steps` steps of the global batch of 8 in micro-batches of 2 (each of dp4's
    ranks takes 1, each of dp2's 2 — under pp2 as 2 pipeline micro-batches —, one process 4), saved every
    `interval` steps (0: at the end) and kept: the expert-parallel runs (tests/parallel/ep_worker.py) and their
    one-process reference."""
    cfg = moe_config(source, strategy)
    cfg.train.max_steps, cfg.train.micro_batch_size = steps, 2
    cfg.parallel.ep, cfg.parallel.tp, cfg.parallel.sequence_parallel = ep, tp, sequence_parallel
    cfg.parallel.pp = pp
    cfg.checkpoint.interval, cfg.checkpoint.keep_last = interval, 10
    # AdamW's eps at 1e-6, not 1e-8: an expert's rows are batched differently at ep > 1 (its pairs from every ep
    # rank in one product), which moves the last bits of gradients, and m/√v turns a last-bit difference of a
    # gradient near eps into a step of up to lr. Measured over 10 steps on the 2-core Xeon with AMX (2026-11-27):
    # eps 1e-8 put 17 of 524288 expert weights 1.8e-5 off (plain FSDP2 over dp4: 2.2e-6), the loss 2.1e-6.
    cfg.optim.eps = 1e-6
    return cfg
