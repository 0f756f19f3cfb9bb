"""GPU acceptance: predicted peak within 3% of torch.cuda.max_memory_allocated (skipped without CUDA).

GPT-2 124M and 350M and a Llama-style 1B over {fp32, bf16} x {none, full, every_k, selective}; the planner's top
choice for a budget fits and trains. Results go to docs/benchmarks.md (Memory).
"""
import itertools

import pytest
import torch

from kiln.config import load_config
from kiln.memory.devices import local_device
from kiln.memory.estimate import estimate, parse_bytes, peak_allocated
from kiln.memory.levers import JobSections, job_for
from kiln.run.measure import measure_step
from kiln.config import apply_overrides
from kiln.memory.planner import search

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODELS = {
    "gpt2-124m": ["--model.preset=gpt2-124m", "--data.seq_len=1024", "--train.micro_batch_size=4"],
    "gpt2-350m": ["--model.preset=gpt2-350m", "--data.seq_len=1024", "--train.micro_batch_size=2"],
    "llama-1b": ["--model.preset=llama-1b", "--data.seq_len=1024", "--train.micro_batch_size=1"],
}
COMMON = ["--data.tokenizer=bpe", "--data.vocab_size=50257", "--train.device=cuda"]


@pytest.mark.parametrize("model,precision,policy", list(itertools.product(
    MODELS, ["fp32", "bf16"], ["none", "full", "every_k", "selective"])))
def test_peak_within_3_percent(model, precision, policy):
    vocab = [] if model.startswith("gpt2") else ["--model.vocab_size=128256"]
    cfg = load_config(None, MODELS[model] + COMMON + vocab + [f"--precision.mode={precision}",
                                                               f"--memory.recompute={policy}"])
    device = torch.device("cuda")
    predicted = peak_allocated(estimate(job_for(JobSections.of(cfg), local_device(device))))
    measured = measure_step(cfg, device, steps=3)
    assert predicted == pytest.approx(measured.step_peaks[-1], rel=0.03)


def test_planner_top_choice_fits_and_trains():
    cfg = load_config(None, MODELS["gpt2-350m"] + COMMON + ["--train.grad_accum_steps=8"])
    device = torch.device("cuda")
    budget = parse_bytes("12GiB")
    plan = search(JobSections.of(cfg), local_device(device), budget)
    assert plan.best is not None
    measured = measure_step(apply_overrides(cfg, plan.best.overrides), device, steps=3)
    assert measured.peak_bytes + local_device(device).context_bytes <= budget
