"""The data-parallel strategies (`parallel.strategy`), one row each: what a strategy does to the model state of the
data-parallel copies, and which other levers it cannot hold. Everything that depends on the strategy asks its row
(ParallelPlan.dp_strategy, World.dp_strategy, the estimator's Job.dp_strategy) instead of comparing names, and
kiln.config and the planner take their refusals from `refusal`, so the two agree by construction.

    STRATEGIES["fsdp"].shards_parameters      True
    strategy("zero1").refusal(optim_offload="host", precision="fp32", optimizer="adamw")   a one-line reason
    strategy("ddp").refusal(optim_offload="none", precision="fp32", optimizer="muon", tp=2)   tp splits Muon's matrices

Pure data: the estimator and the planner read it without torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.precision import PRECISIONS


@dataclass(frozen=True)
class Strategy:
    name: str
    reduces: bool = False  # the copies average their gradients over the dp ranks (every strategy but none)
    ddp_reducer: bool = False  # torch's DDP: a bucketed all-reduce and a second copy of every gradient
    zero_optimizer: bool = False  # ZeroRedundancyOptimizer: each rank keeps 1/dp of the optimizer state and
    # broadcasts its updated parameters after the step; checkpoints consolidate that state on rank 0
    shards_parameters: bool = False  # FSDP2: parameters, gradients and optimizer state sharded, blocks gathered
    # one at a time (its MixedPrecisionPolicy gathers bf16 parameters under bf16 autocast)
    refuses_tp: str = ""  # why it cannot hold tensor-parallel (DTensor) parameters; "" when it can

    @property
    def shards_optimizer(self) -> bool:
        return self.zero_optimizer or self.shards_parameters

    def refusal(self, *, optim_offload: str, precision: str, optimizer: str, tp: int = 1) -> str | None:
        """Why this strategy cannot run with these levers (one line naming the fix), or None when it can. tp: the
        tensor-parallel degree beside it (Muon refuses it under every strategy, none included)."""
        if tp > 1 and optimizer == "muon":  # a tp shard is a slice of each matrix: Newton-Schulz needs all of it
            return (f"optim.name=muon orthogonalises whole matrices and parallel.tp={tp} splits them across ranks: "
                    f"use --parallel.tp=1 (data parallelism with --parallel.strategy=ddp) with muon")
        if self.shards_optimizer and optimizer == "muon":  # gathering each matrix for its update: not built
            return (f"optim.name=muon orthogonalises whole matrices and parallel.strategy={self.name} shards them "
                    f"across ranks: use --parallel.strategy=ddp with muon")
        if self.shards_parameters:
            if optim_offload != "none":
                return ("optim.offload moves kiln's optimizer to the host, which FSDP2 cannot shard; use FSDP2's "
                        "own offload: --parallel.cpu_offload=true --optim.offload=none")
            if precision in PRECISIONS and PRECISIONS[precision].masters:
                return ("precision.mode=bf16-master keeps kiln's fp32 masters beside bf16 weights; under FSDP2 use "
                        "--precision.mode=bf16 (FSDP2's mixed precision: fp32 sharded parameters, bf16 compute, "
                        "fp32 gradient reduction)")
            if optimizer == "adamw8bit":
                return ("optim.name=adamw8bit quantizes whole tensors in blocks; FSDP2's sharded parameters are not "
                        "supported by it: use --parallel.strategy=ddp, or adamw with fsdp")
        if self.zero_optimizer and (optim_offload != "none" or optimizer == "adamw8bit"):
            return ("parallel.strategy=zero1 shards kiln's foreach Adam/SGD state across ranks; it does not "
                    "combine with optim.offload or adamw8bit: use --parallel.strategy=ddp for those")
        return None


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("none"),
    Strategy("ddp", reduces=True, ddp_reducer=True),
    Strategy("zero1", reduces=True, ddp_reducer=True, zero_optimizer=True,
             refuses_tp="(ZeroRedundancyOptimizer) cannot hold tensor-parallel (DTensor) parameters"),
    Strategy("fsdp", reduces=True, shards_parameters=True),
)}


def strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise KilnError(f"parallel.strategy={name!r} is unknown; use one of {tuple(STRATEGIES)}",
                        key="parallel.strategy", value=name, fix=f"use one of {tuple(STRATEGIES)}")
    return STRATEGIES[name]
