"""Run by tests/dist/test_dist.py under `torchrun --nproc_per_node=2`: every distributed scenario in one launch
(spawning processes is the slow part). Each rank runs the same calls; results land in OUT (rank 0 writes)."""
import json
import os
import sys
from pathlib import Path

from tests.dist.scenarios import fit_run, lm_config, measured_state_bytes
from kiln.run.lm import train

out, source = Path(sys.argv[1]), sys.argv[2]

measured = {}
for strategy in ("ddp", "zero1", "fsdp"):
    result = train(lm_config(source, strategy, steps=10), out / f"lm_{strategy}")
    measured[strategy] = measured_state_bytes(result.state)
    fit_run(strategy, out / f"fit_{strategy}")
if os.environ["RANK"] == "0":
    (out / "state_bytes.json").write_text(json.dumps(measured))
train(lm_config(source, "fsdp", steps=5), out / "resume_fsdp")  # resumed by one process with ddp
for strategy in ("fsdp", "zero1"):  # written by one process before the launch
    train(lm_config(source, strategy, steps=10), out / f"from_one_{strategy}", resume=True)
levers = lm_config(source, "fsdp", steps=4)  # fp16 loss scaling (and its telemetry), recompute, chunked loss
levers.precision.mode, levers.memory.recompute, levers.memory.chunked_loss = "fp16", "every_k", 64
levers.numerics.fp16_telemetry_interval = 2
train(levers, out / "levers")
train(lm_config(source, "ddp", steps=8, nan_forward="blocks.1.attn@4", nan_rank=1, trace=True), out / "nan")
try:
    train(lm_config(source, "ddp", steps=2, global_batch_size=4), out / "bad_global")
except ValueError as e:
    if os.environ["RANK"] == "0":
        (out / "bad_global.txt").write_text(str(e))
