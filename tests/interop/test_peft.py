"""PEFT's LoRA format both ways, checked against peft itself: adapters peft trained-and-saved, read by kiln and
merged into the base's kiln weights, give PeftModel's logits; adapters kiln writes load into
PeftModel.from_pretrained and give the same logits; the merge is base + scale·B·A to the element. Small random
GPT-2 (Conv1D: fan_in_fan_out), Llama and Qwen3 models built by transformers (nothing is downloaded)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.interop.base import BaseChanged, base_reference, check_base
from kiln.interop.hf import hf_tensors, read_hf
from kiln.interop.peft import PeftError, PeftSpec, check_fits, hub_rows, merged, read_peft, write_peft
from kiln.models import build_model
from tests.conftest import LazyImport

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
peft = LazyImport("peft", reason="peft is not installed (the test extra has it)")  # it imports Triton

GPT2 = dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=301, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)
LLAMA = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=96,
             max_position_embeddings=64, vocab_size=300, tie_word_embeddings=False)
QWEN3 = LLAMA | dict(head_dim=24, tie_word_embeddings=True)
KINDS = {"gpt2": ("GPT2LMHeadModel", "GPT2Config", GPT2, ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"]),
         "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]),
         "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", QWEN3, ["q_proj", "v_proj", "down_proj"])}
RANK, ALPHA = 4, 8.0


def _base(kind, directory):
    """A random transformers model saved to `directory`: the base."""
    torch.manual_seed(0)
    cls, config_cls, fields, _ = KINDS[kind]
    model = getattr(transformers, cls)(getattr(transformers, config_cls)(**fields))
    model.save_pretrained(directory)
    return model.eval()


def _trained_adapter(kind, base, directory):
    """What a PEFT user has: adapters on the base with nonzero B (as after training), saved by peft."""
    targets = KINDS[kind][3]
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, fan_in_fan_out=kind == "gpt2")
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.save_pretrained(directory)
    return model.eval()


def _kiln_logits(directory, adapters, scale, ids):
    cfg, base = read_hf(directory)
    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(merged(cfg, base, adapters, scale), strict=False)
    assert not unexpected and all(k.startswith("rope_") for k in missing)
    with torch.no_grad():
        return model.eval()(ids), cfg


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
def test_peft_adapters_both_ways_give_peft_logits(kind, tmp_path):
    base = _base(kind, tmp_path / "base")
    theirs = _trained_adapter(kind, base, tmp_path / "peft")
    ids = torch.randint(0, base.config.vocab_size, (2, 16))
    with torch.no_grad():
        want = theirs(input_ids=ids).logits
    # PEFT -> kiln: read, merge into the base's kiln weights
    adapters, spec = read_peft(tmp_path / "peft")
    assert (spec.rank, spec.alpha, spec.fan_in_fan_out) == (RANK, ALPHA, kind == "gpt2")
    got, cfg = _kiln_logits(tmp_path / "base", adapters, spec.scale, ids)
    assert (got[..., :base.config.vocab_size] - want).abs().max().item() <= 1e-4
    # kiln -> PEFT: written again, loaded by PeftModel.from_pretrained on a fresh copy of the base
    write_peft(tmp_path / "out", adapters, PeftSpec(RANK, ALPHA, fan_in_fan_out=kind == "gpt2"))
    fresh = getattr(transformers, KINDS[kind][0]).from_pretrained(tmp_path / "base")
    back = peft.PeftModel.from_pretrained(fresh, tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(input_ids=ids).logits - want).abs().max().item() <= 1e-4
    # the merge itself: kiln's merged weights, written under the Hub's names, are the base + scale·B·A (Conv1D's
    # transposed) to fp32 rounding, and what peft's merge_and_unload makes
    saved = load_file(str(tmp_path / "base" / "model.safetensors"))
    ours = hf_tensors(cfg, merged(cfg, read_hf(tmp_path / "base")[1], adapters, spec.scale), base.config.vocab_size)
    theirs_merged = theirs.merge_and_unload().state_dict()
    rows = hub_rows(cfg)
    for module, (a, b) in adapters.items():
        delta = spec.scale * b.double() @ a.double()
        expected = saved[f"{module}.weight"].double() + (delta.t() if rows[module][3] else delta)
        assert (ours[f"{module}.weight"].double() - expected).abs().max().item() <= 1e-6, module
        assert (theirs_merged[f"{module}.weight"].double() - expected).abs().max().item() <= 1e-6, module
    untouched = [k for k in saved if k.removesuffix(".weight") not in adapters and k in ours]
    assert untouched and all(torch.equal(ours[k], saved[k]) for k in untouched)

def test_adapter_that_does_not_fit_is_one_line(tmp_path):
    base = _base("llama", tmp_path / "base")
    _trained_adapter("llama", base, tmp_path / "peft")
    adapters, spec = read_peft(tmp_path / "peft")
    cfg, _ = read_hf(tmp_path / "base")
    shapes = {m: (a.shape[1], b.shape[0]) for m, (a, b) in adapters.items()}
    where = f"peft:{tmp_path / 'peft'}"
    check_fits(adapters, spec, where, RANK, ALPHA, "all", shapes)  # the run it was trained for
    with pytest.raises(PeftError, match=r"the adapter has rank r=4, the run lora.rank=8; pass --lora.rank=4$"):
        check_fits(adapters, spec, where, 8, ALPHA, "all", shapes)
    with pytest.raises(PeftError, match=r"lora_alpha=8, the run lora.alpha=16; pass --lora.alpha=8$"):
        check_fits(adapters, spec, where, RANK, 16.0, "all", shapes)
    fewer = {m: s for m, s in shapes.items() if "down_proj" not in m}
    with pytest.raises(PeftError, match=r"2 adapted module\(s\) lora.targets='attn' leaves out \(first "
                                        r"model.layers.0.mlp.down_proj\); pass the lora.targets it was "
                                        r"trained with \(its modules: mlp.down_proj, mlp.gate_proj"):
        check_fits(adapters, spec, where, RANK, ALPHA, "attn", fewer)
    wider = {m: (n_in, n_out + 1) for m, (n_in, n_out) in shapes.items()}
    with pytest.raises(PeftError, match=r"trained on another base"):
        check_fits(adapters, spec, where, RANK, ALPHA, "all", wider)
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(PeftError, match=r"peft_type='IA3'; kiln reads LoRA adapters"):
        read_peft(tmp_path / "peft")
    with pytest.raises(PeftError, match=r"no adapter_config.json there; pass a directory"):
        read_peft(tmp_path / "nowhere")


def test_changed_base_is_refused_in_one_line(tmp_path):
    _base("gpt2", tmp_path / "base")
    ref = base_reference(f"hf:{tmp_path / 'base'}")
    assert set(ref["files"]) == {"config.json", "model.safetensors"}
    check_base(ref, "run/checkpoints/step_000004")  # unchanged: nothing said
    weights = tmp_path / "base" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    with pytest.raises(BaseChanged) as e:
        check_base(ref, "run/checkpoints/step_000004")
    assert str(e.value).startswith(f"run/checkpoints/step_000004 was trained on the base model.init=hf:"
                                   f"{tmp_path / 'base'}, whose model.safetensors is not the same file now (xxh3 ")
    assert "\n" not in str(e.value) and "--lora.init=peft:DIR" in str(e.value)
    weights.unlink()
    with pytest.raises(BaseChanged, match="whose model.safetensors is not there now"):
        check_base(ref, "run/checkpoints/step_000004")


GOOD = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
A, B = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
BAD_DIRS = [  # (adapter_config.json, tensors or None for no weights file, the refusal after "peft:DIR")
    ("{", {}, "/adapter_config.json is not valid JSON (Expecting property name enclosed in double quotes); pass a "
              "directory PeftModel.save_pretrained or `kiln export RUN_DIR --peft DIR` wrote"),
    (GOOD | {"use_dora": True}, {}, ": use_dora=true; kiln's adapters are plain LoRA, not DoRA"),
    (GOOD | {"use_rslora": True}, {}, ": use_rslora=true; kiln's adapters are plain LoRA, not rsLoRA (scale alpha/√r)"),
    (GOOD | {"bias": "all"}, {}, ": bias, modules_to_save, rank_pattern or alpha_pattern are set; kiln reads adapters "
                                 "of one rank and scale with no bias and no other trained modules"),
    (GOOD, None, ": no adapter_model.safetensors there (a .bin adapter is not read: save it again with "
                 "safe_serialization=True)"),
    (GOOD, {"base_model.model.lm_head.weight": (4, 4)}, "/adapter_model.safetensors holds "
                                                        "'base_model.model.lm_head.weight', which is no lora_A/lora_B "
                                                        "weight; kiln reads LoRA adapters only"),
    (GOOD, {A: (2, 8)}, "/adapter_model.safetensors: model.layers.0.self_attn.q_proj has lora_A without its pair"),
    (GOOD, {A: (3, 8), B: (8, 3)}, "/adapter_model.safetensors: model.layers.0.self_attn.q_proj has lora_A (3, 8) "
                                   "and lora_B (8, 3), not (r=2, in) and (out, r=2)"),
]


@pytest.mark.parametrize("config, tensors, said", BAD_DIRS, ids=["json", "dora", "rslora", "bias", "no-weights",
                                                                  "not-lora", "unpaired", "rank"])
def test_adapter_directories_kiln_cannot_read_are_one_line(config, tensors, said, tmp_path):
    (tmp_path / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        save_file({k: torch.zeros(shape) for k, shape in tensors.items()} or {A: torch.zeros(2, 8),
                                                                              B: torch.zeros(8, 2)},
                  str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(PeftError) as e:
        read_peft(tmp_path)
    assert str(e.value) == f"peft:{tmp_path}{said}"


def test_an_adapter_for_another_base_does_not_merge(tmp_path):
    _base("llama", tmp_path / "base")
    cfg, base = read_hf(tmp_path / "base")
    with pytest.raises(PeftError, match=r"^adapter for 'model.layers.9.self_attn.q_proj', which is not a weight of "
                                        r"kiln's llama model; the adapter was trained on another base$"):
        merged(cfg, base, {"model.layers.9.self_attn.q_proj": (torch.zeros(2, 64), torch.zeros(64, 2))}, 1.0)
    with pytest.raises(PeftError, match=r"^adapter for model.layers.0.self_attn.k_proj makes a \(64, 64\) update, "
                                        r"the base weight is \(32, 64\); the adapter was trained on another base$"):
        merged(cfg, base, {"model.layers.0.self_attn.k_proj": (torch.zeros(2, 64), torch.zeros(64, 2))}, 1.0)
