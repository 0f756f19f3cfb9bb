"""A LoRA run's checkpoints and what reads them: the checkpoint holds the adapters and a reference to the base,
resumes bit for bit, and refuses a base that changed on disk; `kiln export --peft` gives PeftModel the run's
logits, `--hf` the merged model (base + scale·B·A); `kiln sample`/`eval` load base + adapters; lora.init=peft:DIR
starts from an adapter, or says in one line why it does not fit. Bases are small random Llama and GPT-2 (Conv1D:
PEFT's fan_in_fan_out) models saved by transformers; nothing is downloaded."""
import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli.main import main
from kiln.config import Config, to_toml
from kiln.interop.base import BaseChanged
from kiln.interop.hf import read_hf
from kiln.interop.peft import PeftError
from kiln.models import ModelConfig, build_model
from kiln.models.lora import LoraConfig, apply_lora, merge_lora
from kiln.run.adapters import load_peft_adapters, lora_run
from kiln.run.lm import train
from kiln.run.source import load_source
from tests.conftest import LazyImport

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
peft = LazyImport("peft", reason="peft is not installed (the test extra has it)")  # it imports Triton

BASES = {
    "llama": ("LlamaForCausalLM", transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=48, intermediate_size=64,
        max_position_embeddings=64, vocab_size=256, tie_word_embeddings=False)),
    "gpt2": ("GPT2LMHeadModel", transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=48, n_positions=64, vocab_size=256, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
}
LORA = {"rank": 4, "alpha": 8.0}


def _base(kind, directory):
    torch.manual_seed(0)
    cls, config = BASES[kind]
    getattr(transformers, cls)(config).save_pretrained(directory)
    return directory


def _lora_config(small_config, base, steps, **lora):
    cfg = small_config(train={"max_steps": steps, "eval_batches": 1}, schedule={"total_steps": steps},
                       lora=LORA | lora, optim={"lr": 3e-2})
    cfg.model.init = f"hf:{base}"
    return cfg


def _logits(model, ids):
    with torch.no_grad():
        return model.float().eval()(ids)


