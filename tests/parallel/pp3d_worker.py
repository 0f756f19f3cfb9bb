"""Run by tests/parallel/test_pipeline.py under `torchrun --nproc_per_node=8`: tensor × pipeline × data parallel,
tp2 × pp2 × dp2 (1F1B), GPT-2 with sequence parallelism (tied embeddings) under FSDP2 and Llama under ddp
(FSDP2's replicate over the dp dim), each against one process. One launch: spawning 8 processes is the slow part."""
import sys
from pathlib import Path

from tests.parallel.pp_scenarios import pp_config, pp_run

out, source = Path(sys.argv[1]), sys.argv[2]
pp_run(pp_config(source, pp=2, tp=2, dp=2, strategy="fsdp", sequence_parallel=True), out / "tp2pp2dp2_fsdp_gpt2")
pp_run(pp_config(source, arch="llama", pp=2, tp=2, dp=2, strategy="ddp"), out / "tp2pp2dp2_ddp_llama")
sys.stdout.flush()
