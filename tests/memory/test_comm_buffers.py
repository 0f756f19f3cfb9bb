"""Per-rank communication buffers in the estimate: DDP's gradient buckets and FSDP2's gathered parameters.

These tests hold the model to its own rules and to the state bytes that tests/parallel measures exactly
(rank_state); tests/memory/test_rank_peak.py measures a rank's whole-step peak, buffers included, on 2 gloo ranks."""
from dataclasses import replace

import pytest

from kiln.config import load_config
from kiln.memory.estimate import NUMERICS, Target, data_parallel, estimate, grad_shares, parameter_numels, rank_state
from kiln.memory.levers import JobSections, job_of

SMALL = ["--model.preset=tiny", "--model.n_layer=4", "--model.d_model=96", "--model.n_head=4", "--data.seq_len=48",
         "--train.micro_batch_size=4", "--train.device=cpu"]


def job(precision="fp32", *overrides, parallel="none", world=1):
    cfg = load_config(None, [*SMALL, *overrides])
    sections = JobSections.of(cfg)
    return replace(job_of(sections, sections.resolved_model(), precision, Target("cuda", 9.0)),
                   plan=data_parallel(parallel, world))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-master"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_ddp_buckets_are_one_more_copy_of_the_gradients_all_run_long(strategy, precision):
    one, two = estimate(job(precision)), estimate(job(precision, parallel=strategy, world=2))
    grads = sum(n for _, n in parameter_numels(one.job.model)) * NUMERICS[precision].grad
    assert two.model_state["comm_buffers"] == grads
    assert all(c["comm_buffers"] == grads for _, c in two.timeline)  # from DDP's wrap to the end
    saved_by_zero1 = one.model_state["optimizer_states"] - two.model_state["optimizer_states"]
    assert two.total_bytes == one.total_bytes + grads - (saved_by_zero1 if strategy == "zero1" else 0)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_fsdp_gradients_end_the_backward_as_the_measured_shards(world):
    """The per-block shards the backward leaves behind add up to rank_state's gradients, which tests/parallel measures
    on real FSDP2 ranks: two independent paths to one number."""
    j = job(parallel="fsdp", world=world)
    b = estimate(j)
    end = dict(b.timeline)["backward: embeddings"]
    assert end["gradients"] == rank_state(j)["gradients"] == sum(grad_shares(j).values()) * j.num.grad


def test_fsdp_gathers_two_blocks_at_a_time_or_keeps_them_all():
    j = job(parallel="fsdp", world=2)
    shares = grad_shares(job())  # unsharded elements per part
    block = shares[0] * 4  # fp32: gathered in the parameter's dtype
    root = (shares["embed"] + shares["pos_embed"] + shares["norm"] + shares["head"]) * 4
    events = dict(estimate(j).timeline)
    assert events["forward: block 0"]["comm_buffers"] == root + 2 * block  # block 0 and block 1's prefetch
    assert events["forward: block 3"]["comm_buffers"] == root + block  # the last block has nothing to prefetch
    assert events["backward: block 2"]["comm_buffers"] == root + 2 * block
    kept = dict(estimate(replace(j, reshard_after_forward=False)).timeline)
    assert kept["backward: block 3"]["comm_buffers"] == root + 4 * block  # every block stays gathered
    bf16 = dict(estimate(job("bf16", parallel="fsdp", world=2)).timeline)
    assert bf16["forward: block 0"]["comm_buffers"] == (root + 2 * block) // 2  # MixedPrecisionPolicy gathers bf16


def test_one_rank_holds_no_communication_buffers():
    for strategy in ("ddp", "zero1", "fsdp"):
        b = estimate(job(parallel=strategy, world=1))
        assert b.components["comm_buffers"] == 0 and b.total_bytes == estimate(job()).total_bytes
