"""Run by tests/parallel/test_tensor_parallel.py under `torchrun --nproc_per_node=4`: every tensor-parallel scenario
in one launch (spawning processes is the slow part). Each rank runs the same calls; rank 0 writes the run
directories under OUT."""
import sys
from pathlib import Path

import os

import torch.distributed as dist

from kiln.run import lm
from kiln.run.lm import train
from tests.parallel.scenarios import MaskedLoader, fit_tp_run, rewound, tp_config
from tests.parallel.task_scenarios import score_after, with_tasks

out, source = Path(sys.argv[1]), sys.argv[2]
lm.TokenLoader = MaskedLoader  # uneven valid-token counts across the data-parallel ranks (the reference's too)

# tp2 × dp2 under FSDP2: llama (GQA, SwiGLU: both fused weights split by part), saved at step 3 for the resumes
train(tp_config(source, "llama", "fsdp", tp=2, steps=6, interval=3), out / "llama_fsdp")
# tp2 × dp2 with sequence parallelism, under DDP (FSDP2's replicate over mesh["dp"]): gpt2 (LayerNorm, learned
# positions, tied embeddings); train.eval_tasks scored at its evaluation and after it (tests/parallel/task_scenarios.py)
state = train(with_tasks(tp_config(source, "gpt2", "ddp", tp=2, steps=6, sequence_parallel=True), out),
              out / "gpt2_ddp_sp").state
score_after(state, out, out / "gpt2_ddp_sp")
# a mixture of experts in tp2 × dp2 with sequence parallelism, under FSDP2: attention split, router and experts whole
# on each tp rank, the sequence gathered for them and split again
train(tp_config(source, "qwen3_moe", "fsdp", tp=2, steps=6, sequence_parallel=True), out / "moe_fsdp_sp")
# fsdp × 4 (no TP) for 3 steps, resumed as tp2 × dp2 to step 6: a checkpoint resharded into the TP layout
train(tp_config(source, "llama", "fsdp", tp=1, steps=3), out / "fsdp_to_tp")
train(tp_config(source, "llama", "fsdp", tp=2, steps=6), out / "fsdp_to_tp", resume=True)
# dp2 × cp2 under FSDP2 over all 4 ranks (tests/parallel/test_context_parallel.py): llama, each copy's sequences
# split over 2 cp ranks, the valid counts uneven across the copies
llama_cp = tp_config(source, "llama", "fsdp", tp=1, steps=6)
llama_cp.parallel.cp = 2
state = train(with_tasks(llama_cp, out), out / "llama_dp2_cp2").state  # and train.eval_tasks, as the gpt2 run's
score_after(state, out, out / "llama_dp2_cp2")

# kiln.fit on a model of the user's own with the user's plan (tests/parallel/test_fit_tensor_parallel.py): tp2 × dp2
# under FSDP2, saved at step 3; under DDP (FSDP2's replicate over mesh["dp"]); and the FSDP2 run's step-3 checkpoint
# resumed with resume=True on the same layout; a NaN under the numerics guard.
fit_tp_run("fsdp", 2, out / "fit_fsdp", interval=3)
fit_tp_run("ddp", 2, out / "fit_ddp")
if os.environ["RANK"] == "0":
    rewound(out / "fit_fsdp", out / "fit_resumed")
dist.barrier()
fit_tp_run("fsdp", 2, out / "fit_resumed", interval=3, resume=True)
# the numerics guard: a NaN in the row-parallel linear's output on rank 1 at step 4, traced and skipped everywhere
fit_tp_run("ddp", 2, out / "fit_nan", **{"numerics.trace": True, "faults.nan_forward": "2@4", "faults.rank": 1,
                                        "parallel.timeout": 60.0})
