"""The `parallel` section: how the processes torchrun starts split the model and the batch."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.parallel.strategy import strategy

BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class ParallelConfig:
    """The `parallel` section: data parallelism across the processes torchrun starts."""

    strategy: str = "none"  # none | ddp | zero1 (DDP + sharded optimizer state) | fsdp (FSDP2 fully_shard): the
    # rows of kiln.parallel.strategy.STRATEGIES
    reshard_after_forward: bool = True  # fsdp: free gathered parameters after forward (ZeRO-3) or keep (ZeRO-2)
    cpu_offload: bool = False  # fsdp: parameters, gradients and optimizer state on the host (CPUOffloadPolicy)
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    timeout: float = 300.0  # seconds a collective waits for the other ranks before the run stops, naming the rank
    straggler_factor: float = 1.5  # a rank whose compute time per step is this many times the median is slow
    straggler_intervals: int = 3  # ... for this many log intervals in a row: named in a warning (0: never checked)
    tp: int = 1  # tensor parallel: block linears and the vocabulary (embedding, head, logits) split over tp ranks
    # (neighbouring: kiln.parallel.layout; kiln.parallel.tensor); tp must divide the padded vocabulary, and
    # memory.chunked_loss is refused with tp > 1
    pp: int = 1  # pipeline stages: the blocks split into pp consecutive groups, one per rank
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b (2 virtual stages per rank)
    pp_microbatches: int = 0  # pipeline micro-batches per step; 0 = max(pp, train.grad_accum_steps)
    sequence_parallel: bool = False  # tp: norms and dropout on 1/tp of the sequence between the TP regions
    cp: int = 1  # context parallel: each sequence split over cp ranks (2 chunks each, load-balanced), k and v
    # all-gathered for attention (kiln.parallel.context); trains with strategy fsdp, tp = pp = 1, a dense family and
    # data.seq_len divisible by 2·cp (data.document_mask too); `kiln memory` and `kiln plan` model it with tp and pp
    ep: int = 1  # expert parallel (MoE families): each of ep ranks holds n_experts/ep whole experts, the tokens go
    # to them and back by all-to-all (kiln.parallel.expert). Carved out of the data-parallel ranks: ep divides
    # dp = world/(tp·pp·cp) and n_experts; the rest stays data-parallel over all dp ranks, each expert over dp/ep.
    # Composes with tp (attention split over tp, experts over ep) and pp (each stage's experts over the ep ranks of
    # its dp group); strategy fsdp or ddp

    def validate(self):
        data = strategy(self.strategy)
        if self.backend not in BACKENDS:
            raise KilnError(f"parallel.backend={self.backend!r} is unknown; use one of {BACKENDS}",
                            key="parallel.backend", value=self.backend, fix=f"use one of {BACKENDS}")
        if self.cpu_offload and not data.shards_parameters:
            raise KilnError("parallel.cpu_offload is FSDP2's CPU offload: it needs --parallel.strategy=fsdp",
                            key="parallel.cpu_offload", value=True, fix="--parallel.strategy=fsdp")
        if not self.timeout > 0:
            raise KilnError(f"parallel.timeout must be a number of seconds > 0, got {self.timeout}",
                            key="parallel.timeout", value=self.timeout, fix="give seconds > 0 (default 300)")
        if self.straggler_factor <= 1 or self.straggler_intervals < 0:
            key = "straggler_factor" if self.straggler_factor <= 1 else "straggler_intervals"
            raise KilnError(f"parallel.straggler_factor must be > 1 (got {self.straggler_factor}) and "
                            f"parallel.straggler_intervals ≥ 0 (got {self.straggler_intervals})",
                            key=f"parallel.{key}", value=getattr(self, key))
