"""Every family's description against the model it builds; arch switching; the MoE's routing and losses against
independent references (a float64 dense computation, transformers' load_balancing_loss_func)."""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.models import FAMILIES, PRESETS, ModelConfig, build_model, costs, family, moe_metrics, param_count
from kiln.models.family import Family
from kiln.models.moe import MoE, moe_losses

from tests.memory.test_recipe_memory import PARTS as RECIPE_PARTS

KILN = Path(__file__).resolve().parents[2] / "kiln"
NAMES = "|".join(sorted(FAMILIES, key=len, reverse=True))
# a family name compared with something, or a model.arch compared at all
BRANCH = re.compile(rf"""(==|!=|\bin\s*[\(\[{{])\s*["']({NAMES})["']|["']({NAMES})["']\s*(==|!=)|\.arch\s*(==|!=|in\b)""")


def branches_on_family_names(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "models":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if BRANCH.search(line.split("#")[0]):
                hits.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    return hits


def test_nothing_outside_kiln_models_branches_on_a_family_name(tmp_path):
    assert branches_on_family_names(KILN) == []
    # the check finds what it looks for (the line kiln/perf/flops.py had before the descriptions)
    (tmp_path / "perf").mkdir()
    (tmp_path / "perf" / "flops.py").write_text('mlp = d * ff * (1 if cfg.arch == "gpt2" else 2) + ff * d\n'
                                                'if kind in ("llama", "x"):\n    pass\n')
    assert len(branches_on_family_names(tmp_path)) == 2


KINDS = "|".join(sorted((*costs.NORMS, *costs.MLPS, *costs.POSITIONS), key=len, reverse=True))
# a part kind compared with something, or a description's part field compared at all
PART_BRANCH = re.compile(rf"""(==|!=|\bin\s*[\(\[{{])\s*["']({KINDS})["']|["']({KINDS})["']\s*(==|!=)"""
                         r"""|\.(mlp|norm|positions)\s*(==|!=|in\b)""")


def branches_on_part_kinds(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "models":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PART_BRANCH.search(line.split("#")[0]):
                hits.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    return hits


def test_nothing_outside_kiln_models_branches_on_a_part_kind(tmp_path):
    """The estimator, planner and FLOPs ask the part (kiln.models.costs): a branch on its name would cost a new
    kind as whichever kind the else-branch names."""
    assert branches_on_part_kinds(KILN) == []
    # the check finds what it looks for (lines kiln/memory/estimate.py and kiln/perf/flops.py had before the parts)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "estimate.py").write_text(
        'wide = F if mlp == "gelu" else 3 * F\nif family(cfg.arch).positions != "rope":\n    pass\n'
        'skipped = 0 if fam.mlp == "moe" else 2\nif kind in ("layernorm", "x"):\n    pass\n')
    assert len(branches_on_part_kinds(tmp_path)) == 4


def test_every_part_kind_is_built_by_a_registered_family():
    """The family grids (list(FAMILIES), here and in tests/memory, tests/perf) exercise a part only through a
    family that uses it: a kind no family builds would be costed by code no test runs."""
    used = {(table, getattr(f, field)) for f in FAMILIES.values()
            for table, field in (("norm", "norm"), ("mlp", "mlp"), ("positions", "positions"))}
    # an MLP only a run's model.mlp picks is exercised by the recipe grid (saved bytes, peak) instead
    used |= {("mlp", kw["mlp"]) for _, kw in RECIPE_PARTS.values() if "mlp" in kw}
    for table, kinds in (("norm", costs.NORMS), ("mlp", costs.MLPS), ("positions", costs.POSITIONS)):
        for kind in kinds:
            assert (table, kind) in used, f"{table} {kind!r} is in kiln/models/costs.py but no family builds it"
    assert {f.qk_norm for f in FAMILIES.values()} == {False, True}


def test_an_unknown_part_kind_fails_loudly_and_a_kind_that_forgets_a_cost_too():
    base = FAMILIES["llama"]
    with pytest.raises(ValueError, match=r"family 'x': mlp='geglu' is not a part kiln knows; known: gelu, gelu_exact, "
                                         r"relu2, swiglu, moe"):
        Family(name="x", summary="", block=base.block, norm="rmsnorm", mlp="geglu", positions="rope")
    with pytest.raises(ValueError, match="norm='batchnorm' is not a part kiln knows"):
        costs.make_norm("batchnorm", 8, 1e-5)

    class GeGLU(costs.MLP):  # a new kind that states its linears but not its saved tensors
        name = "geglu"

        def linears(self, cfg):
            return [costs.Linear("mlp.fc", cfg.d_model, cfg.d_ff, "column")]

    with pytest.raises(NotImplementedError, match="MLP 'geglu' states no saved tensors"):
        GeGLU().saved(PRESETS["tiny"], 4, None)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_each_family_builds_and_its_description_matches_the_module(arch):
    fam = family(arch)
    cfg = ModelConfig(preset="nano", arch=arch, n_layer=2, vocab_size=100, max_seq_len=32).resolve()
    model = build_model(cfg)
    params = dict(model.named_parameters())
    assert [(n, tuple(p.shape)) for n, p in params.items()] == fam.parameter_shapes(cfg)
    assert sum(p.numel() for p in params.values()) == param_count(cfg)
    # every block linear the description names exists with its shape (experts: stacked, one row block each)
    block = dict(model.blocks[0].named_modules())
    for lin in fam.linears(cfg):
        shape = (lin.n_out, lin.n_in) if lin.copies == 1 else (lin.copies, lin.n_out, lin.n_in)
        assert tuple(block[lin.name].weight.shape) == shape, lin
    assert set(fam.tp_layout(cfg).values()) <= {"column", "row", "replicate", "expert"}
    # the Hugging Face map covers every parameter once
    mapped = [m.kiln for m in fam.hf_tensors(cfg) if m.kiln in params]
    assert sorted(mapped) == sorted(params)
    logits = model(torch.randint(0, 100, (2, 16)))
    assert logits.shape == (2, 16, cfg.padded_vocab) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_switching_the_arch_of_any_preset_gives_a_valid_model_of_that_family(arch):
    for preset, base in PRESETS.items():
        cfg = ModelConfig(preset=preset, arch=arch, vocab_size=300).resolve()
        assert cfg.arch == arch
        assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.max_seq_len) == (base.n_layer, base.d_model, base.n_head,
                                                                           base.max_seq_len)
        if base.n_layer * base.d_model <= 12 * 768:  # building the 235B-expert shapes on meta takes minutes
            assert param_count(cfg) == sum(p.numel() for p in build_model(cfg, "meta").parameters())
        if family(arch).positions == "rope":
            assert cfg.rope_theta > 0
    nano_llama = ModelConfig(arch="llama").resolve()  # the default preset is a GPT-2
    assert nano_llama.rope_theta == 10000.0 and nano_llama.d_ff == 768 and not nano_llama.bias
    # what the user sets wins over the family's defaults, 0 included where 0 means something
    moe = ModelConfig(arch="qwen3_moe", n_experts=4, moe_aux_coef=0.0).resolve()
    assert moe.n_experts == 4 and moe.moe_aux_coef == 0.0 and moe.n_experts_active == 2


