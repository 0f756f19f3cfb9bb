import math

import pytest
import torch
import torch.nn.functional as F

from kiln.models import IGNORE_INDEX, PRESETS, ModelConfig, build_model, param_count
from kiln.models.generate import Sampling, generate
from kiln.models.transformer import Rotary, rope_cache
from tests.conftest import small_model


@pytest.mark.parametrize("preset", list(PRESETS))
def test_param_count_matches_built_model(preset):
    # 128 experts × 48-94 blocks take a minute to build even on meta: two blocks check the same structure
    depth = {"n_layer": 2} if PRESETS[preset].n_experts > 16 else {}
    cfg = ModelConfig(preset=preset, vocab_size=PRESETS[preset].vocab_size or 256, **depth).resolve()
    model = build_model(cfg, device="meta")
    built = sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once
    assert param_count(cfg) == built


def test_param_counts_of_known_models():
    # nanoGPT's GPT-2 124M with the vocabulary padded to 50304 has 124,475,904 parameters.
    assert param_count(ModelConfig(preset="gpt2-124m")) == 124_475_904
    # Llama-2-7B has 6,738,415,616.
    assert param_count(ModelConfig(preset="llama-7b")) == 6_738_415_616
    # Meta-Llama-3-70B has 70,553,706,496.
    assert param_count(ModelConfig(preset="llama-70b")) == 70_553_706_496


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_loss_at_init_is_near_ln_vocab(arch):
    torch.manual_seed(0)
    preset = "tiny" if arch == "gpt2" else "llama-125m"
    cfg = ModelConfig(preset=preset, n_layer=4, d_model=256, n_head=4, n_kv_head=2 if arch == "llama" else 0,
                      d_ff=0, vocab_size=256, max_seq_len=128).resolve()
    model = build_model(cfg)
    x = torch.randint(0, 256, (4, 128))
    y = torch.randint(0, 256, (4, 128))
    loss = model(x, y).item()
    assert abs(loss - math.log(256)) < 0.1


def test_vocab_is_padded_to_64():
    model = build_model(small_model(vocab_size=257))
    assert model.embed.weight.shape[0] == 320


def test_module_paths_and_init():
    cfg = small_model(vocab_size=256, n_layer=4).resolve()
    model = build_model(cfg)
    names = dict(model.named_modules())
    for name in ("blocks.3.attn", "blocks.3.mlp", "blocks.3.attn.core", "blocks.0.mlp.act", "norm", "loss"):
        assert name in names
    assert model.head is None  # tied
    # Residual projections start 1/sqrt(2·n_layer) smaller.
    std_proj = model.blocks[0].mlp.proj.weight.std().item()
    std_fc = model.blocks[0].mlp.fc.weight.std().item()
    assert std_fc == pytest.approx(0.02, rel=0.1)
    assert std_proj == pytest.approx(0.02 / math.sqrt(8), rel=0.1)


def test_loss_matches_plain_cross_entropy_and_ignores_index():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="llama-125m", n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=0,
                                    vocab_size=100, max_seq_len=32))
    x = torch.randint(0, 100, (2, 16))
    y = torch.randint(0, 100, (2, 16))
    y[0, :5] = IGNORE_INDEX
    logits = model(x)
    ref = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), ignore_index=IGNORE_INDEX)
    assert model(x, y).item() == pytest.approx(ref.item(), rel=1e-5)
    assert model(x, y, reduction="sum").item() == pytest.approx(ref.item() * 27, rel=1e-5)


def test_causality():
    torch.manual_seed(0)
    for preset in ("tiny", "llama-125m"):
        model = build_model(ModelConfig(preset=preset, n_layer=2, d_model=64, n_head=4, d_ff=0, vocab_size=64,
                                        max_seq_len=32)).double()
        x = torch.randint(0, 64, (1, 12))
        x2 = x.clone()
        x2[0, 8:] = (x2[0, 8:] + 1) % 64
        torch.testing.assert_close(model(x)[:, :8], model(x2)[:, :8])


def test_gqa_equals_repeated_kv_heads():
    torch.manual_seed(0)
    cfg = ModelConfig(preset="llama-125m", n_layer=1, d_model=64, n_head=4, n_kv_head=2, d_ff=0, vocab_size=64,
                      max_seq_len=16).resolve()
    attn = build_model(cfg).blocks[0].attn.core
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(attn(q, k, v), ref)


def test_rope_is_a_rotation_of_pairs():
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    cos, sin = rope_cache(8, 5, 10000.0)
    y = Rotary()(x, cos.double(), sin.double())
    # Norm of each (x_i, x_{i+D/2}) pair is preserved; position 0 is unrotated.
    pair_norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])


def test_generate_respects_vocab_limit():
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=10))  # padded to 64
    out = generate(model, [[0]], 50, Sampling(temperature=1.0), vocab_limit=10)
    assert len(out.tokens[0]) == 50 and max(out.tokens[0]) < 10


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="divisible by model.n_head"):
        ModelConfig(d_model=100, n_head=3).resolve()
    with pytest.raises(ValueError, match="did you mean 'gpt2-124m'"):
        ModelConfig(preset="gpt2-124").resolve()
    with pytest.raises(ValueError, match="multiple of model.n_kv_head"):
        ModelConfig(preset="llama-125m", n_kv_head=5).resolve()
