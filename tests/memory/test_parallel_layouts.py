"""Tensor, pipeline and context parallelism in the estimator, the time model and the planner (docs/parallel.md).

The per-rank parameter bytes are checked against the model itself, split by hand the way torch's ColwiseParallel
(Shard(0)) and RowwiseParallel (Shard(1)) split nn.Linear weights; activations, in-flight micro-batches, the bubble
and the collectives against the formulas of Korthikanti et al. 2022 and Narayanan et al. 2021. Measured
per-rank bytes of real TP/PP ranks come when the runtime lands (tests/parallel)."""
import math
from dataclasses import replace

import pytest
import torch

from kiln.cli.main import main
from kiln.config import load_config
from kiln.memory.devices import get_device
from kiln.memory.estimate import Target, estimate, local_parameter_shapes, parameter_shapes, saved_tensors
from kiln.memory.levers import JobSections, for_rank, rank_jobs
from kiln.memory.planner import INTERCONNECTS, bubble_fraction, model_parallel_comm, search, step_time
from kiln.models import build_model, family
from kiln.parallel import ParallelConfig, init_world
from kiln.parallel.layout import ParallelPlan

SMALL = ["--model.n_layer=4", "--model.d_model=64", "--model.n_head=8", "--data.seq_len=32",
         "--train.micro_batch_size=2", "--train.grad_accum_steps=4"]
ARCHS = {"gpt2": ["--model.preset=tiny", "--model.bias=true"],
         "llama": ["--model.preset=llama-125m", "--model.n_kv_head=4", "--model.d_ff=128"],
         "qwen3": ["--model.preset=qwen3-0.6b", "--model.n_kv_head=4", "--model.head_dim=16", "--model.d_ff=128"]}


def cfg_of(arch, *extra):
    return load_config(None, [*SMALL, *ARCHS[arch], *extra])


def job_of(arch, precision="fp32", *extra, ranks=2):
    cfg = cfg_of(arch, *extra)
    plan, jobs = rank_jobs(JobSections.of(cfg), get_device("H100"), ranks)
    return plan, [replace(j, precision=precision) for j in jobs]


def shard_by_hand(model, tp: int) -> dict[str, tuple[int, ...]]:
    """Rank 0's piece of every parameter: a linear's weight cut along its output rows (column-parallel: qkv, fc)
    or input columns (row-parallel: the projections), as torch.chunk cuts it; a column linear's bias with it; the
    embedding and an untied head cut along their vocabulary rows; everything else whole."""
    out = {}
    fam = family(model.cfg.arch)
    roles = fam.tp_layout(model.cfg)
    for name, p in model.named_parameters():
        module = ".".join(name.split(".")[2:-1]) if name.startswith("blocks.") else ""
        role = roles.get(module, "replicate")
        if role == "column" or name in ("embed.weight", "head.weight"):
            p = torch.chunk(p, tp, dim=0)[0]
        elif role == "row" and name.endswith("weight"):
            p = torch.chunk(p, tp, dim=1)[0]
        out[name] = tuple(p.shape)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_local_parameters_are_the_models_own_split_by_hand(arch, tp):
    _, (job,) = job_of(arch, "fp32", f"--parallel.tp={tp}", ranks=tp)
    model = build_model(job.model, device="meta")
    want = shard_by_hand(model, tp)
    got = dict(local_parameter_shapes(job))
    assert got == want
    local = sum(math.prod(s) for s in got.values())
    assert estimate(job).model_state["parameters"] == local * 4
    if tp > 1:  # the blocks' linears and the vocabulary shrink tp-fold, the rest (positions, norms) stays
        whole = sum(math.prod(s) for _, s in parameter_shapes(job.model))
        assert local < whole


