"""Run by tests/parallel/test_dist.py under `torchrun --nproc_per_node=2`: every distributed scenario in one launch
(spawning processes is the slow part). Each rank runs the same calls; results land in OUT (rank 0 writes)."""
import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.parallel.cp_scenarios import cp_config, cp_documents_config, model_parity
from tests.parallel.scenarios import (MaskedLoader, fit_run, lm_config, lora_config, measured_state_bytes, moe_config,
                                      muon_config)
from kiln.parallel.watchdog import CollectiveError
from kiln.run import lm
from kiln.run.lm import train
from kiln.train import loop
from kiln.train.loop import Trainer

out, source = Path(sys.argv[1]), sys.argv[2]


def with_eval_tasks(cfg):
    """train.eval_tasks scored at the run's end, their rows split over the 2 ranks (test_dist.py scores them again
    in one process): 7 multiple-choice items of 2-4 choices (uneven shares) and a 5-window text."""
    tasks = out / "eval_tasks"
    tasks.mkdir(exist_ok=True)
    items = [{"context": f"def f{i}(x):\n    return", "choices": [" x", " x * 2", " None", " f(x)"][:2 + i % 3],
              "label": i % 2} for i in range(7)]
    files = {"mc.jsonl": "".join(json.dumps(r) + "\n" for r in items), "doc.txt": "import os\nimport sys\n" * 15}
    for name, text in files.items():  # every rank writes the same bytes: the rename makes it whole
        (tasks / f"{name}.{os.environ['RANK']}").write_text(text)
        os.replace(tasks / f"{name}.{os.environ['RANK']}", tasks / name)
    cfg.train.eval_tasks = (str(tasks / "mc.jsonl"), f"text:{tasks / 'doc.txt'}")
    return cfg


measured = {}
for strategy in ("ddp", "zero1", "fsdp"):
    result = train(with_eval_tasks(lm_config(source, strategy, steps=10)), out / f"lm_{strategy}")
    measured[strategy] = measured_state_bytes(result.state)
    fit_run(strategy, out / f"fit_{strategy}")
if os.environ["RANK"] == "0":
    (out / "state_bytes.json").write_text(json.dumps(measured))
for strategy in ("ddp", "fsdp"):  # a mixture of experts (every expert replicated, or sharded by FSDP2)
    train(moe_config(source, strategy), out / f"moe_{strategy}")
train(muon_config(source, "ddp"), out / "muon_ddp")  # Muon: whole matrices on each rank, the reduced gradient
train(lm_config(source, "fsdp", steps=5), out / "resume_fsdp")  # resumed by one process with ddp
for mode in ("fp32", "bf16"):  # LoRA: a frozen base (bf16: stored in bf16) and fp32 adapters, both sharded
    state = train(lora_config(source, "fsdp", mode), out / f"lora_fsdp_{mode}").state
    if os.environ["RANK"] == "0":  # what FSDP2 holds: each parameter's dtype, type, local share; the optimizer's
        held = {n: [str(p.dtype), type(p).__name__, p.requires_grad, p.to_local().numel(), p.numel()]
                for n, p in state.model.named_parameters()}
        optimized = sum(p.numel() for g in state.optimizer.param_groups for p in g["params"])
        (out / f"lora_fsdp_{mode}.json").write_text(json.dumps({"params": held, "optimized": optimized}))
for strategy in ("fsdp", "zero1"):  # written by one process before the launch
    train(lm_config(source, strategy, steps=10), out / f"from_one_{strategy}", resume=True)
levers = lm_config(source, "fsdp", steps=4)  # fp16 loss scaling (and its telemetry), recompute, chunked loss
levers.precision.mode, levers.memory.recompute, levers.memory.chunked_loss = "fp16", "every_k", 64
levers.train.cpu_linear = "auto"  # (oneDNN's fp32 products do not apply to fp16)
levers.numerics.fp16_telemetry_interval = 2
# ... and a straggler under FSDP2 (tests/parallel/test_fleet.py): each block's collectives make rank 0 wait for
# rank 1 inside the step; rank 1's forward takes 80 ms longer every step, which only the compute between the
# collectives shows.
levers.faults.slow_forward_ms, levers.faults.rank = 80.0, 1
train(levers, out / "levers")
train(cp_config(source), out / "lm_cp")  # context parallel (tests/parallel/test_context_parallel.py)
train(cp_config(source, steps=4, recompute="full"), out / "lm_cp_recompute")
plain, lm.TokenLoader = lm.TokenLoader, MaskedLoader  # documents that end at each newline, as tp_reference's
train(cp_documents_config(source), out / "gpt2_documents_cp")
lm.TokenLoader = plain
model_parity(out)
train(lm_config(source, "ddp", steps=8, nan_forward="blocks.1.attn@4", nan_rank=1, trace=True), out / "nan")
try:
    train(lm_config(source, "ddp", steps=2, global_batch_size=4), out / "bad_global")
except ValueError as e:
    if os.environ["RANK"] == "0":
        (out / "bad_global.txt").write_text(str(e))

# Surviving failures (tests/parallel/test_fleet.py). Rank 1 alone is preempted (SIGUSR1 after its step 3): every rank
# stops at the same step with one checkpoint.
rank = int(os.environ["RANK"])
log = Trainer._log


def preempt_rank_1(self, *args, **kw):
    log(self, *args, **kw)
    if rank == 1 and self.state.step == 3:
        os.kill(os.getpid(), signal.SIGUSR1)


Trainer._log = preempt_rank_1
stopped = train(lm_config(source, "ddp", steps=10), out / "preempt")
Trainer._log = log
(out / f"preempt_rank{rank}.json").write_text(json.dumps({"step": stopped.step, "signal": stopped.signal}))

# A straggler: rank 1's data arrives 200 ms late every step (its own time per step, not the step time, shows it).
slow = lm_config(source, "ddp", steps=6)
slow.faults.data_delay_ms = 200.0 if rank == 1 else 0.0
slow.checkpoint.safetensors = False
train(slow, out / "straggler")

# checkpoint.async_save on 2 ranks: DCP async_save on its own process group while training goes on; resumed to
# step 10 by the test process.
background = lm_config(source, "ddp", steps=6)
background.checkpoint.interval, background.checkpoint.async_save = 3, True
train(background, out / "async")

# Last, for it breaks the process group: rank 1 hangs inside step 3 past parallel.timeout=3 s; rank 0 must stop
# within the timeout and a few seconds, naming rank 1, the step and the collective.
hang = lm_config(source, "ddp", steps=6)
hang.parallel.timeout = 3.0
step = loop.train_step


def hang_rank_1(*args, **kw):
    if rank == 1 and hang_rank_1.calls == 2:
        time.sleep(9)
    hang_rank_1.calls += 1
    return step(*args, **kw)


hang_rank_1.calls = 0
loop.train_step = hang_rank_1
began = time.monotonic()
try:
    train(hang, out / "hang")
    outcome = {"error": None}
except CollectiveError as e:
    outcome = {"error": str(e), "rank": e.rank, "missing": e.missing, "collective": e.collective, "step": e.step}
outcome["seconds"] = time.monotonic() - began
(out / f"hang_rank{rank}.json").write_text(json.dumps(outcome))
sys.stdout.flush()
os._exit(0)  # the process group is broken: nothing to tear down