def test_bad_family_settings_are_clear_errors():
    with pytest.raises(ValueError, match="did you mean 'llama'"):
        ModelConfig(arch="lama").resolve()
    with pytest.raises(ValueError, match="needs a mixture-of-experts family"):
        ModelConfig(preset="llama-125m", n_experts=4).resolve()
    with pytest.raises(ValueError, match="1 ≤ active ≤ experts"):
        ModelConfig(preset="qwen3-moe-nano", n_experts=4, n_experts_active=5).resolve()
    with pytest.raises(ValueError, match="grouped-query families"):
        ModelConfig(preset="gpt2-124m", n_kv_head=4).resolve()


def _dense_moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token in float64, combined with the top-k weights: no gathering, no scattering."""
    h = x.double().reshape(-1, x.shape[-1])
    probs = F.softmax(h @ moe.router.weight.double().T, dim=-1, dtype=torch.float32)  # HF routes in fp32
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.double()
    out = torch.zeros_like(h)
    for e in range(moe.n_experts):
        gate, up = (h @ moe.experts.fc.weight[e].double().T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ moe.experts.proj.weight[e].double().T
        w = (weights * (chosen == e)).sum(-1, keepdim=True)  # 0 where the token did not pick e
        out += w * y
    return out.view(x.shape)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_routing_matches_a_dense_float64_reference(norm_topk):
    torch.manual_seed(0)
    moe = MoE(32, n_experts=5, top_k=2, d_ff=24, norm_topk=norm_topk).double()
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(moe(x), _dense_moe_reference(moe, x), rtol=1e-12, atol=1e-12)


def test_moe_aux_loss_is_transformers_load_balancing_loss_and_metrics_are_routing_shares():
    hf = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe",
                             reason="transformers is not installed (the test extra has it)")
    torch.manual_seed(0)
    cfg = ModelConfig(preset="qwen3-moe-nano", n_layer=3, vocab_size=100, n_experts=5, n_experts_active=2,
                      moe_aux_coef=0.01).resolve()
    model = build_model(cfg).train()
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    logits_per_layer = []
    hooks = [m.router.register_forward_hook(lambda mod, a, out: logits_per_layer.append(out)) for m in model.moe]
    loss = model(x, y)
    for h in hooks:
        h.remove()
    want = hf.load_balancing_loss_func(tuple(logits_per_layer), cfg.n_experts, cfg.n_experts_active)
    aux, _ = moe_losses(model.moe)
    torch.testing.assert_close(aux, want, rtol=1e-6, atol=0)
    model.eval()
    ce = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    torch.testing.assert_close(loss.detach(), ce + 0.01 * want.detach(), rtol=1e-5, atol=1e-6)
    # shares of routed (token, slot) pairs per expert, per block, since the last read
    shares = []
    for layer_logits in logits_per_layer:
        chosen = layer_logits.float().softmax(-1).topk(2, dim=-1).indices.flatten()
        shares.append(torch.bincount(chosen, minlength=5).float() / chosen.numel())
    shares = torch.stack(shares)
    got = moe_metrics(model)
    assert got["moe_load_max"] == pytest.approx(shares.max().item())
    assert got["moe_load_min"] == pytest.approx(shares.min().item())
    assert got["moe_aux_loss"] == pytest.approx(want.item(), rel=1e-6)
    assert moe_metrics(model) == {}  # read once: counting starts again
    assert moe_metrics(build_model(ModelConfig(vocab_size=100))) == {}  # dense: nothing to report


def test_a_checkpoint_shape_keeps_the_training_fields_the_user_set():
    from kiln.models.config import with_training_fields

    shape = ModelConfig(preset="qwen3-moe-nano", vocab_size=256).resolve()  # moe_aux_coef 0.001, as HF's default
    assert with_training_fields(shape, ModelConfig(moe_aux_coef=0.0, dropout=0.1)).moe_aux_coef == 0.0
    kept = with_training_fields(shape, ModelConfig())
    assert kept.moe_aux_coef == 0.001 and kept.dropout == 0.0 and kept.n_experts == shape.n_experts