@pytest.mark.parametrize("tie", [True, False])
def test_pipeline_stages_hold_their_blocks_embeddings_first_head_last(tie):
    plan, jobs = job_of("llama", "fp32", "--parallel.pp=2", f"--model.tie_embeddings={str(tie).lower()}")
    assert [j.model.n_layer for j in jobs] == [2, 2]
    first, last = (dict(local_parameter_shapes(j)) for j in jobs)
    assert "embed.weight" in first and "head.weight" not in first and "norm.weight" not in first
    assert "norm.weight" in last and "embed.weight" not in last
    assert "head.weight" in last  # a tied embedding's copy on the last stage: two copies, gradients summed
    whole = {n: s for n, s in parameter_shapes(
        JobSections.of(cfg_of("llama", f"--model.tie_embeddings={str(tie).lower()}")).resolved_model())}
    blocks = sum(math.prod(s) for n, s in whole.items() if n.startswith("blocks."))
    held = sum(math.prod(s) for j in (first, last) for n, s in j.items() if n.startswith("blocks."))
    assert held == blocks


def test_tp_splits_attention_and_mlp_activations_and_sp_the_rest():
    _, (one,) = job_of("llama", "bf16", ranks=1)
    _, (tp,) = job_of("llama", "bf16", "--parallel.tp=2", ranks=2)
    _, (sp,) = job_of("llama", "bf16", "--parallel.tp=2", "--parallel.sequence_parallel=true", ranks=2)
    b1, b2, b3 = (saved_tensors(j)[1][0] for j in (one, tp, sp))
    for kind in ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.proj_input"):
        assert b2[kind] * 2 == b1[kind] == b3[kind] * 2
    for kind in ("norm1.input", "norm2.normed"):
        assert b2[kind] == b1[kind] == b3[kind] * 2  # the norms split only with sequence parallelism
    for kind in ("attn.qkv_input", "mlp.fc_input"):  # ColwiseParallel saves its (gathered) input whole
        assert b1[kind] == b2[kind] == b3[kind]
    h1, h2 = saved_tensors(one)[2], saved_tensors(tp)[2]
    assert h2["logits"] * 2 == h1["logits"] and h2["loss.input"] == h1["loss.input"]  # vocabulary-parallel logits
    assert estimate(sp).total_bytes < estimate(tp).total_bytes < estimate(one).total_bytes


