"""LoRA in the estimator (issue #38): the whole-step peak of a LoRA run against live tensor bytes on CPU, the model
state against a hand count, `kiln memory` and `kiln plan` with adapters."""
import math

import pytest
import torch

from kiln.cli.main import main
from kiln.config import load_config
from kiln.memory.devices import get_device
from kiln.memory.estimate import estimate, local_parameter_shapes, peak_allocated, rank_state, trainable
from kiln.memory.levers import JobSections, job_for
from kiln.memory.planner import search
from kiln.run.measure import measure_step

SMALL = ["--model.n_layer=3", "--model.d_model=96", "--model.n_head=4", "--data.seq_len=48",
         "--train.micro_batch_size=4", "--train.device=cpu", "--lora.rank=8"]


@pytest.mark.parametrize("overrides", [
    ["--precision.mode=fp32"],
    ["--precision.mode=bf16"],
    ["--precision.mode=bf16-master", "--model.arch=qwen3", "--model.n_kv_head=2", "--model.head_dim=32"],
    ["--precision.mode=fp32", "--model.arch=qwen3", "--model.n_kv_head=2", "--model.head_dim=32",
     "--lora.targets=attn"],
    ["--precision.mode=bf16", "--model.arch=qwen3", "--model.n_kv_head=2", "--model.head_dim=32",
     "--lora.targets=mlp.proj", "--lora.dropout=0.1", "--train.grad_accum_steps=2"],
], ids=lambda o: " ".join(o))
def test_lora_step_peak_within_5_percent_of_live_bytes_on_cpu(overrides):
    """A LoRA run as `kiln train` builds it (frozen base, bf16 under bf16, fp32 adapters and their AdamW state;
    bf16 adapters with fp32 masters under bf16-master) measured as the full fine-tune's peak tests measure it:
    steady step and first step (no optimizer state yet)."""
    cfg = load_config(None, SMALL + overrides)
    b = estimate(job_for(JobSections.of(cfg), get_device("cpu")))
    peaks = measure_step(cfg, torch.device("cpu"), steps=2).step_peaks
    assert peak_allocated(b) == pytest.approx(peaks[-1], rel=0.05)
    assert b.first_step_peak == pytest.approx(peaks[0], rel=0.05)
    # the full fine-tune of the same shape is not within 5%: the test can tell LoRA's accounting from it
    full = estimate(job_for(JobSections.of(load_config(None, SMALL + overrides + ["--lora.rank=0",
                                                                                  "--lora.dropout=0"])),
                            get_device("cpu")))
    assert peak_allocated(full) > 1.3 * peaks[-1]


def _qwen3_8b_adapters(r=16) -> int:
    """PEFT's count for Qwen3-8B, every linear of the 36 blocks: q, k, v, o, gate, up, down; hidden 4096, 32 query
    and 8 key/value heads of 128, MLP 12288."""
    d, q, kv, f = 4096, 32 * 128, 8 * 128, 12288
    pairs = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    return 36 * sum(r * (i + o) for i, o in pairs)


def test_lora_model_state_by_hand():
    cfg = load_config(None, ["--model.preset=qwen3-8b", "--lora.rank=16", "--precision.mode=bf16"])
    job = job_for(JobSections.of(cfg), get_device("H100"))
    shapes = local_parameter_shapes(job)
    adapters = sum(math.prod(s) for n, s in shapes if trainable(job, n))
    base = sum(math.prod(s) for n, s in shapes if not trainable(job, n))
    assert adapters == _qwen3_8b_adapters() == 43_646_976
    state = rank_state(job)
    # bf16 base without gradient or state; fp32 adapters, their fp32 gradients and Adam's m, v and step
    assert state["parameters"] == 2 * base + 4 * adapters
    assert state["gradients"] == 4 * adapters
    n_tensors = 36 * 7 * 2
    assert state["optimizer_states"] == 8 * adapters + 4 * n_tensors
    b = estimate(job)
    assert b.components["master_weights"] == 0 and b.held()["gradients"] == 4 * adapters
    # bf16-master: bf16 adapters with fp32 masters; the base has none
    master = estimate(job_for(JobSections.of(load_config(None, ["--model.preset=qwen3-8b", "--lora.rank=16",
                                                 "--precision.mode=bf16-master"])), get_device("H100")))
    assert master.model_state["master_weights"] == 4 * adapters
    assert master.model_state["parameters"] == 2 * base + 2 * adapters
    # against the full fine-tune: 16 bytes a parameter of model state, and autocast's copies of the weights
    full = estimate(job_for(JobSections.of(load_config(None, ["--model.preset=qwen3-8b", "--precision.mode=bf16"])),
                            get_device("H100")))
    assert full.held()["gradients"] == 4 * base and b.held()["weight_casts"] < full.held()["weight_casts"] / 100


def test_kiln_memory_and_plan_know_lora(capsys):
    assert main(["memory", "--model.preset=qwen3-8b", "--lora.rank=16", "--device", "H100",
                 "--precision.mode=bf16", "--out", ""]) == 0
    out = capsys.readouterr().out
    assert ("lora: rank 16 on attn.qkv (3 pairs), attn.proj, mlp.fc (2 pairs), mlp.proj; base frozen (2 bytes a "
            "parameter, no gradient or optimizer state): trainable 43,646,976 of 8,234,382,336 parameters (0.53%)"
            in out)
    # the planner searches with the adapters: LoRA on a 0.6B model fits a 4 GiB budget a full fine-tune cannot
    # (its model state alone is 10 bytes a parameter at best: bf16-master with 8-bit AdamW)
    args = ["--model.preset=qwen3-0.6b", "--data.seq_len=512", "--train.micro_batch_size=1"]
    plan = search(JobSections.of(load_config(None, args + ["--lora.rank=16"])), get_device("H100"), 4 * 2**30,
                  8 * 512, quick=True)
    assert plan.best is not None and plan.best.breakdown.job.lora is not None
    assert search(JobSections.of(load_config(None, args)), get_device("H100"), 4 * 2**30, 8 * 512,
                  quick=True).best is None


def test_unknown_lora_target_is_one_line(capsys):
    assert main(["memory", "--model.preset=qwen3-0.6b", "--lora.rank=8", "--lora.targets=attn.qkv,mlp.gate",
                 "--out", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'mlp.gate' is not a linear of model.arch=qwen3" in err[0]


def test_lora_step_time_skips_the_base_weight_gradients():
    """The time model: a frozen linear's backward computes only its input's gradient (1 matmul, not 2), a bf16
    base needs no autocast copies, the update touches the adapters only."""
    from kiln.memory.planner import step_time

    h100 = get_device("H100")
    args = ["--model.preset=qwen3-8b", "--precision.mode=bf16", "--data.seq_len=2048", "--train.micro_batch_size=1"]
    full = step_time(job_for(JobSections.of(load_config(None, args)), h100), h100)
    lora = step_time(job_for(JobSections.of(load_config(None, args + ["--lora.rank=16"])), h100), h100)
    assert 0.5 * full["compute"] < lora["compute"] < 0.75 * full["compute"]
    assert lora["optimizer"] < full["optimizer"] / 50
