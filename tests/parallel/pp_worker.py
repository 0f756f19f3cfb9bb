"""Run by tests/parallel/test_pipeline.py under `torchrun --nproc_per_node=4`: every pipeline-parallel scenario in
one launch (spawning processes is the slow part). Each rank runs the same calls; rank 0 writes the run directories,
every rank the names of the parameters it holds."""
import json
import os
import sys
from pathlib import Path

import torch

from kiln.run.measure import measure_rank_peaks
from tests.parallel.pp_scenarios import NAN_AT, PEAKS, SAMPLE, peak_config, pp_config, pp_run, with_lora
from tests.parallel.task_scenarios import score_after, with_tasks

out, source = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])

held = {}
# 2 stages × 2 data-parallel copies, 1F1B: GPT-2 (tied embeddings) under DDP and under FSDP2 (saved at step 3 for a
# resume on one process; then sampled from the stages' weights gathered), Llama under FSDP2
# (GPT-2 under DDP also scores train.eval_tasks at its evaluation and after it: tests/parallel/task_scenarios.py)
for arch, strategy, interval in (("gpt2", "ddp", 0), ("gpt2", "fsdp", 3), ("llama", "fsdp", 0)):
    cfg = pp_config(source, arch=arch, pp=2, dp=2, strategy=strategy, interval=interval)
    run = f"pp2dp2_{strategy}_{arch}"
    tasks = (arch, strategy) == ("gpt2", "ddp")
    state = pp_run(with_tasks(cfg, out) if tasks else cfg, out / run, sample=SAMPLE if interval else 0)
    if tasks:
        score_after(state, out, out / run)
    held[arch] = sorted(state.model.state_dict())
(out / f"held_rank{rank}.json").write_text(json.dumps(held))
# LoRA on Llama, pp2 × dp2 fsdp: each stage's frozen blocks and adapters sharded over its copies
pp_run(with_lora(pp_config(source, arch="llama", pp=2, dp=2, strategy="fsdp")), out / "pp2dp2_fsdp_llama_lora")
# 4 blocks as 4 virtual stages on 2 ranks (interleaved 1F1B, 4 micro-batches), and as 4 stages (GPipe)
pp_run(pp_config(source, n_layer=4, pp=2, dp=2, schedule="interleaved_1f1b", microbatches=4), out / "interleaved")
pp_run(pp_config(source, n_layer=4, pp=4, schedule="gpipe"), out / "gpipe4")
# resharding: one process wrote 3 steps (DCP) before the launch, continued here into FSDP2-sharded stages
pp_run(pp_config(source, pp=2, dp=2, strategy="fsdp"), out / "from_one", resume=True)
# a NaN planted in block 1's MLP at step 2 on rank 2 (stage 1 of copy 0): the NaN trace replays the step on a
# whole copy gathered to rank 0
pp_run(pp_config(source, pp=2, dp=2, steps=2, nan_forward=NAN_AT, nan_rank=2), out / "nan_trace")
# tensor × pipeline parallel, tp2 × pp2 (one copy), 1F1B: GPT-2 with sequence parallelism (sequence shards between
# the stages; tied embeddings: each tp rank sums with its own pair), saved at step 3 for the resume on one process;
# and Llama (SwiGLU's fused rows) resumed from one process's 3 steps (the model's rows into the TP order on load)
state = pp_run(pp_config(source, pp=2, tp=2, sequence_parallel=True, interval=3), out / "tp2pp2_gpt2")
judged = state.numerics.guard.history[0, :6].tolist()  # the losses this rank's spike guard judged, step by step
(out / f"judged_rank{rank}.json").write_text(json.dumps(judged))
pp_run(pp_config(source, arch="llama", pp=2, tp=2), out / "tp2pp2_llama", resume=True)
# a mixture of experts in tp2 × pp2: whole MoE blocks per stage, router and experts whole on each tp rank; the
# load-balancing loss pooled over both stages' blocks
pp_run(pp_config(source, arch="qwen3_moe", pp=2, tp=2), out / "tp2pp2_qwen3_moe")
# every rank's whole-step peak under pp2 × dp2 fsdp (its CPU allocator, from before the model is built)
peaks = {name: measure_rank_peaks(peak_config(name), torch.device("cpu"), steps=4) for name in PEAKS}
(out / f"peaks_rank{rank}.json").write_text(json.dumps(peaks))
sys.stdout.flush()