@pytest.mark.parametrize("schedule,in_flight", [("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1]),
                                                ("interleaved_1f1b", [5.5, 4.5, 3.5, 2.5])])
def test_micro_batches_in_flight_per_schedule(schedule, in_flight):
    """m = 8 micro-batches on 4 stages. Interleaved (v = 2): stage 0 holds p + (p - 1)/v = 5.5 micro-batches of its
    blocks — Korthikanti et al. 2022 §4.2.3: 1 + (p - 1)/(p·v) times 1F1B's p."""
    cfg = load_config(None, [*SMALL, *ARCHS["gpt2"], "--model.n_layer=8", "--parallel.pp=4",
                             f"--parallel.pp_schedule={schedule}", "--parallel.pp_microbatches=8"])
    plan, jobs = rank_jobs(JobSections.of(cfg), get_device("H100"), 4)
    assert [j.in_flight() for j in jobs] == in_flight
    # a later backward (gradients alive): the k-th has at most m - k micro-batches in flight, so at most 7
    later = [min(n, 7) for n in in_flight]
    assert [j.in_flight_later() for j in jobs] == later
    assert [j.micro_batch for j in jobs] == [1] * 4 and [j.grad_accum for j in jobs] == [8] * 4
    # stage 1 (no embeddings, no head): its activations at the peak are in-flight × one micro-batch's saved bytes,
    # the first backward's count or a later one's (whichever walk peaks: GPipe's 8 without gradients, 7 with)
    b = estimate(jobs[1])
    per_micro = sum(sum(x.values()) for x in saved_tensors(jobs[1])[1])
    at_peak = b.components["activations"] + b.components["weight_casts"]
    assert later[1] * per_micro <= at_peak <= in_flight[1] * per_micro + per_micro // 2


def test_bubble_and_collectives_follow_the_papers():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # (p - 1)/(m + p - 1)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)  # (p - 1)/(v·m + p - 1)
    assert bubble_fraction(1, 8) == 0
    _, (job,) = job_of("llama", "bf16", "--parallel.tp=4", ranks=4)
    link = INTERCONNECTS["nvlink4"]
    got = model_parallel_comm(job, link, link, link, 0.0)["tp"]
    N, d = job.tokens, job.model.d_model
    # 4 per block, and the vocabulary-parallel embedding's (forward) and head's (backward)
    want = job.grad_accum * (4 * job.model.n_layer + 2) * 2 * 3 / 4 * N * d * 2 / (link * 0.7)
    assert got == pytest.approx(want)
    _, (sp,) = job_of("llama", "bf16", "--parallel.tp=4", "--parallel.sequence_parallel=true", ranks=4)
    assert model_parallel_comm(sp, link, link, link, 0.0)["tp"] == pytest.approx(got)  # AG + RS: same bytes


def test_pipeline_step_time_waits_out_the_bubble():
    cfg = load_config(None, [*SMALL, *ARCHS["gpt2"], "--model.n_layer=8", "--parallel.pp=4",
                             "--parallel.pp_microbatches=8", "--precision.mode=bf16"])
    _, jobs = rank_jobs(JobSections.of(cfg), get_device("H100"), 4)
    t = step_time(jobs[1], get_device("H100"))
    assert t["bubble"] == pytest.approx((t["compute"] - t["bubble"] - t["pp_communication"]) * 3 / 8)


def test_context_parallel_is_modelled_and_needs_its_ranks_at_run_time():
    _, (one,) = job_of("llama", "bf16", ranks=1)
    _, (cp,) = job_of("llama", "bf16", "--parallel.cp=2", "--parallel.strategy=fsdp", ranks=2)
    assert cp.tokens * 2 == one.tokens
    assert saved_tensors(cp)[1][0]["mlp.gate_up"] * 2 == saved_tensors(one)[1][0]["mlp.gate_up"]
    with pytest.raises(ValueError, match="parallel.cp=2 splits the model over 2 processes: launch with torchrun"):
        init_world(ParallelConfig(cp=2, strategy="fsdp"), "cpu")
    with pytest.raises(ValueError, match="parallel.cp=2 ranks hold the same weights"):
        ParallelPlan.build(ParallelConfig(cp=2), 2)


def test_kiln_memory_lists_every_stage(capsys):
    import json

    assert main(["memory", *SMALL, *ARCHS["gpt2"], "--parallel.pp=2", "--parallel.tp=2", "--ranks=8",
                 "--parallel.strategy=fsdp", "--device=H100", "--json", "--out="]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["mesh"] == {"pp": 2, "dp": 2, "tp": 2}
    assert [s["stage"] for s in out["stages"]] == [0, 1]
    assert out["total_bytes"] == max(s["total_bytes"] for s in out["stages"])
    assert main(["memory", *SMALL, *ARCHS["gpt2"], "--parallel.tp=3", "--ranks=3", "--out="]) != 0
    said = capsys.readouterr()
    assert "parallel.tp=3 does not divide model.n_head = 8" in said.out + said.err


def test_plan_searches_layouts_within_a_node():
    cfg = load_config(None, ["--model.preset=gpt2-124m", "--data.seq_len=1024", "--data.tokenizer=bpe",
                             "--data.vocab_size=50257"])
    plan = search(JobSections.of(cfg), get_device("H100"), 40 * 2**30, 1024 * 64, gpus=16, quick=True)
    layouts = {(c.choice.tp, c.choice.pp, c.choice.cp) for c in plan.candidates}
    assert any(tp > 1 for tp, _, _ in layouts) and any(pp > 1 for _, pp, _ in layouts)
    assert all(tp <= 8 and 12 % tp == 0 for tp, _, _ in layouts)  # within a node, dividing the 12 heads
    best = plan.best
    assert best.fits and best.step_s == min(c.step_s for c in plan.candidates)
