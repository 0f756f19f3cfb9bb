"""LoRA adapters (kiln.models.lora): the adapted linear against a float64 reference built from the Hub's pieces,
the targets each family's description gives, the mapping to PEFT's names against the built model, the refusals."""
import math

import pytest
import torch
import torch.nn as nn

from kiln.errors import KilnError
from kiln.models import ModelConfig, build_model, family
from kiln.models.lora import (LoraConfig, LoraLinear, adapter_state_dict, apply_lora, lora_tensors, merge_lora,
                              trainable_count)

ARCHS = ("gpt2", "llama", "qwen3")


def small(arch: str, **kw) -> ModelConfig:
    extra = dict(n_kv_head=2) if arch != "gpt2" else {}
    return ModelConfig(preset="nano", arch=arch, n_layer=2, vocab_size=100, max_seq_len=32,
                       **(extra | kw)).resolve()


def randomise(model: nn.Module, seed: int = 1) -> None:
    """B is zero at start (the output is the base's): give every adapter values, so the test sees its product."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("arch", ARCHS)
def test_each_hub_piece_gets_w_x_plus_scale_b_a_x_in_float64(arch):
    cfg = small(arch)
    model = build_model(cfg).double()
    lora = LoraConfig(rank=3, alpha=7.0)
    apply_lora(model, lora, cfg)
    randomise(model)
    table = lora_tensors(cfg, lora)
    by_key = {t.kiln: t for t in table}
    hub = {t.kiln: t for t in family(arch).hf_tensors(cfg)}
    state = model.state_dict()
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        xin = torch.randn(4, module.in_features, dtype=torch.float64)
        y = module(xin)  # (4, out)
        w, b = state[f"{name}.weight"], state.get(f"{name}.bias")
        # Reference: the Hub's modules one by one, each its own W_p x + b_p + (alpha/r)·B_p A_p x
        rows = hub[f"{name}.weight"].rows or (module.out_features,)
        start = 0
        for piece_rows, hf in zip(rows, hub[f"{name}.weight"].hf):
            piece = hf.removesuffix(".weight").rsplit(".", 1)[-1]
            a = state[f"{name}.lora_A.{piece}"]
            bb = state[f"{name}.lora_B.{piece}"]
            ta, tb = by_key[f"{name}.lora_A.{piece}"], by_key[f"{name}.lora_B.{piece}"]
            assert ta.rows == tb.rows == (start, start + piece_rows) and ta.module == hf.removesuffix(".weight")
            ref = xin @ w[start:start + piece_rows].T + (7.0 / 3) * (xin @ a.T) @ bb.T
            if b is not None:
                ref = ref + b[start:start + piece_rows]
            torch.testing.assert_close(y[:, start:start + piece_rows], ref, rtol=1e-12, atol=1e-12)
            start += piece_rows
            checked += 1
        assert start == module.out_features
    pieces = {"gpt2": 4, "llama": 7, "qwen3": 7}[arch]  # c_attn c_proj c_fc c_proj | q k v o gate up down
    assert checked == pieces * cfg.n_layer
    assert model(torch.randint(0, 100, (2, 8))).shape[:2] == (2, 8)  # the whole model runs adapted


@pytest.mark.parametrize("arch", ARCHS)
def test_mapping_lists_the_model_adapters_in_state_dict_order(arch):
    cfg = small(arch)
    lora = LoraConfig(rank=4)
    model = build_model(cfg)
    apply_lora(model, lora, cfg)
    table = lora_tensors(cfg, lora)
    adapters = adapter_state_dict(model)
    assert [t.kiln for t in table] == list(adapters)
    assert all(tuple(adapters[t.kiln].shape) == t.shape for t in table)
    assert all(t.fan_in_fan_out == (arch == "gpt2") for t in table)  # GPT-2's Conv1D modules, as on the Hub
    assert len({t.peft_key for t in table}) == len(table)
    first = {"gpt2": "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight",
             "llama": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
             "qwen3": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"}[arch]
    assert table[0].peft_key == first
    # The base's keys are unchanged: a Hugging Face or kiln checkpoint of the base loads into the adapted model.
    plain = build_model(cfg).state_dict()
    assert [k for k in model.state_dict() if k not in adapters] == list(plain)


def test_fresh_adapters_follow_peft_init_and_leave_the_output_unchanged():
    cfg = small("llama")
    torch.manual_seed(0)
    base = build_model(cfg)
    model = build_model(cfg)
    model.load_state_dict(base.state_dict())
    apply_lora(model, LoraConfig(rank=8), cfg)
    idx = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(model(idx), base(idx), rtol=0, atol=0)
    qkv = model.blocks[0].attn.qkv
    bound = 1 / math.sqrt(cfg.d_model)  # kaiming-uniform(a=√5) on (r, in): U(-1/√in, 1/√in)
    for a in qkv.lora_A.values():
        assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and a.requires_grad
    assert all((b == 0).all() and b.requires_grad for b in qkv.lora_B.values())
    assert not qkv.weight.requires_grad and not model.embed.weight.requires_grad
    assert not getattr(qkv, "residual", False)
    assert model.blocks[0].attn.proj.residual  # the init's mark is kept on the adapted module


@pytest.mark.parametrize("targets, names", [
    ("attn", ["attn.qkv", "attn.proj"]), ("mlp", ["mlp.fc", "mlp.proj"]),
    ("all", ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]), ("mlp.fc, attn.qkv", ["attn.qkv", "mlp.fc"]),
    ("attn,attn.qkv", ["attn.qkv", "attn.proj"])])
def test_targets_from_the_family_description(targets, names):
    cfg = small("qwen3")
    model = build_model(cfg)
    adapted = apply_lora(model, LoraConfig(rank=2, targets=targets), cfg)
    assert adapted == [f"blocks.{i}.{n}" for i in range(cfg.n_layer) for n in sorted(names, key=[
        "attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"].index)]


def test_trainable_count_is_the_adapters():
    cfg = small("llama")
    model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoraConfig(rank=4, targets="attn.qkv,mlp.proj"), cfg)
    d, hd, H, KV, F = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_ff
    per_block = 3 * 4 * d + 4 * (H + 2 * KV) * hd + 4 * F + 4 * d  # q/k/v A's and B's, down's A and B
    assert trainable_count(model) == (cfg.n_layer * per_block, total + cfg.n_layer * per_block)


def test_merge_gives_w_plus_scale_b_a():
    cfg = small("gpt2", bias=True)
    model = build_model(cfg).double()
    apply_lora(model, LoraConfig(rank=2, alpha=4.0), cfg)
    randomise(model)
    idx = torch.randint(0, 100, (2, 12))
    before = model(idx)
    qkv = model.blocks[1].attn.qkv
    expected = qkv.weight + 2.0 * qkv.lora_B["c_attn"] @ qkv.lora_A["c_attn"]
    merged = merge_lora(model)
    assert len(merged) == 4 * cfg.n_layer and not adapter_state_dict(model)
    assert type(model.blocks[1].attn.qkv) is nn.Linear
    torch.testing.assert_close(model.blocks[1].attn.qkv.weight, expected, rtol=0, atol=0)
    torch.testing.assert_close(model(idx), before, rtol=1e-12, atol=1e-12)


def test_user_model_targets_by_suffix():
    net = nn.Sequential()
    net.add_module("enc", nn.Sequential(nn.Linear(4, 8)))
    net.add_module("fc1", nn.Linear(8, 8))
    net.add_module("fc2", nn.Linear(8, 2))
    assert apply_lora(net, LoraConfig(rank=2, targets="0,fc2")) == ["enc.0", "fc2"]
    assert set(adapter_state_dict(net)) == {"enc.0.lora_A.default", "enc.0.lora_B.default",
                                            "fc2.lora_A.default", "fc2.lora_B.default"}
    assert not net.fc1.weight.requires_grad


REFUSALS = [
    (dict(rank=-1), "lora.rank=-1 must be a whole number ≥ 0 (0: no adapters); give e.g. --lora.rank=8, or 0 "
                    "for none"),
    (dict(rank=4, alpha=0.0), "lora.alpha=0.0 must be a finite number > 0 (updates are scaled by alpha/rank); give "
                              "e.g. --lora.alpha=16"),
    (dict(rank=4, dropout=1.0), "lora.dropout=1.0 must be in [0, 1); give e.g. --lora.dropout=0.05, or 0 for none"),
    (dict(rank=4, targets=" , "), "lora.targets is empty; name what to adapt: attn, mlp, all or the linears' names; "
                                  "give --lora.targets=all"),
    (dict(rank=4, init="adapter/"), "lora.init='adapter/': use peft:DIR (an adapter_config.json and "
                                    "adapter_model.safetensors) or \"\" for fresh adapters; give --lora.init=peft:DIR "
                                    "or leave it empty"),
    (dict(dropout=0.1), "lora.init and lora.dropout apply to adapters, and lora.rank=0 builds none; give "
                        "--lora.rank=8 (or another rank > 0)"),
]


@pytest.mark.parametrize("fields, line", REFUSALS)
def test_config_refusals_word_for_word(fields, line):
    with pytest.raises(KilnError) as e:
        LoraConfig(**fields).validate()
    assert str(e.value) == line


def test_target_refusals_word_for_word():
    cfg = small("llama")
    with pytest.raises(KilnError) as e:
        apply_lora(build_model(cfg), LoraConfig(rank=2, targets="attn,q_proj"), cfg)
    assert str(e.value) == ("lora.targets='attn,q_proj': 'q_proj' is not a linear of model.arch=llama; valid: attn, "
                            "mlp, all, attn.qkv, attn.proj, mlp.fc, mlp.proj; use a comma list of: attn, mlp, all, "
                            "attn.qkv, attn.proj, mlp.fc, mlp.proj")
    moe = ModelConfig(preset="qwen3-moe-nano", n_layer=1, vocab_size=100).resolve()
    with pytest.raises(KilnError) as e:
        lora_tensors(moe, LoraConfig(rank=2))
    assert str(e.value) == ("lora.targets='all' reaches the MoE experts (mlp.experts.fc, mlp.experts.proj), which "
                            "LoRA does not adapt yet; adapt attention only: --lora.targets=attn")
    attn = lora_tensors(moe, LoraConfig(rank=2, targets="attn"))
    assert {t.module.rsplit(".", 1)[-1] for t in attn} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    net = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(KilnError) as e:
        apply_lora(net, LoraConfig(rank=2, targets="fc1"))
    assert str(e.value) == ("lora.targets='fc1': no nn.Linear of the model is named 'fc1' or ends in '.fc1'; its "
                            "linears: 0; name nn.Linear layers of the model (matched by suffix), or all")
