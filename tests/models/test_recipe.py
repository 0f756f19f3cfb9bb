"""The recipe's parts (model.mlp=relu2, model.qk_norm, model.zero_init_proj, model.logit_softcap): each against an
independent float64 formula, their FLOPs against a hand count, their refusals word for word."""
import math

import pytest
import torch

from kiln.config import load_config
from kiln.errors import KilnError
from kiln.interop.hf import hf_config, write_hf
from kiln.models import ModelConfig, build_model, param_count
from kiln.models.generate import _last_logits
from kiln.perf.flops import flops_per_token
from kiln.train.pipeline import ModelPlan, prepare_model


def gpt2(**kw) -> ModelConfig:
    return ModelConfig(**(dict(preset="tiny", n_layer=2, n_head=4, d_model=32, max_seq_len=16, vocab_size=50,
                                bias=True) | kw)).resolve()


def _layer_norm(x, m):  # float64 by hand
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + m.eps) * m.weight + m.bias


ACTIVATIONS = {  # float64 by hand, from the fc output h
    "relu2": lambda h: torch.where(h > 0, h * h, torch.zeros_like(h)),  # modded-nanogpt's
    "gelu_exact": lambda h: h * 0.5 * (1 + torch.erf(h / math.sqrt(2))),  # nanoGPT's: h·Φ(h), Φ through erf
    "gelu": lambda h: 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3))),  # GPT-2's
}


@pytest.mark.parametrize("kind", list(ACTIVATIONS))
def test_each_gpt2_mlp_is_fc_activation_proj_in_float64(kind):
    torch.manual_seed(0)
    model = build_model(gpt2(mlp=kind)).double()
    mlp = model.blocks[0].mlp
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    h = x @ mlp.fc.weight.T + mlp.fc.bias
    torch.testing.assert_close(mlp(x), ACTIVATIONS[kind](h) @ mlp.proj.weight.T + mlp.proj.bias, rtol=0, atol=1e-12)
    # no two parts compute the same function (the erf and tanh GELUs differ by up to ~1e-3)
    others = [ACTIVATIONS[k](h) for k in ACTIVATIONS if k != kind]
    assert all((ACTIVATIONS[kind](h) - o).abs().max() > 1e-7 for o in others)
    # and the whole model trains through it: every weight gets a gradient
    ids = torch.randint(0, 50, (2, 16))
    model(ids, ids).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_qk_norm_on_gpt2_is_rmsnorm_per_head_in_float64():
    torch.manual_seed(0)
    cfg = gpt2(qk_norm=True)
    model = build_model(cfg).double()
    attn = model.blocks[0].attn
    with torch.no_grad():  # random gains: a weight the formula ignored would show
        attn.q_norm.weight.normal_(1.0, 0.3)
        attn.k_norm.weight.normal_(1.0, 0.3)
    B, T, H, D = 2, 9, 4, 8
    x = torch.randn(B, T, 32, dtype=torch.float64)
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).split(32, dim=-1)

    def rms(t, w):  # (B, T, H, D): each head normalized over its own D
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + cfg.norm_eps) * w

    q = rms(q.view(B, T, H, D), attn.q_norm.weight).transpose(1, 2)
    k = rms(k.view(B, T, H, D), attn.k_norm.weight).transpose(1, 2)
    v = v.view(B, T, H, D).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32)
    want = y @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)
    # two RMSNorm gains of head_dim per block, and no bias (the family's LayerNorm would have one)
    assert param_count(cfg) == param_count(gpt2()) + 2 * 2 * D
    assert sorted(n for n, _ in attn.named_parameters() if "norm" in n) == ["k_norm.weight", "q_norm.weight"]


def test_zero_init_proj_starts_every_block_as_the_identity():
    torch.manual_seed(0)
    model = build_model(gpt2(zero_init_proj=True)).double()
    for block in model.blocks:
        assert block.attn.proj.weight.abs().max() == 0 and block.mlp.proj.weight.abs().max() == 0
        assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)  # the rest as before
    assert model.init_std(model.blocks[0].mlp.proj) == 0
    ids = torch.randint(0, 50, (2, 16))
    h = model.embed.weight[ids] + model.pos_embed.weight[:16]  # float64: blocks add nothing at the start
    want = _layer_norm(h, model.norm) @ model.embed.weight.T
    torch.testing.assert_close(model(ids), want, rtol=0, atol=1e-12)
    # the projections learn first: they get gradients on the first step (the fc weights from the second)
    model(ids, ids).backward()
    assert model.blocks[0].mlp.proj.weight.grad.abs().sum() > 0
    assert model.blocks[0].attn.proj.weight.grad.abs().sum() > 0


