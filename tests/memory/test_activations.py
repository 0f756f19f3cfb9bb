"""Predicted saved-for-backward bytes against what autograd actually keeps (saved_tensors_hooks), per kind."""
import itertools

import pytest
import torch

from kiln.memory.chunked_loss import ChunkedLMLoss
from kiln.memory.estimate import Job, Target, _split, recompute_plan, saved_tensors
from kiln.memory.measure import measure_saved
from kiln.memory.recompute import apply_recompute
from kiln.models import FAMILIES, build_model
from kiln.train.precision import Precision

from tests.memory.conftest import MODELS

SHAPES = [(2, 24), (3, 40)]


def predicted(job):
    embed, blocks, head = saved_tensors(job)
    total = {"activations": 0, "logits": 0, "weight_casts": 0}
    for part in [embed, head, *blocks]:
        for k, v in _split(part).items():
            total[k] += v
    return total, [sum(b.values()) for b in blocks]


def measured(cfg, mode, plan, B, T, chunk=0):
    precision = Precision(mode, torch.device("cpu"))
    model = build_model(cfg).to(precision.param_dtype)
    apply_recompute(model, plan)
    if chunk:
        model.loss = ChunkedLMLoss(chunk)
    x, y = torch.randint(0, cfg.vocab_size, (B, T)), torch.randint(0, cfg.vocab_size, (B, T))
    return measure_saved(model, x, y, precision)


POLICIES = ["none", "full", "every_k", "selective"]
# The grid is derived from the registry: every family on one shape, and the first family of each norm kind (GPT-2's
# LayerNorm, Llama's RMSNorm) on both. A family added to kiln.models.registry joins it and needs its small config
# in tests/memory/conftest.py's MODELS (test_every_family_has_a_small_config fails until it has one).
NORM_KINDS = dict.fromkeys(f.norm for f in FAMILIES.values())
BOTH_SHAPES = [next(arch for arch, f in FAMILIES.items() if f.norm == kind) for kind in NORM_KINDS]


def test_every_family_has_a_small_config():
    assert set(MODELS) == set(FAMILIES), f"tests/memory/conftest.py MODELS needs {set(FAMILIES) - set(MODELS)}"


@pytest.mark.parametrize("arch,mode,policy,shape", list(itertools.product(
    BOTH_SHAPES, ["fp32", "bf16"], POLICIES, SHAPES)) + list(itertools.product(
    [a for a in FAMILIES if a not in BOTH_SHAPES], ["fp32", "bf16"], POLICIES, SHAPES[1:])),
    ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else str(v))
def test_saved_bytes_match_within_one_percent(arch, mode, policy, shape):
    """The acceptance grid: {GPT-2, Llama GQA} x {fp32, bf16} x {none, full, every_k, selective} x 2 shapes; the
    same for Qwen3 (QK-norm, its own head width) and Qwen3-MoE (4 experts, top-2) on one shape."""
    cfg = MODELS[arch]()
    B, T = shape
    plan = recompute_plan(policy, cfg.n_layer, 2)
    pred, pred_blocks = predicted(Job(model=cfg, micro_batch=B, seq_len=T, precision=mode, target=Target("cpu"),
                                      recompute=plan))
    got = measured(cfg, mode, plan, B, T)
    for kind in ("activations", "logits", "weight_casts"):
        assert got.components[kind] == pytest.approx(pred[kind], rel=0.01, abs=0), kind
    # in fact every byte is accounted for, block by block
    assert got.components == pred
    assert got.per_block == pred_blocks


@pytest.mark.parametrize("arch,mode,dropout,chunk", [
    ("gpt2", "bf16-master", 0.0, 0), ("llama", "bf16-master", 0.0, 0), ("gpt2", "fp32", 0.1, 0),
    ("llama", "bf16", 0.1, 0), ("gpt2", "bf16", 0.0, 16), ("llama", "fp32", 0.0, 48),
    ("qwen3", "bf16-master", 0.0, 16), ("qwen3", "fp32", 0.1, 0), ("qwen3_moe", "bf16-master", 0.0, 0),
    ("qwen3_moe", "bf16", 0.1, 0), ("qwen3_moe", "fp32", 0.1, 48)])
def test_saved_bytes_other_modes(arch, mode, dropout, chunk):
    """bf16-master, dropout (CPU picks the math attention kernel then) and the chunked loss."""
    cfg = MODELS[arch](dropout=dropout)
    B, T = 3, 40
    plan = ("none",) * cfg.n_layer
    pred, _ = predicted(Job(model=cfg, micro_batch=B, seq_len=T, precision=mode, target=Target("cpu"),
                            recompute=plan, chunked_loss=chunk))
    assert measured(cfg, mode, plan, B, T, chunk).components == pred


def test_recompute_drops_activations_as_predicted():
    cfg = MODELS["gpt2"](n_layer=4)
    B, T = 3, 40
    got, want = {}, {}
    for policy in ("none", "selective", "every_k", "full"):
        plan = recompute_plan(policy, cfg.n_layer, 2)
        want[policy] = predicted(Job(model=cfg, micro_batch=B, seq_len=T, precision="fp32", target=Target("cpu"),
                                     recompute=plan))[0]["activations"]
        got[policy] = measured(cfg, "fp32", plan, B, T).components["activations"]
    assert got == want
    assert got["none"] > got["selective"] > got["full"] > got["every_k"]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_selective_kept_matmuls_are_counted_where_the_policy_cannot_see_them(arch, monkeypatch):
    """torch < 2.12 (the GPU image's 2.11) calls the policy before the op: the dispatch-mode path counts the same
    bytes as the op_output path (tests/memory/test_levers.py checks selective's gradients on whichever torch runs)."""
    from kiln.memory import recompute

    cfg = MODELS[arch]()
    B, T = SHAPES[0]
    plan = recompute_plan("selective", cfg.n_layer, 2)
    seen_by_policy = measured(cfg, "fp32", plan, B, T)
    monkeypatch.setattr(recompute, "_POLICY_SEES_OUTPUT", False)
    seen_by_mode = measured(cfg, "fp32", plan, B, T)
    assert seen_by_mode.components == seen_by_policy.components and seen_by_mode.per_block == seen_by_policy.per_block
    assert seen_by_mode.components["activations"] > 0


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("routing", [{"moe_z_coef": 0.01}, {"moe_norm_topk": False}], ids=["z-loss", "raw-topk"])
def test_moe_routing_options_saved_bytes(mode, routing):
    """The router z-loss keeps fp32 logits and their logsumexp; raw top-k weights skip the renormalisation."""
    cfg = MODELS["qwen3_moe"](**routing)
    B, T = 3, 40
    plan = ("none",) * cfg.n_layer
    pred, pred_blocks = predicted(Job(model=cfg, micro_batch=B, seq_len=T, precision=mode, target=Target("cpu"),
                                      recompute=plan))
    got = measured(cfg, mode, plan, B, T)
    assert got.components == pred and got.per_block == pred_blocks
