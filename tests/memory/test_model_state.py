"""Model-state bytes (parameters, gradients, masters, optimizer state) exact, and the classic tables."""
import pytest
import torch

from kiln.config import load_config
from kiln.memory.devices import get_device
from kiln.memory.estimate import (BYTES_PER_PARAM, Job, estimate, kiln_bytes_per_param, korthikanti_layer_bytes,
                                  model_state_table, parameter_numels, recompute_plan, textbook_layer_bytes)
from kiln.memory.levers import JobSections, job_for
from kiln.run.measure import measure_step
from kiln.models import PRESETS, ModelConfig, build_model, param_count


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameter_list_matches_the_model(preset):
    depth = {"n_layer": 2} if PRESETS[preset].n_experts > 16 else {}  # 128 experts × 94 blocks: minutes on meta
    cfg = ModelConfig(preset=preset, vocab_size=300, **depth).resolve()
    model = build_model(cfg, device="meta")
    got = [(n, p.numel()) for n, p in model.named_parameters()]
    assert parameter_numels(cfg) == got
    assert sum(n for _, n in got) == param_count(cfg)


def test_bytes_per_parameter_classics():
    assert kiln_bytes_per_param("fp32") == BYTES_PER_PARAM["fp32"] == 16  # fp32 AdamW
    assert kiln_bytes_per_param("bf16") == 16  # autocast keeps fp32 weights and gradients
    assert kiln_bytes_per_param("bf16-master") == BYTES_PER_PARAM["mixed"] == 16
    table = {int(n / 1e9): (fp32, mixed, acc) for n, fp32, mixed, acc in model_state_table()}
    # "FP32 or BF16 w/o FP32 grad acc" and "BF16 w/ FP32 grad acc", in GB
    assert {k: (v[0] / 1e9, v[1] / 1e9, v[2] / 1e9) for k, v in table.items()} == {
        1: (16, 16, 20), 7: (112, 112, 140), 70: (1120, 1120, 1400)}


@pytest.mark.parametrize("s,b,h,a", [(1024, 32, 1600, 25), (2048, 1, 4096, 32), (512, 8, 768, 12)])
def test_korthikanti_formula_from_the_model_code(s, b, h, a):
    """sbh(34 + 5as/h): kiln's GPT-2 block accounted under the paper's assumptions gives it exactly."""
    assert textbook_layer_bytes(s, b, h, a) == korthikanti_layer_bytes(s, b, h, a)
    assert korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


def test_gpt2_xl_on_a_v100():
    """GPT-2 XL, batch 32 x 1024, one 32 GB V100: fp32 does not fit; mixed precision (half weights, gradients
    and activations, fp32 masters and Adam) does not fit; adding recomputation (and a chunked loss) fits."""
    v100 = get_device("V100")
    model = ModelConfig(preset="gpt2-1.5b").resolve()

    def total(precision, policy="none", chunk=0):
        job = Job(model=model, micro_batch=32, seq_len=1024, precision=precision, target=v100.target,
                  recompute=recompute_plan(policy, model.n_layer), chunked_loss=chunk)
        return estimate(job).total_bytes

    assert total("fp32") > v100.memory
    assert total("bf16-master") > v100.memory
    assert total("bf16-master", "full") > v100.memory  # logits of 32k tokens x 50k vocab alone are 6 GiB in fp32
    assert total("bf16-master", "full", 1024) < v100.memory
    # model state alone: 16 bytes per parameter either way
    assert estimate(Job(model=model, micro_batch=1, seq_len=1, precision="fp32")).model_state["parameters"] == \
        4 * param_count(model)


@pytest.mark.parametrize("overrides", [
    ["--precision.mode=fp32"],
    ["--precision.mode=bf16", "--optim.name=adamw8bit"],
    ["--precision.mode=bf16-master", "--optim.name=sgd"],
    ["--precision.mode=bf16-master", "--optim.offload=host"],
    ["--precision.mode=bf16", "--model.arch=llama"],
    ["--precision.mode=fp32", "--model.arch=qwen3", "--model.n_kv_head=1", "--model.head_dim=24"],
    ["--precision.mode=bf16-master", "--model.arch=qwen3_moe", "--model.n_experts=4", "--optim.name=adamw8bit"],
], ids=lambda o: " ".join(o))
def test_model_state_measured_exactly(overrides):
    cfg = load_config(None, ["--model.n_layer=2", "--model.d_model=64", "--model.n_head=2", "--data.seq_len=32",
                             "--train.micro_batch_size=2", "--train.device=cpu"] + overrides)
    predicted = estimate(job_for(JobSections.of(cfg), get_device("cpu"))).model_state
    measured = measure_step(cfg, torch.device("cpu"), steps=1).components
    for key in ("parameters", "gradients", "master_weights", "optimizer_states", "buffers"):
        want = predicted[key]
        if key == "gradients" and cfg.precision.mode == "bf16-master" and cfg.optim.offload == "none":
            # on the masters
            want = 4 * sum(n for _, n in parameter_numels(job_for(JobSections.of(cfg), get_device("cpu")).model))
        assert measured[key] == want, key
