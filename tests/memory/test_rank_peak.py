"""A rank's whole-step peak under DDP and FSDP2, tensor parallel (tp2) and pipeline parallel (pp2, 1F1B, 2
micro-batches) on 2 CPU ranks (gloo, one torchrun launch) against the estimate of each rank (for_rank: its stage);
tp2 with the embedding, head and logits split over the vocabulary (kiln.parallel.tensor) twice, once with them a
small part of the peak and once with them most of it.

The measurement counts the CPU allocator from before the model is built (kiln.memory.measure.AllocatedBytes): the
rank's model state, what the step saves for backward, FSDP2's all-gathered parameters and reduce-scatter input,
DDP's gradient buckets. The tolerance is the single-process one (tests/memory/test_peak_and_planner.py: 5%).

The shape puts the weights first (width 128, 32 tokens per micro-batch): autocast weight copies that FSDP2's bf16
gathering does not make would be 10-15% of a bf16 rank's peak, so the old accounting fails here."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.memory.devices import get_device
from kiln.memory.estimate import (_block_parameters, _comm_buffers, block_matmul_numel, estimate,
                                  local_parameter_shapes, peak_allocated)
from kiln.memory.levers import JobSections, rank_jobs

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["--model.preset=tiny", "--model.n_layer=3", "--model.d_model=128", "--model.n_head=4",
         "--model.max_seq_len=32", "--data.seq_len=16", "--train.micro_batch_size=2", "--train.grad_accum_steps=1",
         "--train.device=cpu"]
SCENARIOS = {
    "ddp fp32": ["--parallel.strategy=ddp", "--precision.mode=fp32"],
    "ddp bf16": ["--parallel.strategy=ddp", "--precision.mode=bf16"],
    "fsdp fp32": ["--parallel.strategy=fsdp", "--precision.mode=fp32"],
    "fsdp bf16": ["--parallel.strategy=fsdp", "--precision.mode=bf16"],
    "fsdp bf16 keep gathered": ["--parallel.strategy=fsdp", "--precision.mode=bf16",
                                "--parallel.reshard_after_forward=false"],
    "fsdp bf16 llama": ["--parallel.strategy=fsdp", "--precision.mode=bf16", "--model.arch=llama",
                        "--model.n_kv_head=2"],
    "tp2 fp32": ["--parallel.tp=2", "--precision.mode=fp32"],
    # a vocabulary of 8192 and 256 tokens per micro-batch: the embedding and its AdamW state (half per rank) and the
    # loss on the logits split over the vocabulary (4 MB of them per rank) are most of the peak
    "tp2 vocabulary": ["--parallel.tp=2", "--precision.mode=fp32", "--model.vocab_size=8192",
                       "--train.micro_batch_size=8", "--data.seq_len=32"],
    "pp2 fp32": ["--parallel.pp=2", "--precision.mode=fp32"],  # stage 0: blocks 0-1 and the embeddings
    "pp2 bf16": ["--parallel.pp=2", "--precision.mode=bf16"],  # ... 2 micro-batches' bf16 weight copies at most
}
RTOL = 0.05


def overrides(name: str) -> list[str]:
    return SHAPE + SCENARIOS[name]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank-peaks")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "memory" / "rank_peak_worker.py"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_rank_peak_matches_the_estimate(measured, name):
    """Steady state: the least of four later steps' peaks. Gloo runs each collective on a worker thread that may
    release its buffers after the step's next allocation; a step's peak can then carry up to one block's gathered
    parameters more (on the loaded 2-core machine: fsdp fp32 8.13 MB most steps, 8.26 or 8.92 MB in some; fsdp
    bf16 6.93-7.52 MB). The first step has one sample: it may exceed the estimate by that block beyond the
    tolerance, never fall short of it; so may the steady state when all four later steps carried one (fsdp bf16 in
    a clean-clone CI run, 2026-11-27: 7.52 MB each, 6.96 MB predicted)."""
    cfg = load_config(None, overrides(name))
    plan, jobs = rank_jobs(JobSections.of(cfg), get_device("cpu"), 2)
    for rank in (0, 1) if plan.pp > 1 else (0,):  # a pipeline's ranks differ; data parallel: rank 0, below
        job = jobs[plan.coords(rank)["pp"]]
        b = estimate(job)
        first, *later = measured[rank][name]
        comm = _comm_buffers(job, _block_parameters([(n, math.prod(s)) for n, s in local_parameter_shapes(job)]))
        late_free = max(comm.gathered.values(), default=0)
        steady, predicted = min(later), peak_allocated(b)
        assert steady == pytest.approx(predicted, rel=RTOL) or (
            predicted <= steady <= predicted * (1 + RTOL) + late_free), rank
        assert first * (1 - RTOL) <= b.first_step_peak <= first * (1 + RTOL) or (
            b.first_step_peak <= first <= b.first_step_peak * (1 + RTOL) + late_free), rank
    if plan.pp == 1:  # rank 0 holds the larger shards (tp: the same); rank 1's four later steps may all carry a
        # late-freed block (fsdp bf16 keep gathered, 2026-11-27: rank 1 7.46-7.72 MB, rank 0 7.06 MB twice)
        assert min(measured[1][name][1:]) <= min(measured[0][name][1:]) * (1 + RTOL) + late_free


def test_fsdp_bf16_makes_no_autocast_weight_copies(measured):
    """The accounting this replaces counted autocast's bf16 copy of every block's weights under FSDP2 bf16: that
    many more bytes than the rank holds."""
    cfg = load_config(None, overrides("fsdp bf16"))
    _, (job,) = rank_jobs(JobSections.of(cfg), get_device("cpu"), 2)
    copies = 2 * block_matmul_numel(job.model) * job.model.n_layer
    steady = min(measured[0]["fsdp bf16"][1:])
    assert peak_allocated(estimate(job)) + copies > steady * (1 + RTOL)