def test_logit_softcap_is_cap_tanh_of_the_logits_before_the_loss_in_float64():
    torch.manual_seed(0)
    cap = 2.5  # small, so the cap bites on these logits
    model = build_model(gpt2(logit_softcap=cap)).double()
    with torch.no_grad():
        model.embed.weight.mul_(50)  # logits well beyond the cap
    ids, targets = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    raw = model.hidden(ids) @ model.embed.weight.T
    want = cap * torch.tanh(raw / cap)
    assert raw.abs().max() > 3 * cap
    torch.testing.assert_close(model(ids), want, rtol=0, atol=1e-12)
    assert model(ids).abs().max() <= cap
    ce = -want.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(model(ids, targets), ce, rtol=0, atol=1e-12)
    # sampling reads the capped logits too (temperature and top-p act on what the model trained with)
    torch.testing.assert_close(_last_logits(model, ids, None, None), want[:, -1].float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(mlp="relu2"), dict(mlp="gelu_exact"), dict(qk_norm=True),
                                dict(logit_softcap=15.0), dict(arch="llama", mlp="relu2"), dict(arch="llama", mlp="gelu")],
                         ids=["gpt2", "relu2", "gelu_exact", "qk_norm", "softcap", "llama-relu2", "llama-gelu"])
def test_flops_per_token_by_hand(kw):
    """6·(matmul weights) + 12·L·T·d: relu2 and GELU multiply by fc (d×F) and proj (F×d); a SwiGLU fc is d×2F;
    QK-norm and the cap add no matmul."""
    cfg = gpt2(**kw)
    d, F_, L, V, T = 32, cfg.d_ff, 2, cfg.padded_vocab, 16
    fc = 2 * F_ if (cfg.mlp or {"gpt2": "gelu", "llama": "swiglu"}[cfg.arch]) == "swiglu" else F_
    hand = 6 * (L * (d * 3 * d + d * d + d * fc + F_ * d) + V * d) + 12 * L * T * d
    assert flops_per_token(cfg, T) == hand


REFUSALS = [
    (["--model.mlp=relu3"], "model.mlp='relu3' is not an MLP kiln can swap in (an MoE keeps its SwiGLU experts); "
                            "give one of gelu, gelu_exact, relu2, swiglu, or \"\" for the family's own (gpt2: gelu)"),
    (["--model.preset=qwen3-moe-nano", "--model.mlp=relu2"],
     "model.mlp='relu2' is not an MLP kiln can swap in (an MoE keeps its SwiGLU experts); give one of gelu, "
     "gelu_exact, relu2, swiglu, or \"\" for the family's own (qwen3_moe: moe)"),
    (["--model.logit_softcap=-1"], "model.logit_softcap=-1 must be ≥ 0; give a cap > 0 (modded-nanogpt: 15; "
                                   "Gemma 2: 30), or 0 for none"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS, ids=["unknown-mlp", "moe-mlp", "negative-cap"])
def test_bad_recipe_values_are_one_line(overrides, message):
    with pytest.raises(KilnError) as e:
        load_config(None, overrides)
    assert str(e.value) == message


@pytest.mark.parametrize("kw,message", [
    (dict(arch="llama", mlp="relu2"), "model.mlp='relu2': llama's Hugging Face config has no such MLP"),
    (dict(mlp="swiglu"), "model.mlp='swiglu': gpt2's Hugging Face config has no such MLP"),
    (dict(qk_norm=True), "model.qk_norm=True: gpt2's Hugging Face model has no QK-norm"),
    (dict(arch="qwen3", qk_norm=False), "model.qk_norm=False: qwen3's Hugging Face model has QK-norm"),
    (dict(logit_softcap=15.0), "model.logit_softcap=15: gpt2's Hugging Face model has no logit soft-capping"),
], ids=["llama-relu2", "gpt2-swiglu", "gpt2-qk_norm", "qwen3-no-qk_norm", "softcap"])
def test_export_refuses_parts_the_hub_has_no_form_for_before_writing(kw, message, tmp_path):
    cfg = gpt2(**kw)
    with pytest.raises(KilnError) as e:
        write_hf(cfg, build_model(cfg).state_dict(), 50, tmp_path / "out")
    assert str(e.value) == (f"kiln export --hf: {message}; export without --hf (the kiln checkpoint), or train "
                            f"without that part")
    assert not (tmp_path / "out").exists()


def test_relu2_exports_as_gpt2_activation_relu2():
    assert hf_config(gpt2(mlp="relu2"), 50)["activation_function"] == "relu2"
    assert hf_config(gpt2(mlp="gelu_exact"), 50)["activation_function"] == "gelu"  # transformers' erf GELU
    assert hf_config(gpt2(), 50)["activation_function"] == "gelu_new"


def test_the_chunked_loss_refuses_a_capped_model():
    """(The fused loss takes the same refusal; it needs Triton, a GPU.)"""
    model = build_model(gpt2(logit_softcap=15.0))
    with pytest.raises(ValueError) as e:
        prepare_model(model, ModelPlan(loss="chunked", loss_chunk=8), torch.device("cpu"))
    assert str(e.value) == ("the chunked loss has no logit soft-cap: model.logit_softcap=15 needs the plain loss "
                            "(drop --memory.chunked_loss / the fused loss)")