def test_resume_is_bit_identical_and_the_checkpoint_holds_adapters(small_config, tmp_path):
    base = _base("llama", tmp_path / "base")
    sections = dict(dropout=0.1)  # the adapter's dropout draws from the torch RNG stream the checkpoint saves
    straight = train(_lora_config(small_config, base, 4, **sections), tmp_path / "straight")
    first = _lora_config(small_config, base, 4, **sections)
    first.train.max_steps = 2
    train(first, tmp_path / "resumed")
    resumed = train(_lora_config(small_config, base, 4, **sections), tmp_path / "resumed", resume=True)
    a, b = straight.state.model.state_dict(), resumed.state.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
              for d in (tmp_path / "straight", tmp_path / "resumed")]
    assert losses[0] == losses[1] and len(losses[0]) == 4

    step = tmp_path / "resumed" / "checkpoints" / "step_000004"
    state = torch.load(step / "state.pt", weights_only=True)
    adapters = {k for k in a if ".lora_" in k}
    assert set(state["model"]) == adapters == set(load_file(str(step / "model.safetensors")))
    assert state["base"]["init"] == f"hf:{base}" and set(state["base"]["files"]) == {"config.json",
                                                                                     "model.safetensors"}
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in state["model"].items() if ".lora_B." in k)

    # the base changes on disk: resume, sample and export each refuse in one line
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(BaseChanged, match=f"^{step} was trained on the base model.init=hf:{base}, whose "
                                          f"model.safetensors is not the same file now"):
        train(_lora_config(small_config, base, 6), tmp_path / "resumed", resume=True)
    with pytest.raises(BaseChanged, match="whose model.safetensors is not the same file now"):
        load_source(tmp_path / "resumed", device="cpu")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_export_peft_gives_the_runs_logits_and_hf_the_merged_model(kind, small_config, tmp_path, capsys):
    base = _base(kind, tmp_path / "base")
    cfg = _lora_config(small_config, base, 2)
    cfg.train.sample_tokens = 4  # the run's own sample at its end: a plain model from base + adapters
    result = train(cfg, tmp_path / "run")
    assert isinstance(result.sample, str) and result.sample.startswith(cfg.train.sample_prompt)
    ids = torch.randint(0, 256, (2, 24))
    ours = _logits(result.state.model, ids)[..., :256]
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "peft")]) == 0
    said = capsys.readouterr().out.strip()
    assert said.startswith(f"wrote {tmp_path / 'peft'}: LoRA adapters for ") and said.endswith(f"base hf:{base}")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (4, 8.0, kind == "gpt2")
    cls = getattr(transformers, BASES[kind][0])
    theirs = peft.PeftModel.from_pretrained(cls.from_pretrained(base), tmp_path / "peft").eval()
    with torch.no_grad():
        assert (theirs(input_ids=ids).logits - ours).abs().max().item() <= 1e-4

    # --hf: the merged model, each adapted Hub weight = base + (alpha/rank)·B·A (transposed for Conv1D)
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "merged")]) == 0
    assert "(LoRA rank 4 merged into hf:" in capsys.readouterr().out
    got, was = load_file(str(tmp_path / "merged" / "model.safetensors")), load_file(str(base / "model.safetensors"))
    lora = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    modules = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in lora}
    for module in modules:
        a, b = (lora[f"base_model.model.{module}.lora_{x}.weight"].double() for x in "AB")
        delta = (8.0 / 4) * b @ a
        want = was[f"{module}.weight"].double() + (delta.t() if kind == "gpt2" else delta)
        assert (got[f"{module}.weight"].double() - want).abs().max().item() <= 1e-6, module
    assert all(torch.equal(got[k], was[k]) for k in was if k.removesuffix(".weight") not in modules and k in got)
    merged = cls.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - ours).abs().max().item() <= 1e-4

    # kiln sample / eval load base + adapters from the run directory
    source = load_source(tmp_path / "run", device="cpu")
    assert "(LoRA rank 4 on hf:" in source.description
    assert (_logits(source.model, ids)[..., :256] - ours).abs().max().item() <= 1e-4

    if kind != "llama":
        return
    # lora.init=peft:DIR starts from those adapters; one that does not fit is one line
    model_cfg = read_hf(base)[0]
    model = build_model(model_cfg)
    apply_lora(model, LoraConfig(**LORA, init=f"peft:{tmp_path / 'peft'}"), model_cfg)
    load_peft_adapters(model, model_cfg, LoraConfig(**LORA, init=f"peft:{tmp_path / 'peft'}"))
    started, trained = model.state_dict(), result.state.model.state_dict()
    assert all(torch.equal(started[k], trained[k]) for k in trained if ".lora_" in k)
    attn_only = LoraConfig(rank=4, alpha=8.0, targets="attn", init=f"peft:{tmp_path / 'peft'}")
    model = build_model(model_cfg)
    apply_lora(model, attn_only, model_cfg)
    with pytest.raises(PeftError, match=r"6 adapted module\(s\) lora.targets='attn' leaves out \(first "
                                        r"model.layers.0.mlp.down_proj\); pass --lora.targets=attn.qkv,attn.proj,"
                                        r"mlp.fc,mlp.proj \(its modules: mlp.down_proj, mlp.gate_proj, mlp.up_proj, "
                                        r"self_attn.k_proj, self_attn.o_proj, self_attn.q_proj, self_attn.v_proj\)$"):
        load_peft_adapters(model, model_cfg, attn_only)
    cfg = small_config()
    argv = ["train", f"--data.source={cfg.data.source}", f"--data.cache_dir={cfg.data.cache_dir}",
            f"--model.init=hf:{base}", "--train.device=cpu", "--lora.rank=8", f"--lora.init=peft:{tmp_path / 'peft'}",
            f"--run-dir={tmp_path / 'refused'}"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kiln train: error: peft:{tmp_path / 'peft'}: the adapter has rank r=4, the run lora.rank=8; "
                   f"pass --lora.rank=4"]


def test_export_takes_exactly_one_of_hf_and_peft(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--hf", "a", "--peft", "b"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kiln export: error: kiln export takes exactly one of --hf OUT_DIR (the whole model) and --peft OUT_DIR (a "
        "LoRA run's adapters); run it twice for both")
    assert main(["export", str(tmp_path)]) == 2
    assert "exactly one of --hf OUT_DIR" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(Config()))
    assert main(["export", str(run), "--peft", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kiln export: error: {run} is not a LoRA run (lora.rank=0): it has no adapters; export the model with "
        f"--hf OUT_DIR")
    cfg = Config()
    cfg.lora.rank = 4
    (run / "config.toml").write_text(to_toml(cfg))
    assert main(["export", str(run), "--peft", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kiln export: error: {run} trained LoRA adapters on a base of its own (no model.init=hf:DIR), which "
        f"transformers cannot load; export the merged model with --hf OUT_DIR")


@pytest.mark.parametrize("preset", ["llama-125m", "tiny"])
def test_a_run_on_its_own_base_merges_as_merge_lora_does(preset, tmp_path):
    """No model.init: the checkpoint holds the whole model; kiln.run.adapters' merge (through the Hub's names)
    equals kiln.models.lora.merge_lora (the adapter module's own B·A), per preset family."""
    cfg = Config()
    cfg.model = ModelConfig(preset=preset, n_layer=2, n_head=4, n_kv_head=2 if preset != "tiny" else 0, d_model=64,
                            d_ff=96 if preset != "tiny" else 0, vocab_size=256, max_seq_len=64).resolve()
    cfg.lora = LoraConfig(**LORA)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    apply_lora(model, cfg.lora, cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    (tmp_path / "step").mkdir()
    torch.save({"model": model.state_dict()}, tmp_path / "step" / "state.pt")
    got = lora_run(cfg, model.state_dict(), tmp_path / "step").merged()
    merge_lora(model)
    want = model.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert (got[key].double() - want[key].double()).abs().max().item() <= 1e-6, key
