"""FLOPs per token against PyTorch's own FLOP counter; GPU names matched to the device tables."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from kiln.memory.devices import DEVICES, cuda_device
from kiln.models import FAMILIES, ModelConfig, build_model
from kiln.perf.flops import flops_per_token, names_gpu, peak_flops_for, recompute_flops_per_token
from kiln.train.pipeline import ModelPlan, prepare_model


# One small config per registered family (the grids below are list(FAMILIES)): a family added to
# kiln.models.registry fails test_every_family_has_a_small_config until it has one here.
SMALL = {
    "gpt2": dict(preset="tiny", n_layer=2, n_head=4, d_model=64, max_seq_len=32, vocab_size=259),
    "llama": dict(preset="llama-125m", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, max_seq_len=32,
                  vocab_size=300),
    "qwen3": dict(preset="qwen3-0.6b", n_layer=2, n_head=4, n_kv_head=2, head_dim=24, d_model=64, d_ff=96,
                  max_seq_len=32, vocab_size=300),
    "qwen3_moe": dict(preset="qwen3-moe-nano", n_layer=2, n_head=4, n_kv_head=2, head_dim=24, d_model=64,
                      n_experts=6, n_experts_active=2, moe_d_ff=32, max_seq_len=32, vocab_size=300),
}


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch 2.13's counter has no formula for grouped_mm (an MoE's experts, kiln.models.moe): 2·M·K·N, whichever of
    M (2-D × 3-D: forward, input gradient), K (2-D × 2-D: the weight gradient) or N the groups cut; × G for 3-D × 3-D."""
    batch = a_shape[0] if len(a_shape) == 3 and len(b_shape) == 3 else 1
    return 2 * batch * a_shape[-2] * a_shape[-1] * b_shape[-1]


if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_registry:
    register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


def test_every_family_has_a_small_config():
    assert set(SMALL) == set(FAMILIES), f"SMALL needs {set(FAMILIES) - set(SMALL)}"
    assert all(ModelConfig(**SMALL[arch]).resolve().arch == arch for arch in SMALL)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_flops_per_token_equals_counted_matmul_flops(arch):
    """6·N + 12·L·T·d_attn is what the model's matmuls do, forward and backward, when attention is counted over
    the full T×T square (torch's math attention computes the whole square, masked)."""
    cfg = ModelConfig(**SMALL[arch]).resolve()
    model = build_model(cfg)
    B, T = 3, 32
    x = torch.randint(0, cfg.vocab_size, (B, T))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(x, x).backward()
    assert counter.get_total_flops() == flops_per_token(cfg, T) * B * T


@pytest.mark.parametrize("name,model", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"), ("Tesla V100-SXM2-32GB", "V100-32GB"), ("NVIDIA L4", "L4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 3090", None),
])
def test_cuda_names_find_their_table_entry(name, model):
    memory = DEVICES[model].memory if model else 48 * 2**30
    device = cuda_device(name, memory, 8.0)
    assert device.name == name and device.memory == memory and device.capability == 8.0
    if model:
        assert device.peak_flops == DEVICES[model].peak_flops and device.bandwidth == DEVICES[model].bandwidth
        assert peak_flops_for(name, "bf16-master") == DEVICES[model].peak_flops.get("bf16")
    else:  # not in the table: generic numbers, never another card's (an L40S is not an L4)
        assert all(device.peak_flops != d.peak_flops for d in DEVICES.values())
        assert peak_flops_for(name, "bf16") is None


def test_names_gpu_is_whole_word():
    assert names_gpu("NVIDIA L4", "L4") and not names_gpu("NVIDIA L40S", "L4")
    assert not names_gpu("NVIDIA H200", "H100") and names_gpu("nvidia h100 pcie", "H100")


@pytest.mark.parametrize("plan", [("none", "none", "none"), ("full", "full", "full"), ("full", "seg", "none"),
                                  ("selective", "selective", "selective"), ("selective", "full", "none")],
                         ids=["none", "full", "every_k-segment", "selective", "mixed-budget"])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_hardware_flops_equal_counted_flops_with_each_recompute_plan(arch, plan):
    """HFU's numerator: the model's FLOPs plus what recomputation runs again, against torch's FLOP counter over a
    real forward and backward of the model with that recompute plan installed."""
    cfg = ModelConfig(**{**SMALL[arch], "n_layer": 3}).resolve()
    model = build_model(cfg)
    prepare_model(model, ModelPlan(recompute=plan))
    B, T = 2, 32
    x = torch.randint(0, cfg.vocab_size, (B, T))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(x, x).backward()
    expected = (flops_per_token(cfg, T) + recompute_flops_per_token(cfg, T, plan)) * B * T
    assert counter.get_total_flops() == expected
    if plan != ("none",) * 3:
        assert recompute_flops_per_token(cfg, T, plan) > 0


def test_metrics_log_hfu_beside_mfu(small_config, tmp_path):
    """A run with full recomputation logs HFU above MFU by exactly the recomputed share; without recompute the two
    are equal."""
    import json

    from kiln.run.lm import resolve_model, train

    for policy in ("none", "full"):
        cfg = small_config(train={"max_steps": 3}, memory={"recompute": policy})
        train(cfg, tmp_path / policy)
        records = [json.loads(line) for line in (tmp_path / policy / "metrics.jsonl").read_text().splitlines()]
        model = resolve_model(cfg, 256)
        extra = recompute_flops_per_token(model, cfg.data.seq_len, (policy,) * model.n_layer)
        for r in (r for r in records if r["kind"] == "train"):
            assert r["hfu"] / r["mfu"] == pytest.approx(1 + extra / flops_per_token(model, cfg.data.seq_len),
                                                        rel=1e-12)
        assert (extra > 0) == (policy == "full")
