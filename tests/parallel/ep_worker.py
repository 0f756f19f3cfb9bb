"""Run by tests/parallel/test_expert_parallel.py under `torchrun --nproc_per_node=4`: every expert-parallel scenario
in one launch. Each rank runs the same calls; rank 0 writes the results under OUT."""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.ep_rank_peaks import SCENARIOS, SHAPE
from kiln.config import load_config
from kiln.parallel.expert import all_to_all_seconds, exchange
from kiln.run.lm import train
from kiln.run.measure import measure_rank_peaks
from tests.parallel.scenarios import ep_config
from tests.train.test_host_syncs import HostSyncCounter

out, source = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
results = {}

# The split sizes of one exchange over all 4 ranks as one ep group (8 experts, 2 per rank): rank r routes
# ROUTED[r][e] pairs to expert e (test_expert_parallel.py counts what each rank sends and receives by hand).
ROUTED = [[3, 0, 1, 4, 0, 0, 2, 5], [0, 1, 0, 0, 6, 2, 1, 1], [2, 2, 2, 2, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 9]]
dist.init_process_group("gloo")
sent, got, received = exchange(torch.tensor(ROUTED[rank]), dist.group.WORLD, 4)
everyone = [None] * 4
dist.all_gather_object(everyone, {"sent": sent, "got": got, "received": received.tolist()})
results["splits"] = everyone

# ep2 over dp4 (FSDP2)
state = train(ep_config(source, "fsdp", ep=2, interval=3), out / "ep2").state  # step 6: resumed by one process

# The host syncs of one forward and backward at ep2: the split sizes' exchange, once per MoE block
x = torch.randint(0, 256, (2, 32))
calls = []
with HostSyncCounter(calls):
    state.objective(state.step_model, (x, x)).backward()
results["syncs"] = calls
results["blocks"] = len(state.model.moe)
# What kiln profile reads: the all-to-all seconds of the 10 steps and the check above, then none (taken)
results["all_to_all_s"] = [all_to_all_seconds(state.model), all_to_all_seconds(state.model)]
if rank == 0:
    (out / "ep_results.json").write_text(json.dumps(results))

# ep2 with tp2 (dp2, DDP as FSDP2's replicate), and the one-process reference's step-6 checkpoint resumed as ep2
# with tp2 and sequence parallelism under FSDP2 (copied into place by the test before the launch)
train(ep_config(source, "ddp", ep=2, tp=2), out / "ep2_tp2")
train(ep_config(source, "fsdp", ep=2, tp=2, sequence_parallel=True), out / "one_to_ep2_tp2", resume=True)

# ep2 with pp2 (dp2, FSDP2): each stage's experts split over the 2 ranks of its dp group
train(ep_config(source, "fsdp", ep=2, pp=2), out / "ep2_pp2")

# Each rank's step peaks (the CPU allocator from before the model is built) for benchmarks/ep_rank_peaks.py's ep2
# scenarios over dp4 (dp/ep = 2: the experts FSDP2-sharded over 2 ranks): test_expert_parallel.py holds rank 0's
# against the estimate
peaks = {name: measure_rank_peaks(load_config(None, SHAPE + extra), torch.device("cpu"), steps=3)
         for name, extra in SCENARIOS.items() if "ep2" in name}
everyone = [None] * 4
dist.all_gather_object(everyone, peaks)
if rank == 0:
    (out / "ep_peaks.json").write_text(json.dumps(everyone))
